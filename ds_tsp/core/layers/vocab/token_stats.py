"""Per-token log-probabilities through the streaming LM head, and their all-gather to the full sequence.

What TRL's fused LM head (`model(..., fused_lm_head=True)`, SFTTrainer's loss) asks of a model, under TSP: for every
next-token label, its log-probability (with a gradient), the entropy of the next-token distribution and whether the
label is the argmax (metrics), without ever building [tokens, vocab] logits or a full LM-head weight.

`tsp_token_stats`: the same ring over vocab shards and [<= chunk_tokens, V/D] tiles as lm_head_loss.py, keeping per
token a running max, sum of exp and sum of exp * logit (online log-sum-exp), and the target logit. Output, for this
rank's tokens: float32 [4, *labels.shape] = (log_prob, entropy, is_top1, label_mask), zero where the label is -100;
with logit_stats=True two more rows, [6, ...]: the mean logit over the real vocabulary (each shard's sum of its
real rows, summed around the ring, / V) and log sum_v p_v^2 (a running sum of exp(2 (logit - max)), rescaled by the
square of the max's shift), TRL's mean_logits and log_sum_sq_probs (DPO's logits/* metrics, WPO weights).
Only row 0 carries a gradient: d logit_j = g * (1[j = target] - p_j), recomputed per tile from the saved
log-sum-exp, the weight grad riding the ring home (lm_head_loss.py's backward with a per-token coefficient).

`gather_token_stats`: every rank's [K, B, L] -> [K, B, S] in global token order (zigzag undone, padding cut), on
every rank. Each rank then computes the same function of it (an HF loss), so every rank gets the same gradient
and keeps its own tokens' slice: no communication in backward (a reduce-scatter would count it D times).

Autocast (ds_tsp.core.layers.amp): the stats Function is AUTOCAST_LOW_PRECISION like the loss (the logits GEMMs
in the autocast dtype on the cast x and shard, the statistics from float32 tiles); the gather moves data only.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_KEEP_DTYPE, AUTOCAST_LOW_PRECISION, apply_autocast
from ds_tsp.core.layers.vocab.loss import _shard_logits, _token_tiles, softmax_ce_backward_ring
from ds_tsp.core.tokens.zigzag import pad_to, rank_order_to_global_index, shard

LOG_PROB, ENTROPY, IS_TOP1, LABEL_MASK, MEAN_LOGIT, LOG_SUM_SQ_PROBS = range(6)


class _TSPLMHeadTokenStats(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # the logits GEMMs; stats come from float32 tiles in any case

    @staticmethod
    def forward(ctx, x, vocab_shard, shift_labels, vocab_size: int, comm: TSPComm, chunk_tokens: int,
                softcap: float | None = None, logit_stats: bool = False):
        h = x.shape[-1]
        x2d, labels = x.reshape(-1, h), shift_labels.reshape(-1)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        rows = vocab_shard.shape[0]
        n = labels.numel()
        running_max = torch.full((n,), float("-inf"), dtype=compute_dtype, device=x.device)
        running_sum = torch.zeros(n, dtype=compute_dtype, device=x.device)
        running_xsum = torch.zeros(n, dtype=compute_dtype, device=x.device)  # sum exp(l - max) * l
        target = torch.zeros(n, dtype=compute_dtype, device=x.device)
        if logit_stats:
            running_zsum = torch.zeros(n, dtype=compute_dtype, device=x.device)  # sum of the real rows' logits
            running_sqsum = torch.zeros(n, dtype=compute_dtype, device=x.device)  # sum exp(2 (l - max))
        tiles = _token_tiles(n, chunk_tokens)

        def step(owner, shard):
            for t in tiles:
                logits = _shard_logits(x2d[t], shard, owner, vocab_size, compute_dtype, softcap)
                old_max = running_max[t]
                new_max = torch.maximum(old_max, logits.max(dim=1).values)
                shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
                local = labels[t] - owner * rows
                hit = (local >= 0) & (local < rows)
                picked = logits.gather(1, local.clamp(0, rows - 1)[:, None]).squeeze(1)
                finite = logits.masked_fill(torch.isneginf(logits), 0.0)  # padded vocab rows: exp 0, logit 0
                e = logits.sub_(shift[:, None]).exp_()
                scale = torch.exp(old_max - shift)
                running_sum[t] = running_sum[t] * scale + e.sum(dim=1)
                running_xsum[t] = running_xsum[t] * scale + (e * finite).sum(dim=1)
                if logit_stats:
                    running_zsum[t] = running_zsum[t] + finite.sum(dim=1)
                    running_sqsum[t] = running_sqsum[t] * scale * scale + (e * e).sum(dim=1)
                running_max[t] = new_max
                target[t] = torch.where(hit, picked, target[t])
                del logits, finite, e

        ring_forward(comm, vocab_shard, step)
        lse = running_max + torch.log(running_sum)
        valid = labels != -100
        zero = torch.zeros_like(lse)
        rows = [torch.where(valid, target - lse, zero), torch.where(valid, lse - running_xsum / running_sum, zero),
                (valid & (target >= running_max)).to(compute_dtype), valid.to(compute_dtype)]
        if logit_stats:
            rows += [torch.where(valid, running_zsum / vocab_size, zero),
                     torch.where(valid, torch.log(running_sqsum) - 2 * torch.log(running_sum), zero)]
        stats = torch.stack(rows)
        ctx.vocab_size, ctx.comm, ctx.tiles, ctx.softcap = vocab_size, comm, tiles, softcap
        ctx.save_for_backward(x, vocab_shard, shift_labels, lse)
        return stats.view(len(rows), *shift_labels.shape)

    @staticmethod
    def backward(ctx, dstats):
        x, vocab_shard, shift_labels, lse = ctx.saved_tensors
        labels = shift_labels.reshape(-1)
        # loss = f(log_prob), log_prob = target - lse: d logit_j = -g * (p_j - 1[j = target])
        coef = -(dstats[LOG_PROB].reshape(-1).to(lse.dtype)) * (labels != -100).to(lse.dtype)
        dx, grad_shard = softmax_ce_backward_ring(ctx.comm, x, vocab_shard, labels, lse, coef, ctx.tiles,
                                                  ctx.vocab_size, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                  ctx.softcap)
        return dx, grad_shard, None, None, None, None, None, None


def tsp_token_stats(x: torch.Tensor, vocab_shard: torch.Tensor, shift_labels: torch.Tensor, vocab_size: int,
                    comm: TSPComm, chunk_tokens: int = 4096, softcap: float | None = None,
                    logit_stats: bool = False) -> torch.Tensor:
    """float32 [4, *shift_labels.shape]: (log_prob, entropy, is_top1, label_mask) of this rank's tokens (labels
    already shifted; -100 rows all zero), of the soft-capped logits under softcap; logit_stats=True adds
    (mean_logit, log_sum_sq_probs): [6, ...]. Only log_prob (row LOG_PROB) has a gradient."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: must be an integer >= 1")
    return apply_autocast(_TSPLMHeadTokenStats, x.device.type, x, vocab_shard, shift_labels, vocab_size, comm,
                          chunk_tokens, softcap, logit_stats)


