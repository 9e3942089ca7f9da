"""`TSPAccelerator`: Accelerate's Accelerator with TSP on the innermost axis, the one line a script changes.

    from ds_tsp.accelerate import TSPAccelerator as Accelerator
    accelerate launch --config_file ds_configs/accelerate_tsp.yaml train.py        # DeepSpeed ZeRO on the data axis
    accelerate launch --config_file ds_configs/accelerate_tsp_fsdp2.yaml train.py  # FSDP2 on the data axis
    python train.py                                                                # one process: the reference

Accelerate has no plug-in point for another sequence-parallel engine (its DeepSpeed path builds the
deepspeed.initialize call itself and passes an mpu only for its own Ulysses), so `prepare` does the TSP part and
hands the rest back to Accelerate:
- the model becomes a ds_tsp.hf.TSPForCausalLM on this rank's TSP group (an HF Llama-family model is converted, a
  checkpoint path loaded by slices), and the optimizer built on the HF model is rebound to the shards; a
  vision-language model (Qwen3.5 / Qwen3-VL ...ForConditionalGeneration) becomes a TSPForConditionalGeneration,
  whose loaders yield the collator's full batch (pixels whole) on every TSP rank (under FSDP2 its vision tower
  stays whole, fp32 only: ds_tsp.integrations.fsdp);
- dataloaders are sampled over the data axis only and cut to zigzag shards (ds_tsp.integrations.accelerate.dataloaders);
- DeepSpeed: Accelerate's own _prepare_deepspeed runs, and its (call-time) deepspeed.initialize receives the TSP
  mpu and a train_batch_size counted over the mpu's data-parallel ranks (data x cp; the TSP group counted once);
- FSDP2: ds_tsp.integrations.fsdp.shard_with_fsdp2 on the data sub-mesh, bf16 via MixedPrecisionPolicy.
cp_size (C TSP groups split each sequence): the DeepSpeed JSON's "tsp" block (ZeRO over data x cp), the FSDP2
config's parallelism_config_cp_size (fully_shard over data x cp), or TSPAccelerator(cp_size=C) without either (no
data engine: `backward` averages the gradients over the cp groups at each optimizer step, as DDP would).
clip_grad_norm_ (the full model's norm), gather_for_metrics (data axis only: TSP and cp ranks hold the same values),
save_state / load_state (every rank's own shards) and save_model are TSP-aware. On CPU the same commands work: gloo
under DeepSpeed (Accelerate would start one 1-rank group per process) and cpu=True otherwise (its barriers would do
nothing).
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.checkpoint import tensor_tree
from ds_tsp.checkpoint.local_state import load_model_local, load_optimizer_local, to_local
from ds_tsp.core.config import check_deepspeed_compatible
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
from ds_tsp.core.reliability.watchdog import guarded
from ds_tsp.integrations.accelerate.dataloaders import TSPShardedLoader, WholeBatchLoader
from ds_tsp.integrations.accelerate.launch_config import TSPAccelerateSetup, resolve_setup
from ds_tsp.integrations.accelerate.state_layout import check_layout, layout_record, write_layout
from ds_tsp.integrations.deepspeed.clip_norm import keep_clip_norm
from ds_tsp.integrations.deepspeed.mpu import TSPModelParallelUnit
from ds_tsp.integrations.deepspeed.zero3_fetch import register_zero3_fetches
from ds_tsp.model.convert import parameter_names, rebind_optimizer, to_tsp_model
from ds_tsp.model.hf_causal_lm import TSPForCausalLM


def _import_accelerate():
    try:
        import accelerate
    except ImportError as err:
        raise ImportError("ds_tsp.accelerate needs accelerate: pip install 'ds_tsp[hf]'") from err
    return accelerate


_accelerate = _import_accelerate()
STATE_STEM = "tsp_state_rank{rank}"  # + .safetensors and .json (ds_tsp.checkpoint.tensor_tree): never unpickled
PICKLED_STATE_FILE = "tsp_state_rank{rank}.pt"  # what earlier versions wrote: refused, never loaded
# Accelerate's prepare, named in a stalled peer's report (under DeepSpeed it runs deepspeed.initialize)
PREPARE_WHAT = "Accelerate prepare (deepspeed.initialize: the model's broadcast, ZeRO's partitioning, barriers)"


def write_rank_state(directory: str | Path, rank: int, models: list, optimizers: list) -> None:
    """This rank's own model and optimizer shards (local tensors) as safetensors + JSON."""
    state = {"models": [to_local(m.state_dict()) for m in models],
             "optimizers": [to_local(o.state_dict()) for o in optimizers]}
    tensor_tree.save_tree(directory, STATE_STEM.format(rank=rank), state)


