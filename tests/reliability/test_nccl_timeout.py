"""NCCL's own watchdog must not fire before ds_tsp's: NCCL times a work from enqueue, ds_tsp from
wait(), and NCCL's abort (SIGABRT and its dump) would otherwise replace the one-line report. Groups that run NCCL are
created with timeout_s + max(60 s, timeout_s); gloo groups keep timeout_s. On a CUDA machine a timeout_s below the
GPU floor warns. torch.distributed is mocked: no group is created."""
from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ds_tsp.core.config import GPU_TIMEOUT_FLOOR_S, TSPConfig
from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups, group_timeout, nccl_timeout_s


@pytest.fixture
def fake_dist(monkeypatch):
    """A 4-rank world whose default backend the test sets; new_group records the timeout it was given."""
    state = {"backend": "gloo", "timeouts": []}

    def new_group(ranks, backend=None, timeout=None):
        state["timeouts"].append((tuple(ranks), backend, timeout))
        return object()

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["backend"])
    monkeypatch.setattr(dist, "new_group", new_group)
    return state


def test_margin_rule():
    assert nccl_timeout_s(20) == 80  # small timeouts: at least a minute more
    assert nccl_timeout_s(1800) == 3600  # large ones: doubled
    assert group_timeout(None, "nccl") is None


@pytest.mark.parametrize("default_backend,backend,expected_s", [
    ("cpu:gloo,cuda:nccl", None, 80),  # the default group's backends (init_from_env on a GPU node)
    ("nccl", None, 80),  # deepspeed.init_distributed on GPUs
    ("gloo", "nccl", 80),  # asked for explicitly
    ("gloo", None, 20),  # CPU: gloo's timer stays at timeout_s (its timeout reads as the watchdog's own)
])
def test_groups_are_created_with_the_margin_on_nccl(fake_dist, default_backend, backend, expected_s):
    fake_dist["backend"] = default_backend
    groups = ProcessGroups.build(ParallelLayout(pipe=1, data=2, tsp=2), backend=backend, timeout_s=20,
                                 weight_channel=True)
    assert groups.tsp_weight_group is not None
    assert len(fake_dist["timeouts"]) == 2 + 2 + 4 + 2  # tsp, data, pipe, tsp_weights groups, every one of them
    assert {t for _, _, t in fake_dist["timeouts"]} == {timedelta(seconds=expected_s)}


def test_init_from_env_default_group_gets_the_margin(monkeypatch):
    """The default group carries the non-finite check and DeepSpeed's collectives: NCCL there gets the margin too."""
    from ds_tsp.core.parallel import launch

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(launch, "local_device", lambda: torch.device("cpu"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    launch.init_from_env(timeout_s=30, backend="cpu:gloo,cuda:nccl")
    assert seen["timeout"] == timedelta(seconds=90)
    launch.init_from_env(timeout_s=30, backend="gloo")
    assert seen["timeout"] == timedelta(seconds=30)


def test_small_timeout_warns_on_gpu_only(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TSPConfig(timeout_s=5)  # CPU (the suite's runs): no warning
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match=rf"tsp.timeout_s=5 is below the GPU floor of {GPU_TIMEOUT_FLOOR_S} s"):
        TSPConfig(timeout_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TSPConfig(timeout_s=GPU_TIMEOUT_FLOOR_S)