class _GatherTokens(torch.autograd.Function):
    AUTOCAST = AUTOCAST_KEEP_DTYPE  # data movement: float32 stats stay float32

    @staticmethod
    def forward(ctx, local, comm: TSPComm, seq_len: int):
        *lead, L = local.shape
        out = local.new_empty((comm.size, *local.shape))
        comm.all_gather(out, local.contiguous(), what="per-token stats gather").wait()
        ranked = out.movedim(0, -2).reshape(*lead, comm.size * L)  # rank order along the sequence
        index = rank_order_to_global_index(comm.size * L, comm.size, device=local.device)
        ctx.comm, ctx.padded = comm, comm.size * L
        return ranked.index_select(-1, index)[..., :seq_len]

    @staticmethod
    def backward(ctx, grad):
        padded = pad_to(grad, ctx.padded, 0.0, dim=grad.dim() - 1)
        return shard(padded, ctx.comm.size, ctx.comm.rank, dim=grad.dim() - 1).contiguous(), None, None


def gather_token_stats(local: torch.Tensor, comm: TSPComm, seq_len: int) -> torch.Tensor:
    """forward: every rank's zigzag shard [..., S_pad/D] -> [..., seq_len] in global order, on every rank;
    backward: this rank's slice of the (replicated) gradient, no communication."""
    return apply_autocast(_GatherTokens, local.device.type, local, comm, seq_len)
