"""Differentiable one-call forms of the shard broadcast and the sequence all-gather, for the primitive tests (a
helper module, not a test file). The fused layers (ds_tsp.core.functions) use the handle-level primitives of
ds_tsp.core.comm_primitives directly, to overlap transfers with compute; these wait at once.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.comm_primitives import gather_sequence, scatter_sequence_grad


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
        out, handle = gather_sequence(comm, local)
        handle.wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        out, handle = scatter_sequence_grad(ctx.comm, grad.contiguous())
        handle.wait()
        return out, None


def all_gather_sequence(local: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """forward: all-gather into [D, *local.shape] (rank order); backward: reduce-scatter (sum)."""
    return _GatherSequence.apply(local, comm)
