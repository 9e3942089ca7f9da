"""`ds_tsp.initialize`: deepspeed.initialize with TSP turned on by the config's "tsp" block.

Layout (pipe x data x tsp, tsp innermost so a TSP group is one node's adjacent ranks). DeepSpeed gets a
Megatron-style mpu whose model-parallel group is the TSP group, so ZeRO 1/2/3 shard and average over the data axis
only; sharded params carry tensor_model_parallel=True so the grad norm counts them on every TSP rank. With
pipeline_stages > 1 the model becomes a DeepSpeed PipelineModule of TSP blocks on the outer axis.
"""
from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_tsp.comm import TSPComm
from ds_tsp.config import TSPConfig, parse_tsp_config
from ds_tsp.data import TSPDataLoader
from ds_tsp.errors import TSPConfigError
from ds_tsp.integrations.mpu import TSPModelParallelUnit
from ds_tsp.model import TSPCausalLM, TSPOptions
from ds_tsp.model_config import ModelShape
from ds_tsp.nonfinite import NonFiniteGuard
from ds_tsp.topology import ParallelLayout, ProcessGroups
from ds_tsp.watchdog import label_modules


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError("ds_tsp's DeepSpeed integration needs deepspeed: pip install 'ds_tsp[deepspeed]'") from err
    return deepspeed


def load_ds_config(config: str | Path | dict | None, args: Any = None) -> dict:
    """The DeepSpeed config as a fresh dict, from a dict, a JSON path, or args.deepspeed_config / args.ds_config."""
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "ds_config", None)
    if config is None:
        raise TSPConfigError("no DeepSpeed config: pass config=<dict or path> or args with --deepspeed_config")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise TSPConfigError(f"DeepSpeed config {str(path)!r} does not exist")
    return json.loads(path.read_text())


def check_compatible(ds_config: dict, tsp: TSPConfig) -> None:
    """Reject combinations that would silently replace or break the TSP layout."""
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if tsp.size > 1 and autotp and autotp > 1:
        raise TSPConfigError(
            f'tensor_parallel.autotp_size={autotp} together with tsp.size={tsp.size}: DeepSpeed AutoTP replaces the '
            'model-parallel unit that TSP provides; remove "tensor_parallel" (TSP already shards the weights)')
    sp = ds_config.get("sequence_parallel_size", 1)
    if tsp.size > 1 and sp and sp > 1:
        raise TSPConfigError(
            f"sequence_parallel_size={sp} together with tsp.size={tsp.size}: DeepSpeed's Ulysses sequence "
            "parallelism and TSP both shard the sequence; remove sequence_parallel_size")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if tsp.pipeline_stages > 1 and stage > 1:
        raise TSPConfigError(
            f"zero_optimization.stage={stage} with tsp.pipeline_stages={tsp.pipeline_stages}: DeepSpeed's pipeline "
            "engine supports ZeRO stage 0 or 1 only; lower the stage or set pipeline_stages to 1")


def options_from_config(tsp: TSPConfig) -> TSPOptions:
    return TSPOptions(kernel_backend=None if tsp.kernel == "auto" else tsp.kernel,
                      keep_gathered_kv=tsp.keep_gathered_kv, activation_checkpointing=tsp.activation_checkpointing,
                      recompute_projections=tsp.recompute_projections,
                      lm_head_chunk_tokens=tsp.lm_head_chunk_tokens)


