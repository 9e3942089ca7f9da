"""A TSP model's PEFT LoRA adapter saved as the directory `PeftModel.save_pretrained` writes, so plain peft loads it
onto the plain transformers model: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)`.

    adapter_config.json          the LoraConfig the model was converted from (inference_mode true, as peft writes)
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight / lora_B.weight, PEFT's key names

The model answers `lora_tensors()` (ds_tsp.model.causal_lm): every factor with the slice this rank holds
or None when replicated. One factor at a time, a sharded one is gathered from the TSP group to the writer (global
rank 0) and put back together by its slices, a replicated one is the writer's own copy; only the writer holds the
adapter (r * (in + out) per target, small next to any shard). Each file goes to a temporary name and is renamed
into place, so an interrupted save leaves the previous adapter (if any) whole; nothing else in the directory is
touched (a Trainer's checkpoint-* folders, a base model's files).
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds_tsp.checkpoint.hf.collective_save import agree_on_outcome, is_writer, whole_on_this_rank
from ds_tsp.checkpoint.safetensors.durable import fsync_path
from ds_tsp.checkpoint.safetensors.reader import DEFAULT_METADATA

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def _assemble(shards: list[torch.Tensor], dim: int, starts: tuple[int, ...]) -> torch.Tensor:
    length = shards[0].shape[dim]
    shape = list(shards[0].shape)
    shape[dim] = max(starts) + length
    full = shards[0].new_empty(shape)
    placed = set()
    for shard, start in zip(shards, starts):
        if start not in placed:  # shared kv heads: the first rank of a kv group holds the live copy
            full.narrow(dim, start, length).copy_(shard)
            placed.add(start)
    return full


def gather_adapter(model, grads: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective over the TSP group: (PEFT key, the full factor on TSP rank 0, None elsewhere), one factor at a
    time. grads=True: the factors' gradients instead (zeros where none), for tests and checks."""
    comm = model.comm
    for name, param, cut in model.lora_tensors():
        with whole_on_this_rank(param, comm, "save_pretrained (adapter): data-axis gather") as whole:
            local = whole
            if grads:
                local = param.grad.detach() if param.grad is not None else torch.zeros_like(whole)
            if cut is None:
                full = local if comm.rank == 0 else None
            else:
                shards = comm.gather_to(local.contiguous(), dst=0)
                full = _assemble(shards, *cut) if shards is not None else None
        yield PEFT_PREFIX + name, full


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_adapter(model, directory: str | Path) -> Path | None:
    """Collective over every rank; global rank 0 writes. Returns the directory there, None elsewhere."""
    directory = Path(directory)
    writer = is_writer()
    tensors = {}
    for key, full in gather_adapter(model):
        if writer and full is not None:
            tensors[key] = full.detach().cpu().contiguous()
    failure = None
    if writer:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _replace(directory / ADAPTER_WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata=dict(DEFAULT_METADATA)))
            _replace(directory / ADAPTER_CONFIG_NAME, lambda p: p.write_text(model.lora_adapter_config))
            fsync_path(directory)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure = f"{type(exc).__name__}: {exc}"
    agree_on_outcome(failure, directory, getattr(model, "comm", None))
    return directory if writer else None
