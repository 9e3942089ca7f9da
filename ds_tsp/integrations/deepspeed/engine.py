"""`ds_tsp.initialize`: deepspeed.initialize with TSP turned on by the config's "tsp" block.

Layout (pipe x data x tsp, tsp innermost so a TSP group is one node's adjacent ranks). DeepSpeed gets a
Megatron-style mpu whose model-parallel group is the TSP group, so ZeRO 1/2/3 shard and average over the data axis
only; sharded params carry tensor_model_parallel=True so the grad norm counts them on every TSP rank. With
pipeline_stages > 1 the model becomes a DeepSpeed PipelineModule of TSP blocks on the outer axis.
"""
from __future__ import annotations

import copy
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ds_tsp.core.config import check_deepspeed_compatible, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.launch import init_from_env, local_device
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.reliability.nonfinite import NonFiniteGuard
from ds_tsp.core.reliability.watchdog import guarded, label_modules
from ds_tsp.core.shape.hf_config import generation_config_json
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.loader import TSPDataLoader
from ds_tsp.integrations.deepspeed.clip_norm import keep_clip_norm
from ds_tsp.integrations.deepspeed.mpu import TSPModelParallelUnit
from ds_tsp.integrations.deepspeed.zero3_fetch import register_zero3_fetches
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.convert import to_tsp_model
from ds_tsp.model.hf_causal_lm import TSPForCausalLM

