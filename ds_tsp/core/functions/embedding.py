"""Vocab-sharded embedding: vocab shards stream around the ring and each rank picks the rows of its own tokens.

Rank p owns rows [p*Vd, (p+1)*Vd) of the (padded) table, Vd = ceil(V/D). Streaming the table (D-1 hops of
Vd*h) instead of all-gathering token ids and reduce-scattering partial rows keeps every temporary at O(S/D):
the gather alternative needs an [S, h] buffer on every rank.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.comm_primitives import ring_backward, ring_forward


class _TSPEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_ids, vocab_shard, comm: TSPComm):
        rows = vocab_shard.shape[0]
        out = vocab_shard.new_zeros((*input_ids.shape, vocab_shard.shape[1]))

        def step(owner, shard):
            # Masks with torch.where rather than boolean indexing: no device-to-host sync inside the ring.
            local = input_ids - owner * rows
            hit = (local >= 0) & (local < rows)
            out.copy_(torch.where(hit[..., None], shard[local.clamp(0, rows - 1)], out))

        ring_forward(comm, vocab_shard, step)
        ctx.comm = comm
        ctx.save_for_backward(input_ids, vocab_shard)
        return out

    @staticmethod
    def backward(ctx, dout):
        input_ids, vocab_shard = ctx.saved_tensors
        rows = vocab_shard.shape[0]
        dout = dout.contiguous()

        def step(owner, shard):
            local = input_ids - owner * rows
            hit = (local >= 0) & (local < rows)
            grad = torch.zeros_like(shard)
            grad.index_add_(0, local.clamp(0, rows - 1).reshape(-1),
                            (dout * hit[..., None]).reshape(-1, dout.shape[-1]))
            return grad

        return None, ring_backward(ctx.comm, vocab_shard, step), None


def tsp_embedding(input_ids: torch.Tensor, vocab_shard: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """[B, L] local token ids -> [B, L, h] rows of the vocab-sharded table."""
    return _TSPEmbedding.apply(input_ids, vocab_shard, comm)
