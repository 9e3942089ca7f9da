"""Rank layout (pipe x data x tsp) and the process groups built from it.

Axes are ordered (pipe, data, tsp) with tsp INNERMOST: rank = (pipe_idx * data + data_idx) * tsp + tsp_idx.
A TSP group is therefore `tsp` adjacent ranks, i.e. one node's fast interconnect carries the per-layer weight
and K/V traffic, while the data and pipe axes (one gradient reduction / one activation hop per step) cross
nodes. DeepSpeed's PipeModelDataParallelTopology (pipe, data, model) puts `model` innermost too, so the TSP axis
maps onto its `model` axis.

`ParallelLayout` is pure arithmetic (usable without torch.distributed); `ProcessGroups` holds the groups of one
rank and is passed explicitly to whatever needs them — there is no module-level state.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_tsp.core import finalize
from ds_tsp.core.errors import TSPConfigError

__all__ = ["ParallelLayout", "ProcessGroups", "group_timeout", "nccl_timeout_s"]

AXES = ("pipe", "data", "tsp")


def nccl_timeout_s(timeout_s: float) -> float:
    """The timeout NCCL groups get for a tsp block's timeout_s: timeout_s + max(60 s, timeout_s).

    Why a margin: NCCL's watchdog times a work from when it is enqueued and, when it fires, aborts the process
    (SIGABRT and its dump, TORCH_NCCL_ASYNC_ERROR_HANDLING's default) before anything else can speak; ds_tsp's
    watchdog times the same work from the later wait() and prints the one line naming collective, layer and peer.
    The gap between the two clocks is the host's run-ahead (a few layers queued ahead of the GPU), the lazy
    communicator setup of a group's first collective, and the report's own flush (<= 2 s). At least 60 s covers
    those at small timeouts; doubling at large ones keeps NCCL a proportional backstop (it still ends a rank whose
    ds_tsp watchdog could not run), never the first responder.
    """
    return timeout_s + max(60.0, timeout_s)


def group_timeout(timeout_s: float | None, backend: str | None = None) -> timedelta | None:
    """The `timeout=` to create a group with: timeout_s, with nccl_timeout_s's margin when the group runs NCCL
    (backend names it, or backend is None and the default group's does). None: the backend's default."""
    if timeout_s is None:
        return None
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
    uses_nccl = backend is not None and "nccl" in str(backend).lower()
    return timedelta(seconds=nccl_timeout_s(timeout_s) if uses_nccl else timeout_s)


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TSPConfigError(f"{name}={value!r}: the {name} degree must be an integer >= 1 (1 disables the axis)")


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of the three mesh axes; their product is the world size."""

    pipe: int = 1
    data: int = 1
    tsp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            _check_degree(name, getattr(self, name))

    @classmethod
    def from_world_size(cls, world_size: int, *, tsp: int, pipe: int = 1) -> ParallelLayout:
        """Layout that uses every rank: data = world_size / (tsp * pipe)."""
        _check_degree("world_size", world_size)
        _check_degree("tsp", tsp)
        _check_degree("pipe", pipe)
        inner = tsp * pipe
        if world_size % inner:
            raise TSPConfigError(
                f"world size {world_size} is not divisible by tsp*pipe={inner} (tsp={tsp}, pipe={pipe}): "
                f"the data-parallel degree would not be whole; choose tsp and pipe whose product divides "
                f"{world_size}, or launch a multiple of {inner} ranks")
        return cls(pipe=pipe, data=world_size // inner, tsp=tsp)

    @property
    def world_size(self) -> int:
        return self.pipe * self.data * self.tsp

    @property
    def tsp_enabled(self) -> bool:
        return self.tsp > 1

    @property
    def data_enabled(self) -> bool:
        return self.data > 1

    @property
    def pipe_enabled(self) -> bool:
        return self.pipe > 1

    @property
    def seq_len_divisor(self) -> int:
        """Sequences are padded to a multiple of this (zigzag cuts 2*tsp chunks)."""
        return 2 * self.tsp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless this layout covers exactly `world_size` ranks."""
        if world_size != self.world_size:
            raise TSPConfigError(
                f"world size {world_size} does not match the layout pipe={self.pipe} x data={self.data} x "
                f"tsp={self.tsp} = {self.world_size}: launch {self.world_size} ranks or use "
                f"ParallelLayout.from_world_size({world_size}, tsp=..., pipe=...)")

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TSPConfigError(f"rank={rank!r} is outside [0, world_size={self.world_size}) for {self}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipe_idx, data_idx, tsp_idx) of a global rank."""
        self._check_rank(rank)
        rest, tsp_idx = divmod(rank, self.tsp)
        pipe_idx, data_idx = divmod(rest, self.data)
        return pipe_idx, data_idx, tsp_idx

    def rank_of(self, pipe_idx: int, data_idx: int, tsp_idx: int) -> int:
        """Global rank at the given coordinates (inverse of `coords`)."""
        for name, idx, size in (("pipe_idx", pipe_idx, self.pipe), ("data_idx", data_idx, self.data),
                                ("tsp_idx", tsp_idx, self.tsp)):
            if not 0 <= idx < size:
                raise TSPConfigError(f"{name}={idx} is outside [0, {size}) for {self}")
        return (pipe_idx * self.data + data_idx) * self.tsp + tsp_idx

    def tsp_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pipe and data coordinates (adjacent ranks)."""
        p, d, _ = self.coords(rank)
        return [self.rank_of(p, d, t) for t in range(self.tsp)]

    def data_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pipe and tsp coordinates: the ones that average gradients of the same shard."""
        p, _, t = self.coords(rank)
        return [self.rank_of(p, d, t) for d in range(self.data)]

    def pipe_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s data and tsp coordinates: the stages of one pipeline."""
        _, d, t = self.coords(rank)
        return [self.rank_of(p, d, t) for p in range(self.pipe)]

    def all_tsp_groups(self) -> list[list[int]]:
        return [self.tsp_group_ranks(self.rank_of(p, d, 0)) for p in range(self.pipe) for d in range(self.data)]

    def all_data_groups(self) -> list[list[int]]:
        return [self.data_group_ranks(self.rank_of(p, 0, t)) for p in range(self.pipe) for t in range(self.tsp)]

    def all_pipe_groups(self) -> list[list[int]]:
        return [self.pipe_group_ranks(self.rank_of(0, d, t)) for d in range(self.data) for t in range(self.tsp)]

    def mesh_ranks(self) -> torch.Tensor:
        """[pipe, data, tsp] tensor of global ranks (row-major, so tsp is innermost)."""
        return torch.arange(self.world_size, dtype=torch.int).reshape(self.pipe, self.data, self.tsp)


class ProcessGroups:
    """The tsp / data / pipe groups that contain this rank.

    Build with `ProcessGroups.build(layout)` on every rank (collective). Size-1 axes still get a real 1-rank group,
    so code never special-cases tsp=1.
    """

    def __init__(self, layout: ParallelLayout, rank: int, tsp_group: dist.ProcessGroup,
                 data_group: dist.ProcessGroup, pipe_group: dist.ProcessGroup,
                 tsp_weight_group: dist.ProcessGroup | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.tsp_group = tsp_group
        self.tsp_weight_group = tsp_weight_group  # same ranks as tsp_group: its own NCCL stream for weights
        self.data_group = data_group
        self.pipe_group = pipe_group
        self._mesh = None

    @classmethod
    def build(cls, layout: ParallelLayout, backend: str | None = None,
              timeout_s: float | None = None, weight_channel: bool | None = None) -> ProcessGroups:
        """Create every group of `layout`; call on ALL ranks after init_process_group.

        torch requires every rank to call dist.new_group for every group, in the same order, even for groups it is
        not a member of; this rank keeps the three that contain it. timeout_s bounds every collective on the groups,
        the ones DeepSpeed and FSDP post on them included. Groups that run NCCL get timeout_s plus a margin
        (nccl_timeout_s): ds_tsp's watchdog reports a stall in one line first, NCCL's abort is the backstop.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise TSPConfigError(
                "torch.distributed is not initialized: call dist.init_process_group (or ds_tsp.core.launch.init_from_env) "
                "before ProcessGroups.build")
        layout.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        finalize.install()  # the groups end cleanly at interpreter exit (ds_tsp.core.finalize)
        timeout = group_timeout(timeout_s, backend)
        mine: dict[str, dist.ProcessGroup] = {}
        # weight_channel: a second communicator over each TSP group for weights (TSPComm.weight_group). NCCL runs
        # one in-order stream per communicator, so on CUDA it keeps weight prefetches from queueing ahead of K/V;
        # gloo runs every op on its own threads and gains nothing, so CPU runs skip it (default: CUDA available).
        # Created last so the first three keep the creation order they always had.
        if weight_channel is None:
            weight_channel = torch.cuda.is_available()
        axes = [("tsp", layout.all_tsp_groups()), ("data", layout.all_data_groups()),
                ("pipe", layout.all_pipe_groups())] + ([("tsp_weights", layout.all_tsp_groups())] if weight_channel
                                                       else [])
        for axis, groups in axes:
            for ranks in groups:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if rank in ranks:
                    mine[axis] = group
        return cls(layout, rank, mine["tsp"], mine["data"], mine["pipe"], mine.get("tsp_weights"))

    @property
    def tsp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def tsp_size(self) -> int:
        return self.layout.tsp

    @property
    def data_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def data_size(self) -> int:
        return self.layout.data

    @property
    def pipe_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pipe_size(self) -> int:
        return self.layout.pipe

    def device_mesh(self, device_type: str = "cpu"):
        """A torch DeviceMesh ("pipe", "data", "tsp") over the groups already built (no new communicators).

        Cached per instance; e.g. FSDP2 takes `mesh["data"]` as its sharding mesh.
        """
        if self._mesh is None or self._mesh.device_type != device_type:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(
                [self.pipe_group, self.data_group, self.tsp_group], device_type,
                mesh=self.layout.mesh_ranks(), mesh_dim_names=AXES)
        return self._mesh

    def __repr__(self) -> str:
        pipe, data, tsp = self.layout.coords(self.rank)
        return (f"ProcessGroups(rank={self.rank}, pipe={pipe}/{self.layout.pipe}, data={data}/{self.layout.data}, "
                f"tsp={tsp}/{self.layout.tsp})")
