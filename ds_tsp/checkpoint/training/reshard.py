"""This rank's shard of every parameter (weight or optimizer state), from shards saved at any TSP degree.

Same degree: the rank's own tensor is read as saved (bit for bit). Another degree: for each sharded module the
saved shards of every old rank are put together into that module's HF tensors (ds_tsp.model.sharded_modules: unshard) and this
rank's part is cut out of them (shard_full), one module at a time, so no rank ever holds more than one module
whole. Replicated parameters (norms) are read from TSP rank 0's files.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_tsp.checkpoint.training.manifest import Manifest
from ds_tsp.checkpoint.training.shard_files import ShardFileReader
from ds_tsp.core.comm import TSPComm


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

    def files(self) -> set[str]:
        """The files this rank reads (to verify their checksums first)."""
        return {f for r in self.readers.values() for f in r.tensor_files.values()}

    def value(self, param_name: str, key: str | None = None) -> torch.Tensor:
        """This rank's shard of parameter `param_name` (its weight, or optimizer state `key`), as saved (fp32)."""
        tensor = state_tensor_name(param_name, key)
        if param_name not in self.sharded:
            return self.readers[0].get(tensor)
        if self.same_layout:
            return self.readers[self.model.comm.rank].get(tensor)
        shards = [self.readers[r].get(tensor) for r in range(self.old_size)]
        full = self.old_modules[param_name].unshard(shards)
        return self.sharded[param_name].shard_full(full)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
