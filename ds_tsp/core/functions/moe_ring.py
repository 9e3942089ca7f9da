"""MoE MLP, expert-ring schedule: each rank's packed experts travel around the ring, tokens never leave their rank.

Rank p owns experts [p*E_r, (p+1)*E_r) as one flat packed shard (MoESpec.layout). At ring step k rank p holds the
shard of owner (p - k) mod D and runs ITS OWN rows routed to those experts (ds_tsp.core.functions.moe_experts),
adding weight * expert output to its local y. Bytes per layer: the dense MLP's ring over E_r * 3 * F * h
parameters, independent of the sequence length.

Saved for backward: x, the routing weights, the sorted row order and per-expert counts (and the own shard, a
parameter). Foreign shards are dropped after their step; backward runs the ring again, recomputing the expert
activations (spec.recompute_projections; False keeps each step's gate/up pre-activations), and the expert grads
ride the ring home (ring_backward), as in the dense MLP.

Host syncs: the loop path reads the per-expert counts ONCE per layer forward (one .tolist()) and reuses them in
backward; the grouped path reads nothing (device offsets, and each step's rows rotated to the front of a fixed-size
gather so the grouped GEMM needs no host offset).
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm_primitives import ring_backward, ring_forward
from ds_tsp.core.functions.moe_experts import experts_backward, experts_forward
from ds_tsp.core.functions.moe_routing import ExpertOrder


class _StepRows:
    """Which of this rank's sorted rows meet the experts of `owner`, for either GEMM path."""

    def __init__(self, plan: ExpertOrder, host_counts: list | None, experts_per_rank: int):
        self.plan, self.host_counts, self.e_r = plan, host_counts, experts_per_rank
        if host_counts is None:
            ends = plan.counts.cumsum(0)
            self.starts = torch.cat([ends.new_zeros(1), ends])  # starts[e] = first sorted row of expert e
            self.arange = torch.arange(plan.order.numel(), device=plan.order.device)
        else:
            self.host_starts = [0]
            for n in host_counts:
                self.host_starts.append(self.host_starts[-1] + n)

    def of(self, owner: int):
        """(row indices [M], groups, valid [M] or None) of the experts owner holds."""
        lo, hi = owner * self.e_r, (owner + 1) * self.e_r
        if self.host_counts is not None:
            a, b = self.host_starts[lo], self.host_starts[hi]
            return self.plan.order[a:b], self.host_counts[lo:hi], None
        # grouped: a fixed-size gather that starts at this owner's first row (a device scalar), so the grouped
        # GEMM's offsets count from 0; rows past the owner's last are masked (valid False)
        n = self.arange.numel()
        start = self.starts[lo]
        rows = self.plan.order[(self.arange + start) % max(n, 1)]
        valid = self.arange < self.starts[hi] - start
        groups = (self.starts[lo + 1:hi + 1] - start).to(torch.int32)
        return rows, groups, valid


class MoERing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, top_w, top_i, experts_shard, spec, comm, path: str):
        plan = ExpertOrder.of(top_i, spec.num_experts)
        # loop path: THE host sync of this layer (per-expert row counts), reused by backward
        host_counts = plan.counts.tolist() if path == "loop" else None
        steps = _StepRows(plan, host_counts, spec.experts_per_rank)
        w_flat = top_w.reshape(-1)
        y = torch.zeros_like(x2d)
        kept = []

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            rows, groups, valid = steps.of(owner)
            tok = plan.tokens(rows)
            out, gu = experts_forward(x2d[tok], w["gate_up"], w["down"], groups, valid,
                                      keep_projections=not spec.recompute_projections)
            y.index_add_(0, tok, out * w_flat[rows][:, None])
            if gu is not None:
                kept.append(gu)

        ring_forward(comm, experts_shard, step)
        ctx.spec, ctx.comm, ctx.steps = spec, comm, steps
        ctx.save_for_backward(x2d, top_w, experts_shard, *kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, top_w, experts_shard, *kept = ctx.saved_tensors
        spec, steps = ctx.spec, ctx.steps
        plan = steps.plan
        w_flat = top_w.reshape(-1)
        dx = torch.zeros_like(x2d)
        dw_flat = torch.zeros_like(w_flat)
        need_w = ctx.needs_input_grad[3]
        kept = iter(kept)  # same ring order as forward

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            rows, groups, valid = steps.of(owner)
            tok = plan.tokens(rows)
            drows, dw, d_gate_up, d_down = experts_backward(
                x2d[tok], dy[tok], w_flat[rows], w["gate_up"], w["down"], groups, valid=valid,
                projections=None if spec.recompute_projections else next(kept), need_weight_grad=need_w)
            dx.index_add_(0, tok, drows)
            if valid is not None:
                dw = torch.where(valid, dw, torch.zeros((), dtype=dw.dtype, device=dw.device))
            dw_flat.index_add_(0, rows, dw)
            return spec.layout.pack({"gate_up": d_gate_up, "down": d_down}) if need_w else None

        if need_w:
            grad_shard = ring_backward(ctx.comm, experts_shard, step)
        else:  # frozen experts: the weights ride the ring for dx and the routing grads, no grad buffer travels
            ring_forward(ctx.comm, experts_shard, step)
            grad_shard = None
        return dx, dw_flat.view_as(top_w), None, grad_shard, None, None, None
