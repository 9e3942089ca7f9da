"""LM head fused with cross-entropy, streaming vocab shards: the [tokens, vocab] logits never exist.

Per ring step rank p computes logits of its local tokens against one vocab shard, one tile of at most
`chunk_tokens` tokens at a time ([chunk_tokens, Vd] is the largest transient, whatever S and V are), folds them
into a running log-sum-exp and picks the target logit when the target falls in that shard. Backward
recomputes each shard's logits from the saved input and log-sum-exp; the weight grad rides the ring home (a
frozen head: the shards ride it for dx alone, no grad buffer travels).

Loss normalisation: each rank returns sum(local token losses) / (valid tokens in the whole TSP group), so the
per-rank losses add up to the mean loss and the sharded weight grads add up to the true mean-loss gradient. The
Function returns the SUM and the wrapper divides outside it: under autocast the Function's floating-point inputs are
cast to the autocast dtype, and a bf16 token count would round (257 -> 256).

Autocast (ds_tsp.core.layers.amp, AUTOCAST_LOW_PRECISION): x and the vocab shard are cast to the autocast dtype
once, on entry, so the logits GEMMs run in it and the ring carries the cast shard (half the bytes of fp32 master
weights); each logits tile is then upcast (`_shard_logits`), so log-sum-exp, softmax and cross-entropy stay in
float32 as they do in eager autocast (HF upcasts logits before its loss).
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ring_backward, ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast


def _shard_logits(x2d, shard, owner, vocab_size, compute_dtype, softcap: float | None = None):
    rows = shard.shape[0]
    logits = (x2d @ shard.t()).to(compute_dtype)
    if softcap is not None:  # Gemma's final_logit_softcapping: cap * tanh(logits / cap), before the padding mask
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    pad = min((owner + 1) * rows - vocab_size, rows)  # a shard can be ALL padding when V is tiny next to D
    if pad > 0:  # rows past the real vocabulary (padding to a multiple of D) never win
        logits[:, rows - pad:] = float("-inf")
    return logits


def _softcap_backward_(dlogits, logits, softcap: float | None):
    """In place: d raw logits from d capped ones, d(cap tanh(z / cap))/dz = 1 - (capped / cap)^2 (0 on the padding
    rows, whose capped logits are -inf and whose grads are 0)."""
    if softcap is None:
        return dlogits
    factor = logits.div(softcap).square_().neg_().add_(1.0)
    return dlogits.mul_(factor.masked_fill_(torch.isneginf(logits), 0.0))


def _token_tiles(n_tokens: int, chunk_tokens: int):
    """Slices of at most chunk_tokens rows: the [tokens, V/D] logits are built one tile at a time."""
    return [slice(t, min(t + chunk_tokens, n_tokens)) for t in range(0, n_tokens, chunk_tokens)]


class _TSPLMHeadLoss(torch.autograd.Function):
    """Sum over this rank's valid tokens of -log p(label): float32 (or wider) whatever x's dtype."""

    AUTOCAST = AUTOCAST_LOW_PRECISION  # the logits GEMMs; the CE itself is upcast per tile in any case

    @staticmethod
    def forward(ctx, x, vocab_shard, shift_labels, vocab_size: int, comm: TSPComm, chunk_tokens: int,
                softcap: float | None = None):
        h = x.shape[-1]
        x2d, labels = x.reshape(-1, h), shift_labels.reshape(-1)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        rows = vocab_shard.shape[0]
        running_max = torch.full(labels.shape, float("-inf"), dtype=compute_dtype, device=x.device)
        running_sum = torch.zeros(labels.shape, dtype=compute_dtype, device=x.device)
        target = torch.zeros(labels.shape, dtype=compute_dtype, device=x.device)
        tiles = _token_tiles(labels.numel(), chunk_tokens)

        def step(owner, shard):
            for t in tiles:
                logits = _shard_logits(x2d[t], shard, owner, vocab_size, compute_dtype, softcap)
                old_max = running_max[t]
                new_max = torch.maximum(old_max, logits.max(dim=1).values)
                # -inf until a shard with real rows came by (all-padding shards first): exp(-inf - -inf) is NaN
                shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
                picked = logits.gather(1, (labels[t] - owner * rows).clamp(0, rows - 1)[:, None]).squeeze(1)
                sum_exp = logits.sub_(shift[:, None]).exp_().sum(dim=1)  # in place: one tile-sized buffer
                running_sum[t] = running_sum[t] * torch.exp(old_max - shift) + sum_exp
                running_max[t] = new_max
                local = labels[t] - owner * rows
                hit = (local >= 0) & (local < rows)
                target[t] = torch.where(hit, picked, target[t])  # no device-to-host sync inside the ring
                del logits  # before the next tile is built: else two tiles are live at once

        ring_forward(comm, vocab_shard, step)
        lse = running_max + torch.log(running_sum)
        valid = labels != -100
        total = ((lse - target) * valid).sum()
        ctx.vocab_size, ctx.comm, ctx.tiles, ctx.softcap = vocab_size, comm, tiles, softcap
        ctx.save_for_backward(x, vocab_shard, shift_labels, lse)
        return total  # float32 (or wider): a bf16 share would round the sum of shares and the logged loss

    @staticmethod
    def backward(ctx, dtotal):
        x, vocab_shard, shift_labels, lse = ctx.saved_tensors
        labels = shift_labels.reshape(-1)
        coef = (labels != -100).to(lse.dtype) * dtotal.to(lse.dtype)
        dx, grad_shard = softmax_ce_backward_ring(ctx.comm, x, vocab_shard, labels, lse, coef, ctx.tiles,
                                                  ctx.vocab_size, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                  ctx.softcap)
        return dx, grad_shard, None, None, None, None, None


def softmax_ce_backward_ring(comm: TSPComm, x: torch.Tensor, vocab_shard: torch.Tensor, labels: torch.Tensor,
                             lse: torch.Tensor, coef: torch.Tensor, tiles, vocab_size: int, need_x: bool,
                             need_w: bool, softcap: float | None = None) -> tuple[torch.Tensor | None,
                                                                                 torch.Tensor | None]:
    """(dx, d vocab_shard) of sum_t coef[t] * (lse[t] - logit[t, label[t]]) with the vocab shards passed around
    the ring, logits rebuilt one tile at a time (the loss and TRL's per-token log-probs share it); softcap: the
    logits are cap * tanh(raw / cap). A frozen head (need_w False) sends its shards around for dx only: no grad
    buffer travels with them."""
    h = x.shape[-1]
    x2d = x.reshape(-1, h)
    rows = vocab_shard.shape[0]
    dx2d = torch.zeros_like(x2d) if need_x else None

    def step(owner, shard):
        grad = torch.zeros_like(shard) if need_w else None
        for t in tiles:
            logits = _shard_logits(x2d[t], shard, owner, vocab_size, lse.dtype, softcap)
            capped = logits.clone() if softcap is not None else None  # the tanh derivative reads them
            dlogits = logits.sub_(lse[t, None]).exp_()  # softmax, in place in the tile's logits
            local = labels[t] - owner * rows
            hit = (local >= 0) & (local < rows)
            dlogits.scatter_add_(1, local.clamp(0, rows - 1)[:, None], -hit.to(dlogits.dtype)[:, None])
            dlogits = _softcap_backward_(dlogits.mul_(coef[t, None]), capped, softcap).to(x.dtype)
            if need_x:
                dx2d[t].addmm_(dlogits, shard)
            if need_w:
                grad.addmm_(dlogits.t(), x2d[t])
            del logits, dlogits, capped  # before the next tile is built
        return grad

    if need_w:
        grad_shard = ring_backward(comm, vocab_shard, step)
    else:
        ring_forward(comm, vocab_shard, step)
        grad_shard = None
    return (dx2d.view_as(x) if need_x else None), grad_shard


def tsp_lm_head_loss(x: torch.Tensor, vocab_shard: torch.Tensor, shift_labels: torch.Tensor,
                     n_valid_total: torch.Tensor, vocab_size: int, comm: TSPComm,
                     chunk_tokens: int = 4096, softcap: float | None = None) -> torch.Tensor:
    """This rank's share of the mean next-token loss (labels already shifted; -100 ignored).

    chunk_tokens bounds the largest transient: logits are built [<= chunk_tokens, V/D] at a time; softcap (Gemma's
    final_logit_softcapping): the loss of cap * tanh(logits / cap).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: must be an integer >= 1")
    total = apply_autocast(_TSPLMHeadLoss, x.device.type, x, vocab_shard, shift_labels, vocab_size, comm, chunk_tokens,
                           softcap)
    return total / n_valid_total