# the one-time setup's collectives, named in a stalled peer's report
SETUP_WHAT = "deepspeed.initialize (the model's broadcast, ZeRO's partitioning, barriers)"


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


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, config: str | Path | dict | None = None,
               *, state_dict: dict[str, torch.Tensor] | None = None, seed: int = 0, dtype: torch.dtype | None = None,
               **ds_kwargs):
    """Same call shape and return tuple as deepspeed.initialize: (engine, optimizer, dataloader, lr_scheduler).

    `model` is a ModelShape, an HF config, an HF Llama-family model (converted, weights sharded), a ShardedCausalLM
    built on a TSP group of the configured size, or the path of a local HF checkpoint: then every rank reads only
    its slices and the engine wraps a ds_tsp.hf.TSPForCausalLM (HF call signature, `engine.module.save_pretrained`).
    `state_dict` (HF names) initialises the shards; otherwise they are initialised in place by
    ShardedCausalLM.init_weights_(seed). `training_data` (samples with "input_ids" and optionally
    "labels"/"position_ids") comes back as a TSPDataLoader: data-parallel sampling, zigzag shards, batches on
    `engine.device`.
    Call forms: `engine(**batch)` with a loader batch, whole (it carries tsp_shard: never sharded again). Wrapping
    ShardedCausalLM it returns this rank's loss share (also `engine(input_ids, shift_labels, position_ids)`);
    wrapping TSPForCausalLM an HF output whose `.loss` is the global loss (input_ids alone positionally).
    Without a launcher (plain `python script.py`) a 1-process group is started (no MPI discovery).
    The engine carries `tsp_groups` (ProcessGroups), `tsp_config`, `tsp_model` and `tsp_guard` (a NonFiniteGuard:
    `if engine.tsp_guard.check(loss, step): engine.step()`, else `engine.zero_grad()`; None with pipeline stages).
    """
    deepspeed = import_deepspeed()
    ds_config = load_ds_config(config, args)
    tsp = parse_tsp_config(ds_config.pop("tsp", None))
    check_deepspeed_compatible(ds_config, tsp)
    pipeline_shape = None
    if tsp.pipeline_stages > 1:  # checked before any process group is built: a config error needs no launch
        from ds_tsp.integrations.deepspeed.pipeline import check_pipeline_moe, check_pipeline_source
        check_pipeline_source(model)  # LoRA: refused by name
        pipeline_shape = model if isinstance(model, ModelShape) else ModelShape.from_hf_config(
            getattr(model, "config", model))
        check_pipeline_moe(pipeline_shape)
    device = local_device()  # cuda:LOCAL_RANK made current before anything (DeepSpeed's groups included) is built
    if not _launched():  # a plain `python script.py`: one local rank, not DeepSpeed's MPI discovery (mpi4py)
        _single_process_env()
        init_from_env(timeout_s=tsp.timeout_s)
    # Also when torch.distributed is up already: deepspeed.comm must adopt the group (PipelineModule asks it).
    deepspeed.init_distributed(timeout=timedelta(seconds=tsp.timeout_s))
    runtime = build_runtime(tsp, ds_config=ds_config)  # DeepSpeed's cpu_checkpointing read as offload_activations
    tsp = runtime.config
    groups, comm = runtime.groups, runtime.comm
    if dtype is None:
        dtype = torch.bfloat16 if (ds_config.get("bf16") or {}).get("enabled") else torch.float32
    device = None if device.type == "cpu" else device
    if tsp.pipeline_stages > 1:
        from ds_tsp.integrations.deepspeed.pipeline import build_pipeline_module, unpartitioned_pipeline_config
        ds_config["pipeline"] = unpartitioned_pipeline_config(ds_config.get("pipeline"))
        shape = pipeline_shape
        if state_dict is None and hasattr(model, "state_dict") and not isinstance(model, ModelShape):
            state_dict = model.state_dict()
        tsp_model = None
        module, mpu = build_pipeline_module(shape, groups, comm, runtime.options, dtype=dtype,
                                            device=device, state_dict=state_dict, seed=seed,
                                            source=model if hasattr(model, "config") else None), None
        label_modules(module, comm)  # a stalled collective's report names its layer (to_tsp_model does the rest)
    else:
        # The transformers config (and generation config) the model comes from, kept for save_consolidated.
        source_config = model if hasattr(model, "to_json_string") else None
        generation = hf_model = None
        if hasattr(model, "config") and hasattr(model, "state_dict") and not isinstance(model, TSPForCausalLM):
            # An in-memory HF (or PEFT LoRA) model: the engine trains the sharded core (its call takes this rank's
            # shard), in the model's own dtype, from its weights unless state_dict overrides them, with its
            # requires_grad and LoRA adapter.
            hf_model = model
            generation = generation_config_json(model)
            dtype, model = next(model.parameters()).dtype, model.config
            source_config = model
        module = to_tsp_model(model, comm, options=runtime.options, dtype=dtype, device=device,
                              data_group=groups.data_group, state_dict=state_dict, seed=seed, source=hf_model)
        if isinstance(module, ShardedCausalLM) and source_config is not None:
            module.hf_config, module.generation_config_json = source_config, generation
        tsp_model, mpu = (module.tsp if isinstance(module, TSPForCausalLM) else module), TSPModelParallelUnit(groups)
        _register_zero3_fetches(tsp_model, ds_config, deepspeed)
    guard = None  # the pipeline engine steps inside train_batch: nothing to guard from outside
    if tsp.pipeline_stages == 1:
        if tsp.on_nonfinite == "skip" and (ds_config.get("gradient_accumulation_steps") or 1) != 1:
            raise TSPConfigError('tsp.on_nonfinite="skip" with gradient_accumulation_steps > 1: a skipped micro-batch '
                                 "would desynchronise DeepSpeed's accumulation boundary; use 1, or \"error\"")
        guard = NonFiniteGuard(module, policy=tsp.on_nonfinite)  # hooks before DeepSpeed moves any grad
    if model_parameters is None:
        model_parameters = [p for p in module.parameters() if p.requires_grad]
    # DeepSpeed's setup posts collectives (the model's broadcast over data, ZeRO's partitioning, barriers): bounded
    # by timeout_s as one block with the watchdog's one line (so timeout_s must exceed it, as a backward)
    with guarded(comm, SETUP_WHAT, context="setup", comm_errors_only=True):
        engine, opt, _, sched = deepspeed.initialize(model=module, optimizer=optimizer,
                                                     model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                                                     mpu=mpu, config=ds_config, dist_init_required=False, **ds_kwargs)
    loader = None
    if training_data is not None:
        # on the engine's device: DeepSpeed does not move inputs, and NCCL groups take no CPU tensor
        loader = TSPDataLoader(training_data, groups, micro_batch_size=engine.train_micro_batch_size_per_gpu(),
                               seed=seed, device=engine.device)
    engine.tsp_groups, engine.tsp_config, engine.tsp_model = groups, tsp, tsp_model
    keep_clip_norm(engine)
    engine.tsp_guard = guard
    engine.tsp_comm = comm  # `with engine.tsp_comm.guard("what", group=g):` bounds a script's own collectives
    if tsp.pipeline_stages == 1:
        _guard_step(engine, comm)
        _guard_backward(engine, comm)
    else:
        _guard_pipeline(engine, comm)
    return engine, opt, loader, sched


