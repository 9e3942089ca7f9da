"""The TSP axis stays inside a node: a TSP group spanning nodes is refused at setup with one
message naming the size, the processes per node and the sizes that fit; "allow_cross_node": true keeps it.

The check itself is a pure function of the layout and every rank's node (tsp_node_placement_error), tested over many
layouts here; one real launch (4 processes as two 2-process "nodes" on this host, with the variables torchrun and the
deepspeed launcher set) proves every rank gets the error from build_runtime before any step, and none hangs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.placement import node_name, tsp_node_placement_error
from ds_tsp.core.parallel.topology import ParallelLayout

REPO = Path(__file__).resolve().parents[2]


def _nodes(*per_node: int) -> list[int]:
    """Node of every global rank when ranks are laid out node by node (as torchrun and deepspeed lay them out)."""
    return [n for n, count in enumerate(per_node) for _ in range(count)]


def _brute_force_spans(layout: ParallelLayout, node_of_rank) -> bool:
    return any(len({node_of_rank[r] for r in layout.tsp_group_ranks(rank)}) > 1 for rank in range(layout.world_size))


# (processes per node, tsp, pipe, spans)
CASES = [((8,), 8, 1, False), ((8, 8), 8, 1, False), ((8, 8), 16, 1, True), ((8, 8), 4, 2, False),
         ((2, 2), 4, 1, True), ((2, 2), 2, 1, False), ((2, 2), 2, 2, False), ((2, 2), 1, 4, False),
         ((4, 4, 4), 4, 3, False), ((4, 4, 4), 6, 1, True), ((4, 4, 4), 3, 1, True), ((4, 4, 4), 12, 1, True),
         ((6, 6), 4, 1, True), ((6, 6), 3, 2, False), ((6, 6), 3, 1, False), ((3, 5), 4, 1, True),
         ((3, 5), 2, 1, True), ((4, 2, 2), 2, 1, False), ((4, 2, 2), 4, 1, True), ((4, 2, 2), 8, 1, True),
         ((1, 1, 1, 1), 2, 1, True), ((1, 1, 1, 1), 1, 1, False)]


@pytest.mark.parametrize("per_node, tsp, pipe, spans", CASES, ids=[f"{c[0]}-tsp{c[1]}-pipe{c[2]}" for c in CASES])
def test_refused_exactly_when_a_group_spans_nodes(per_node, tsp, pipe, spans):
    nodes = _nodes(*per_node)
    layout = ParallelLayout.from_world_size(len(nodes), tsp=tsp, pipe=pipe)
    assert _brute_force_spans(layout, nodes) is spans  # the table itself is right
    message = tsp_node_placement_error(layout, nodes)
    assert (message is not None) is spans
    if spans:
        assert f"tsp.size={tsp}" in message and "allow_cross_node" in message
        counts = sorted(set(per_node))
        assert (f"{counts[0]} processes per node" if len(counts) == 1 else "nodes differ") in message
        fit = message.split("inside a node here: ")[1].split(";")[0].split(", ")
        # every size named fits, every size that fits is named
        world = len(nodes)
        expected = [d for d in range(1, world // pipe + 1) if world % (d * pipe) == 0 and not _brute_force_spans(
            ParallelLayout.from_world_size(world, tsp=d, pipe=pipe), nodes)]
        assert [int(s) for s in fit] == expected


def test_node_ids_any_hashable_and_any_order():
    """Hostnames, interleaved rank orders: only which ranks share a node matters."""
    layout = ParallelLayout.from_world_size(4, tsp=2)
    assert tsp_node_placement_error(layout, ["a", "a", "b", "b"]) is None
    message = tsp_node_placement_error(layout, ["a", "b", "a", "b"])  # round-robin placement: every group spans
    assert message is not None and "ranks 0-1 sit on 2 nodes (a, b)" in message and "here: 1;" in message
    with pytest.raises(TSPConfigError, match="names 3 ranks"):
        tsp_node_placement_error(layout, ["a", "a", "b"])


def test_node_name_from_each_launcher():
    assert node_name({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "node 1"  # torchrun
    assert node_name({"CROSS_RANK": "3", "LOCAL_SIZE": "8"}) == "node 3"  # deepspeed launcher
    assert node_name({}) not in ("", None)  # the hostname


def test_allow_cross_node_is_a_tsp_key():
    assert parse_tsp_config({"size": 4, "allow_cross_node": True}).allow_cross_node
    assert not parse_tsp_config({"size": 4}).allow_cross_node
    with pytest.raises(TSPConfigError, match="allow_cross_node"):
        parse_tsp_config({"allow_cross_node": "yes"})


def test_two_local_nodes_refused_at_setup_on_every_rank(tmp_path):
    """4 processes as 2 nodes x 2 (torchrun's and the deepspeed launcher's variables): size 4 refused on every rank
    before any step, 2 fits, allow_cross_node keeps 4; with neither launcher's variables the hostname decides."""
    from ds_tsp.core.parallel.launch import free_port

    port, procs = free_port(), []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GROUP_RANK": str(node), "LOCAL_WORLD_SIZE": "2",
               "CROSS_RANK": str(node), "CROSS_SIZE": "2", "LOCAL_SIZE": "2",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "node_placement_rank.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for out in outs:
        for launcher in ("torchrun", "deepspeed"):
            kind, message = out[f"{launcher} size 4"]
            assert kind == "error"
            assert message.startswith("tsp.size=4 puts a TSP group across nodes: ranks 0-3 sit on 2 nodes (node 0, "
                                      "node 1); this launch runs 2 nodes with 2 processes per node")
            assert "inside a node here: 1, 2;" in message
            assert out[f"{launcher} size 2"] == ["ok", 2, 2]
        assert out["torchrun size 4 allowed"] == ["ok", 4, 1]
        assert out["hostname size 4"] == ["ok", 4, 1]


def test_with_a_cp_axis_the_sizes_that_fit_keep_it():
    """tsp stays innermost under cp (ds_tsp.core.parallel.topology): the check and the sizes it names hold the cp degree."""
    nodes = _nodes(2, 2, 2, 2)
    assert tsp_node_placement_error(ParallelLayout.from_world_size(8, tsp=2, cp=2), nodes) is None
    message = tsp_node_placement_error(ParallelLayout.from_world_size(8, tsp=4, cp=2), nodes)
    assert message is not None and "inside a node here: 1, 2;" in message
