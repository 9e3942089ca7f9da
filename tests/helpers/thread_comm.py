"""D ranks as D threads of one process: a TSPComm stand-in whose collectives meet at a barrier (a helper module).

For property tests that draw many (D, shape, documents) cases: one process, no spawn, no gloo. Each collective
returns a finished handle; every rank must post the same collectives in the same order (as under NCCL), else the
barrier times out and the test fails (it never hangs). Only what the layers call is implemented: broadcast,
reduce, all_gather, reduce_scatter, all_reduce, with TSPComm's argument conventions.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


class _Done:
    def wait(self) -> None:
        return None


class _World:
    def __init__(self, size: int, timeout_s: float):
        self.size, self.timeout_s = size, timeout_s
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list = [None] * size


class ThreadComm:
    grad_bucket = None
    recorder = None
    weight_group = None
    cp = None  # TSPComm.cp: no context-parallel axis (the sequence is this group's)

    def __init__(self, world: _World, rank: int):
        self.world, self.rank, self.size, self.context = world, rank, world.size, ""
        self.posted: list[tuple[str, tuple[int, ...]]] = []  # (kind, shape) in post order, for order checks

    def _exchange(self, kind: str, tensor: torch.Tensor, combine) -> _Done:
        self.posted.append((kind, tuple(tensor.shape)))
        w = self.world
        w.slots[self.rank] = tensor
        w.barrier.wait()
        try:
            combine(w.slots)
        finally:
            w.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return _Done()

    def broadcast(self, tensor, src, what=None):
        return self._exchange("broadcast", tensor, lambda s: self.rank != src and tensor.copy_(s[src]))

    def reduce(self, tensor, dst, what=None):
        total = None

        def combine(slots):
            nonlocal total
            if self.rank == dst:
                total = sum(t.clone() for t in slots)
        done = self._exchange("reduce", tensor, combine)
        if total is not None:
            tensor.copy_(total)
        return done

    def all_gather(self, out, local, what=None):
        return self._exchange("all_gather", local, lambda s: out.view(self.size, -1).copy_(
            torch.stack([t.reshape(-1) for t in s])))

    def reduce_scatter(self, out, full, what=None):
        return self._exchange("reduce_scatter", full, lambda s: out.copy_(
            sum(t.reshape(self.size, -1)[self.rank].clone() for t in s).view_as(out)))

    def all_reduce(self, tensor, kind="all_reduce", what=None, context=None):
        total = None

        def combine(slots):
            nonlocal total
            total = sum(t.clone() for t in slots)
        done = self._exchange("all_reduce", tensor, combine)
        tensor.copy_(total)
        return done


def run_threads(size: int, fn, timeout_s: float = 120) -> list:
    """[fn(comm) for each rank], the ranks running concurrently as threads; re-raises the first failure."""
    world = _World(size, timeout_s)
    comms = [ThreadComm(world, r) for r in range(size)]

    def call(comm):
        try:
            return fn(comm)
        except BaseException:
            world.barrier.abort()  # the other ranks fail at their next collective instead of waiting
            raise

    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = [pool.submit(call, c) for c in comms]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
