"""The stall watchdog where `work.wait()` returns at once (NCCL: it only orders the current stream): the works still
in flight are polled with is_completed() on the watchdog thread, and a stall is reported with the same one-line
message (collective, layer, peer) within timeout_s + POLL_S. Fake works stand in for NCCL's; a `meta` tensor
stands in for a CUDA one (Handle polls the works of device tensors only)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_tsp.core.comm import CommCounter, Handle
from ds_tsp.core.stall_message import MESSAGE_PREFIX, Blocked
from ds_tsp.core.watchdog import EXIT_CODE, POLL_S, WATCHDOG

REPO = Path(__file__).resolve().parents[1]
# A loaded 2-core CI box may run the watchdog thread this late; the bound is timeout_s + POLL_S + SLACK_S.
SLACK_S = 0.25


class StuckWork:
    """NCCL's work on a stalled peer: wait() returns at once, is_completed() never becomes True."""

    def __init__(self, done_after_s: float | None = None, error: str | None = None):
        self.start, self.done_after_s, self.error, self.polls = time.perf_counter(), done_after_s, error, 0

    def wait(self):
        return True

    def is_completed(self) -> bool:
        self.polls += 1
        if self.error is not None and self.polls > 1:  # the first call is watch()'s own, on the waiting thread
            raise RuntimeError(self.error)
        return self.done_after_s is not None and time.perf_counter() - self.start >= self.done_after_s


def _blocked(context="model.layers.1.mlp forward"):
    comm = SimpleNamespace(rank=0, size=3, _ranks=[0, 1, 2], context=context)
    return Blocked(comm, "ring", ("ring", 2, 1), "weight hop 1/2")


def _handle(work, timeout_s: float, device: str = "meta") -> Handle:
    return Handle([work], CommCounter(), (torch.empty(4, device=device),), _blocked(), timeout_s)


@pytest.fixture
def reports(monkeypatch):
    """Messages the watchdog would print before exiting (captured instead), with the time each arrived."""
    got, arrived = [], threading.Event()

    def capture(message: str) -> None:
        got.append((time.perf_counter(), message))
        arrived.set()

    monkeypatch.setattr(WATCHDOG, "report_and_exit", capture)
    return SimpleNamespace(got=got, arrived=arrived)


def test_stall_is_reported_although_wait_returns_at_once(reports):
    timeout_s = 0.5
    start = time.perf_counter()
    _handle(StuckWork(), timeout_s).wait()
    assert time.perf_counter() - start < timeout_s / 2  # wait() did not block: the host went on
    assert reports.arrived.wait(timeout_s + POLL_S + SLACK_S + 5)
    (at, message), = reports.got
    assert timeout_s <= at - start <= timeout_s + POLL_S + SLACK_S, at - start
    assert message.startswith(f"{MESSAGE_PREFIX} ring (weight hop 1/2) timed out on rank 0 (TSP rank 0 of 3) after "
                              f"0.5 s, timeout_s=0.5: waiting for rank 2 (ring receive) or rank 1 (ring send)"), message
    assert "; layer: model.layers.1.mlp forward; " in message
    assert "test_watchdog_polling.py" in message  # the call site of the wait, not where the host is now
    time.sleep(3 * POLL_S)
    assert len(reports.got) == 1  # reported once, then dropped


def test_work_that_completes_in_time_is_not_a_stall(reports):
    work = StuckWork(done_after_s=0.15)
    polls_before = WATCHDOG.poller.polls
    _handle(work, timeout_s=0.4).wait()
    time.sleep(0.6)
    assert not reports.got, reports.got
    assert WATCHDOG.poller.polls > polls_before and work.polls >= 2  # it was polled, on the watchdog thread
    assert WATCHDOG.poller.idle()  # and released once done


def test_work_that_fails_while_polled_is_reported(reports):
    _handle(StuckWork(error="NCCL communicator was aborted on rank 1"), timeout_s=5.0).wait()
    assert reports.arrived.wait(2.0)
    (_, message), = reports.got
    assert "ring (weight hop 1/2) failed on rank 0" in message
    assert "NCCL communicator was aborted on rank 1" in message and "layer: model.layers.1.mlp forward" in message


def test_cpu_works_are_not_polled(reports):
    """After a blocking wait (gloo) is_completed() may stay False for good (gloo's reduce_scatter work, torch 2.13):
    polling it would report a stall that is not one."""
    _handle(StuckWork(), timeout_s=0.2, device="cpu").wait()
    time.sleep(0.2 + POLL_S + SLACK_S)
    assert not reports.got, reports.got


def test_stalled_process_ends_with_one_message():
    """End to end: the rank goes on after wait() returned, and the watchdog ends it with EXIT_CODE."""
    code = ("import time, torch\n"
            "from test_watchdog_polling import StuckWork, _handle\n"
            "_handle(StuckWork(), 1.0).wait()\n"
            "print('wait returned', flush=True)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=90, check=False)
    assert done.returncode == EXIT_CODE, done.stderr
    assert "wait returned" in done.stdout
    messages = [line for line in done.stderr.splitlines() if line.startswith(MESSAGE_PREFIX)]
    assert len(messages) == 1 and "timed out" in messages[0] and "waiting for rank 2" in messages[0], done.stderr
    assert time.monotonic() - start < 30  # interpreter start-up plus 1 s, not the 60 s sleep
