"""Rank layout arithmetic (pure) and the process groups it builds on 4 real gloo ranks."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups

LAYOUTS = [ParallelLayout(), ParallelLayout(tsp=4), ParallelLayout(data=3, tsp=2), ParallelLayout(pipe=2, data=3, tsp=2),
           ParallelLayout(pipe=3, data=1, tsp=2), ParallelLayout(pipe=2, data=2, tsp=1)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coords_rank_of_bijection_tsp_innermost(layout):
    seen = []
    for rank in range(layout.world_size):
        p, d, t = layout.coords(rank)
        assert layout.rank_of(p, d, t) == rank
        assert rank == (p * layout.data + d) * layout.tsp + t
        seen.append((p, d, t))
    assert sorted(seen) == list(itertools.product(range(layout.pipe), range(layout.data), range(layout.tsp)))
    # tsp innermost: a TSP group is a block of adjacent ranks
    for group in layout.all_tsp_groups():
        assert group == list(range(group[0], group[0] + layout.tsp))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_partition_the_world(layout):
    world = list(range(layout.world_size))
    for groups, size, of_rank in ((layout.all_tsp_groups(), layout.tsp, layout.tsp_group_ranks),
                                  (layout.all_data_groups(), layout.data, layout.data_group_ranks),
                                  (layout.all_pipe_groups(), layout.pipe, layout.pipe_group_ranks)):
        assert sorted(r for g in groups for r in g) == world
        assert len(groups) == layout.world_size // size and all(len(g) == size for g in groups)
        for g in groups:
            for r in g:
                assert of_rank(r) == g
    # a data group and a tsp group meet in exactly one rank
    for r in world:
        assert set(layout.tsp_group_ranks(r)) & set(layout.data_group_ranks(r)) == {r}
        assert set(layout.tsp_group_ranks(r)) & set(layout.pipe_group_ranks(r)) == {r}


def test_layout_examples_and_flags():
    layout = ParallelLayout.from_world_size(8, tsp=2, pipe=2)
    assert layout == ParallelLayout(pipe=2, data=2, tsp=2) and layout.world_size == 8
    assert layout.coords(5) == (1, 0, 1)
    assert layout.tsp_group_ranks(5) == [4, 5]
    assert layout.data_group_ranks(5) == [5, 7]
    assert layout.pipe_group_ranks(5) == [1, 5]
    assert layout.tsp_enabled and layout.data_enabled and layout.pipe_enabled
    assert layout.seq_len_divisor == 4
    single = ParallelLayout()
    assert not (single.tsp_enabled or single.data_enabled or single.pipe_enabled)
    assert single.all_tsp_groups() == [[0]]
    layout.check_world_size(8)


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(TSPConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_layout_errors_name_the_field():
    msg = _message(ParallelLayout.from_world_size, 6, tsp=4)
    assert "world size 6" in msg and "tsp*pipe=4" in msg
    msg = _message(ParallelLayout.from_world_size, 6, tsp=2, pipe=2)
    assert "tsp=2" in msg and "pipe=2" in msg
    assert "tsp=0" in _message(ParallelLayout, tsp=0)
    assert "data=-1" in _message(ParallelLayout, data=-1)
    assert "pipe=1.5" in _message(ParallelLayout, pipe=1.5)
    assert "world size 6" in _message(ParallelLayout(data=2, tsp=2).check_world_size, 6)
    assert "rank=4" in _message(ParallelLayout(data=2, tsp=2).coords, 4)
    assert "tsp_idx=2" in _message(ParallelLayout(data=2, tsp=2).rank_of, 0, 0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelLayout().tsp = 2  # type: ignore[misc]


def _check_groups(pipe: int, data: int, tsp: int) -> dict:
    layout = ParallelLayout(pipe=pipe, data=data, tsp=tsp)
    groups = ProcessGroups.build(layout)
    rank = dist.get_rank()
    out = {}
    for axis, group in (("tsp", groups.tsp_group), ("data", groups.data_group), ("pipe", groups.pipe_group)):
        members = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([rank]), group=group)
        out[axis] = [int(m) for m in members]
        out[axis + "_group_rank"] = dist.get_rank(group)
    out["ranks"] = (groups.tsp_rank, groups.data_rank, groups.pipe_rank)
    out["sizes"] = (groups.tsp_size, groups.data_size, groups.pipe_size)
    mesh = groups.device_mesh("cpu")
    assert groups.device_mesh("cpu") is mesh  # cached
    out["mesh_shape"] = tuple(mesh.shape)
    out["mesh_names"] = mesh.mesh_dim_names
    out["mesh_tsp_ranks"] = sorted(int(r) for r in mesh["tsp"].mesh.flatten())
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.get_group("data"))
    out["mesh_data_sum"] = float(total)
    return out


def test_process_groups_on_four_ranks():
    results = run_on_local_ranks(_check_groups, 4, 1, 2, 2, timeout_s=120)
    layout = ParallelLayout(pipe=1, data=2, tsp=2)
    for rank, out in enumerate(results):
        p, d, t = layout.coords(rank)
        assert out["tsp"] == layout.tsp_group_ranks(rank) == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert out["data"] == layout.data_group_ranks(rank) == [rank % 2, rank % 2 + 2]
        assert out["pipe"] == [rank]
        assert (out["tsp_group_rank"], out["data_group_rank"], out["pipe_group_rank"]) == (t, d, p)
        assert out["ranks"] == (t, d, p)
        assert out["sizes"] == (2, 2, 1)
        assert out["mesh_shape"] == (1, 2, 2)
        assert out["mesh_names"] == ("pipe", "data", "tsp")
        assert out["mesh_tsp_ranks"] == layout.tsp_group_ranks(rank)
        assert out["mesh_data_sum"] == 2.0
