"""A launched script that simply returns exits with 0: no exit_rank, no os._exit.

Without ds_tsp.core.reliability.clean_exit, ~1 run in 5 of a user's script under torchrun aborted at interpreter exit ("terminate
called without an active exception", SIGABRT): a gloo worker thread freed its last finished work during
finalization (see the module). The hook is installed wherever ds_tsp joins or builds groups; it stops the watchdog,
destroys the groups and drains the threads. benchmarks/exit_trials.py measures 50 runs; here 3."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_tsp.core.reliability import clean_exit as finalize

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hooks(monkeypatch):
    """atexit registrations made meanwhile (captured, not registered)."""
    got = []
    monkeypatch.setattr(finalize, "_installed", False)
    monkeypatch.setattr(finalize.atexit, "register", lambda fn, *a, **k: got.append(fn))
    return got


def test_comm_and_groups_install_the_hook(hooks):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups

    TSPComm.single()
    assert hooks == []  # no process group: nothing to end
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        TSPComm(dist.group.WORLD)
        ProcessGroups.build(ParallelLayout(tsp=2))
    finally:
        dist.destroy_process_group()
    assert hooks == [finalize.finalize]  # once per process


def test_init_from_env_installs_the_hook(hooks, monkeypatch):
    from ds_tsp.core.parallel import launch

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    launch.init_from_env(backend="gloo")
    assert hooks == [finalize.finalize]


def test_finalize_stops_the_watchdog_and_destroys_the_groups():
    """In a fresh interpreter: a 1-rank gloo group, a TSP group, the watchdog thread running; finalize() leaves no
    group and no watchdog thread, and the interpreter then exits with 0."""
    code = ("import json, torch, torch.distributed as dist\n"
            "from ds_tsp.core.parallel.launch import init_from_env\n"
            "from ds_tsp.core.comm.communicator import TSPComm\n"
            "from ds_tsp.core.reliability.watchdog import WATCHDOG, Blocked, stats\n"
            "from ds_tsp.core.reliability import clean_exit as finalize\n"
            "init_from_env(backend='gloo')\n"
            "comm = TSPComm(dist.new_group([0]), timeout_s=600)\n"
            "WATCHDOG.disarm(WATCHDOG.arm(Blocked(comm, 'probe', ('group',)), 600.0))\n"
            "before = stats()['thread']\n"
            "finalize.finalize()\n"
            "print(json.dumps({'before': before, 'after': stats()['thread'], 'group': dist.is_initialized()}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"before": True, "after": False, "group": False}
    assert "terminate called" not in done.stderr


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the drain reads /proc/self/task (Linux)")
def test_drain_waits_for_runnable_threads():
    assert finalize.drain(2.0)  # nothing else runs: settled within a few pauses
    stop = time.monotonic() + 0.3

    def spin():
        while time.monotonic() < stop:
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    start = time.monotonic()
    assert finalize.drain(5.0)
    assert time.monotonic() - start >= 0.25  # it waited for the runnable thread to finish
    worker.join()


def test_user_script_exits_cleanly(tmp_path):
    """benchmarks/exit_user_script.py (load, 2 steps, save_pretrained, return) under torchrun, 3 runs: rc 0, no
    "terminate called"."""
    out = tmp_path / "exit.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "exit_trials.py"), "--runs", "3", "--what",
                           "minimal", "--keep", str(tmp_path / "runs"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["runs"] == 3 and summary["aborts"] == 0, done.stdout
    for i in range(3):
        assert "saved " in (tmp_path / "runs" / f"run{i}.out").read_text()  # the script really ran to its end


@pytest.mark.parametrize("error, backend, expected", [
    (True, "cpu:gloo,cuda:nccl", "abort"), (False, "cpu:gloo,cuda:nccl", "destroy"), (True, "gloo", "destroy"),
], ids=["error-nccl-aborts", "clean-nccl-destroys", "error-gloo-destroys"])
def test_an_error_exit_on_nccl_aborts_instead_of_a_graceful_destroy(monkeypatch, error, backend, expected):
    """NCCL's destroy waits for the peers (ncclCommFinalize): a rank that raised after posting a collective its peers
    never post would sit in exit until NCCL's timeout. After an uncaught exception (sys.last_value set) the groups
    are aborted; a clean exit, or gloo, destroys them as before. torch.distributed mocked."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ds_tsp.core.reliability.watchdog import WATCHDOG

    called = []
    monkeypatch.setattr(WATCHDOG, "shutdown", lambda: None)  # the test process's watchdog keeps running
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: called.append("destroy"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: called.append("abort"))
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom") if error else None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    finalize.finalize(drain_limit_s=0.0)
    assert called == [expected]
