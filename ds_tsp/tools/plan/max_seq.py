"""The longest sequence TSP fits: device memory G per GPU and, with offload, host memory H per rank.

    longest_seq(inp, gpu_mem_bytes=80 * 2**30, host_mem_bytes=232 * 2**30) -> MaxSeq

Planned peaks and host pools grow with the sequence (never shrink), so a doubling search then a bisection over
multiples of `unit` (a multiple of 2D, the zigzag granularity, and of 8192 tokens, so answers read as round numbers)
finds the largest that fits. The binding limit is said: "device" or "host".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError

SEQ_GRANULE = 8192
_SEQ_CAP = 2 ** 34  # beyond any memory in sight: stops the doubling on a shape whose peak would not grow


@dataclass(frozen=True)
class MaxSeq:
    seq: int  # 0: not even `unit` tokens fit
    unit: int
    limit: str  # what the next `unit` more tokens would exceed: "device" or "host"
    plan: object  # the LayoutPlan at `seq` (None when seq == 0)
    next_plan: object  # the LayoutPlan at seq + unit (what does not fit)

    def to_dict(self) -> dict:
        out = {"max_seq": self.seq, "unit": self.unit, "limit": self.limit}
        for key, plan in (("at_max", self.plan), ("over_max", self.next_plan)):
            if plan is not None:
                out[key] = {"peak_bytes_per_rank": plan.peak_bytes_per_rank,
                            "host_bytes_per_rank": plan.host_bytes_per_rank, "offload": plan.offload}
        return out


def longest_seq(inp: PlanInput, *, gpu_mem_bytes: int, host_mem_bytes: int | None = None, plan_fn=None) -> MaxSeq:
    """The largest seq (multiple of the unit) whose TSP plan fits; inp.seq is ignored. plan_fn(PlanInput) ->
    LayoutPlan (default plan_tsp; the CLI passes one that applies its PCIe / TFLOP/s rates)."""
    if inp.offload_activations and host_mem_bytes is None:
        raise PlanInputError("host_mem_gib", "the longest sequence with offload_activations needs the host memory "
                                             "per rank: --host-mem-gib H")
    if plan_fn is None:
        from ds_tsp.tools.plan.tsp import plan_tsp as plan_fn
    unit = math.lcm(2 * inp.degree, SEQ_GRANULE)

    def plan_at(k: int):
        return plan_fn(replace(inp, seq=k * unit))

    def verdict(plan) -> str | None:  # None: fits; else the limit exceeded
        if plan.peak_bytes_per_rank > gpu_mem_bytes:
            return "device"
        if inp.offload_activations and plan.host_bytes_per_rank > host_mem_bytes:
            return "host"
        return None

    lo, hi = 0, 1  # lo fits (0: nothing yet), hi is being tried
    hi_plan = plan_at(hi)
    while verdict(hi_plan) is None:
        if hi * unit >= _SEQ_CAP:
            return MaxSeq(hi * unit, unit, "none below the search cap", hi_plan, None)
        lo, hi = hi, hi * 2
        hi_plan = plan_at(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_plan = plan_at(mid)
        if verdict(mid_plan) is None:
            lo = mid
        else:
            hi, hi_plan = mid, mid_plan
    return MaxSeq(lo * unit, unit, verdict(hi_plan), plan_at(lo) if lo else None, hi_plan)
