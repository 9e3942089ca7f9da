"""Save TSP shards as a standard HF checkpoint, one module at a time, so no rank ever holds the whole model.

For each sharded module (an embedding, one layer's attention, one layer's dense MLP, the LM head) the TSP group
gathers the packed shards to the writer only (dist.gather, not all-gather), the writer reassembles that module's HF
tensors and hands them to StreamingCheckpointWriter, which writes a safetensors shard whenever max_shard_size is
reached. Writer memory: one checkpoint shard plus one module. Under ZeRO-3 each parameter is gathered over the
data axis just for its turn, under FSDP2 its DTensor is made whole the same way. Everything is written into a
temporary directory that is renamed into place at the end, so an interrupted save never leaves a partial checkpoint
under `directory`.

Modules whose ranks own whole tensors (MoE experts: ds_tsp.checkpoint.hf.owned_tensors) are not gathered: every TSP rank
of the writing data replica (the one holding global rank 0) streams its own experts into the same temporary
directory, and reports its files to the writer, which indexes and renames them with its own. Collectives, in this
order on every rank: a world broadcast of the temporary directory's path (or of why the writer could not open it);
per sharded module, its data-axis gather (ZeRO-3 / FSDP2) and, for a gathered module, the TSP gather; a gather_object
of the expert files over the writing replica's TSP group (MoE models only); a world broadcast of the outcome.

A failure on a writing rank (disk full, ...) must not strand the other ranks in the next collective: it keeps
joining the collectives, skips writing, and the outcomes are agreed at the end so every rank raises the same error
and the writer drops the temporary directory, every rank's files with it.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.checkpoint.hf.collective_save import CONTEXT, agree_on_outcome, global_rank, is_writer, whole_on_this_rank
from ds_tsp.checkpoint.hf.load import progress_on_rank0
from ds_tsp.checkpoint.hf.owned_tensors import OwnedParts, gather_owned_parts, open_rank_stream, saved_by_owner
from ds_tsp.checkpoint.safetensors.shard_stream import ShardStream
from ds_tsp.checkpoint.safetensors.writer import StreamingCheckpointWriter
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.reliability.watchdog import guarded


def _failure(exc: BaseException) -> str:
    return f"global rank {global_rank()}: {type(exc).__name__}: {exc}"


def _in_writing_replica(comm) -> bool:
    """This rank's TSP group is the one global rank 0 (the writer) is TSP rank 0 of."""
    if comm.size == 1:
        return is_writer()
    return dist.get_global_rank(comm.group, 0) == 0


class _FirstFailure:
    """Runs the writing steps of one rank until the first failure, which it keeps instead of raising: a rank that
    raised here would leave the others waiting in their next collective."""

    def __init__(self):
        self.failure: str | None = None

    def run(self, fn, *args):
        if self.failure is not None:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported on every rank at the end
            self.failure = _failure(exc)
            return None


