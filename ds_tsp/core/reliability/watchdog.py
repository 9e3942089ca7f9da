"""Bound every blocking TSP wait by `timeout_s`: a failed or stalled peer ends this rank with ONE clear message.

Why a watchdog and not only the process-group timeout: gloo applies the timeout given to init_process_group,
which is not the tsp block's `timeout_s` when the group was started elsewhere (torchrun + init_from_env default
1800 s), and a blocked C++ `work.wait()` cannot be interrupted from Python. What gloo does, measured (torch 2.13):

* a KILLED peer closes its sockets: every pending op on it raises "Connection closed by peer" within ~0.5 s;
* a STOPPED peer (SIGSTOP, a hung host, a swapped-out node) keeps its sockets open: the kernel still accepts
  small sends, receives never complete, and gloo waits for the process-group timeout (forever, for practical
  purposes, with the 1800 s default).

So every blocking wait made through `TSPComm` (and every block wrapped in `comm.guard(...)`) is armed here: the
thread records a monotonic deadline in a dict (no lock, no thread, no syscall per collective). ONE daemon thread
per process sleeps until the earliest deadline (or `timeout_s` when nothing is armed), so it wakes about twice
per `timeout_s`, however many collectives run. When a wait outlives its deadline the thread writes one line to
stderr naming the collective, the layer context, and the rank(s) waited for, then leaves with os._exit(EXIT_CODE):
the blocked C++ wait is never unwound, atexit handlers and process-group destructors (which would join gloo
threads blocked on the stopped peer) are skipped on purpose. A wait that RAISES (killed peer, gloo's own timeout)
gets the same one-line message and the same exit; with `timeout_s=None` it raises `TSPCommError` instead.

Where the process group's own timeout is not longer than timeout_s (ds_tsp.initialize and build_runtime create the
groups with timeout_s) gloo's timer, started when an op is posted, often fires first (9 of 20 by-hand SIGSTOP
trials): the wait raises "Timed out waiting 10000ms for recv operation to complete" (or "Application timeout caused
pair closure"). That is reported as the watchdog's own: "timed out", collective, layer, peer, gloo's words after.

On NCCL (and any backend of device tensors) `work.wait()` does not block the host: it only orders the current
stream after the work and returns at once, so no thread is ever blocked past a deadline. Such waits are armed all
the same (wait() may block during lazy communicator setup); then an event recorded on the stream after the wait
is polled by the same thread (ds_tsp.core.reliability.polling: the event, never the Work, which would keep the
collective's output buffers alive until the GPU finishes it). NCCL's own watchdog is the backstop, not the first
responder: ds_tsp.core.parallel.topology creates NCCL groups with a margin over timeout_s, so this one-line report comes
first. The message itself is built by ds_tsp.core.reliability.stall_message.

At interpreter exit (atexit, before finalization begins) `shutdown()` stops the thread and drops what it polls, so
nothing is reported after a script returned, and no Python thread of ours runs into finalization
(ds_tsp.core.reliability.clean_exit does the rest of a clean exit).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ds_tsp.core.reliability import polling as watchdog_polling
from ds_tsp.core.reliability.polling import WorkPoller
from ds_tsp.core.reliability.stall_message import (
    MESSAGE_PREFIX,
    Blocked,
    TSPCommError,
    caller_frames,
    describe,
    is_comm_error,
    is_timeout,
)

__all__ = ["EXIT_CODE", "MESSAGE_PREFIX", "POLL_S", "TSPCommError", "guard", "guarded", "label_modules", "stats",
           "WATCHDOG"]

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): the job may succeed when restarted without the failed peer
# Seconds between polls of works in flight: a stall is reported by timeout_s + POLL_S; a polled work (and what it
# holds) is released at most this late after it completes.
POLL_S = 0.02


# --- the per-process watchdog ---------------------------------------------------------------------------------
class Watchdog:
    """One per process: deadlines of the waits in progress (thread id -> entry), the works in flight after waits
    that did not block (polled), and one daemon thread."""

    def __init__(self, poll_s: float = POLL_S):
        self.poll_s = poll_s
        self._reset()

    def _reset(self) -> None:
        self.poller = WorkPoller()  # events of collectives in flight after waits that did not block
        self._armed: dict[int, tuple] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = False  # shutdown(): the thread leaves at its next wake-up
        self._report_lock = threading.Lock()
        self._reported = False
        self._idle_s = float("inf")
        self.arms = 0
        self.wakeups = 0

    # hot path: a dict store, a counter, a clock read
    def arm(self, blocked: Blocked, timeout_s: float) -> tuple:
        ident = threading.get_ident()
        start = time.perf_counter()
        prev = self._armed.get(ident)
        entry = (start + timeout_s, start, timeout_s, blocked)
        self._armed[ident] = entry
        self.arms += 1
        if timeout_s < self._idle_s:
            self._idle_s = timeout_s
            self._ensure_thread()
            self._wake.set()  # it may be sleeping for a longer idle period
        return ident, entry, prev

    def disarm(self, token: tuple) -> None:
        ident, _, prev = token
        if prev is None:
            self._armed.pop(ident, None)
        else:
            self._armed[ident] = prev

    def watch(self, device: torch.device, blocked: Blocked, start: float, timeout_s: float, frame) -> None:
        """After a wait() that did not block: poll an event recorded on `device`'s current stream (it completes with
        the collectives that wait() ordered the stream after) until done, or report it timeout_s after start.

        The poller gets the event, the groups (whose error state tells a failed work from a finished one) and the
        call site; never the Works or their tensors, so every buffer is freed as soon as Python drops it."""
        if device.type == "cuda" and device.index is None:  # the watchdog thread must know which GPU: name it here
            device = torch.device("cuda", torch.cuda.current_device())
        event = watchdog_polling.record_event(device)
        if event is None or event.query():
            return
        comm = blocked.comm
        groups = tuple(g for g in (getattr(comm, "group", None), getattr(comm, "weight_group", None)) if g is not None)
        if self.poller.hand((start + timeout_s, start, timeout_s, blocked, event, groups, device,
                             caller_frames(frame))):
            self._ensure_thread()
            self._wake.set()  # it may be sleeping until a far deadline

    def _ensure_thread(self) -> None:
        if self._stop:  # after shutdown (interpreter exit): waits still run, nothing is watched any more
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ds_tsp-watchdog", daemon=True)
            self._thread.start()

    def shutdown(self, join_s: float = 5.0) -> None:
        """Stop the thread and drop every armed wait and polled event (at interpreter exit: the script returned,
        so nothing it waited for is a stall any more). Idempotent."""
        self._stop = True
        self._armed.clear()
        self.poller.clear()
        thread = self._thread
        self._wake.set()
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(join_s)

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()  # before looking, so that a set() made while we look cuts the sleep short
            now = time.perf_counter()
            wake_at = now + self._idle_s
            for ident, entry in list(self._armed.items()):
                if entry[0] <= now:
                    self._fire(ident, entry, now)
                wake_at = min(wake_at, entry[0])
            entry = None  # a finished wait's entry must not keep its TSPComm (and process group) alive while we sleep
            if self.poller.poll(now, self.report_and_exit):
                wake_at = min(wake_at, now + self.poll_s)
            if self._stop:
                break
            self._wake.wait(max(wake_at - now, 0.0) + 0.005)
            self.wakeups += 1

    def _fire(self, ident: int, entry: tuple, now: float) -> None:
        _, start, timeout_s, blocked = entry
        frame = sys._current_frames().get(ident)
        message = describe(blocked, "timed out", now - start, timeout_s, frame=frame)
        del frame
        if self._armed.get(ident) is not entry:  # it completed while we looked: not a stall
            return
        self.report_and_exit(message)

    def failed(self, blocked: Blocked, err: BaseException, start: float, timeout_s: float | None) -> None:
        """A wait raised: report once and exit (watched), or raise TSPCommError (timeout_s None). The backend's own
        timeout (the process group's, fired first) is reported as "timed out", like the watchdog's."""
        outcome = "timed out" if is_timeout(err) else "failed"
        message = describe(blocked, outcome, time.perf_counter() - start, timeout_s, frame=sys._getframe(1),
                           cause=err)
        if timeout_s is None:
            raise TSPCommError(message) from err
        self.report_and_exit(message)

    def report_and_exit(self, message: str) -> None:
        with self._report_lock:
            first, self._reported = not self._reported, True
        if not first:  # another thread is reporting and exiting: never a second message
            threading.Event().wait()
        data = (message + f" -- exiting with code {EXIT_CODE}\n").encode("utf-8", "replace")
        try:
            os.write(2, data)
        except OSError:
            pass
        flusher = threading.Thread(target=_flush_std, daemon=True)  # a full stdout pipe must not block the exit
        flusher.start()
        flusher.join(2.0)
        os._exit(EXIT_CODE)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


WATCHDOG = Watchdog()
if hasattr(os, "register_at_fork"):  # a forked child has no watchdog thread and no waits of its parent
    os.register_at_fork(after_in_child=WATCHDOG._reset)


def watched_wait(works: list, blocked: Blocked, timeout_s: float | None, poll: torch.device | None = None) -> None:
    """Wait for every work; bounded by timeout_s (None: unbounded, failures raise TSPCommError).

    poll: the device of the works' tensors when wait() does not block the host for them (NCCL: it only orders the
    current stream after them); the watchdog thread then polls an event recorded on that device's stream after the
    waits and reports it if not done timeout_s after this call began.
    """
    start = time.perf_counter()
    if timeout_s is None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as err:
            WATCHDOG.failed(blocked, err, start, None)
        return
    token = WATCHDOG.arm(blocked, timeout_s)
    try:
        for work in works:
            work.wait()
        if poll is not None:
            WATCHDOG.watch(poll, blocked, start, timeout_s, sys._getframe(1))
    except RuntimeError as err:
        WATCHDOG.failed(blocked, err, start, timeout_s)
    finally:
        WATCHDOG.disarm(token)


def post_failed(blocked: Blocked, err: BaseException, timeout_s: float | None) -> None:
    """Starting a collective raised (e.g. isend on a connection its peer closed)."""
    WATCHDOG.failed(blocked, err, time.perf_counter(), timeout_s)


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Guard:
    """`with guard(...)`: arm the watchdog around blocking torch.distributed calls made outside TSPComm. poll: the
    device of the block's tensors when its collectives do not block the host (NCCL): after the block an event on
    that device's stream is watched like a TSPComm wait's (Watchdog.watch). comm_errors_only: around a block that
    mostly computes (a backward with the gradient reduction in its hooks), an error that is not a collective's
    (stall_message.is_comm_error) propagates as it is instead of being reported as the collective's failure.

    Guards nest: an inner guard (a TSPComm wait inside the block) arms its own deadline and restores the outer one
    when it ends, so the outer deadline still counts from the outer block's start."""

    __slots__ = ("blocked", "timeout_s", "poll", "comm_errors_only", "_token", "_start")

    def __init__(self, blocked: Blocked, timeout_s: float | None, poll: torch.device | None = None,
                 comm_errors_only: bool = False):
        self.blocked, self.timeout_s, self._token = blocked, timeout_s, None
        self.comm_errors_only = comm_errors_only
        self.poll = poll if poll is not None and poll.type not in ("cpu", "meta") else None

    def __enter__(self) -> "Guard":
        self._start = time.perf_counter()
        if self.timeout_s is not None:
            self._token = WATCHDOG.arm(self.blocked, self.timeout_s)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._token is not None:
            WATCHDOG.disarm(self._token)
            self._token = None
        # an out-of-memory error is the device's, not a peer's: it propagates as it is
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, (TSPCommError, _OOM)) and \
                (not self.comm_errors_only or is_comm_error(exc)):
            WATCHDOG.failed(self.blocked, exc, self._start, self.timeout_s)
        if exc is None and self.poll is not None and self.timeout_s is not None:
            WATCHDOG.watch(self.poll, self.blocked, self._start, self.timeout_s, sys._getframe(1))
        return False


