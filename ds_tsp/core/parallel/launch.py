"""Start ranks: N local gloo processes for tests and `ds-tsp verify`, or the env:// group under torchrun/deepspeed.

`run_on_local_ranks` exists because a failing rank must not hang the caller: the other ranks sit in a collective
waiting for it, so the parent watches every child, and on the first error (or the deadline) terminates the rest
and raises with the failing rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_tsp.core.errors import TSPConfigError, config_error_in

__all__ = ["run_on_local_ranks", "init_from_env", "free_port", "local_device", "default_backend"]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race with other processes remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(value: Any) -> Any:
    """Move tensors (also inside lists, tuples and dicts) to CPU so the parent never touches a device."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _child(rank: int, world_size: int, port: int, timeout_s: float, env: Mapping[str, str] | None,
           fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """Body of one rank. Results travel as plain pickled bytes (not torch shared memory), so they stay valid
    after this process exits."""
    try:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
        if env:
            os.environ.update(env)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(*args)
        dist.destroy_process_group()
        results.put(("ok", rank, pickle.dumps(_to_cpu(value))))
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        config = config_error_in(exc)
        if config is not None:  # an input error: its one line, not a traceback (those stay for real bugs)
            results.put(("config_error", rank, str(config)))
        else:
            results.put(("error", rank, traceback.format_exc()))


class RankConfigError(TSPConfigError, RuntimeError):
    """A TSPConfigError raised in a rank run_on_local_ranks started: its message alone (callers that catch a rank's
    failure as RuntimeError still do). `rank`: the first rank that reported it."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _stop(procs: list) -> None:
    procs = [p for p in procs if p.pid is not None]  # only those that started
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
                       env: Mapping[str, str] | None = None) -> list:
    """Run fn(*args) on `world_size` spawned processes that share one gloo group; return each rank's result.

    `fn` and `args` must be picklable (a module-level function); each result must be picklable (tensors are moved
    to CPU). Inside `fn`, dist.get_rank() tells the rank, and local_device() is the CPU even on a GPU node (the group
    is gloo-only; for GPUs start the script under torchrun instead). Raises RuntimeError naming the rank and
    carrying its traceback as soon as any rank fails, or when `timeout_s` (overall wall clock) passes; the remaining
    ranks are terminated in both cases.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an integer >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, timeout_s, dict(env) if env else None, fn, args,
                                              results), name=f"ds_tsp-rank{r}")
             for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    try:
        for p in procs:
            p.start()  # pickles fn and args: fails here if they are not picklable
        while len(values) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.05)
            except queue_mod.Empty:
                now = time.monotonic()
                if now > deadline:
                    waiting = [r for r in range(world_size) if r not in values]
                    raise RuntimeError(f"run_on_local_ranks timed out after {timeout_s} s; ranks {waiting} had not "
                                       "returned (a collective that not every rank joined?)") from None
                for r, p in enumerate(procs):
                    if r in values or p.exitcode is None:
                        continue
                    # A rank that exited normally may still have its result in the pipe: allow a grace period.
                    first_seen = exited_at.setdefault(r, now)
                    if now - first_seen > 2.0:
                        raise RuntimeError(f"rank {r} exited with code {p.exitcode} without returning a result "
                                           "(killed, or crashed in native code)")
                continue
            if status == "config_error":
                raise RankConfigError(payload, rank)
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        if len(values) < world_size:
            _stop(procs)
        else:
            for p in procs:
                p.join(timeout=30)
            _stop(procs)
        results.close()
    return [values[r] for r in range(world_size)]


def local_device() -> torch.device:
    """The device this process trains on: cuda:LOCAL_RANK (made current) when CUDA exists, else the CPU.

    The one rule every entry point follows (init_from_env, ds-tsp verify, the examples, ds_tsp.initialize): pick the
    GPU before anything is built, so no rank builds its shards on cuda:0 by default.

    Also the CPU when a default process group is up whose CUDA tensors would go through gloo (ranks spawned by
    run_on_local_ranks, or a user's own init_process_group("gloo")): gloo's send/recv would read a device pointer
    from the host, so such ranks compute on the CPU, whatever the node's GPU count.
    """
    if not torch.cuda.is_available() or not _group_carries_cuda():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this node shows {count} CUDA device(s): start at most "
                           f"{count} processes per node (--nproc_per_node {count})")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _group_carries_cuda() -> bool:
    """True unless the default process group exists and has no CUDA backend but gloo (or none) for CUDA tensors.
    No group yet (a launcher's rank before init_from_env): True, the group built next gets NCCL for CUDA."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    backends = {}
    for part in dist.get_backend_config().split(","):  # "gloo" reads "cpu:gloo,cuda:gloo"; "nccl" "cuda:nccl"
        device, _, backend = part.rpartition(":")
        backends[device or "cuda"] = backend
    return backends.get("cuda", "gloo") != "gloo"


def default_backend() -> str:
    """gloo without CUDA; with CUDA, NCCL for CUDA tensors AND gloo for CPU ones (bookkeeping collectives)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout_s: float = 1800, backend: str | None = None) -> tuple[int, int]:
    """Join the default process group as a torchrun / deepspeed launcher set it up; return (rank, world_size).

    With CUDA the process's GPU (LOCAL_RANK) is made current first (see local_device). Does nothing but report if a
    group already exists. Without launcher variables (a plain `python script.py`) it starts a 1-rank group on a free
    local port. backend: default_backend() unless given.
    """
    local_device()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = default_backend()
    from ds_tsp.core.parallel.topology import (
        group_timeout,  # NCCL: a margin over timeout_s, so ds_tsp's report comes first
    )
    from ds_tsp.core.reliability.clean_exit import install

    install()  # at interpreter exit: the groups destroyed and gloo's workers drained (no abort, no os._exit needed)
    timeout = group_timeout(timeout_s, backend)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)  # env:// reads RANK, WORLD_SIZE, MASTER_ADDR/PORT
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def exit_rank(code: int | None = 0) -> None:
    """End a launched rank (torchrun, accelerate launch, deepspeed) once everything is saved: flush stdout and
    stderr, destroy the default process group if one is up, and leave without interpreter finalization.

    No longer needed: a script that simply returns exits cleanly, because ds_tsp.core.reliability.clean_exit (installed
    by init_from_env, TSPComm and ProcessGroups.build) stops the watchdog, destroys the groups and lets gloo's worker
    threads release their finished ops before finalization; without it torch's gloo backend aborted at exit
    ("terminate called without an active exception", exit code -6) in about 1 run in 5. Kept for scripts that
    call it: it still skips finalization (os._exit) after everything was written and flushed.
    """
    import sys

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))  # as sys.exit: None is success
