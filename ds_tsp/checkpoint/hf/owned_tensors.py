"""Sharded modules whose TSP ranks each own WHOLE checkpoint tensors (the MoE experts: rank p holds experts
[p*E/D, (p+1)*E/D) whole, ds_tsp.model.modules.moe) are saved by their owners, not gathered to the writer.

Every TSP rank of the writing data replica streams its own tensors into the writer's temporary directory (a
filesystem the TSP ranks share, as loading by slices already assumes) as part files of its own
(`model-tsp{p}-0000k.safetensors.part`, ds_tsp.checkpoint.safetensors.shard_stream). At the end each sends the writer,
over the TSP group (gather_object: names and file names, a few KB, never tensor bytes), what it wrote or why it failed;
the writer adopts the parts (StreamingCheckpointWriter.adopt_parts), so the final names (`model-0000k-of-0000N`), the
index and the atomic rename cover every rank's files, or, if any rank failed, drops them all with its own.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ds_tsp.checkpoint.safetensors.shard_stream import ShardStream


def saved_by_owner(module, tsp_size: int) -> bool:
    """True when every TSP rank's slices (hf_slices(rank)) are whole tensors of hf_shapes() and no two ranks share
    one: each tensor then has exactly one owner, which can write it as it is. Same answer on every rank (shapes)."""
    if tsp_size == 1 or "rank" not in inspect.signature(module.hf_slices).parameters:
        return False
    shapes, owned = module.hf_shapes(), set()
    for rank in range(tsp_size):
        for name, where in module.hf_slices(rank=rank).items():
            if isinstance(where[0], tuple):  # several ranges of the tensor (HFRanges): never all of it
                return False
            dim, start, length = where
            if start != 0 or length != shapes[name][dim] or name in owned:
                return False
            owned.add(name)
    return owned == set(shapes)


def part_stem(tsp_rank: int) -> str:
    return f"model-tsp{tsp_rank}"


def open_rank_stream(tmp_dir: Path, tsp_rank: int, max_shard_size: int | str) -> ShardStream:
    """The part files of a non-writer TSP rank, in the writer's temporary directory."""
    if not tmp_dir.is_dir():
        raise FileNotFoundError(
            f"the writer's temporary directory {tmp_dir} is not visible on this rank: TSP ranks write their own "
            "experts into it, so the checkpoint's parent directory must be on a filesystem every TSP rank shares "
            "(as loading already assumes); save to such a path")
    return ShardStream(tmp_dir, max_shard_size, stem=part_stem(tsp_rank))


@dataclass
class OwnedParts:
    """What one TSP rank wrote (its ShardStream's parts and their bytes), or why it failed."""

    tsp_rank: int
    global_rank: int
    parts: list[tuple[str, list[str]]] = field(default_factory=list)
    total_size: int = 0
    failure: str | None = None


def gather_owned_parts(comm, mine: OwnedParts) -> list[OwnedParts] | None:
    """Collective over the TSP group: every rank's OwnedParts on TSP rank 0, in rank order; None elsewhere. Posted
    after the last tensor, so rank 0 renames (or deletes) nothing another rank is still writing."""
    if comm.size == 1:
        return [mine]
    out = [None] * comm.size if comm.rank == 0 else None
    with comm.guard("save_pretrained: TSP ranks report their expert files to the writer"):
        dist.gather_object(mine, out, dst=dist.get_global_rank(comm.group, 0), group=comm.group)
    return out
