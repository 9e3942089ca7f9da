"""One setup path from a "tsp" block to what a training run needs: process groups, the TSP communicator, options.

Every integration (DeepSpeed's initialize, TSPAccelerator, TSPTrainer) calls `build_runtime` once, after
torch.distributed is up, so the layout (pipe x data x tsp, tsp innermost), the communicator's overlap and timeout,
and the model options are decided in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPConfig, TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.offload_config import with_deepspeed_activation_checkpointing
from ds_tsp.core.parallel.placement import check_tsp_inside_nodes
from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
from ds_tsp.core.reliability.watchdog import guarded


def cp_comm(groups: ProcessGroups | None, *, overlap: bool = True, timeout_s: float | None = 1800) -> TSPComm | None:
    """The communicator of the cp ring (TSPComm.cp) of `groups`: None without a cp axis (cp = 1)."""
    if groups is None or groups.cp_group is None:
        return None
    return TSPComm(groups.cp_group, overlap=overlap, timeout_s=timeout_s)


@dataclass(frozen=True)
class TSPRuntime:
    config: TSPConfig
    layout: ParallelLayout
    groups: ProcessGroups | None  # None: one process, torch.distributed not initialised
    comm: TSPComm
    options: TSPOptions

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        return self.groups.data_group if self.groups is not None else None


def build_runtime(tsp: TSPConfig, *, world_size: int | None = None,
                  groups: ProcessGroups | None = None, ds_config: dict | None = None) -> TSPRuntime:
    """The layout of `world_size` processes (default: the initialised world) under `tsp`, its groups (built here
    unless passed: a collective over the world) and the TSP communicator bounded by tsp.timeout_s.

    ds_config: the DeepSpeed config beside the block, when there is one: its activation_checkpointing.cpu_checkpointing
    is read as tsp.offload_activations (core/offload_config.py); runtime.config is the block with it folded in.
    A TSP group spanning nodes is refused here, before any group is built (core/parallel/placement.py)."""
    tsp = with_deepspeed_activation_checkpointing(tsp, ds_config)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    layout = ParallelLayout.from_world_size(world_size, tsp=tsp.size, pipe=tsp.pipeline_stages, cp=tsp.cp_size)
    # both collectives over the world, before any TSPComm exists: bounded by tsp.timeout_s with the watchdog's line
    with guarded(None, "setup: node-placement all_gather_object", context="setup", timeout_s=tsp.timeout_s):
        check_tsp_inside_nodes(layout, allow_cross_node=tsp.allow_cross_node)
    if groups is not None and groups.layout != layout:
        raise TSPConfigError(f"tsp_groups were built for {groups.layout}, the config asks for {layout}")
    if groups is None and dist.is_initialized():
        with guarded(None, "setup: process groups' creation (new_group)", context="setup", timeout_s=tsp.timeout_s):
            groups = ProcessGroups.build(layout, timeout_s=tsp.timeout_s)
    comm = TSPComm(groups.tsp_group if groups is not None else None, overlap=tsp.overlap, timeout_s=tsp.timeout_s,
                   weight_group=groups.tsp_weight_group if groups is not None else None,
                   cp=cp_comm(groups, overlap=tsp.overlap, timeout_s=tsp.timeout_s))
    return TSPRuntime(tsp, layout, groups, comm, tsp.options())