def read_rank_state(directory: str | Path, rank: int, device: torch.device | str) -> dict:
    """What write_rank_state saved for `rank`, read without unpickling; a pickled state of an earlier version is
    one TSPConfigError (it is never opened: unpickling a file can run arbitrary code)."""
    stem = STATE_STEM.format(rank=rank)
    tensors, record = tensor_tree.paths(directory, stem)
    if not record.is_file():
        pickled = Path(directory) / PICKLED_STATE_FILE.format(rank=rank)
        if pickled.is_file():
            raise TSPConfigError(
                f"{pickled} is a pickled TSPAccelerator state of an earlier ds_tsp: it is not loaded, since "
                f"unpickling a file can run arbitrary code. Resume from the run's ds_tsp.save_training_checkpoint "
                f"or its saved model, or, for a state you trust, convert it once with "
                f"ds_tsp.integrations.accelerate.accelerator.convert_pickled_state({str(directory)!r})")
        raise TSPConfigError(f"{record} is missing: the state was saved by another layout or without TSP")
    return tensor_tree.load_tree(directory, stem, device)


def convert_pickled_state(directory: str | Path) -> list[Path]:
    """Rewrite the pickled per-rank states of an earlier ds_tsp in `directory` as safetensors + JSON. It UNPICKLES
    them: call it only on a state you trust (load_state itself never does). Returns the converted files."""
    converted = []
    for pickled in sorted(Path(directory).glob(PICKLED_STATE_FILE.format(rank="*"))):
        rank = int(pickled.stem.rsplit("rank", 1)[1])
        state = torch.load(pickled, map_location="cpu", weights_only=False)
        tensor_tree.save_tree(directory, STATE_STEM.format(rank=rank), state)
        converted.append(pickled)
    return converted


def _cpu_defaults(kwargs: dict, mode: str) -> dict:
    """Several processes without CUDA. DeepSpeed: ask for gloo explicitly, else Accelerate starts a 1-rank group in
    every process. Otherwise: cpu=True, else Accelerate runs as DistributedType.NO (its barriers do nothing)."""
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return kwargs
    if mode != "deepspeed":
        return {"cpu": True, **kwargs}
    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(kwargs.get("kwargs_handlers") or [])
    if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return {**kwargs, "kwargs_handlers": handlers}


def _guard(accelerator, what: str, group, poll: torch.device | None = None):
    """The accelerator's TSPComm guard (its timeout_s, the watchdog's one line) around a collective of its own."""
    comm = getattr(accelerator, "tsp_comm", None)
    return comm.guard(what, group=group, poll=poll) if comm is not None else contextlib.nullcontext()


class DataAxisScheduler(_accelerate.scheduler.AcceleratedScheduler):
    """Accelerate steps a scheduler once per PROCESS per optimizer step (each process consumed a batch); under TSP
    the ranks of a TSP group share one batch, so it steps once per data replica."""

    data_size: int = 1

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or self.split_batches or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)
        if any(opt.step_was_skipped for opt in self.optimizers):
            return None
        for _ in range(self.data_size):
            if getattr(self.scheduler, "total_steps", None) is not None and \
                    self.scheduler._step_count > self.scheduler.total_steps:
                break
            self.scheduler.step(*args, **kwargs)
        return None


def _is_vlm(model) -> bool:
    from ds_tsp.integrations.multimodal import is_vision_language

    return is_vision_language(model)


def _vlm_names(names: dict[int, str]) -> dict[int, str]:
    """A transformers VLM's parameter names as the optimizer rebinding reads them: the language model's under the
    causal LM's names (model.language_model.X -> model.X), the tower's as TSPForConditionalGeneration names it
    (model.visual.Y -> visual.Y); under FSDP2 too (shard_with_fsdp2 keeps the tower whole, under the same names)."""
    renamed = {}
    for key, name in names.items():
        for prefix, to in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
        renamed[key] = name
    return renamed