def build_tsp_model(model: Any, comm: TSPComm, options: TSPOptions, *, data_group=None,
                    state_dict: dict[str, torch.Tensor] | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device=None) -> TSPCausalLM:
    """A TSPCausalLM from a ModelShape, an HF config, or an HF Llama-family model (whose weights it shards)."""
    if isinstance(model, TSPCausalLM):
        if model.comm.size != comm.size:
            raise TSPConfigError(f"the TSPCausalLM passed was built for tsp={model.comm.size} but the config "
                                 f'asks for "tsp": {{"size": {comm.size}}}; pass a ModelShape or HF model instead')
        model.set_data_parallel_group(data_group)
        return model
    hf_weights = None
    if isinstance(model, ModelShape):
        shape = model
    elif hasattr(model, "config") and hasattr(model, "state_dict"):  # a transformers PreTrainedModel
        shape = ModelShape.from_hf_config(model.config)
        hf_weights = model.state_dict()
        dtype = next(model.parameters()).dtype
    elif hasattr(model, "to_dict") or isinstance(model, dict):  # an HF config
        shape = ModelShape.from_hf_config(model)
    else:
        raise TSPConfigError(f"model={type(model).__name__}: pass a ds_tsp ModelShape, a transformers config, or a "
                             "Llama/Mistral/Qwen2 transformers model")
    tsp_model = TSPCausalLM(shape, comm, options=options, dtype=dtype, device=device, data_group=data_group)
    weights = state_dict if state_dict is not None else hf_weights
    if weights is not None:
        tsp_model.load_full_state_dict(weights)
    else:
        tsp_model.init_weights_(seed)
    return tsp_model


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, config: str | Path | dict | None = None,
               *, state_dict: dict[str, torch.Tensor] | None = None, seed: int = 0, dtype: torch.dtype | None = None,
               **ds_kwargs):
    """Same call shape and return tuple as deepspeed.initialize: (engine, optimizer, dataloader, lr_scheduler).

    `model` is a ModelShape, an HF config, an HF Llama-family model (converted, weights sharded), a TSPCausalLM
    built on a TSP group of the configured size, or the path of a local HF checkpoint: then every rank reads only
    its slices and the engine wraps a ds_tsp.hf.TSPForCausalLM (HF call signature, `engine.module.save_pretrained`). `state_dict` (HF names) initialises the shards; otherwise they
    are initialised in place by TSPCausalLM.init_weights_(seed). `training_data` (samples with "input_ids" and
    optionally "labels"/"position_ids") comes back as a TSPDataLoader: data-parallel sampling, zigzag shards.
    The engine carries `tsp_groups` (ProcessGroups), `tsp_config`, `tsp_model` and `tsp_guard` (a NonFiniteGuard:
    `if engine.tsp_guard.check(loss, step): engine.step()`, else `engine.zero_grad()`; None with pipeline stages).
    """
    deepspeed = import_deepspeed()
    ds_config = load_ds_config(config, args)
    tsp = parse_tsp_config(ds_config.pop("tsp", None))
    check_compatible(ds_config, tsp)
    # Also when torch.distributed is up already: deepspeed.comm must adopt the group (PipelineModule asks it).
    deepspeed.init_distributed(timeout=timedelta(seconds=tsp.timeout_s))
    layout = ParallelLayout.from_world_size(dist.get_world_size(), tsp=tsp.size, pipe=tsp.pipeline_stages)
    groups = ProcessGroups.build(layout)
    comm = TSPComm(groups.tsp_group, overlap=tsp.overlap, timeout_s=tsp.timeout_s)  # bounds every TSP wait
    if dtype is None:
        dtype = torch.bfloat16 if (ds_config.get("bf16") or {}).get("enabled") else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if tsp.pipeline_stages > 1:
        from ds_tsp.integrations.pipeline import build_pipeline_module, unpartitioned_pipeline_config
        ds_config["pipeline"] = unpartitioned_pipeline_config(ds_config.get("pipeline"))
        shape = model if isinstance(model, ModelShape) else ModelShape.from_hf_config(getattr(model, "config", model))
        if state_dict is None and hasattr(model, "state_dict") and not isinstance(model, ModelShape):
            state_dict = model.state_dict()
        tsp_model = None
        module, mpu = build_pipeline_module(shape, groups, comm, options_from_config(tsp), dtype=dtype,
                                            device=device, state_dict=state_dict, seed=seed), None
    elif isinstance(model, (str, Path)):  # a local HF checkpoint: load by slices, train the HF-shaped model
        from ds_tsp.hf import TSPForCausalLM

        module = TSPForCausalLM.from_pretrained(model, comm, dtype=dtype, options=options_from_config(tsp),
                                                device=device, data_group=groups.data_group)
        tsp_model, mpu = module.tsp, TSPModelParallelUnit(groups)
        _register_tied_head_for_zero3(tsp_model, ds_config, deepspeed)
    else:
        tsp_model = build_tsp_model(model, comm, options_from_config(tsp), data_group=groups.data_group,
                                    state_dict=state_dict, seed=seed, dtype=dtype, device=device)
        module, mpu = tsp_model, TSPModelParallelUnit(groups)
        _register_tied_head_for_zero3(tsp_model, ds_config, deepspeed)
    label_modules(module, comm)  # a stalled collective's report names its layer
    guard = None  # the pipeline engine steps inside train_batch: nothing to guard from outside
    if tsp.pipeline_stages == 1:
        if tsp.on_nonfinite == "skip" and (ds_config.get("gradient_accumulation_steps") or 1) != 1:
            raise TSPConfigError('tsp.on_nonfinite="skip" with gradient_accumulation_steps > 1: a skipped micro-batch '
                                 "would desynchronise DeepSpeed's accumulation boundary; use 1, or \"error\"")
        guard = NonFiniteGuard(module, policy=tsp.on_nonfinite)  # hooks before DeepSpeed moves any grad
    if model_parameters is None:
        model_parameters = [p for p in module.parameters() if p.requires_grad]
    engine, opt, _, sched = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=model_parameters,
                                                 lr_scheduler=lr_scheduler, mpu=mpu, config=ds_config,
                                                 dist_init_required=False, **ds_kwargs)
    loader = None
    if training_data is not None:
        loader = TSPDataLoader(training_data, groups, micro_batch_size=engine.train_micro_batch_size_per_gpu(),
                               seed=seed)
    engine.tsp_groups, engine.tsp_config, engine.tsp_model = groups, tsp, tsp_model
    engine.tsp_guard = guard
    return engine, opt, loader, sched


def _register_tied_head_for_zero3(model: TSPCausalLM, ds_config: dict, deepspeed) -> None:
    # ZeRO-3 gathers a param only inside its own module's forward; the tied head reads the embedding's shard.
    if model.lm_head.tied and (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
        deepspeed.zero.register_external_parameter(model.lm_head, model.model.embed_tokens.vocab_shard)
