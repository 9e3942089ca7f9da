"""Gradients averaged over the data group by hand, for a loop that has no data-parallel engine to do it.

DeepSpeed and FSDP2 average gradients over `ProcessGroups.data_group` (data x cp) themselves. A plain loop with a cp
axis (TSPAccelerator(cp_size=C) without DeepSpeed or FSDP2) has none: each cp group's backward yields the gradient
of ITS tokens only (the loss denominator is already the whole batch's token count / data-group size, as under an
averaging engine), so the cp groups' gradients must be averaged once per optimizer step, which is what this does:
one SUM all-reduce per dtype over a flat copy of every gradient, then a division by the group size (gloo has no
AVG), copied back in place. Averaging the accumulated `.grad` once at the end of gradient accumulation equals
averaging every micro-step (the average is linear), so it runs only when the optimizer is about to step.

Every rank passes the same parameters in the same order (the same model), so the flat buffers match; a parameter
without a gradient is skipped, which is the same on every rank of a TSP model (same graph everywhere).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


@torch.no_grad()
def average_grads(parameters: Iterable[torch.Tensor], size: int, sum_all_reduce: Callable[[torch.Tensor], None]
                  ) -> None:
    """Average every `.grad` of `parameters` over `size` ranks in place: per dtype (in a fixed order, the same on
    every rank) one flat buffer, summed in place by `sum_all_reduce(flat)` (blocking), divided, copied back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        sum_all_reduce(flat)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def average_grads_over_group(parameters: Iterable[torch.Tensor], group: dist.ProcessGroup | None, comm) -> None:
    """Average every `.grad` of `parameters` over `group` in place (a no-op for a missing or 1-rank group).
    comm: the model's TSPComm, whose timeout_s bounds the all-reduce (a stalled peer is reported, not waited on)."""
    if group is None or dist.get_world_size(group) == 1:
        return

    def sum_all_reduce(flat: torch.Tensor) -> None:
        with comm.guard(f"gradient all_reduce over data x cp ({flat.dtype})", group=group):
            dist.all_reduce(flat, group=group)

    average_grads(parameters, dist.get_world_size(group), sum_all_reduce)
