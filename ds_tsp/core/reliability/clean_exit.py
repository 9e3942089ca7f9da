"""A clean interpreter exit for the ranks of a torch.distributed job: a script that simply returns exits with 0.

What went wrong without this (torch 2.13, gloo; seen in a core dump of an aborted rank): every gloo collective runs
on a worker thread of its ProcessGroupGloo, which drops its finished work AFTER the waiting thread has returned.
Dropping the work frees its tensors, and a tensor with a Python object must take the GIL to release it. When the
script ends right after a collective (save_pretrained's last broadcast), the main thread reaches interpreter
finalization before the worker got the GIL (a waiting thread asks for it only after the 5 ms switch interval);
a thread that takes the GIL during finalization is ended with pthread_exit, whose forced unwind through the C++
worker loop calls std::terminate: "terminate called without an active exception", SIGABRT, torchrun reports a
failure although everything was saved.

`finalize()` runs from atexit (registered by `install()`, which init_from_env, ProcessGroups.build and TSPComm
call), i.e. after the script returned but BEFORE finalization begins, in this order:
1. stop ds_tsp's watchdog thread (nothing the script waited for is a stall any more);
2. destroy the process groups if the script did not (torch's own guidance for every job's end; when nothing else
   holds a group, its destructor joins the gloo workers, which settles step 3 at once);
3. drain: release the GIL until no other thread of the process is runnable for a few consecutive looks, so a gloo
   worker still holding a finished work takes the GIL and frees it while the interpreter is fully alive (Linux:
   /proc/self/task; elsewhere a fixed pause). Bounded by `DRAIN_LIMIT_S`; costs ~20 ms on an idle exit.

After an error (the script ended with an uncaught exception: `sys.last_value` is set before atexit runs) on NCCL,
step 2 ABORTS the groups instead: NCCL's destroy is a graceful ncclCommFinalize that waits for the peers, and a rank
that raised after posting a collective its peers never post would sit in exit until NCCL's timeout instead of dying
and letting the launcher tear the job down.

`ds_tsp.exit_rank()` (os._exit after flushing) is not needed for a clean exit; it stays for scripts that must end at
once.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time

__all__ = ["install", "finalize", "DRAIN_LIMIT_S"]

DRAIN_LIMIT_S = 3.0  # the most an exit waits for other threads to settle
_STEP_S = 0.005  # one GIL-free pause: a runnable thread waiting for the GIL takes it at once
_QUIET_LOOKS = 4  # consecutive looks with no other runnable thread: drained

_installed = False


def install() -> None:
    """Register `finalize` with atexit (once per process; cheap to call again)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(finalize)


def finalize(drain_limit_s: float = DRAIN_LIMIT_S) -> None:
    """Stop the watchdog, destroy the process groups, let every thread release what it holds. Idempotent; never
    raises (it runs at exit)."""
    try:
        from ds_tsp.core.reliability.watchdog import WATCHDOG

        WATCHDOG.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if exiting_on_error() and "nccl" in str(dist.get_backend()).lower():
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()  # every group, no waiting on peers that will never answer
            else:
                dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group already broken (a dead peer) must not turn an exit into a traceback
        pass
    drain(drain_limit_s)


def exiting_on_error() -> bool:
    """The script ended with an uncaught exception (the interpreter set sys.last_value / last_exc while printing
    it, before atexit handlers run)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _runnable_threads() -> int | None:
    """Threads of this process, other than the caller, that are running or runnable (R) or in uninterruptible
    sleep (D); None where /proc/self/task cannot be read (not Linux)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = 0
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]  # the field after "(comm)"
        busy += state in (b"R", b"D")
    return busy


def drain(limit_s: float = DRAIN_LIMIT_S) -> bool:
    """Release the GIL in short pauses until no other thread is runnable for _QUIET_LOOKS looks in a row (True), or
    limit_s passed (False). A thread waiting for the GIL is woken by each pause and runs then."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(_STEP_S)
        busy = _runnable_threads()
        if busy is None:  # no /proc: one longer pause is all we can do
            time.sleep(min(0.1, limit_s))
            return True
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= _QUIET_LOOKS:
            return True
    return False
