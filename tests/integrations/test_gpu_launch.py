"""Launch on GPUs, checked with CUDA mocked (CI has none): one rule for every entry point.

With CUDA: cuda:LOCAL_RANK is made current BEFORE the process group or any shard is built, and init_from_env asks
for "cpu:gloo,cuda:nccl" (CPU bookkeeping collectives keep working beside NCCL). Without CUDA: gloo, nothing else.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_tsp.core.parallel import launch


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
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    launch.init_from_env()
    assert calls == [("set_device", 1)]


@pytest.mark.parametrize("config, gpu", [("cpu:gloo,cuda:nccl", True), ("cuda:nccl", True),
                                         ("cpu:gloo,cuda:gloo", False), ("cpu:gloo", False)])
def test_an_existing_group_without_cuda_backend_keeps_the_rank_on_the_cpu(monkeypatch, calls, config, gpu):
    """A gloo-only group (run_on_local_ranks' ranks, a user's init_process_group("gloo")) would carry CUDA tensors
    through gloo: those ranks stay on the CPU, also when the node has fewer GPUs than ranks (no LOCAL_RANK error)."""
    _cuda(monkeypatch, True, 2)
    monkeypatch.setenv("LOCAL_RANK", "1" if gpu else "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert launch.local_device() == (torch.device("cuda", 1) if gpu else torch.device("cpu"))
    assert calls == ([("set_device", 1)] if gpu else [])


def _device_with_mocked_cuda(gpus: int) -> str:
    """Body of a spawned rank on a pretend CUDA node with `gpus` GPUs: the device the entry points would use."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: gpus
    torch.cuda.set_device = lambda i: (_ for _ in ()).throw(AssertionError(f"set_device({i}) on a gloo-only rank"))
    return str(launch.local_device())


def test_spawned_ranks_on_a_cuda_node_stay_on_the_cpu():
    """`python examples/demo_train.py` / `ds-tsp verify --tsp 3` without a launcher on a 1-GPU node: every rank of the
    gloo group computes on the CPU (before: rank 0 on cuda:0 feeding gloo, rank 1 the LOCAL_RANK error)."""
    assert launch.run_on_local_ranks(_device_with_mocked_cuda, 3, 1, timeout_s=120) == ["cpu"] * 3


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
    # without a launcher it starts a 1-process group: recorded, not started (a group left up in this pytest
    # process, or its RANK / MASTER_PORT variables, would change every later in-process test)
    monkeypatch.setattr(engine, "_launched", lambda: False)
    monkeypatch.setattr(engine, "_single_process_env", lambda: log.append("env"))
    monkeypatch.setattr(engine, "init_from_env", lambda **kwargs: log.append("init_from_env"))
    with pytest.raises(Stop):
        engine.initialize(model=None, config={"train_batch_size": 1, "tsp": {"size": 1}})
    assert log == ["local_device", "env", "init_from_env", "init_distributed"]
    assert not dist.is_initialized()


def test_groups_get_the_configured_timeout_at_creation(monkeypatch):
    """A stall inside DeepSpeed's or FSDP's own collectives on the TSP / data groups is bounded by timeout_s too."""
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime

    created: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # NCCL's margin: tests/reliability/test_nccl_timeout.py
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, timeout=None: created.append(timeout) or
                        object())
    monkeypatch.setattr("ds_tsp.core.parallel.runtime.TSPComm", lambda group, **kw: kw)
    # the node-placement check exchanges node names over a real group (tests/reliability/test_node_placement.py covers it)
    monkeypatch.setattr("ds_tsp.core.parallel.runtime.check_tsp_inside_nodes", lambda *a, **k: None)
    for cuda, weight_groups in ((False, 0), (True, 2)):
        created.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        runtime = build_runtime(parse_tsp_config({"size": 2, "timeout_s": 77}))
        weights = runtime.comm.pop("weight_group")
        assert runtime.comm == {"overlap": True, "timeout_s": 77, "cp": None} and (weights is not None) == cuda
        # tsp, data, pipe groups, then (on CUDA: NCCL's one stream per communicator) one more per TSP group
        assert len(created) == 2 + 2 + 4 + weight_groups and {t.total_seconds() for t in created} == {77}
