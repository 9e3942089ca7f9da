"""Vocab-sharded embedding: vocab shards stream around the ring and each rank picks the rows of its own tokens.

Rank p owns rows [p*Vd, (p+1)*Vd) of the (padded) table, Vd = ceil(V/D). Streaming the table (D-1 hops of
Vd*h) instead of all-gathering token ids and reduce-scattering partial rows keeps every temporary at O(S/D):
the gather alternative needs an [S, h] buffer on every rank.

padding_idx (transformers' nn.Embedding(padding_idx=config.pad_token_id)): that row's grad from the lookup is zero,
as torch's embedding backward leaves it; the owner zeroes it in its ring step (a host int, no sync).

The table's grad is accumulated in float32 (or the shard's dtype if wider) within each ring step: a bf16 grad row
that one frequent token adds to hundreds of times would otherwise round at every add. Each step's contribution is
cast to the shard's dtype as it leaves the step (the grad ring carries the parameter's dtype).
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ring_backward, ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_KEEP_DTYPE, apply_autocast


class _TSPEmbedding(torch.autograd.Function):
    AUTOCAST = AUTOCAST_KEEP_DTYPE  # a lookup: rows keep the table's dtype, as eager autocast leaves embedding

    @staticmethod
    def forward(ctx, input_ids, vocab_shard, comm: TSPComm, padding_idx: int | None):
        rows = vocab_shard.shape[0]
        out = vocab_shard.new_zeros((*input_ids.shape, vocab_shard.shape[1]))

        def step(owner, shard):
            # Masks with torch.where rather than boolean indexing: no device-to-host sync inside the ring.
            local = input_ids - owner * rows
            hit = (local >= 0) & (local < rows)
            out.copy_(torch.where(hit[..., None], shard[local.clamp(0, rows - 1)], out))

        ring_forward(comm, vocab_shard, step)
        ctx.comm, ctx.padding_idx = comm, padding_idx
        ctx.save_for_backward(input_ids, vocab_shard)
        return out

    @staticmethod
    def backward(ctx, dout):
        input_ids, vocab_shard = ctx.saved_tensors
        rows, h = vocab_shard.shape
        acc = torch.promote_types(vocab_shard.dtype, torch.float32)
        dout_acc = dout.reshape(-1, h).to(acc)  # once for all ring steps (no copy when already acc)

        def step(owner, shard):
            local = (input_ids - owner * rows).reshape(-1)
            hit = (local >= 0) & (local < rows)
            # tokens of other shards add to a scratch row past the end: no masked [tokens, h] copy of dout, and
            # torch.where instead of boolean indexing keeps the ring free of device-to-host syncs
            grad = torch.zeros((rows + 1, h), dtype=acc, device=shard.device)
            grad.index_add_(0, torch.where(hit, local, rows), dout_acc)
            pad = None if ctx.padding_idx is None else ctx.padding_idx - owner * rows
            if pad is not None and 0 <= pad < rows:
                grad[pad] = 0
            return grad[:rows].to(shard.dtype)

        return None, ring_backward(ctx.comm, vocab_shard, step), None, None


def tsp_embedding(input_ids: torch.Tensor, vocab_shard: torch.Tensor, comm: TSPComm,
                  padding_idx: int | None = None) -> torch.Tensor:
    """[B, L] local token ids -> [B, L, h] rows of the vocab-sharded table; padding_idx: the row whose grad stays
    zero (torch's nn.Embedding(padding_idx=...))."""
    return apply_autocast(_TSPEmbedding, vocab_shard.device.type, input_ids, vocab_shard, comm, padding_idx)
