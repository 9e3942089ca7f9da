"""The watchdog's polling half: collectives still in flight after a wait() that did not block the host.

On NCCL (and any backend of device tensors) `work.wait()` only orders the current stream after the work and
returns at once. The waiting thread then records a device event on that stream (`record_event`) and hands the
EVENT, never the Work, to the watchdog thread (ds_tsp.core.reliability.watchdog), which queries it every poll_s while
any is in flight and reports one still pending timeout_s after its wait began. Why not the Work: a WorkNCCL keeps its
collective's outputs (the gathered K/V buffer, broadcast shards, grad buffers) until the GPU finishes it, so a
polled Work would pin every buffer of the host's run-ahead window; an event holds no tensor. The event completes
when the stream reaches the point right after the collective: the same moment the work completes.

A FAILED work also lets its stream go on (NCCL aborts the communicator and the kernels end), so a completed event
does not mean success: NCCL records the failure on its process group, and every poll reads the groups' error state
(`Backend.get_error()`, set by NCCL's watchdog for a work's exception or timeout) and reports "failed" instead of
dropping the entry. Backends without an error state (gloo, fake) say nothing there.

Events are recorded only where wait() does not block (the caller says so); after a blocking wait (gloo) there is
nothing left in flight.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from ds_tsp.core.reliability.stall_message import describe, is_timeout


def record_event(device: torch.device):
    """An event recorded on `device`'s current stream (what a wait() just ordered after its collective), or None
    where the device has no events (meta: nothing runs asynchronously there)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    if device.type in ("cpu", "meta") or not hasattr(torch, "Event"):
        return None
    try:  # other accelerators (xpu, ...): the generic device event
        event = torch.Event(device=device)
        event.record()
    except (RuntimeError, TypeError, ValueError):
        return None
    return event


_thread_device = threading.local()  # the CUDA device this thread made current (the watchdog thread: once)


def bind_device(device: torch.device) -> None:
    """Make `device` current on the calling thread before it queries an event of that device. A fresh thread's
    current device is 0, and an event query (a bare cudaEventQuery, no device guard) on it would create a CUDA
    context on GPU 0: about 0.5 GiB per rank, all landing on rank 0's GPU. Set once per thread and device."""
    if device.type != "cuda" or getattr(_thread_device, "index", None) == device.index:
        return
    torch.cuda.set_device(device)
    _thread_device.index = device.index


def group_error(group, device: torch.device) -> str | None:
    """The error NCCL recorded on `group` for `device` ("TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"), None when none or
    when its backend keeps no error state."""
    try:
        error = group._get_backend(device).get_error()
    except (AttributeError, RuntimeError, TypeError, ValueError):  # gloo / fake: "does not support getError"
        return None
    name = getattr(error, "name", str(error))
    return None if name.endswith("SUCCESS") else name


class WorkPoller:
    """Entries (deadline, start, timeout_s, blocked, event, groups, device, call-site frames): waiting threads hand
    them over through a deque (thread-safe without a lock), the watchdog thread moves them into its own list."""

    def __init__(self):
        self._handed: deque = deque()
        self._polled: list[tuple] = []
        self.polling = False  # the watchdog thread polls every poll_s (else it sleeps until the earliest deadline)
        self.polls = 0

    def hand(self, entry: tuple) -> bool:
        """On the waiting thread. True: the watchdog thread is not polling yet and must be woken."""
        self._handed.append(entry)
        if self.polling:
            return False
        self.polling = True
        return True

    def idle(self) -> bool:
        return not self._polled and not self._handed

    def entries(self) -> list[tuple]:
        """What the poller holds now (tests check it holds no tensor and no Work)."""
        return list(self._polled) + list(self._handed)

    def clear(self) -> None:
        """Drop every entry (at interpreter exit: nothing is reported after the script returned)."""
        self._handed.clear()
        self._polled = []

    def poll(self, now: float, report: Callable[[str], None]) -> bool:
        """On the watchdog thread: drop completed entries, report failed or overdue ones; True while some are still
        in flight."""
        while True:
            while self._handed:
                self._polled.append(self._handed.popleft())
            if self._polled:
                self.polls += 1
                errors: dict = {}  # one error-state read per group and poll round
                self._polled = [entry for entry in self._polled if self._in_flight(entry, now, report, errors)]
                if self._polled:
                    return True
            self.polling = False
            # A hand() that read `polling` as True before the store above did not wake us: look once more.
            if not self._handed:
                return False
            self.polling = True

    @staticmethod
    def _in_flight(entry: tuple, now: float, report: Callable[[str], None], errors: dict) -> bool:
        deadline, start, timeout_s, blocked, event, groups, device, frames = entry
        try:
            bind_device(device)
            done = event.query()
        except RuntimeError as err:  # the device reports an error (e.g. an illegal access in the stream)
            outcome = "timed out" if is_timeout(err) else "failed"
            report(describe(blocked, outcome, now - start, timeout_s, cause=err, frames=frames))
            return False
        for group in groups:
            key = id(group)
            if key not in errors:
                errors[key] = group_error(group, device)
            if errors[key] is not None:  # a failed work completes its event too: never read as done
                outcome = "timed out" if errors[key] == "TIMEOUT" else "failed"  # NCCL's own timeout fired
                report(describe(blocked, outcome, now - start, timeout_s, frames=frames,
                                cause=RuntimeError(f"the process group reports {errors[key]}")))
                return False
        if done:
            return False
        if deadline <= now:
            report(describe(blocked, "timed out", now - start, timeout_s, frames=frames))
            return False
        return True