def save_streaming(model: nn.Module, directory: str | Path, config_json: str, *,
                   max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                   extra_files: dict[str, str] | None = None) -> Path | None:
    """Collective over every rank (TSP and data groups). Global rank 0 writes the checkpoint (and the TSP ranks of
    its data replica their own MoE experts); returns the directory there, else None.

    dtype: the dtype tensors are stored in (default: the model's). extra_files: {file name: text} written beside
    config.json (generation_config.json).
    """
    if getattr(model, "lora_adapter_config", None) is not None:  # a PEFT LoRA model saves its adapter, as PEFT does
        from ds_tsp.checkpoint.hf.peft_adapter import save_adapter

        return save_adapter(model, directory)
    if not callable(getattr(model, "sharded_modules", None)) or not hasattr(model, "comm"):
        raise TSPConfigError(
            f"save_pretrained / save_consolidated: {type(model).__name__} is not a TSP model (no sharded_modules() / "
            "comm); a DeepSpeed PipelineModule (tsp.pipeline_stages > 1) cannot be saved as one HF checkpoint: "
            "use engine.save_checkpoint, or train with tsp.pipeline_stages=1 to save the HF layout")
    directory = Path(directory)
    comm = model.comm
    sharded = model.sharded_modules()
    by_owner = [saved_by_owner(module, comm.size) for _, module, _ in sharded]
    writer, tmp_dir = _open_writer(directory, max_shard_size, comm)
    keep = _FirstFailure()
    writes_experts = any(by_owner) and _in_writing_replica(comm)  # the same on every rank of a TSP group
    stream = (keep.run(open_rank_stream, tmp_dir, comm.rank, max_shard_size)
              if writes_experts and writer is None else None)  # None where the open failed (kept in keep)
    experts_to = writer if writer is not None else stream

    def add(target, name: str, tensor: torch.Tensor) -> None:
        if target is not None:
            keep.run(lambda: target.add(name, tensor.detach().to(dtype or tensor.dtype).cpu()))

    replicated = model.replicated_params()
    buffers = model.replicated_buffers() if callable(getattr(model, "replicated_buffers", None)) else {}
    with progress_on_rank0(f"saving {directory.name}", len(sharded) + len(replicated)) as advance:
        for (prefix, module, param), owned in zip(sharded, by_owner):
            with whole_on_this_rank(param, comm, f"save_pretrained: data-axis gather of {prefix}") as whole:
                if owned:  # this rank's experts, written here (views: the stream copies them one part at a time)
                    for name, tensor in module.hf_targets(whole).items():
                        add(experts_to, prefix + name, tensor)
                    advance()
                    continue
                shards = comm.gather_to(whole, dst=0)
            if shards is not None:
                for name, tensor in module.unshard(shards).items():
                    add(writer, prefix + name, tensor)
            del shards
            advance()
        for name, param in replicated.items():
            with whole_on_this_rank(param, comm, f"save_pretrained: data-axis gather of {name}") as whole:
                add(writer, name, whole)
            advance()
        for name, buffer in buffers.items():  # in their own dtype, as transformers keeps GLM's bias in float32
            if writer is not None:
                keep.run(lambda name=name, buffer=buffer: writer.add(name, buffer.detach().cpu()))
    if writes_experts:
        _collect_owned_parts(comm, keep, writer, stream)
    if writer is not None:
        try:
            if keep.failure is None:
                writer.add_file("config.json", config_json)
                for name, text in (extra_files or {}).items():
                    writer.add_file(name, text)
                writer.close()
            else:
                writer.abort()
        except Exception as exc:  # noqa: BLE001
            keep.failure = keep.failure or _failure(exc)
    agree_on_outcome(keep.failure, directory, comm)
    return directory if writer is not None else None


def _open_writer(directory: Path, max_shard_size: int | str, comm) -> tuple[StreamingCheckpointWriter | None, Path]:
    """The writer on global rank 0; its temporary directory's path broadcast to every rank (the TSP ranks of the
    writing replica write their experts there). A writer that cannot open fails every rank here, together."""
    writer, failure = None, None
    if is_writer():
        try:
            if comm.size > 1 and comm.rank != 0:
                raise TSPConfigError(f"global rank 0 is TSP rank {comm.rank} of its group: the writer must be TSP "
                                     "rank 0 (the gathers go there); build the TSP groups with ProcessGroups")
            writer = StreamingCheckpointWriter(directory, max_shard_size=max_shard_size)
        except Exception as exc:  # noqa: BLE001 - raised on every rank just below
            failure = _failure(exc)
    start = [None if writer is None else str(writer.tmp_dir), failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        with guarded(comm, "save_pretrained: broadcast of the temporary directory", context=CONTEXT):
            dist.broadcast_object_list(start, src=0)
    if start[1] is not None:
        raise TSPConfigError(f"save_pretrained({str(directory)!r}) could not start: {start[1]}; nothing was written")
    return writer, Path(start[0])


def _collect_owned_parts(comm, keep: _FirstFailure, writer: StreamingCheckpointWriter | None,
                         stream: ShardStream | None) -> None:
    """The writing replica's TSP ranks report their expert files; the writer adopts them, or keeps a failure."""
    parts = keep.run(stream.finish) if stream is not None else None
    mine = OwnedParts(comm.rank, global_rank(), parts or [], stream.total_size if stream is not None else 0,
                      keep.failure)
    reports = gather_owned_parts(comm, mine)
    for report in reports[1:] if writer is not None else ():
        if report.failure is not None:
            keep.failure = keep.failure or report.failure
        keep.run(writer.adopt_parts, report.parts, report.total_size)
