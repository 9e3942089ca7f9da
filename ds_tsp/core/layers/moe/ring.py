"""MoE MLP, expert-ring schedule: each rank's packed experts travel around the ring, tokens never leave their rank.

Rank p owns experts [p*E_r, (p+1)*E_r) as one flat packed shard (MoESpec.layout). At ring step k rank p holds the
shard of owner (p - k) mod D and runs ITS OWN rows routed to those experts (ds_tsp.core.layers.moe.experts),
adding weight * expert output to its local y. Bytes per layer: the dense MLP's ring over E_r * 3 * F * h
parameters, independent of the sequence length.

Saved for backward: x, the routing weights, the sorted row order and per-expert counts (and the own shard, a
parameter). Foreign shards are dropped after their step; backward runs the ring again, recomputing the expert
activations (spec.recompute_projections; False keeps each step's gate/up pre-activations), and the expert grads
ride the ring home (ring_backward), as in the dense MLP: each step's weight grads first, its rows' dx GEMMs while
they travel (experts_backward's rows_later), so the last hop to the owner is not waited bare.

Row work per step: the rows are sorted by expert (so by owner) once per layer, one device argsort
(ExpertOrder), and each step slices exactly its owner's segment with host bounds: the row gathers, the expert
GEMMs (loop: host counts; grouped: device offsets of the same segment), the activation and the scatters of a step
touch the owner's rows and nothing else (~N x top_k / D at even routing), forward and backward.

Host syncs: ONE device-to-host read per layer forward, the per-expert row counts (one .tolist(), the same read
all_to_all makes for its split sizes); both GEMM paths and backward reuse it (zero syncs in backward). Without it
no gather could be sized to the owner's rows: a static size must cover the largest count an owner may receive,
N x min(top_k, E_r), i.e. all N x k rows whenever E_r >= top_k (D times the real row work).

Meta device (no values, so no host read): each step takes a static window of owner_row_bound = N x min(top_k, E_r)
sorted rows instead (_StepRows, one branch). Meta computes nothing, so only the shapes matter: the schedule traces
with every step at its worst-case row count. tsp_moe_mlp runs only the grouped GEMMs on meta.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.primitives import GradStep, ring_backward, ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION
from ds_tsp.core.layers.moe.experts import experts_backward, experts_forward
from ds_tsp.core.layers.moe.routing import ExpertOrder


def owner_row_bound(tokens: int, top_k: int, experts_per_rank: int) -> int:
    """The most rows one owner's experts can receive from `tokens` tokens: a token's top_k experts are distinct, so
    at most min(top_k, E_r) of its rows meet the E_r experts one rank owns. The meta device's static rows per ring
    step (it has no counts to read)."""
    return tokens * min(top_k, experts_per_rank)


class _StepRows:
    """Which of this rank's sorted rows meet the experts of `owner`, for either GEMM path.

    The rows are sorted by expert once per layer (ExpertOrder: one device argsort), so an owner's rows are one
    contiguous segment [a, b) of `order`, its bounds read on the host once per layer (the layer's one sync; the
    loop path's per-expert counts come from the same read). grouped: the per-expert cumulative row ends of each
    owner, int32 on the device (one cumsum per layer), so the grouped GEMM covers exactly the segment's rows."""

    def __init__(self, plan: ExpertOrder, experts_per_rank: int, path: str):
        self.plan, self.e_r = plan, experts_per_rank
        owners = plan.counts.numel() // experts_per_rank
        if plan.order.is_meta:  # no values to read: every owner a worst-case window (module doc; shapes only)
            window = owner_row_bound(plan.order.numel() // plan.top_k, plan.top_k, experts_per_rank)
            self.counts, self.bounds = None, [(0, window)] * owners
        else:
            self.counts = plan.counts.tolist()  # THE host sync of this layer (module doc), reused by backward
            ends = [0]
            for n in self.counts:
                ends.append(ends[-1] + n)
            self.bounds = [(ends[p * experts_per_rank], ends[(p + 1) * experts_per_rank]) for p in range(owners)]
        self.offsets = (plan.counts.view(owners, experts_per_rank).cumsum(1).to(torch.int32)
                        if path == "grouped" else None)

    def of(self, owner: int):
        """(row indices [M] of owner's experts, sorted by expert; groups: host counts (loop) or device offsets)."""
        a, b = self.bounds[owner]
        rows = self.plan.order[a:b]
        if self.offsets is not None:
            return rows, self.offsets[owner]
        return rows, self.counts[owner * self.e_r:(owner + 1) * self.e_r]


class MoERing(torch.autograd.Function):
    # expert GEMMs: autocast's lower-precision list. x, the routing weights and the packed experts are cast once on
    # entry (the experts before they travel), so forward and backward run in one dtype (ds_tsp.core.layers.amp)
    AUTOCAST = AUTOCAST_LOW_PRECISION

    @staticmethod
    def forward(ctx, x2d, top_w, top_i, experts_shard, spec, comm, path: str):
        plan = ExpertOrder.of(top_i, spec.num_experts)
        steps = _StepRows(plan, spec.experts_per_rank, path)
        w_flat = top_w.reshape(-1)
        y = torch.zeros_like(x2d)
        kept = []

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            rows, groups = steps.of(owner)
            if not rows.numel():  # none of this rank's rows meet owner's experts (a host-known bound): no work
                return
            tok = plan.tokens(rows)
            # index_select, not x2d[tok]: the same rows, 3-5x faster than advanced indexing on CPU tensors
            out, gu = experts_forward(x2d.index_select(0, tok), w, groups, spec.glu,
                                      keep_projections=not spec.recompute_projections)
            y.index_add_(0, tok, out.mul_(w_flat.index_select(0, rows)[:, None]))  # out: this step's own buffer
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
            rows, groups = steps.of(owner)
            if not rows.numel():  # as in forward: nothing routed to owner's experts, a zero grad contribution
                return torch.zeros_like(shard) if need_w else None
            tok = plan.tokens(rows)
            grad = shard.new_empty(shard.shape) if need_w else None  # the expert GEMMs write it, every element
            drows, dw, _ = experts_backward(
                x2d.index_select(0, tok), dy.index_select(0, tok), w_flat.index_select(0, rows), w, groups, spec.glu,
                projections=None if spec.recompute_projections else next(kept), need_weight_grad=need_w,
                grad_into=spec.layout.unpack(grad) if need_w else None, rows_later=need_w)
            dw_flat.index_add_(0, rows, dw)
            if not need_w:
                dx.index_add_(0, tok, drows)
                return None
            # the rows' dx GEMMs once the weight grads are on their way (the last hop to the owner hides behind them)
            return GradStep(grad, lambda: dx.index_add_(0, tok, drows()))

        if need_w:
            grad_shard = ring_backward(ctx.comm, experts_shard, step)
        else:  # frozen experts: the weights ride the ring for dx and the routing grads, no grad buffer travels
            ring_forward(ctx.comm, experts_shard, step)
            grad_shard = None
        return dx, dw_flat.view_as(top_w), None, grad_shard, None, None, None
