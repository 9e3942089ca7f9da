"""Rank layout (pipe x data x cp x tsp) and the process groups built from it.

Axes are ordered (pipe, data, cp, tsp) with tsp INNERMOST and cp next:
rank = ((pipe_idx * data + data_idx) * cp + cp_idx) * tsp + tsp_idx. A TSP group is therefore `tsp` adjacent
ranks, i.e. one node's fast interconnect carries the per-layer weight and K/V traffic, while the cp axis (one
K/V ring hop per head block, ds_tsp.core.layers.attention.cp_ring), the data axis (one gradient reduction per step) and
the pipe axis (one activation hop) cross nodes. cp = 1 is the plain pipe x data x tsp layout (same ranks, same groups).

The context-parallel (cp) axis splits ONE sequence over cp TSP groups; they hold the same weight shards, so
their gradients are reduced like data-parallel ones: `ProcessGroups.data_group` spans data x cp (what DeepSpeed,
FSDP2 and the loss denominator reduce over), while the sampler draws over the data axis only (`data_rank`,
`data_size`), so the cp ranks of one replica read the same samples.

DeepSpeed's PipeModelDataParallelTopology (pipe, data, model) puts `model` innermost too, so the TSP axis maps
onto its `model` axis.

`ParallelLayout` is pure arithmetic (usable without torch.distributed); `ProcessGroups` holds the groups of one
rank and is passed explicitly to whatever needs them — there is no module-level state.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.reliability import clean_exit as finalize

__all__ = ["ParallelLayout", "ProcessGroups", "group_timeout", "nccl_timeout_s"]

AXES = ("pipe", "data", "tsp")  # the DeviceMesh axes; with cp > 1 "data" spans data x cp (mesh_ranks)


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
    """Degrees of the four mesh axes; their product is the world size."""

    pipe: int = 1
    data: int = 1
    tsp: int = 1
    cp: int = 1  # context-parallel TSP groups that share one sequence (between data and tsp in rank order)

    def __post_init__(self) -> None:
        for name in (*AXES, "cp"):
            _check_degree(name, getattr(self, name))

    @classmethod
    def from_world_size(cls, world_size: int, *, tsp: int, pipe: int = 1, cp: int = 1) -> ParallelLayout:
        """Layout that uses every rank: data = world_size / (tsp * cp * pipe)."""
        _check_degree("world_size", world_size)
        _check_degree("tsp", tsp)
        _check_degree("pipe", pipe)
        _check_degree("cp", cp)
        inner = tsp * pipe * cp
        if world_size % inner:
            axes = f"tsp*pipe={inner} (tsp={tsp}, pipe={pipe})" if cp == 1 else \
                f"tsp*cp*pipe={inner} (tsp={tsp}, cp={cp}, pipe={pipe})"
            raise TSPConfigError(
                f"world size {world_size} is not divisible by {axes}: the data-parallel degree would not be whole; "
                f"choose degrees whose product divides {world_size}, or launch a multiple of {inner} ranks")
        return cls(pipe=pipe, data=world_size // inner, tsp=tsp, cp=cp)

    @property
    def world_size(self) -> int:
        return self.pipe * self.data * self.cp * self.tsp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

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
        """Sequences are padded to a multiple of this (zigzag cuts 2*cp chunks, then each into 2*tsp)."""
        return 2 * self.tsp * self.cp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless this layout covers exactly `world_size` ranks."""
        if world_size != self.world_size:
            raise TSPConfigError(
                f"world size {world_size} does not match the layout pipe={self.pipe} x data={self.data} x "
                f"cp={self.cp} x tsp={self.tsp} = {self.world_size}: launch {self.world_size} ranks or use "
                f"ParallelLayout.from_world_size({world_size}, tsp=..., cp=..., pipe=...)")

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TSPConfigError(f"rank={rank!r} is outside [0, world_size={self.world_size}) for {self}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipe_idx, data_idx, tsp_idx) of a global rank (its cp index: cp_index)."""
        self._check_rank(rank)
        rest, tsp_idx = divmod(rank, self.tsp)
        pipe_idx, data_idx = divmod(rest // self.cp, self.data)
        return pipe_idx, data_idx, tsp_idx

    def cp_index(self, rank: int) -> int:
        """Which of the cp TSP groups sharing a sequence holds `rank` (0 when cp = 1)."""
        self._check_rank(rank)
        return (rank // self.tsp) % self.cp

    def rank_of(self, pipe_idx: int, data_idx: int, tsp_idx: int, cp_idx: int = 0) -> int:
        """Global rank at the given coordinates (inverse of `coords` and `cp_index`)."""
        for name, idx, size in (("pipe_idx", pipe_idx, self.pipe), ("data_idx", data_idx, self.data),
                                ("tsp_idx", tsp_idx, self.tsp), ("cp_idx", cp_idx, self.cp)):
            if not 0 <= idx < size:
                raise TSPConfigError(f"{name}={idx} is outside [0, {size}) for {self}")
        return ((pipe_idx * self.data + data_idx) * self.cp + cp_idx) * self.tsp + tsp_idx

    def tsp_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pipe, data and cp coordinates (adjacent ranks)."""
        p, d, _ = self.coords(rank)
        c = self.cp_index(rank)
        return [self.rank_of(p, d, t, c) for t in range(self.tsp)]

    def data_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pipe and tsp coordinates: the ones that average gradients of the same shard
        (every data replica and every cp group of it, data-major)."""
        p, _, t = self.coords(rank)
        return [self.rank_of(p, d, t, c) for d in range(self.data) for c in range(self.cp)]

    def cp_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pipe, data and tsp coordinates: the ring that passes K/V of one sequence."""
        p, d, t = self.coords(rank)
        return [self.rank_of(p, d, t, c) for c in range(self.cp)]

    def pipe_group_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s data, cp and tsp coordinates: the stages of one pipeline."""
        _, d, t = self.coords(rank)
        c = self.cp_index(rank)
        return [self.rank_of(p, d, t, c) for p in range(self.pipe)]

    def all_tsp_groups(self) -> list[list[int]]:
        return [self.tsp_group_ranks(self.rank_of(p, d, 0, c)) for p in range(self.pipe) for d in range(self.data)
                for c in range(self.cp)]

    def all_data_groups(self) -> list[list[int]]:
        return [self.data_group_ranks(self.rank_of(p, 0, t)) for p in range(self.pipe) for t in range(self.tsp)]

    def all_cp_groups(self) -> list[list[int]]:
        return [self.cp_group_ranks(self.rank_of(p, d, t)) for p in range(self.pipe) for d in range(self.data)
                for t in range(self.tsp)]

    def all_pipe_groups(self) -> list[list[int]]:
        return [self.pipe_group_ranks(self.rank_of(0, d, t, c)) for d in range(self.data) for c in range(self.cp)
                for t in range(self.tsp)]

    def mesh_ranks(self) -> torch.Tensor:
        """[pipe, data * cp, tsp] tensor of global ranks (row-major, so tsp is innermost). Its middle axis is the
        data group's ranks (data x cp, data-major): what FSDP2 shards over, since cp groups hold the same shards."""
        return torch.arange(self.world_size, dtype=torch.int).reshape(self.pipe, self.data * self.cp, self.tsp)


class ProcessGroups:
    """The tsp / data / pipe groups that contain this rank.

    Build with `ProcessGroups.build(layout)` on every rank (collective). Size-1 axes still get a real 1-rank group,
    so code never special-cases tsp=1.
    """

    def __init__(self, layout: ParallelLayout, rank: int, tsp_group: dist.ProcessGroup,
                 data_group: dist.ProcessGroup, pipe_group: dist.ProcessGroup,
                 tsp_weight_group: dist.ProcessGroup | None = None, cp_group: dist.ProcessGroup | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.tsp_group = tsp_group
        # the K/V ring of one sequence (ds_tsp.core.layers.attention.cp_ring); None when cp = 1
        self.cp_group = cp_group
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
                "torch.distributed is not initialized: call dist.init_process_group (or "
                "ds_tsp.core.parallel.launch.init_from_env) before ProcessGroups.build")
        layout.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        finalize.install()  # the groups end cleanly at interpreter exit (ds_tsp.core.reliability.clean_exit)
        timeout = group_timeout(timeout_s, backend)
        mine: dict[str, dist.ProcessGroup] = {}
        # weight_channel: a second communicator over each TSP group for weights (TSPComm.weight_group). NCCL runs
        # one in-order stream per communicator, so on CUDA it keeps weight prefetches from queueing ahead of K/V;
        # gloo runs every op on its own threads and gains nothing, so CPU runs skip it (default: CUDA available).
        # Created last so the first three keep the creation order they always had (the cp ring, cp > 1 only, after).
        if weight_channel is None:
            weight_channel = torch.cuda.is_available()
        axes = [("tsp", layout.all_tsp_groups()), ("data", layout.all_data_groups()),
                ("pipe", layout.all_pipe_groups())] + ([("tsp_weights", layout.all_tsp_groups())] if weight_channel
                                                       else [])
        if layout.cp > 1:
            axes.append(("cp", layout.all_cp_groups()))
        for axis, groups in axes:
            for ranks in groups:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if rank in ranks:
                    mine[axis] = group
        return cls(layout, rank, mine["tsp"], mine["data"], mine["pipe"], mine.get("tsp_weights"), mine.get("cp"))

    @property
    def tsp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def tsp_size(self) -> int:
        return self.layout.tsp

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_index(self.rank)

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def data_rank(self) -> int:
        """This rank's data replica: what the sampler draws by (the data group also spans cp; see module doc)."""
        return self.layout.coords(self.rank)[1]

    @property
    def data_size(self) -> int:
        """Data replicas (samplers); the data group holds data_size * cp_size ranks."""
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
        cp = f"cp={self.cp_rank}/{self.layout.cp}, " if self.layout.cp > 1 else ""
        return (f"ProcessGroups(rank={self.rank}, pipe={pipe}/{self.layout.pipe}, data={data}/{self.layout.data}, "
                f"{cp}tsp={tsp}/{self.layout.tsp})")
