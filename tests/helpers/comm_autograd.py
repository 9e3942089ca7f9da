"""Differentiable one-call forms of the shard broadcast and a rank-order sequence all-gather, for the primitive tests
(a helper module, not a test file). The fused layers (ds_tsp.core.layers) post handle-level collectives
(ds_tsp.core.comm.primitives, ds_tsp.core.comm.kv_gather) to overlap transfers with compute; these wait at once.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm


class _BroadcastShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, owner, comm):
        ctx.owner, ctx.comm = owner, comm
        out = shard.detach().clone() if comm.rank == owner else torch.empty_like(shard)
        comm.broadcast(out, src=owner).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.reduce(grad, dst=ctx.owner).wait()
        return (grad if ctx.comm.rank == ctx.owner else None), None, None


def broadcast_shard(shard: torch.Tensor, owner: int, comm: TSPComm) -> torch.Tensor:
    """forward: broadcast from `owner`; backward: reduce (sum) to `owner` (others get no grad)."""
    return _BroadcastShard.apply(shard, owner, comm)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, comm):
        ctx.comm = comm
        out = local.new_empty((comm.size, *local.shape))
        comm.all_gather(out, local).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        ctx.comm.reduce_scatter(out, grad.contiguous()).wait()
        return out, None


def all_gather_sequence(local: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """forward: all-gather into [D, *local.shape] (rank order); backward: reduce-scatter (sum)."""
    return _GatherSequence.apply(local, comm)
