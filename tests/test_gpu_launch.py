"""Launch on GPUs, checked with CUDA mocked (CI has none): one rule for every entry point.

With CUDA: cuda:LOCAL_RANK is made current BEFORE the process group or any shard is built, and init_from_env asks
for "cpu:gloo,cuda:nccl" (CPU bookkeeping collectives keep working beside NCCL). Without CUDA: gloo, nothing else.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_tsp.core import launch


@pytest.fixture
def calls(monkeypatch):
    """Record set_device / init_process_group in order, with no real group created."""
    log: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: log.append(("set_device", i)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: log.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return log


def _cuda(monkeypatch, available: bool, count: int = 4):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_with_cuda_the_local_gpu_is_set_before_the_group_and_both_backends_are_asked_for(monkeypatch, calls):
    _cuda(monkeypatch, True)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert launch.init_from_env() == (0, 4)
    assert calls == [("set_device", 2), ("init", "cpu:gloo,cuda:nccl")]


def test_without_cuda_gloo_and_no_device_call(monkeypatch, calls):
    _cuda(monkeypatch, False, 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    launch.init_from_env()
    assert calls == [("init", "gloo")]
    assert launch.local_device() == torch.device("cpu")


def test_local_device_is_cuda_local_rank(monkeypatch, calls):
    _cuda(monkeypatch, True, 8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert launch.local_device() == torch.device("cuda", 5)
    assert calls == [("set_device", 5)]


def test_more_processes_than_gpus_is_one_clear_error(monkeypatch, calls):
    _cuda(monkeypatch, True, 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 but this node shows 2 CUDA device.*--nproc_per_node 2"):
        launch.init_from_env()
    assert calls == []


def test_an_existing_group_still_gets_its_device(monkeypatch, calls):
    _cuda(monkeypatch, True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    launch.init_from_env()
    assert calls == [("set_device", 1)]


def test_deepspeed_initialize_picks_the_gpu_before_deepspeed_builds_anything(monkeypatch):
    from ds_tsp.integrations.deepspeed import engine

    log: list[str] = []

    class Stop(Exception):
        pass

    class FakeDeepSpeed:
        @staticmethod
        def init_distributed(**kwargs):
            log.append("init_distributed")
            raise Stop

    monkeypatch.setattr(engine, "import_deepspeed", lambda: FakeDeepSpeed)
    monkeypatch.setattr(engine, "local_device", lambda: log.append("local_device") or torch.device("cpu"))
    with pytest.raises(Stop):
        engine.initialize(model=None, config={"train_batch_size": 1, "tsp": {"size": 1}})
    assert log == ["local_device", "init_distributed"]


def test_groups_get_the_configured_timeout_at_creation(monkeypatch):
    """A stall inside DeepSpeed's or FSDP's own collectives on the TSP / data groups is bounded by timeout_s too."""
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.setup import build_runtime

    created: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, timeout=None: created.append(timeout) or
                        object())
    monkeypatch.setattr("ds_tsp.core.setup.TSPComm", lambda group, **kw: kw)
    for cuda, weight_groups in ((False, 0), (True, 2)):
        created.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        runtime = build_runtime(parse_tsp_config({"size": 2, "timeout_s": 77}))
        weights = runtime.comm.pop("weight_group")
        assert runtime.comm == {"overlap": True, "timeout_s": 77} and (weights is not None) == cuda
        # tsp, data, pipe groups, then (on CUDA: NCCL's one stream per communicator) one more per TSP group
        assert len(created) == 2 + 2 + 4 + weight_groups and {t.total_seconds() for t in created} == {77}
