"""Save and resume a whole training state: weights, optimizer state, schedule, data position and RNG.

Every rank calls `save_train_state` / `load_train_state` (collective over the job). Where an engine shards state
over the data axis, reading it is collective too, so every rank walks the parameters in the same order; data rank 0
of each TSP rank writes that rank's shard files (with a cp axis, the cp groups hold the same shards as data replicas
do: only cp rank 0 of data rank 0 writes, so nothing is written twice), rank 0 writes the RNG file and the manifest
and commits the step directory. A failure on any rank is agreed on (one small all-gather) before the next
collective, so every rank raises the same error instead of waiting for the one that failed.

Every collective here is guarded by the model's TSPComm (`timeout_s`): a stalled or dead peer ends each other rank
with the watchdog's one line naming the collective and the peer, and since the step directory is committed (renamed
into place) only after every rank's files are in, an interrupted save leaves the previous checkpoints untouched.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ds_tsp.checkpoint.training.access import OptimizerAccess
from ds_tsp.checkpoint.training.manifest import FileEntry, Layout, Manifest, OptimizerRecord, verify_file, versions
from ds_tsp.checkpoint.training.reshard import ShardSource, state_tensor_name
from ds_tsp.checkpoint.training.shard_files import DEFAULT_FILE_BYTES, ShardFileWriter, write_file
from ds_tsp.checkpoint.training.store import CheckpointStore
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ProcessGroups
from ds_tsp.core.reliability.watchdog import guarded

RNG_FILE = "rng.safetensors"


# --- agreement over the job -----------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def comm_of(model: Any):
    """The TSPComm whose timeout_s bounds a checkpoint's collectives (None for a model without one: unbounded)."""
    comm = getattr(model, "comm", None)
    if comm is None:
        comm = getattr(getattr(model, "tsp", None), "comm", None)
    return comm if hasattr(comm, "guard") else None


CONTEXT = "training checkpoint"  # the layer a stalled collective's report names


def _gather(obj: Any, comm=None, what: str = "training checkpoint all_gather_object") -> list:
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world
    with guarded(comm, what, context=CONTEXT):
        dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any, comm=None, what: str = "training checkpoint broadcast_object_list") -> Any:
    if _world()[1] == 1:
        return obj
    box = [obj]
    with guarded(comm, what, context=CONTEXT):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: str | None, comm=None) -> None:
    """Raise the first rank's error on every rank (or return when no rank has one)."""
    errors = [(r, e) for r, e in enumerate(_gather(error, comm, "training checkpoint: agreeing on errors")) if e]
    if errors:
        rank, message = errors[0]
        raise TSPConfigError(message if rank == _world()[0] else f"rank {rank}: {message}")


def _attempt(fn, *args) -> str | None:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - reported on every rank by _agree
        return str(err) if isinstance(err, TSPConfigError) else f"{type(err).__name__}: {err}"
    return None


# --- RNG --------------------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state(),
             "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    random.setstate((3, tuple(int(v) for v in state["python"].tolist()), None))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


# --- save ---------------------------------------------------------------------------------------------------
def _check_pipeline(groups: ProcessGroups) -> None:
    if groups.layout.pipe_enabled:
        raise TSPConfigError(f"pipeline_stages={groups.pipe_size}: ds_tsp training checkpoints cover TSP x data "
                             "layouts; with pipeline stages use engine.save_checkpoint / load_checkpoint (same "
                             "layout only)")


