"""The TSP axis stays inside a node: a TSP group that spans nodes is refused at setup, before any step.

Why: every decoder layer broadcasts its weight shards and gathers K/V over the TSP group
(ds_tsp.core.comm.communicator), so the group must sit on one node's fast interconnect (NVLink); the data and pipe axes,
one gradient reduction or one activation hop per step, are the ones meant to cross nodes. The layout puts tsp innermost
(ds_tsp.core.parallel.topology), so a TSP group spans nodes only when tsp.size does not divide the processes per node,
or exceeds it.

Where the node of each rank comes from: each rank names its node, the launcher's node rank when it sets one
(torchrun: GROUP_RANK; the deepspeed launcher: CROSS_RANK), else its hostname (mp.spawn, a hand-rolled launcher),
and one all_gather_object over the world, once at setup, tells every rank every rank's node. The exchange (rather
than arithmetic on LOCAL_WORLD_SIZE) keeps heterogeneous nodes and any rank order right, and every rank posts it,
whatever its environment says, so no rank can wait on a collective the others skip.

`tsp_node_placement_error` is the pure check (a layout and the node of every rank in, the message or None out);
`check_tsp_inside_nodes` is what core/parallel/runtime.py calls. `"allow_cross_node": true` in the "tsp" block skips it.
"""
from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import torch.distributed as dist

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ParallelLayout

__all__ = ["check_tsp_inside_nodes", "node_name", "tsp_node_placement_error"]

# the node rank as each launcher names it: torchrun (torch.distributed.run), the deepspeed launcher
_NODE_RANK_ENV = ("GROUP_RANK", "CROSS_RANK")


def _spanning_groups(layout: ParallelLayout, node_of_rank: Sequence[Hashable]) -> list[list[int]]:
    return [ranks for ranks in layout.all_tsp_groups() if len({node_of_rank[r] for r in ranks}) > 1]


def _sizes_that_fit(layout: ParallelLayout, node_of_rank: Sequence[Hashable]) -> list[int]:
    """TSP sizes whose groups all stay inside a node for this world, pipeline and cp degrees."""
    world, pipe, cp, fit = layout.world_size, layout.pipe, layout.cp, []
    for size in range(1, world // (pipe * cp) + 1):
        if world % (size * pipe * cp) == 0:
            candidate = ParallelLayout.from_world_size(world, tsp=size, pipe=pipe, cp=cp)
            if not _spanning_groups(candidate, node_of_rank):
                fit.append(size)
    return fit


def tsp_node_placement_error(layout: ParallelLayout, node_of_rank: Sequence[Hashable]) -> str | None:
    """The message refusing `layout` when one of its TSP groups spans nodes, else None (pure: no communication).

    node_of_rank[r]: any hashable naming the node of global rank r (node rank, hostname), one per rank."""
    if len(node_of_rank) != layout.world_size:
        raise TSPConfigError(f"node_of_rank names {len(node_of_rank)} ranks but the layout {layout} has "
                             f"{layout.world_size}")
    spanning = _spanning_groups(layout, node_of_rank)
    if not spanning:
        return None
    per_node = Counter(node_of_rank)
    counts = sorted(set(per_node.values()))
    procs = (f"{counts[0]} processes per node" if len(counts) == 1
             else f"{', '.join(map(str, counts))} processes per node (nodes differ)")
    first = spanning[0]
    nodes = list(dict.fromkeys(node_of_rank[r] for r in first))
    fit = _sizes_that_fit(layout, node_of_rank)
    return (f"tsp.size={layout.tsp} puts a TSP group across nodes: ranks {first[0]}-{first[-1]} sit on "
            f"{len(nodes)} nodes ({', '.join(map(str, nodes))}); this launch runs {len(per_node)} nodes with {procs}. "
            f"Every layer's weight broadcast and K/V gather would cross the inter-node network. TSP sizes that stay "
            f"inside a node here: {', '.join(map(str, fit))}; set tsp.size to one of them (the data axis then "
            f"spans the nodes), or set \"allow_cross_node\": true in the \"tsp\" block if you mean it")


def node_name(env: Mapping[str, str]) -> str:
    """This process's node: the launcher's node rank when it sets one (two local "nodes" on one host differ),
    else the hostname."""
    for node_key in _NODE_RANK_ENV:
        if env.get(node_key, "").isdigit():
            return f"node {env[node_key]}"
    return socket.gethostname()


def check_tsp_inside_nodes(layout: ParallelLayout, *, allow_cross_node: bool = False,
                           env: Mapping[str, str] | None = None) -> None:
    """Raise TSPConfigError on every rank when a TSP group of `layout` spans nodes (once, at setup).

    One all_gather_object of node_name over the initialised world: a collective every rank posts at the same point
    (core/parallel/runtime.py, before the groups are built), so every rank raises the same message and none hangs."""
    if allow_cross_node or layout.tsp == 1 or layout.world_size == 1:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != layout.world_size:
        return  # one process, or groups laid out for another world (passed in): nothing to place here
    node_of_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_of_rank, node_name(os.environ if env is None else env))
    message = tsp_node_placement_error(layout, node_of_rank)
    if message is not None:
        raise TSPConfigError(message)