def guard(what: str, *, timeout_s: float | None = 1800, group: Any = None, comm: Any = None,
          context: str | None = None, poll: torch.device | None = None, comm_errors_only: bool = False) -> Guard:
    """Bound a block of blocking torch.distributed calls, e.g. `with guard("loss all_reduce", group=g): ...`.

    group: the process group the block talks to (its other ranks are named as the waited-for peers; default the
    TSP group of `comm`, else the world). poll: the device of the block's tensors, comm_errors_only: see Guard. Prefer
    `comm.guard(what)`, which takes timeout_s and context from comm.
    """
    if group is not None and dist.is_initialized():
        peer = ("ranks", dist.get_process_group_ranks(group))
    elif comm is not None:
        peer = ("group",)
    else:
        peer = ("ranks", list(range(dist.get_world_size())) if dist.is_initialized() else [0])
    return Guard(Blocked(comm, what, peer, context=context if context is not None else getattr(comm, "context", "")),
                 timeout_s, poll, comm_errors_only)


def guarded(comm: Any, what: str, *, context: str, group: Any = None, timeout_s: float | None = None,
            comm_errors_only: bool = False):
    """`with guarded(comm, "what", context="save"):` the block's collectives over `group` (default the world) bounded
    by comm's timeout_s with the watchdog's one line; nothing without a process group (or a 1-process one), or
    without a comm and a timeout_s (a model without a TSPComm: unbounded). timeout_s: for a block that runs before
    any TSPComm exists (the setup that builds the groups). comm_errors_only: see Guard (for blocks that also
    compute, read or write files: their own errors propagate as they are)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return contextlib.nullcontext()
    group = group if group is not None else dist.group.WORLD
    if comm is not None and hasattr(comm, "guard"):
        return comm.guard(what, group=group, context=context, comm_errors_only=comm_errors_only)
    if timeout_s is None:
        return contextlib.nullcontext()
    return guard(what, timeout_s=timeout_s, group=group, context=context, comm_errors_only=comm_errors_only)


def stats() -> dict:
    """Waits armed, watchdog-thread wake-ups and poll rounds so far in this process (the overhead, in events)."""
    return {"arms": WATCHDOG.arms, "wakeups": WATCHDOG.wakeups, "polls": WATCHDOG.poller.polls,
            "thread": WATCHDOG._thread is not None and WATCHDOG._thread.is_alive()}


# --- layer labels -----------------------------------------------------------------------------------------------
def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def label_modules(model: torch.nn.Module, comm: Any = None) -> torch.nn.Module:
    """Keep `comm.context` naming the module a collective runs in: "model.layers.3.self_attn forward", then
    "... backward" (set when the grad of that module's output arrives), "... recompute" under activation
    checkpointing. Hooks go on the root and every submodule holding a `comm`; each costs one attribute store
    per call. Idempotent (a module labelled once keeps its first name). Returns the model.
    """
    root_comm = comm if comm is not None else getattr(model, "comm", None)
    if root_comm is None:
        root_comm = next((getattr(m, "comm") for m in model.modules() if hasattr(getattr(m, "comm", None),
                                                                                  "context")), None)
    if root_comm is None:
        return model
    for name, module in model.named_modules():
        mcomm = getattr(module, "comm", None)
        if module is model:
            mcomm = mcomm if hasattr(mcomm, "context") else root_comm
        if not hasattr(mcomm, "context") or getattr(module, "_ds_tsp_labelled", False):
            continue
        module._ds_tsp_labelled = True
        _hook(module, mcomm, name or type(model).__name__, root=module is model)
    return model


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((o for o in values if isinstance(o, torch.Tensor) and o.requires_grad), None)


def _hook(module: torch.nn.Module, comm: Any, name: str, root: bool) -> None:
    fw, bw, rc = f"{name} forward", f"{name} backward", f"{name} recompute (backward)"

    def on_grad(_grad):
        comm.context = bw
        if root:  # when this backward pass ends, say so instead of naming the last layer it ran
            prev = getattr(module, "_ds_tsp_prev_context", "")
            torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(comm, "context", prev))

    def pre(mod, _args):
        mod._ds_tsp_prev_context = comm.context
        comm.context = rc if _in_backward() else fw

    def post(mod, _args, output):
        comm.context = mod._ds_tsp_prev_context
        out = _first_tensor(output)
        if out is not None and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(on_grad)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
