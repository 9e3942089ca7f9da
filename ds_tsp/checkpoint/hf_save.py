"""Save TSP shards as a standard HF checkpoint, one module at a time, so no rank ever holds the whole model.

For each sharded module (an embedding, one layer's attention, one layer's MLP, the LM head) the TSP group gathers
the packed shards to the writer only (dist.gather, not all-gather), the writer reassembles that module's HF
tensors and hands them to StreamingCheckpointWriter, which writes a safetensors shard whenever max_shard_size is
reached. Writer memory: one checkpoint shard plus one module. Under ZeRO-3 each parameter is gathered over the
data axis just for its turn, under FSDP2 its DTensor is made whole the same way. Everything is written into a temporary directory that is renamed into place at the
end, so an interrupted save never leaves a partial checkpoint under `directory`.

A failure on the writer (disk full, ...) must not strand the other ranks in the next gather: the writer keeps
joining the collectives, skips writing, and the outcome is broadcast at the end so every rank raises the same error.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.checkpoint.safetensors_writer import StreamingCheckpointWriter
from ds_tsp.core.errors import TSPConfigError


@contextlib.contextmanager
def _whole_on_this_rank(param: torch.nn.Parameter):
    """This rank's whole TSP shard for the duration: under ZeRO-3 (partitioned over the data axis) gathered, under
    FSDP2 (a DTensor sharded over the data mesh) its full_tensor(); both collective over the data axis."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param.detach()
    elif hasattr(param, "full_tensor"):
        yield param.detach().full_tensor()
    else:
        yield param.detach()


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_streaming(model: nn.Module, directory: str | Path, config_json: str, *,
                   max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                   extra_files: dict[str, str] | None = None) -> Path | None:
    """Collective over every rank (TSP and data groups). Global rank 0 writes; returns the directory there, else None.

    dtype: the dtype tensors are stored in (default: the model's). extra_files: {file name: text} written beside
    config.json (generation_config.json).
    """
    if getattr(model, "lora_adapter_config", None) is not None:  # a PEFT LoRA model saves its adapter, as PEFT does
        from ds_tsp.checkpoint.peft_adapter import save_adapter

        return save_adapter(model, directory)
    directory = Path(directory)
    writer = StreamingCheckpointWriter(directory, max_shard_size=max_shard_size) if _is_writer() else None
    failure: str | None = None

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal failure
        if writer is None or failure is not None:
            return
        try:
            writer.add(name, tensor.detach().to(dtype or tensor.dtype).cpu())
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure = f"{type(exc).__name__}: {exc}"

    comm = model.comm
    for prefix, module, param in model.sharded_modules():
        with _whole_on_this_rank(param) as whole:
            shards = comm.gather_to(whole, dst=0)
        if shards is not None:
            for name, tensor in module.unshard(shards).items():
                add(prefix + name, tensor)
        del shards
    for name, param in model.replicated_params().items():
        with _whole_on_this_rank(param) as whole:
            add(name, whole)
    if writer is not None:
        try:
            if failure is None:
                writer.add_file("config.json", config_json)
                for name, text in (extra_files or {}).items():
                    writer.add_file(name, text)
                writer.close()
            else:
                writer.abort()
        except Exception as exc:  # noqa: BLE001
            failure = failure or f"{type(exc).__name__}: {exc}"
    _agree_on_outcome(failure, directory)
    return directory if writer is not None else None


def _agree_on_outcome(failure: str | None, directory: Path) -> None:
    outcome = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise TSPConfigError(f"save_pretrained({str(directory)!r}) failed on the writing rank: {outcome[0]}; "
                             "the previous checkpoint there (if any) is untouched")
