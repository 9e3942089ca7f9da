"""Gradients averaged over the data group by hand, for a loop that has no data-parallel engine to do it.

DeepSpeed and FSDP2 average gradients over `ProcessGroups.data_group` (data x cp) themselves. A plain loop with a cp
axis (TSPAccelerator(cp_size=C) without DeepSpeed or FSDP2) has none: each cp group's backward yields the gradient
of ITS tokens only (the loss denominator is already the whole batch's token count / data-group size, as under an
averaging engine), so the cp groups' gradients must be averaged once per optimizer step, which is what this does:
per dtype, buckets of at most BUCKET_BYTES (a gradient larger than that is its own bucket, reduced in place, with no
copy): one SUM all-reduce per bucket, then a division by the group size (gloo has no AVG), copied back in place. A
bucket bounds the extra memory to one bucket, where one flat copy of every gradient doubled the gradients' bytes at
the optimizer step (+4 GB fp32 for an 8B model at D=8). Averaging the accumulated `.grad` once at the end of
gradient accumulation equals averaging every micro-step (the average is linear), so it runs only when the optimizer
is about to step.

Every rank passes the same parameters in the same order (the same model), so the flat buffers match; a parameter
without a gradient is skipped, which is the same on every rank of a TSP model (same graph everywhere).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2 ** 20


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `grads` of at most bucket_bytes each (a larger gradient alone)."""
    out: list[list[torch.Tensor]] = []
    size = bucket_bytes
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


@torch.no_grad()
def average_grads(parameters: Iterable[torch.Tensor], size: int, sum_all_reduce: Callable[[torch.Tensor], None],
                  bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average every `.grad` of `parameters` over `size` ranks in place: per dtype (in a fixed order, the same on
    every rank) and bucket (the same buckets on every rank: the same gradients), summed by `sum_all_reduce(flat)`
    (blocking), divided, copied back. A bucket of one contiguous gradient is reduced in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):
        for grads in _buckets(by_dtype[dtype], bucket_bytes):
            if len(grads) == 1 and grads[0].is_contiguous():
                sum_all_reduce(grads[0])
                grads[0].div_(size)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            sum_all_reduce(flat)
            flat.div_(size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            del flat


def average_grads_over_group(parameters: Iterable[torch.Tensor], group: dist.ProcessGroup | None, comm) -> None:
    """Average every `.grad` of `parameters` over `group` in place (a no-op for a missing or 1-rank group).
    comm: the model's TSPComm, whose timeout_s bounds the all-reduce (a stalled peer is reported, not waited on)."""
    if group is None or dist.get_world_size(group) == 1:
        return

    def sum_all_reduce(flat: torch.Tensor) -> None:
        with comm.guard(f"gradient all_reduce over data x cp ({flat.dtype})", group=group):
            dist.all_reduce(flat, group=group)

    average_grads(parameters, dist.get_world_size(group), sum_all_reduce)
