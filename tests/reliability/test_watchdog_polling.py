"""The stall watchdog where `work.wait()` returns at once (NCCL: it only orders the current stream): an event recorded
after the wait is polled on the watchdog thread (never the Work, which would keep its outputs alive), and a stall is
reported with the same one-line message (collective, layer, peer) within timeout_s + POLL_S; a failed work (its
group's error state set, its event completed by the abort) is reported as failed, not dropped as done. Fake works and
fake events stand in for NCCL's and CUDA's; a `meta` tensor stands in for a CUDA one (Handle polls device tensors
only)."""
from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import CommCounter, Handle, TSPComm
from ds_tsp.core.reliability import polling as watchdog_polling
from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX, Blocked
from ds_tsp.core.reliability.watchdog import EXIT_CODE, POLL_S, WATCHDOG

REPO = Path(__file__).resolve().parents[2]
# A loaded 2-core CI box may run the watchdog thread this late; the bound is timeout_s + POLL_S + SLACK_S.
SLACK_S = 0.25


class StuckWork:
    """NCCL's work: wait() returns at once (it only orders the stream). Never asked whether it completed."""

    def wait(self):
        return True

    def is_completed(self) -> bool:
        raise AssertionError("the watchdog must poll the event, not the Work")


class FakeEvent:
    """A CUDA event on the stream after the collective: query() turns True once the 'GPU' gets there."""

    def __init__(self, done_after_s: float | None = None, done_from_query: int | None = None):
        self.start, self.done_after_s, self.done_from_query = time.perf_counter(), done_after_s, done_from_query
        self.queries, self.done = 0, False

    def query(self) -> bool:
        self.queries += 1
        if self.done or (self.done_from_query is not None and self.queries >= self.done_from_query):
            return True
        return self.done_after_s is not None and time.perf_counter() - self.start >= self.done_after_s


class FakeGroup:
    """A process group whose NCCL backend reports `error` (an ErrorType name) from get_error()."""

    def __init__(self, error: str = "SUCCESS"):
        self.error = error

    def _get_backend(self, device):
        return SimpleNamespace(get_error=lambda: SimpleNamespace(name=self.error))


def _blocked(context="model.layers.1.mlp forward", group=None):
    comm = SimpleNamespace(rank=0, size=3, _ranks=[0, 1, 2], context=context, group=group)
    return Blocked(comm, "ring", ("ring", 2, 1), "weight hop 1/2")


def _handle(work, timeout_s: float, device: str = "meta", group=None) -> Handle:
    return Handle([work], CommCounter(), (torch.empty(4, device=device),), _blocked(group=group), timeout_s)


@pytest.fixture
def reports(monkeypatch):
    """Messages the watchdog would print before exiting (captured instead), with the time each arrived."""
    got, arrived = [], threading.Event()

    def capture(message: str) -> None:
        got.append((time.perf_counter(), message))
        arrived.set()

    monkeypatch.setattr(WATCHDOG, "report_and_exit", capture)
    return SimpleNamespace(got=got, arrived=arrived)


@pytest.fixture
def events(monkeypatch):
    """record_event hands out the queued FakeEvents (a never-completing one when none is queued)."""
    queued, made = [], []

    def record(device):
        event = queued.pop(0) if queued else FakeEvent()
        made.append((device, event))
        return event

    monkeypatch.setattr(watchdog_polling, "record_event", record)
    yield SimpleNamespace(queued=queued, made=made)
    WATCHDOG.poller.clear()  # nothing of this test left for the next one


def test_stall_is_reported_although_wait_returns_at_once(reports, events):
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
    assert [d.type for d, _ in events.made] == ["meta"]  # one event, on the tensors' device
    time.sleep(3 * POLL_S)
    assert len(reports.got) == 1  # reported once, then dropped


def test_work_that_completes_in_time_is_not_a_stall(reports, events):
    event = FakeEvent(done_after_s=0.15)
    events.queued.append(event)
    polls_before = WATCHDOG.poller.polls
    _handle(StuckWork(), timeout_s=0.4).wait()
    time.sleep(0.6)
    assert not reports.got, reports.got
    assert WATCHDOG.poller.polls > polls_before and event.queries >= 2  # it was polled, on the watchdog thread
    assert WATCHDOG.poller.idle()  # and released once done


@pytest.mark.parametrize("done", [True, False], ids=["event_completed_by_the_abort", "event_pending"])
def test_failed_work_is_reported_not_taken_as_completed(reports, events, done):
    """NCCL: a failed work counts as completed (and the abort lets the stream, so the event, go on); its group's
    error state says it failed. The one-line report names it, well before timeout_s."""
    # done: the first query (right after wait(), on the waiting thread) says pending, the poller's say done
    events.queued.append(FakeEvent(done_from_query=2 if done else None))
    _handle(StuckWork(), timeout_s=5.0, group=FakeGroup("COMM_ERROR")).wait()
    assert reports.arrived.wait(2.0)
    (_, message), = reports.got
    assert "ring (weight hop 1/2) failed on rank 0" in message
    assert "the process group reports COMM_ERROR" in message and "layer: model.layers.1.mlp forward" in message


