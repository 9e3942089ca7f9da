"""MoE MLP, token-dispatch schedule: routed token rows go to their experts' owners and the outputs come back.

Forward, per layer:
1. the per-expert row counts [E] (device) travel by a tiny all_to_all: rank p learns how many rows each rank sends
   to each of its E_r experts;
2. ONE device-to-host read of both count vectors (the split sizes all_to_all_single needs on the host, and the
   loop path's per-expert bounds) -- the only host sync of the layer; backward reuses them (zero syncs there);
3. x rows sorted by expert (= grouped by owner) go out, the owner sorts what arrives by expert (a device argsort),
   runs its experts (ds_tsp.core.layers.moe.experts), and the UNWEIGHTED outputs go back in arrival order;
   the source adds weight * output into its local y.
Memory-optimal (spec.recompute_projections, the default): nothing of the dispatch is kept; backward sends x rows
again with dy and the routing weight (2h + 1 per row) and receives d x rows with the routing-weight grad (h + 1).
spec.recompute_projections False keeps the received rows and their gate/up pre-activations instead (h + 1 out).
The owner's expert grads are complete where they are computed: no weight traffic at all.
The host read cannot run on the meta device; tsp_moe_mlp refuses that combination.
"""
from __future__ import annotations

import torch

from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION
from ds_tsp.core.layers.moe.experts import experts_backward, experts_forward
from ds_tsp.core.layers.moe.routing import ExpertOrder


def _arrival_order_by_expert(recv_counts: torch.Tensor, rows: int, experts_per_rank: int) -> torch.Tensor:
    """recv_counts [D * E_r] (from rank s for my expert j at s * E_r + j): the permutation sorting the arrived rows
    (rank order, then expert) by expert, computed on the device from the counts."""
    ends = recv_counts.cumsum(0)
    segment = torch.searchsorted(ends, torch.arange(rows, device=recv_counts.device), right=True)
    return torch.argsort(segment % experts_per_rank, stable=True)


class MoEAllToAll(torch.autograd.Function):
    # expert GEMMs: autocast's lower-precision list. x, the routing weights and the packed experts are cast once on
    # entry (the experts before they travel), so forward and backward run in one dtype (ds_tsp.core.layers.amp)
    AUTOCAST = AUTOCAST_LOW_PRECISION

    @staticmethod
    def forward(ctx, x2d, top_w, top_i, experts_shard, spec, comm, path: str):
        d, e_r, h = comm.size, spec.experts_per_rank, spec.hidden
        plan = ExpertOrder.of(top_i, spec.num_experts)
        recv_counts = torch.empty_like(plan.counts)
        comm.all_to_all(recv_counts, plan.counts, [e_r] * d, [e_r] * d, what="moe expert row counts").wait()
        host = torch.cat([plan.counts, recv_counts]).tolist()  # THE host sync of this layer (see module doc)
        sent, arrived = host[:spec.num_experts], host[spec.num_experts:]
        in_splits = [sum(sent[q * e_r:(q + 1) * e_r]) for q in range(d)]
        out_splits = [sum(arrived[s * e_r:(s + 1) * e_r]) for s in range(d)]
        if path == "loop":
            groups = [sum(arrived[s * e_r + j] for s in range(d)) for j in range(e_r)]
        else:
            groups = recv_counts.view(d, e_r).sum(0).cumsum(0).to(torch.int32)
        n_in = sum(out_splits)
        perm = _arrival_order_by_expert(recv_counts, n_in, e_r)

        tok = plan.tokens(plan.order)
        send = x2d.index_select(0, tok)  # not x2d[tok]: the same rows, faster than advanced indexing on CPU
        recv = x2d.new_empty((n_in, h))
        comm.all_to_all(recv, send, out_splits, in_splits, what="moe token rows").wait()
        del send
        rows = recv.index_select(0, perm)
        del recv
        w = spec.layout.unpack(experts_shard)
        out_sorted, gu = experts_forward(rows, w, groups, spec.glu, keep_projections=not spec.recompute_projections)
        out_arrived = torch.empty_like(out_sorted).index_copy_(0, perm, out_sorted)
        del out_sorted
        back = x2d.new_empty((tok.numel(), h))
        comm.all_to_all(back, out_arrived, in_splits, out_splits, what="moe expert outputs").wait()
        del out_arrived
        # back is the receive buffer, read once: weighted in place
        y = torch.zeros_like(x2d).index_add_(0, tok, back.mul_(top_w.reshape(-1).index_select(0, plan.order)[:, None]))

        ctx.spec, ctx.comm, ctx.groups = spec, comm, groups
        ctx.splits = (in_splits, out_splits)
        kept = () if spec.recompute_projections else (rows, gu)
        ctx.save_for_backward(x2d, top_w, plan.order, perm, experts_shard, *kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, top_w, order, perm, experts_shard, *kept = ctx.saved_tensors
        spec, comm = ctx.spec, ctx.comm
        in_splits, out_splits = ctx.splits
        h, k = spec.hidden, spec.top_k
        tok = torch.div(order, k, rounding_mode="floor")
        # the rows gathered straight into their columns of the send buffer (x rows unless kept, dy rows, the
        # routing weight): one pass, no gathered parts concatenated
        send = dy.new_empty((order.numel(), (h if kept else 2 * h) + 1))
        if not kept:
            torch.index_select(x2d, 0, tok, out=send[:, :h])
        torch.index_select(dy, 0, tok, out=send[:, -1 - h:-1])
        torch.index_select(top_w.reshape(-1), 0, order, out=send[:, -1])
        recv = send.new_empty((perm.numel(), send.shape[1]))
        comm.all_to_all(recv, send, out_splits, in_splits, what="moe backward rows").wait()
        del send
        got = recv.index_select(0, perm)
        del recv
        # contiguous operands: the grouped kernels need aligned row strides, and both paths then run the same
        # GEMMs on the same layout (their results agree to the bit, tests/moe/test_moe_core.py)
        if kept:
            rows, gu = kept
        else:
            rows, gu = got[:, :h].contiguous(), None
        dy_rows, w_rows = got[:, -1 - h:-1].contiguous(), got[:, -1].contiguous()
        del got  # nothing views it any more: the received rows are freed before the expert GEMMs
        need_w = ctx.needs_input_grad[3]
        w = spec.layout.unpack(experts_shard)
        grad_shard = experts_shard.new_empty(experts_shard.shape) if need_w else None  # written whole, in place
        drows, dw, _ = experts_backward(rows, dy_rows, w_rows, w, ctx.groups, spec.glu, projections=gu,
                                        need_weight_grad=need_w,
                                        grad_into=spec.layout.unpack(grad_shard) if need_w else None)
        del rows, dy_rows
        ret_arrived = drows.new_empty((perm.numel(), h + 1))  # d rows and d weights back in arrival order
        ret_arrived[:, :h].index_copy_(0, perm, drows)
        ret_arrived[:, h].index_copy_(0, perm, dw)
        del drows, dw
        back = ret_arrived.new_empty((order.numel(), h + 1))
        comm.all_to_all(back, ret_arrived, in_splits, out_splits, what="moe backward row grads").wait()
        del ret_arrived
        dx = torch.zeros_like(x2d).index_add_(0, tok, back[:, :h])
        dw_flat = torch.empty_like(top_w.reshape(-1)).index_copy_(0, order, back[:, h])  # order: a permutation
        return dx, dw_flat.view_as(top_w), None, grad_shard, None, None, None
