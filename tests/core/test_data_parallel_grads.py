"""Gradients averaged by hand over the data group (ds_tsp.core.grads.data_parallel, the plain TSPAccelerator's cp
axis): exact averages of coordinate-encoded gradients on 3 ranks (threads, tests/helpers/thread_comm.py), in buckets
that bound the extra memory: no all-reduce larger than one bucket unless it is one gradient reduced in place."""
from __future__ import annotations

import torch
from thread_comm import run_threads

from ds_tsp.core.grads.data_parallel import average_grads

SHAPES = [(3, 5), (7,), (40, 10), (2, 2), (11,)]  # (40, 10): larger than the bucket below, reduced in place


def _params(rank: int) -> list[torch.nn.Parameter]:
    params = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64 if i == 3 else torch.float32))
        n = p.numel()
        # coordinate-encoded: parameter i, element j, rank r -> 1000 i + j + 0.25 r (exact in binary)
        p.grad = (1000 * i + torch.arange(n, dtype=p.dtype) + 0.25 * rank).reshape(shape)
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(4)))  # no gradient: skipped on every rank
    return params


def _average(comm):
    params = _params(comm.rank)
    calls = []

    def sum_all_reduce(flat):
        calls.append((flat.numel() * flat.element_size(), any(flat.data_ptr() == p.grad.data_ptr()
                                                               for p in params if p.grad is not None)))
        comm.all_reduce(flat)

    average_grads(params, comm.size, sum_all_reduce, bucket_bytes=200)
    return params, calls


def test_bucketed_average_is_exact_and_bounded():
    results = run_threads(3, _average)
    for params, calls in results:
        for i, (p, shape) in enumerate(zip(params, SHAPES)):
            want = (1000 * i + torch.arange(p.numel(), dtype=p.dtype) + 0.25).reshape(shape)  # mean of 0, .25, .5
            assert torch.equal(p.grad, want), i
        assert params[-1].grad is None
        # float32: [15 + 7 elements = 88 B] copied; [400 elements] and [11 elements] alone, in place; float64: [4
        # elements] alone, in place
        assert sorted(calls) == sorted([(88, False), (1600, True), (44, True), (32, True)]), calls
        assert all(nbytes <= 200 or in_place for nbytes, in_place in calls)
