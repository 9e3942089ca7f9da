"""The watchdog's one-line report of a failed or stalled TSP wait: collective, rank, time waited, the rank(s) waited
for, the layer (`comm.context`) and the call site. Built only when something goes wrong
(ds_tsp.core.reliability.watchdog)."""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

MESSAGE_PREFIX = "ds_tsp: TSP collective"
# How a process-group timeout reads when it fires before the watchdog (a group created with a timeout <= timeout_s,
# as ds_tsp.initialize does): gloo "Timed out waiting 10000ms for recv operation to complete", "Application timeout
# caused pair closure" (a pair an earlier timeout closed); NCCL "Watchdog caught collective operation timeout".
_TIMEOUT_MARKERS = ("timed out", "timeout")
# How a transport failure reads (gloo "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", "Connection
# reset by peer", NCCL "NCCL error", "Broken pipe"): gloo raises plain RuntimeErrors, so the text tells them apart.
_TRANSPORT_MARKERS = ("gloo", "nccl", "connection", "by peer", "broken pipe", "socket")


class TSPCommError(RuntimeError):
    """A TSP collective failed (peer died, transport error); the message names collective, layer and peer."""


class Blocked:
    """Description of a pending wait, formatted only when something goes wrong (so building it costs ~nothing).

    peer: ("src", j) broadcast source, ("dst", j) reduce/gather destination (TSP group ranks),
    ("ring", prev, next) ring hop, ("group",) every other rank of the TSP group, ("ranks", [global ranks]).
    """

    __slots__ = ("comm", "kind", "peer", "what", "context")

    def __init__(self, comm: Any, kind: str, peer: tuple, what: str | None = None, context: str | None = None):
        self.comm, self.kind, self.peer, self.what = comm, kind, peer, what
        self.context = getattr(comm, "context", "") if context is None else context


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _name(comm: Any, group_rank: int) -> str:
    ranks = getattr(comm, "_ranks", None)
    g = ranks[group_rank] if ranks and 0 <= group_rank < len(ranks) else group_rank
    return f"rank {g}" if g == group_rank else f"rank {g} (TSP rank {group_rank})"


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def describe_peers(b: Blocked) -> str:
    comm, peer = b.comm, b.peer
    me = getattr(comm, "rank", 0)
    size = getattr(comm, "size", 1)
    ranks = getattr(comm, "_ranks", None)
    ranks = ranks if ranks and len(ranks) == size else list(range(size))
    others = [ranks[r] for r in range(size) if r != me]
    kind = peer[0]
    if kind == "src":
        return (f"{_name(comm, peer[1])} (the broadcast source)" if peer[1] != me
                else f"{_names(others)} (the broadcast receivers; this rank is the source)")
    if kind == "dst":
        return (f"{_name(comm, peer[1])} (the {b.kind} destination)" if peer[1] != me
                else f"{_names(others)} (the {b.kind} contributors; this rank is the destination)")
    if kind == "ring":
        prv, nxt = peer[1], peer[2]
        if prv == nxt:
            return f"{_name(comm, prv)} (the ring neighbour)"
        return f"{_name(comm, prv)} (ring receive) or {_name(comm, nxt)} (ring send)"
    if kind == "ranks":
        mine = _global_rank()
        rest = [r for r in peer[1] if r != mine]
        return f"{_names(rest)} (the rest of its group)" if rest else "no other rank"
    return f"{_names(others)} (the rest of the TSP group)" if others else "no other rank"


def _short(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    path = os.path.abspath(path)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else os.path.basename(path)


# frames a call site skips: ds_tsp's communication and watchdog modules, torch internals
_SKIP = tuple(os.path.join(*parts) for parts in (
    *(("ds_tsp", "core", f"{name}.py") for name in ("comm", "comm_primitives", "comm_recorder", "watchdog",
                                                     "watchdog_polling", "stall_message")),
    ("torch", "distributed", ""), ("torch", "autograd", ""), ("torch", "nn", ""), ("torch", "utils", ""),
    ("torch", "_tensor.py"), ("contextlib.py",), ("threading.py",)))


def caller_frames(frame, depth: int = 3) -> list[tuple[str, int, str]]:
    """The innermost `depth` frames outside ds_tsp's comm / watchdog modules and torch internals, unformatted
    (cheap: what a wait handed to the polling thread keeps)."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if not any(s in code.co_filename for s in _SKIP):
            out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return out


def _call_site(frame=None, depth: int = 3, frames: list | None = None) -> str:
    frames = caller_frames(frame, depth) if frames is None else frames
    return " < ".join(f"{_short(f)}:{line} {name}" for f, line, name in frames) if frames else "unknown"


def _cause(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if text.startswith("[") and "] " in text:  # gloo prefixes "[/path/to/pair.cc:553] "
        text = text.split("] ", 1)[1]
    for cut in (". This is typically", " GLHF"):
        text = text.split(cut, 1)[0]
    return text[:240]


def is_timeout(err: BaseException) -> bool:
    """The error is the backend's own timeout (the process group's, fired before the watchdog's deadline)."""
    text = str(err).lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS)


def is_comm_error(err: BaseException) -> bool:
    """The error is a collective's (a torch.distributed error, a transport failure, a backend timeout), not one of
    the computation around it."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS + _TRANSPORT_MARKERS)


def describe(b: Blocked, outcome: str, waited_s: float, timeout_s: float | None, frame=None,
             cause: BaseException | None = None, frames: list | None = None) -> str:
    """The one-line report: collective, rank, how long, waited-for peer(s), layer context, call site (`frame`
    of the blocked thread, or `frames` taken by caller_frames where the wait was made)."""
    comm = b.comm
    size, me = getattr(comm, "size", 1), getattr(comm, "rank", 0)
    kind = b.kind if not b.what else f"{b.kind} ({b.what})"
    limit = f", timeout_s={timeout_s:g}" if timeout_s is not None else ""
    head = (f"{MESSAGE_PREFIX} {kind} {outcome} on rank {_global_rank()} (TSP rank {me} of {size}) after "
            f"{waited_s:.1f} s{limit}: waiting for {describe_peers(b)}")
    if cause is not None:
        head += f": {_cause(cause)}"
    layer = b.context or "not labelled (ds_tsp.core.reliability.watchdog.label_modules(model) names the layers)"
    return f"{head}; layer: {layer}; at {_call_site(frame, frames=frames)}"