class TSPAccelerator(_accelerate.Accelerator):
    """Accelerate's Accelerator with TSP on the innermost axis: `prepare` converts the model to this rank's TSP
    shards and cuts the dataloaders to zigzag shards, DeepSpeed or FSDP2 runs on the data axis. tsp_size / cp_size:
    the TSP and cp degrees for a plain launch (a DeepSpeed or FSDP2 config gives them itself)."""

    def __init__(self, *args, tsp_size: int | None = None, cp_size: int | None = None,
                 tsp_groups: ProcessGroups | None = None, **kwargs):
        self.tsp_setup: TSPAccelerateSetup = resolve_setup(
            os.environ, tsp_size=tsp_size, cp_size=cp_size, deepspeed_plugin=kwargs.get("deepspeed_plugin"),
            fsdp_plugin=kwargs.pop("fsdp_plugin", None), parallelism_config=kwargs.pop("parallelism_config", None))
        super().__init__(*args, **_cpu_defaults(kwargs, self.tsp_setup.mode))
        tsp = self.tsp_setup.tsp
        if self.tsp_setup.mode == "deepspeed":
            ds_config = self.state.deepspeed_plugin.deepspeed_config
            ds_config.pop("tsp", None)  # DeepSpeed must not see it
            check_deepspeed_compatible(ds_config, tsp)
        layout = ParallelLayout.from_world_size(self.num_processes, tsp=tsp.size, cp=tsp.cp_size)
        if self.tsp_setup.mode == "plain" and layout.data_enabled:
            fix = f"tsp_size={self.num_processes // tsp.cp_size}"
            fix += f", cp_size={tsp.cp_size}" if tsp.cp_size > 1 else ""
            raise TSPConfigError(f"{self.num_processes} processes with tsp={tsp.size} x cp={tsp.cp_size} leave a data "
                                 f"axis of {layout.data}: launch with ds_configs/accelerate_tsp.yaml (DeepSpeed) or "
                                 "accelerate_tsp_fsdp2.yaml (FSDP2) for data parallelism, or TSPAccelerator("
                                 f"{fix})")
        self.tsp_runtime = build_runtime(tsp, world_size=self.num_processes, groups=tsp_groups,
                                         ds_config=ds_config if self.tsp_setup.mode == "deepspeed" else None)
        self.tsp_groups, self.tsp_comm = self.tsp_runtime.groups, self.tsp_runtime.comm
        self.tsp_model: TSPForCausalLM | None = None

    # --- layout -------------------------------------------------------------------------------------------------
    @property
    def data_rank(self) -> int:
        return self.tsp_groups.data_rank if self.tsp_groups else 0

    @property
    def data_size(self) -> int:
        return self.tsp_groups.data_size if self.tsp_groups else 1

    @property
    def _data_group(self):
        """The ranks holding the same shards: data x cp (data-major), the data axis alone when cp = 1."""
        return self.tsp_groups.data_group if self.tsp_groups else None

    @property
    def _cp_size(self) -> int:
        return self.tsp_groups.cp_size if self.tsp_groups else 1

    # --- prepare ------------------------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        if device_placement is not None:
            raise TSPConfigError("device_placement is not supported by TSPAccelerator: shards live on self.device")
        result = list(args)
        models = [i for i, obj in enumerate(args) if isinstance(obj, (nn.Module, str, Path))]
        if len(models) > 1:
            raise TSPConfigError("TSPAccelerator.prepare takes one model")
        optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer)]
        if models:
            original = args[models[0]]
            names = parameter_names(original)  # before conversion / FSDP2 re-create the parameters
            if _is_vlm(original):
                names = _vlm_names(names)
            model = self._convert_model(original)
            if self.tsp_setup.mode != "deepspeed":
                with self._setup_guard(f"{self.tsp_setup.mode} sharding of the model (fully_shard)"):
                    model = self._shard_model(model)
            for optimizer in optimizers:  # the optimizer built on the HF model now steps the TSP shards
                rebind_optimizer(optimizer, names, model)
            result[models[0]] = model
        for i, obj in enumerate(args):
            if isinstance(obj, torch.utils.data.DataLoader):
                result[i] = self._prepare_tsp_loader(obj)
        # Accelerate prepares the rest: optimizer and scheduler wrappers, and under DeepSpeed the model's engine.
        keep = [i for i, obj in enumerate(result) if not isinstance(obj, TSPShardedLoader) and
                (self.tsp_setup.mode == "deepspeed" or i not in models)]
        if keep:
            with self._tsp_deepspeed_initialize(result) if self.tsp_setup.mode == "deepspeed" else \
                    contextlib.nullcontext(), self._setup_guard(PREPARE_WHAT):
                prepared = super().prepare(*[result[i] for i in keep])
            for i, obj in zip(keep, prepared if isinstance(prepared, tuple) else (prepared,)):
                result[i] = obj
        for obj in result:
            if isinstance(obj, _accelerate.scheduler.AcceleratedScheduler):
                obj.__class__, obj.data_size = DataAxisScheduler, self.data_size
        return result[0] if len(result) == 1 else tuple(result)

    def _setup_guard(self, what: str):
        """The one-time setup's collectives (under DeepSpeed: deepspeed.initialize's broadcasts, ZeRO's partitioning,
        barriers) bounded by timeout_s as one block with the watchdog's one line, over every process."""
        return guarded(getattr(self, "tsp_comm", None), what, context="setup", comm_errors_only=True)

    def _convert_model(self, model) -> TSPForCausalLM:
        if _is_vlm(model):  # full batches on every TSP rank, per-replica means (ds_tsp.integrations.multimodal)
            from ds_tsp.integrations.multimodal import to_vlm_model

            converted = to_vlm_model(model, self.tsp_runtime)
        else:
            converted = to_tsp_model(model, self.tsp_comm, options=self.tsp_runtime.options,
                                     data_group=self._data_group, hf_face=True)
        if self.tsp_setup.activation_checkpointing:
            converted.gradient_checkpointing_enable()
        converted.to(self.device)
        self.tsp_model = converted
        return converted

    def _shard_model(self, model: TSPForCausalLM) -> TSPForCausalLM:
        if self.tsp_setup.mode == "fsdp2":
            from ds_tsp.integrations.fsdp import shard_with_fsdp2

            shard_with_fsdp2(model, self.tsp_groups, mp_policy=self._fsdp2_policy(),
                             reshard_after_forward=self.tsp_setup.reshard_after_forward)
            if _is_vlm(model):  # per-replica means, as under DeepSpeed (to_vlm_model); the tower stays averaged
                model.tsp.set_data_parallel_group(None)
        self._models.append(model)
        return model

    def _fsdp2_policy(self):
        precision = self.tsp_setup.mixed_precision
        if precision == "no":
            return None
        if precision != "bf16":
            raise TSPConfigError(f"mixed_precision={precision!r} with FSDP2 + TSP: use 'bf16' (its "
                                 "MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction and master weights) "
                                 "or 'no'")
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def _prepare_tsp_loader(self, loader) -> TSPShardedLoader:
        from accelerate.data_loader import prepare_data_loader

        prepared = prepare_data_loader(
            loader, self.device, num_processes=self.data_size, process_index=self.data_rank,
            split_batches=self.split_batches, put_on_device=self.device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False, even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return TSPShardedLoader(prepared, self.tsp_comm, batch_size=loader.batch_size, whole=self._holds_vlm)

    def _holds_vlm(self) -> bool:
        """Whether the prepared model is a vision-language model (read when a loader is iterated): it takes the
        collator's full batch on every TSP rank and shards the tokens itself, pixels whole."""
        from ds_tsp.model.hf_conditional_generation import TSPForConditionalGeneration

        return isinstance(self.tsp_model, TSPForConditionalGeneration)

    @contextlib.contextmanager
    def _tsp_deepspeed_initialize(self, objects: list):
        """Accelerate calls deepspeed.initialize at prepare time: give it the TSP mpu and the data-axis batch size."""
        import deepspeed

        plugin = self.state.deepspeed_plugin
        if plugin.is_auto("train_micro_batch_size_per_gpu"):
            loaders = [o for o in objects if isinstance(o, TSPShardedLoader)]
            if not loaders or loaders[0].batch_size is None:
                raise TSPConfigError("train_micro_batch_size_per_gpu is 'auto' but prepare got no dataloader with a "
                                     "batch_size: set it in the DeepSpeed JSON or prepare the dataloader together")
            per_replica = loaders[0].batch_size // (self.data_size if self.split_batches else 1)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_replica
        original = deepspeed.initialize
        groups, data_size, cp_size, model = self.tsp_groups, self.data_size, self._cp_size, self.tsp_model

        def initialize(*args, **kwargs):
            config = kwargs.get("config_params") or kwargs.get("config")
            # DeepSpeed checks it against its data-parallel world, the mpu's data x cp (the cp groups of a
            # sequence are gradient replicas to it); the samples per step are micro x accumulation x data_size
            config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] *
                                          config["gradient_accumulation_steps"] * data_size * cp_size)
            if groups is not None:
                kwargs["mpu"] = TSPModelParallelUnit(groups)
            if model is not None and (config.get("zero_optimization") or {}).get("stage", 0) == 3:
                register_zero3_fetches(model, deepspeed)  # what each layer reads, whole in its hooks
            out = original(*args, **kwargs)
            keep_clip_norm(out[0])  # the grad_norm the Trainer logs, also without ZeRO
            return out

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = original

    # --- TSP-aware utilities --------------------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        """Accelerate's backward; in the plain setup with cp groups (no data engine to reduce them) the cp groups'
        gradients are then averaged over the data group (data x cp), once per optimizer step (sync_gradients), so
        clip_grad_norm_ and the optimizer see the whole sequence's gradient. Bounded by timeout_s as one block with
        the watchdog's one line: the gradient reduction in the backward's hooks (DeepSpeed's ZeRO reduce /
        all-reduce, FSDP2's reduce-scatter) and, under DeepSpeed, engine.step() (Accelerate steps it here)."""
        with self._backward_guard(loss):
            super().backward(loss, **kwargs)
        if self.tsp_setup.mode == "plain" and self._cp_size > 1 and self.sync_gradients and self.tsp_model is not None:
            from ds_tsp.core.grads.data_parallel import average_grads_over_group

            average_grads_over_group(self.tsp_model.parameters(), self._data_group, self.tsp_comm)

    def _backward_guard(self, loss):
        if self.tsp_comm is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return contextlib.nullcontext()
        what = "DeepSpeed backward and step (gradient reduction, grad-norm all_reduce, ZeRO collectives)" \
            if self.tsp_setup.mode == "deepspeed" else f"{self.tsp_setup.mode} backward (gradient reduction)"
        device = getattr(loss, "device", None)  # a tensor's; Guard watches only a device (cuda), never the host
        return self.tsp_comm.guard(what, group=dist.group.WORLD, context="backward", poll=device,
                                   comm_errors_only=True)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The norm of the FULL model's gradient (TSP shards summed over the group, norms counted once)."""
        if self.tsp_setup.mode == "deepspeed":
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        if self.tsp_groups is None:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        from ds_tsp.core.grads.clip import clip_grad_norm_

        return clip_grad_norm_(list(parameters), max_norm, self.tsp_groups, norm_type)

    def gather(self, tensor):
        """Gather over the DATA axis only: the ranks of a TSP group hold the same batch, so the same values, and so
        do the cp groups of one replica (one copy kept: the data group spans data x cp, data-major)."""
        from accelerate.utils import recursively_apply

        if self.data_size == 1:
            return tensor
        cp_size = self._cp_size

        def gather_one(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            if t.dim() == 0:
                t = t[None]
            out = [torch.empty_like(t) for _ in range(self.data_size * cp_size)]
            with _guard(self, "gather over data", self._data_group, poll=t.device):
                dist.all_gather(out, t, group=self._data_group)
            return torch.cat(out[::cp_size])

        return recursively_apply(gather_one, tensor, error_on_other_type=True)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Accelerate's gather_for_metrics over the data axis (duplicates of the last batch dropped as it does)."""
        try:
            from accelerate.utils import recursively_apply

            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        if use_gather_object or not all_tensors:
            if self.data_size == 1:
                data = input_data if isinstance(input_data, list) else [input_data]
            else:
                parts = [None] * (self.data_size * self._cp_size)
                with _guard(self, "gather_for_metrics gather_object over data", self._data_group):
                    dist.all_gather_object(parts, input_data, group=self._data_group)
                data = [x for part in parts[::self._cp_size] for x in (part if isinstance(part, list) else [part])]
        else:
            data = self.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if use_gather_object or not all_tensors:
                return data[:state.remainder]
            return recursively_apply(lambda t: t[:state.remainder], data)
        return data

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        """Accelerate's: it gathers the sizes over every process (the evaluation loop's predictions and labels);
        guarded (its .cpu() waits on the host, so the deadline covers it on NCCL too)."""
        group = dist.group.WORLD if dist.is_initialized() else None
        with _guard(self, "pad_across_processes size gather", group):
            return super().pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        if isinstance(dataloader, WholeBatchLoader):
            return WholeBatchLoader(super().skip_first_batches(dataloader.loader, num_batches), self.tsp_comm)
        if isinstance(dataloader, TSPShardedLoader):
            return TSPShardedLoader(super().skip_first_batches(dataloader.loader, num_batches), self.tsp_comm,
                                    batch_size=dataloader.batch_size, whole=dataloader.whole)
        return super().skip_first_batches(dataloader, num_batches)

    def save_model(self, model, save_directory, max_shard_size="5GB", safe_serialization=True):
        """The HF layout, streamed (every rank must call it)."""
        self.unwrap_model(model).save_pretrained(save_directory, max_shard_size=max_shard_size)

    def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
        """Accelerate's save_state; outside DeepSpeed every rank also writes its own model and optimizer shards
        (Accelerate's files hold only the main process's tensors, which differ between TSP ranks). The layout
        (tsp x cp x data) is recorded beside them: load_state refuses another one (state_layout.py)."""
        with guarded(self.tsp_comm, "TSPAccelerator.save_state (Accelerate's and DeepSpeed's collectives, barrier)",
                     context="save", comm_errors_only=True):
            return self._save_state(output_dir, safe_serialization, **kwargs)

    def _save_state(self, output_dir, safe_serialization, **kwargs):
        if self.tsp_setup.mode == "deepspeed":
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        else:
            models, optimizers = self._models, self._optimizers
            self._models, self._optimizers = [], []
            try:
                location = super().save_state(output_dir, safe_serialization, **kwargs)
            finally:
                self._models, self._optimizers = models, optimizers
            write_rank_state(location, self.process_index, models, optimizers)
        if self.is_local_main_process:
            write_layout(location, self._state_layout(), self.process_index)
        self.wait_for_everyone()
        return location

    def _state_layout(self) -> dict[str, int]:
        groups = self.tsp_groups
        return layout_record(groups.tsp_size, groups.cp_size, groups.data_size) if groups else layout_record(1, 1, 1)

    def _saved_state_dir(self, input_dir) -> Path | None:
        """The directory Accelerate's load_state reads: input_dir, else its newest automatically named one."""
        if input_dir is not None:
            return Path(os.path.expanduser(input_dir))
        if self.project_configuration.automatic_checkpoint_naming:
            folders = list(Path(self.project_dir, "checkpoints").glob("*"))
            return max(folders, key=lambda f: int(re.findall(r"[0-9]+", f.name)[0])) if folders else None
        return None

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        """Accelerate's load_state (DeepSpeed's checkpoint load under DeepSpeed), then every rank's own shards;
        its collectives bounded by timeout_s as one block."""
        with guarded(self.tsp_comm, "TSPAccelerator.load_state (Accelerate's and DeepSpeed's collectives)",
                     context="load", comm_errors_only=True):
            return self._load_state(input_dir, load_kwargs, **kwargs)

    def _load_state(self, input_dir, load_kwargs, **kwargs):
        directory = self._saved_state_dir(input_dir)
        if directory is not None:  # before anything is loaded: another layout's files would fit the wrong ranks
            check_layout(directory, self._state_layout())
        if self.tsp_setup.mode == "deepspeed":
            return super().load_state(input_dir, load_kwargs, **kwargs)
        if input_dir is None:
            raise TSPConfigError("load_state needs input_dir under TSP (automatic checkpoint naming is not supported)")
        # read first: a missing or refused state fails before Accelerate restored its part (RNG, scheduler)
        state = read_rank_state(input_dir, self.process_index, self.device)
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        for model, saved in zip(models, state["models"]):
            load_model_local(model, saved)
        for optimizer, saved in zip(optimizers, state["optimizers"]):
            load_optimizer_local(getattr(optimizer, "optimizer", optimizer), saved)