def saved_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a checkpoint holds: the trainable ones (weights and optimizer state). A frozen parameter has
    no optimizer state and does not change, so it is not saved: it comes from the model the resuming run loads (a
    LoRA run saves its adapter and the adapter's optimizer state, never the frozen base)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def sharded_ids(model: nn.Module) -> set[int]:
    """ids of the parameters every TSP rank holds its own part of (the rest is replicated: TSP rank 0 writes it):
    the sharded modules' and LoRA's sharded factors."""
    ids = {id(p) for _, _, p in model.sharded_modules()}
    return ids | {id(p) for _, p, cut in getattr(model, "lora_tensors", lambda: [])() if cut is not None}


def save_train_state(access: OptimizerAccess, model: nn.Module, groups: ProcessGroups, store: CheckpointStore,
                     step: int, *, data_state: dict | None = None,
                     max_file_bytes: int = DEFAULT_FILE_BYTES) -> Path:
    """Collective. Writes DIR/step-<step> and returns its path (on every rank)."""
    _check_pipeline(groups)
    rank, _ = _world()
    comm = comm_of(model)
    tmp = Path(_broadcast(str(store.new_temporary(step)) if rank == 0 else None, comm,
                          "training checkpoint save: broadcast of the directory"))
    tsp_rank, writes = groups.tsp_rank, groups.data_rank == 0 and groups.cp_rank == 0  # one writer per TSP shard
    writer = ShardFileWriter(tmp, f"tsp{tsp_rank:02d}", max_file_bytes) if writes else None
    sharded = sharded_ids(model)
    keys = access.state_keys()
    error = None
    for name, param in saved_parameters(model):
        for key in (None, *keys):
            with guarded(comm, f"training checkpoint save: {state_tensor_name(name, key)} over data",
                         group=groups.data_group, context=CONTEXT):  # collective over data (ZeRO)
                value = access.weight(param) if key is None else access.state(param, key)
            if writer is not None and error is None and (tsp_rank == 0 or id(param) in sharded):
                error = _attempt(writer.add, state_tensor_name(name, key), value)
    if writer is not None and error is None:
        error = _attempt(writer.flush)
    mine = (tsp_rank, writer.files if writer else {}, writer.tensor_files if writer else {}, _rng_state(), error)
    everyone = _gather(mine, comm, "training checkpoint save: all_gather_object of the files")
    outcome = None
    if rank == 0:
        outcome = next((f"rank {r}: {e[4]}" for r, e in enumerate(everyone) if e[4]), None)
        if outcome is None:
            outcome = _attempt(_commit, access, model, groups, store, step, tmp, everyone, data_state)
        if outcome is not None:
            store.discard_temporary(tmp)
    outcome = _broadcast(outcome, comm, "training checkpoint save: broadcast of the outcome")
    if outcome is not None:
        raise TSPConfigError(f"saving the training checkpoint of step {step} failed ({outcome}); the previous "
                             "checkpoints are untouched")
    return store.root / store.step_name(step)


def _commit(access, model, groups, store, step, tmp, everyone, data_state) -> None:
    files: dict[str, FileEntry] = {}
    shards: dict[int, dict[str, str]] = {}
    for tsp_rank, rank_files, tensor_files, _, _ in everyone:
        if rank_files:
            files.update(rank_files)
            shards[tsp_rank] = tensor_files
    rng = {f"rank{r}.{k}": v for r, e in enumerate(everyone) for k, v in e[3].items()}
    data = safetensors_bytes(rng)
    write_file(tmp / RNG_FILE, data)
    files[RNG_FILE] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    manifest = Manifest(
        step=step, layout=Layout(tsp=groups.tsp_size, data=groups.data_size, pipe=groups.pipe_size, cp=groups.cp_size),
        model=_shape_dict(model), dtype=str(model.dtype).removeprefix("torch."),
        global_batch_size=access.global_batch_size(),
        optimizer=OptimizerRecord(name=access.name(), state_keys=access.state_keys(), step=access.step_count(),
                                  param_groups=access.param_groups()),
        lr_scheduler=access.scheduler_state(), engine=access.counters(), data=data_state, versions=versions(),
        shards=shards, files=files)
    manifest.write(tmp)
    store.commit(tmp, step)


# The adapter's fields that decide the factors' shapes and values: a resume with other ones is refused by name.
_LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
                "layers_to_transform")


def _shape_dict(model: nn.Module) -> dict:
    shape = json.loads(json.dumps(model.shape.to_dict()))  # tuples as lists, as the manifest reads back
    adapter = getattr(model, "lora_adapter_config", None)  # ds_tsp.model.trainability.load_hf_model sets it
    if adapter:
        config = json.loads(adapter)
        shape["lora"] = {k: config.get(k) for k in _LORA_FIELDS}
    return shape


# --- load ---------------------------------------------------------------------------------------------------
def find_checkpoint(store: CheckpointStore, path: str | Path | None = None, comm=None) -> Path | None:
    """The checkpoint to resume from (rank 0's view, shared): `path`, else the store's latest complete one."""
    rank, _ = _world()
    found = None
    if rank == 0:
        found = Path(path).absolute() if path is not None else store.latest()
        found = None if found is None else str(found)
    found = _broadcast(found, comm, "training checkpoint load: broadcast of the directory")
    return None if found is None else Path(found)