def _guard_pipeline(engine, comm) -> None:
    """The pipeline engine runs a whole step inside train_batch (eval_batch: the forwards): the stages' activation
    and gradient sends / receives, the tied-weight and data-axis reductions, the optimizer step. Each call is bounded
    by timeout_s as one block with the watchdog's one line (so timeout_s must exceed one step, as for a backward);
    the layers' own waits inside keep their own deadlines; errors of the computation propagate as they are."""
    import torch.distributed as dist

    for name in ("train_batch", "eval_batch"):
        def bounded(*args, _run=getattr(engine, name), _name=name, **kwargs):
            with comm.guard(f"DeepSpeed pipeline {_name} (stage sends / receives, gradient reductions, step)",
                            group=dist.group.WORLD, context=f"pipeline {_name}", comm_errors_only=True):
                return _run(*args, **kwargs)

        setattr(engine, name, bounded)


def _guard_step(engine, comm) -> None:
    """engine.step() posts DeepSpeed's own collectives (the grad-norm all-reduce over the TSP group for clipping,
    ZeRO's gathers): bounded by timeout_s with the watchdog's one line, like every collective of ds_tsp's."""
    import torch.distributed as dist

    step = engine.step

    def guarded_step(*args, **kwargs):
        with comm.guard("DeepSpeed optimizer step (grad-norm all_reduce, ZeRO collectives)", group=dist.group.WORLD,
                        context="optimizer step"):
            return step(*args, **kwargs)

    engine.step = guarded_step


def _guard_backward(engine, comm) -> None:
    """engine.backward(loss) posts DeepSpeed's gradient reduction from its hooks (ZeRO-1/2's bucketed reduce /
    all-reduce over the data group, ZeRO-3's reduce-scatter, the plain engine's all-reduce at the boundary): the
    whole backward is bounded by timeout_s with the watchdog's one line (so timeout_s must exceed one backward; the
    layers' own waits inside it nest, each with its own deadline). Errors of the computation propagate as they are.
    On a device the wait is an event recorded after the backward, polled by the watchdog thread: no host sync."""
    import torch.distributed as dist

    backward = engine.backward
    poll = engine.device if getattr(engine.device, "type", "cpu") not in ("cpu", "meta") else None

    def guarded_backward(*args, **kwargs):
        with comm.guard("DeepSpeed backward (gradient reduction: ZeRO reduce / all_reduce hooks)",
                        group=dist.group.WORLD, context="backward", poll=poll, comm_errors_only=True):
            return backward(*args, **kwargs)

    engine.backward = guarded_backward


# Variables a launcher sets: torchrun / deepspeed (WORLD_SIZE), mpirun (OpenMPI, MPICH / Intel MPI, MVAPICH).
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _launched() -> bool:
    """A process group exists already, or a launcher set up the variables DeepSpeed reads (or discovers by MPI)."""
    import torch.distributed as dist

    return dist.is_initialized() or any(name in os.environ for name in _LAUNCHER_VARIABLES)


def _single_process_env() -> None:
    """The variables a launcher would set for one process (DeepSpeed's engine asserts LOCAL_RANK), on a free port."""
    from ds_tsp.core.parallel.launch import free_port

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _register_zero3_fetches(model: ShardedCausalLM, ds_config: dict, deepspeed) -> None:
    # ZeRO-3 gathers a param only inside its own module's hooks: what each layer (and a tied head) reads is
    # registered with it (ds_tsp.integrations.deepspeed.zero3_fetch)
    if (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
        register_zero3_fetches(model, deepspeed)
