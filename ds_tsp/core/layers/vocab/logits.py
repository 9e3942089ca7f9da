"""Full-vocabulary logits of a FEW positions (HF's logits_to_keep): prefill and answer scoring under TSP.

The positions wanted ([B, k], the same slots for every row) live on whichever ranks hold them in the zigzag layout.
Forward: each rank scatters its selected hidden rows into a [B, k, h] buffer and one all-reduce (disjoint rows, so
a sum) gives every rank all k rows; each rank multiplies them by its vocab shard ([B, k, V/D]) and one all-gather
assembles [B, k, V]. Only k rows of logits are ever built, never [tokens, V].

The logits are replicated: like every other input of an HF-style loss they are identical on all TSP ranks, and
each rank must compute the same function of them. Backward then gets the same dlogits on every rank, so
    d(vocab shard p) = dlogits[:, :, shard p]^T @ rows      (local, no communication)
    d(rows)          = sum_p dlogits[:, :, shard p] @ shard p  (one all-reduce), then each rank keeps its rows.
Under autocast the GEMMs run in the autocast dtype (h and the shard cast on entry), and the logits come out in it,
as HF's lm_head Linear gives them under autocast.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast


class _SelectedLogits(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # a Linear: its GEMMs run in the autocast dtype

    @staticmethod
    def forward(ctx, h, vocab_shard, local_index, slots, k: int, vocab_size: int, comm: TSPComm):
        B, _, hidden = h.shape
        rows = h.new_zeros(B, k, hidden)
        rows[:, slots] = h[:, local_index]
        comm.all_reduce(rows, kind="logits_rows").wait()
        local_logits = rows @ vocab_shard.t()  # [B, k, V/D]
        gathered = local_logits.new_empty((comm.size, *local_logits.shape))
        comm.all_gather(gathered, local_logits).wait()
        ctx.save_for_backward(rows, vocab_shard, local_index, slots)
        ctx.comm, ctx.shape, ctx.vocab_size = comm, h.shape, vocab_size
        return gathered.permute(1, 2, 0, 3).reshape(B, k, -1)[..., :vocab_size]

    @staticmethod
    def backward(ctx, dlogits):
        rows, vocab_shard, local_index, slots = ctx.saved_tensors
        comm, rows_per_rank = ctx.comm, vocab_shard.shape[0]
        B, k, _ = dlogits.shape
        padded = dlogits.new_zeros(B, k, comm.size * rows_per_rank)
        padded[..., :ctx.vocab_size] = dlogits
        mine = padded.view(B, k, comm.size, rows_per_rank)[:, :, comm.rank]  # [B, k, V/D]
        d_shard = None
        if ctx.needs_input_grad[1]:  # a frozen head gets no grad
            d_shard = mine.reshape(-1, rows_per_rank).t() @ rows.reshape(-1, rows.shape[-1])
        if not ctx.needs_input_grad[0]:  # nothing below needs d(rows): skip the all-reduce (same on every rank)
            return None, d_shard, None, None, None, None, None
        d_rows = (mine @ vocab_shard).contiguous()
        comm.all_reduce(d_rows, kind="logits_rows").wait()
        dh = d_rows.new_zeros(ctx.shape)
        dh[:, local_index] = d_rows[:, slots]
        return dh, d_shard, None, None, None, None, None


def tsp_selected_logits(h: torch.Tensor, vocab_shard: torch.Tensor, local_index: torch.Tensor,
                        slots: torch.Tensor, k: int, vocab_size: int, comm: TSPComm) -> torch.Tensor:
    """[B, k, V] logits of k global positions. h: this rank's final hidden states [B, L, h]; local_index [n] are
    the local positions this rank holds among them and slots [n] their output slots in [0, k)."""
    return apply_autocast(_SelectedLogits, h.device.type, h, vocab_shard, local_index, slots, k, vocab_size, comm)
