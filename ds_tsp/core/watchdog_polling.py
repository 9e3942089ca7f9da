"""The watchdog's polling half: works still in flight after a wait() that did not block the host.

On NCCL (and any backend of device tensors) `work.wait()` only orders the current stream after the work and
returns at once. The waiting thread hands the works still in flight to the watchdog thread (ds_tsp.core.watchdog),
which polls `work.is_completed()` every poll_s while any is in flight, releases the completed ones, and reports a
work still running timeout_s after its wait began, or one whose poll raises. Works are polled only where wait()
does not block (the caller says so), because after a blocking wait is_completed() is not reliable: gloo's
reduce_scatter work reports False forever (torch 2.13).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from ds_tsp.core.stall_message import describe, is_timeout


class WorkPoller:
    """Entries (deadline, start, timeout_s, blocked, works in flight, call-site frames): waiting threads hand them
    over through a deque (thread-safe without a lock), the watchdog thread moves them into its own list."""

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

    def poll(self, now: float, report: Callable[[str], None]) -> bool:
        """On the watchdog thread: drop completed works, report overdue ones; True while some are still in flight."""
        while True:
            while self._handed:
                self._polled.append(self._handed.popleft())
            if self._polled:
                self.polls += 1
                self._polled = [entry for entry in self._polled if self._in_flight(entry, now, report)]
                if self._polled:
                    return True
            self.polling = False
            # A hand() that read `polling` as True before the store above did not wake us: look once more.
            if not self._handed:
                return False
            self.polling = True

    @staticmethod
    def _in_flight(entry: tuple, now: float, report: Callable[[str], None]) -> bool:
        deadline, start, timeout_s, blocked, works, frames = entry
        try:
            works[:] = [w for w in works if not w.is_completed()]  # release completed works now
        except RuntimeError as err:
            outcome = "timed out" if is_timeout(err) else "failed"
            report(describe(blocked, outcome, now - start, timeout_s, cause=err, frames=frames))
            return False
        if works and deadline <= now:
            report(describe(blocked, "timed out", now - start, timeout_s, frames=frames))
            return False
        return bool(works)