def test_healthy_group_event_done_is_dropped(reports, events):
    events.queued.append(FakeEvent(done_after_s=0.05))
    _handle(StuckWork(), timeout_s=0.3, group=FakeGroup("SUCCESS")).wait()
    time.sleep(0.5)
    assert not reports.got and WATCHDOG.poller.idle()


def _reachable(roots, kinds, limit: int = 20_000) -> list:
    """Objects of `kinds` reachable from roots through gc referents (types and modules not followed)."""
    seen, todo, found = set(), list(roots), []
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, type(sys))):
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(obj)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def test_poller_holds_no_tensor_and_no_work(reports, events):
    """After wait() the poller keeps an event, not the Work (a WorkNCCL keeps its outputs until the
    GPU finishes it). On the fake process group: the output and input buffers and the Work are freed as soon as
    Python drops them, while the collective is still 'in flight' for the poller."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        comm = TSPComm(dist.group.WORLD, timeout_s=30)
        event = FakeEvent()  # the 'GPU' has not reached it yet
        events.queued.append(event)
        out, local = torch.empty(8, device="meta"), torch.empty(4, device="meta")
        handle = comm.all_gather(out, local, what="sequence gather")
        refs = [weakref.ref(out), weakref.ref(local), weakref.ref(handle._works[0])]
        handle.wait()
        del out, local, handle
        gc.collect()
        assert [r() for r in refs] == [None, None, None]  # buffers and Work freed at once
        entries = WATCHDOG.poller.entries()
        assert len(entries) == 1 and event in entries[0]  # the collective is still watched, by its event
        assert not _reachable(entries, (torch.Tensor, dist.Work))
        event.done = True
        deadline = time.monotonic() + 5
        while not WATCHDOG.poller.idle() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert WATCHDOG.poller.idle() and not reports.got
    finally:
        dist.destroy_process_group()


def test_cpu_works_are_not_polled(reports, events):
    """After a blocking wait (gloo) nothing is in flight: no event is recorded, nothing polled (gloo's reduce_scatter
    work reports is_completed() False for good, torch 2.13: polling it would report a stall that is not one)."""
    _handle(StuckWork(), timeout_s=0.2, device="cpu").wait()
    time.sleep(0.2 + POLL_S + SLACK_S)
    assert not reports.got, reports.got
    assert not events.made and WATCHDOG.poller.idle()


def test_record_event_needs_no_device_on_meta_and_cpu():
    """Production record_event: nothing to poll where nothing runs asynchronously."""
    assert watchdog_polling.record_event(torch.device("meta")) is None
    assert watchdog_polling.record_event(torch.device("cpu")) is None


def test_stalled_process_ends_with_one_message():
    """End to end: the rank goes on after wait() returned, and the watchdog ends it with EXIT_CODE."""
    code = ("import time, torch\n"
            "from ds_tsp.core.reliability import polling as watchdog_polling\n"
            "from test_watchdog_polling import FakeEvent, StuckWork, _handle\n"
            "watchdog_polling.record_event = lambda device: FakeEvent()\n"
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


def test_watchdog_thread_sets_the_cuda_device_before_it_queries(reports, events, monkeypatch):
    """A fresh thread's current CUDA device is 0, and a bare cudaEventQuery there creates a context on GPU 0 (about
    0.5 GiB per rank, all on rank 0's GPU). torch.cuda mocked: a per-thread current device, set_device recorded; the
    event records which device was current on the thread that queried it. The rank's device is cuda:1, named as
    plain "cuda" by the caller (the current device of the waiting thread)."""
    current, calls = threading.local(), []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))

    def set_device(device):
        index = device.index if isinstance(device, torch.device) else int(device)
        calls.append((threading.get_ident(), index))
        current.index = index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(watchdog_polling._thread_device, "index", None, raising=False)
    current.index = 1  # the waiting (main) thread runs on the rank's GPU

    class DeviceEvent(FakeEvent):
        def __init__(self):
            super().__init__(done_from_query=3)
            self.seen = []

        def query(self) -> bool:
            self.seen.append((threading.get_ident(), getattr(current, "index", 0)))
            return super().query()

    event = DeviceEvent()
    events.queued.append(event)
    WATCHDOG.watch(torch.device("cuda"), _blocked(), time.perf_counter(), 5.0, sys._getframe())
    deadline = time.monotonic() + 5
    while not WATCHDOG.poller.idle() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert WATCHDOG.poller.idle() and not reports.got, reports.got
    assert [d for d, _ in events.made] == [torch.device("cuda", 1)]  # the index resolved on the waiting thread
    main = threading.get_ident()
    on_watchdog = [(t, d) for t, d in event.seen if t != main]
    assert on_watchdog and all(d == 1 for _, d in on_watchdog), event.seen  # never queried with GPU 0 current
    assert [i for t, i in calls if t != main] == [1]  # set once on the watchdog thread, not per query
