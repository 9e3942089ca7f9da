"""This rank's shard of every parameter (weight or optimizer state), from shards saved at any TSP degree.

Same degree: the rank's own tensor is read as saved (bit for bit). Another degree: for each sharded module the
saved shards of every old rank are put together into that module's HF tensors (ds_tsp.model.modules.decoder: unshard)
and this rank's part is cut out of them (shard_full), one module at a time, so no rank ever holds more than one module
whole. Replicated parameters (norms) are read from TSP rank 0's files.

A LoRA factor cut along its base slice's dim (ds_tsp.model.peft.lora: B's rows of q/k/v/gate/up, A's columns of o/down)
is put together from every old rank's cut at that rank's start (a kv group's leader holds the live copy of a
shared kv head's rows) and re-cut at this rank's start; the replicated factor is read from TSP rank 0's files.
Only trainable parameters are in a checkpoint (train_state.saved_parameters): frozen ones, LoRA's base included,
come from the model the run loads.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_tsp.checkpoint.training.manifest import Manifest
from ds_tsp.checkpoint.training.shard_files import ShardFileReader
from ds_tsp.core.comm.communicator import TSPComm


def state_tensor_name(param_name: str, key: str | None) -> str:
    """The name a parameter's weight (key None) or optimizer state `key` has in the shard files."""
    return param_name if key is None else f"{param_name}::{key}"


def layout_model(model: nn.Module, tsp: int) -> nn.Module:
    """The same model cut for `tsp` ranks, without storage (meta): only its modules' shard layouts are used."""
    comm = TSPComm.single()
    comm.size = tsp  # a layout, never a group: nothing communicates through it
    return type(model)(model.shape, comm, options=model.options, device="meta")


class ShardSource:
    def __init__(self, directory: Path, manifest: Manifest, model: nn.Module):
        self.model, self.old_size = model, manifest.layout.tsp
        self.same_layout = self.old_size == model.comm.size
        ranks = {0, model.comm.rank} if self.same_layout else set(range(self.old_size))
        self.readers = {r: ShardFileReader(directory, manifest.shards[r]) for r in sorted(ranks)}
        names = {id(p): n for n, p in model.named_parameters()}
        self.sharded = {names[id(param)]: module for _, module, param in model.sharded_modules()}
        old = {} if self.same_layout else dict(layout_model(model, self.old_size).named_modules())
        self.old_modules = {n: old[n.rsplit(".", 1)[0]] for n in self.sharded} if old else {}
        # sharded LoRA factors: name -> (dim, this rank's start, its length, every old rank's start)
        self.lora = {}
        for _, param, cut in getattr(model, "lora_tensors", lambda: [])():
            if cut is not None:
                name = names[id(param)]
                dim, starts = cut
                length = tuple(getattr(param, "ds_shape", param.shape))[dim]  # ZeRO-3 keeps the shape aside
                self.lora[name] = (dim, starts[model.comm.rank], length, _old_starts(old, name) if old else None)

    def files(self) -> set[str]:
        """The files this rank reads (to verify their checksums first)."""
        return {f for r in self.readers.values() for f in r.tensor_files.values()}

    def value(self, param_name: str, key: str | None = None) -> torch.Tensor:
        """This rank's shard of parameter `param_name` (its weight, or optimizer state `key`), as saved (fp32)."""
        tensor = state_tensor_name(param_name, key)
        if param_name in self.lora and not self.same_layout:
            dim, start, length, old_starts = self.lora[param_name]
            full = _assemble([self.readers[r].get(tensor) for r in range(self.old_size)], dim, old_starts)
            return full.narrow(dim, start, length).contiguous()
        if param_name not in self.sharded and param_name not in self.lora:
            return self.readers[0].get(tensor)
        if self.same_layout:
            return self.readers[self.model.comm.rank].get(tensor)
        shards = [self.readers[r].get(tensor) for r in range(self.old_size)]
        full = self.old_modules[param_name].unshard(shards)
        return self.sharded[param_name].shard_full(full)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def _old_starts(old_modules: dict[str, nn.Module], factor_name: str) -> tuple[int, ...]:
    """Every old rank's start of a LoRA factor named <piece>.lora.<proj>.lora_X: its base slice's (hf_slices)."""
    piece_name, rest = factor_name.split(".lora.", 1)
    piece, weight = old_modules[piece_name], rest.split(".", 1)[0] + ".weight"
    return tuple(piece.hf_slices(r)[weight][1] for r in range(piece.comm.size))


def _assemble(shards: list[torch.Tensor], dim: int, starts: tuple[int, ...]) -> torch.Tensor:
    """The whole factor from every rank's cut; ranks sharing a kv head hold one slice, the first one's is kept."""
    length = shards[0].shape[dim]
    shape = list(shards[0].shape)
    shape[dim] = max(starts) + length
    full = shards[0].new_empty(shape)
    for r in sorted(range(len(shards)), key=lambda r: -r):  # the lowest rank of a shared slice is written last
        full.narrow(dim, starts[r], length).copy_(shards[r])
    return full