def check_resumable(manifest: Manifest, access: OptimizerAccess, model: nn.Module, groups: ProcessGroups,
                    where: Path) -> None:
    """One clear error for a checkpoint this run cannot continue from (the same on every rank)."""
    _check_pipeline(groups)
    if manifest.layout.pipe != 1:
        raise TSPConfigError(f"{where}: saved with pipeline_stages={manifest.layout.pipe}; resume it with "
                             "engine.load_checkpoint on the same layout")
    shape = _shape_dict(model)
    diff = sorted(k for k in set(shape) | set(manifest.model) if shape.get(k) != manifest.model.get(k))
    if diff:
        k = diff[0]
        raise TSPConfigError(f"{where}: the checkpoint's model has {k}={manifest.model.get(k)!r}, this model "
                             f"{k}={shape.get(k)!r} ({len(diff)} fields differ): resume with the model it was "
                             "saved from")
    try:
        model.shape.check_tsp_degree(manifest.layout.tsp)
    except TSPConfigError as err:
        raise TSPConfigError(f"{where}: saved at tsp={manifest.layout.tsp}, which this model cannot map ({err})")
    if manifest.optimizer.name != access.name():
        raise TSPConfigError(f"{where}: the optimizer was {manifest.optimizer.name}, this run uses {access.name()}: "
                             "configure the same optimizer to resume")
    if manifest.global_batch_size != access.global_batch_size():
        saved = manifest.layout
        raise TSPConfigError(
            f"{where}: saved with a global batch of {manifest.global_batch_size} samples per step, this run has "
            f"{access.global_batch_size()} (train_batch_size = micro batch x gradient_accumulation_steps x data "
            "degree; the cp groups of a replica share its samples, so cp does not count): keep "
            f"{manifest.global_batch_size} (saved at tsp={saved.tsp} x cp={saved.cp} x data={saved.data}, this run "
            f"is tsp={groups.tsp_size} x cp={groups.cp_size} x data={groups.data_size}: raise the micro batch or the "
            "accumulation steps when the data degree shrinks, lower them when it grows) so data order and schedule "
            "continue")
    missing_ranks = sorted(set(range(manifest.layout.tsp)) - set(manifest.shards))
    if missing_ranks:
        raise TSPConfigError(f"{where}: the manifest lists no files of TSP rank {missing_ranks[0]}: the checkpoint "
                             "is incomplete; resume from another one")
    saved, ids = saved_parameters(model), sharded_ids(model)
    trainable = {n for n, _ in saved}
    extra = sorted({t.split("::")[0] for t in manifest.shards.get(0, {})} - trainable)
    if extra:
        raise TSPConfigError(f"{where}: the checkpoint trained {extra[0]!r} ({len(extra)} parameters), which is "
                             "frozen (requires_grad=False) or absent in this model: freeze the same parameters "
                             "(and wrap the same LoRA adapter) as the run that saved it")
    names = {state_tensor_name(n, k) for n in trainable for k in (None, *manifest.optimizer.state_keys)}
    sharded = {n for n, p in saved if id(p) in ids}
    for tsp_rank, tensors in manifest.shards.items():
        need = names if tsp_rank == 0 else {t for t in names if t.split("::")[0] in sharded}
        missing = sorted(need - set(tensors))
        if missing:
            raise TSPConfigError(f"{where}: no tensor {missing[0]!r} for TSP rank {tsp_rank} ({len(missing)} "
                                 "missing): the checkpoint was saved from another model, or with this parameter "
                                 "frozen: freeze the same parameters as the run that saved it")


def load_train_state(access: OptimizerAccess, model: nn.Module, groups: ProcessGroups, store: CheckpointStore,
                     *, path: str | Path | None = None) -> tuple[Manifest, Path] | None:
    """Collective. Restore everything but the data position (returned in the manifest); None: nothing to resume."""
    comm = comm_of(model)
    where = find_checkpoint(store, path, comm)
    if where is None:
        return None
    state: dict[str, Any] = {}

    def read_and_check():
        state["manifest"] = manifest = Manifest.read(where)
        check_resumable(manifest, access, model, groups, where)
        state["source"] = source = ShardSource(where, manifest, model)
        for name in sorted(source.files() | {RNG_FILE}):
            if name not in manifest.files:
                raise TSPConfigError(f"{where}: {name} has no checksum in the manifest: the checkpoint is damaged")
            verify_file(where, name, manifest.files[name])

    _agree(_attempt(read_and_check), comm)
    manifest, source = state["manifest"], state["source"]
    keys = manifest.optimizer.state_keys
    params = [p for _, p in saved_parameters(model)]
    if keys:
        access.ensure_state(params)  # a fresh engine's zero step: the model's own collectives are guarded
        if access.state_keys() != keys:
            raise TSPConfigError(f"{where}: the checkpoint holds optimizer state {keys}, this optimizer "
                                 f"{access.state_keys()}: configure the same optimizer")
    for name, param in saved_parameters(model):  # local writes (each rank its own shards and fragments)
        access.set_weight(param, source.value(name))
        for key in keys:
            access.set_state(param, key, source.value(name, key))
    source.close()
    with guarded(comm, "training checkpoint load: ZeRO-3 re-gather of the persistent parameters",
                 group=groups.data_group, context=CONTEXT):
        access.finish_load()
    access.set_step_count(manifest.optimizer.step)
    access.set_param_groups(manifest.optimizer.param_groups)
    access.load_scheduler_state(manifest.lr_scheduler)
    access.set_counters(manifest.engine)
    rank, _ = _world()
    rng = load_safetensors(str(where / RNG_FILE))
    mine = {k.split(".", 1)[1]: v for k, v in rng.items() if k.startswith(f"rank{rank}.")}
    if mine:  # a rank the saving run did not have keeps its own RNG (documented: only on the same world size)
        _set_rng_state(mine)
    return manifest, where
