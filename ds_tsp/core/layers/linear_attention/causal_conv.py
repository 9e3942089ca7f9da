"""The Gated DeltaNet's depthwise causal conv over both local zigzag chunks, with a written-out backward.

Per channel, with K taps and tap s reading the token s steps back (transformers' conv1d weight index K-1-s):

    acc[t] = sum_s w[K-1-s] * m_s[t] * ext[t - s]          ext = [the K-1 halo tokens | the chunk]

m_s is 1 where tap s stays inside the token's document (tap 0 always does), or absent. Autograd over the K shifted
slices of one concatenated [halo | chunk] tensor would, in backward, fill a zero tensor of that size per tap, copy
the tap's grad into its slice and sum the K of them: K full-size fills and K-1 full-size sums. Here each tap's grad
is added in place into the one chunk grad (and the small halo grad), and no concatenated copy is made either way.
The result and every grad are the same per-tap sums, tap 0 first, as the autograd version's (equal up to rounding:
a fused multiply-add may round once where a product and a sum round twice).
"""
from __future__ import annotations

import torch

_TOKENS = (0, 1, 2)  # [B, 2, c, C]: the weight grads sum over rows, chunks and tokens


class CausalConv(torch.autograd.Function):
    """acc [B, 2, c, C] of both local chunks [B, 2, c, C], their halos [B, 2, K-1, C] and the weight [C, K];
    tap_mask [B, 2, c, K] (1 where tap s is in the token's document) or None."""

    @staticmethod
    def forward(ctx, chunks, halo, weight, tap_mask):
        c, K = chunks.shape[2], weight.shape[1]
        acc = chunks * weight[:, K - 1]
        for s in range(1, K):
            w, n = weight[:, K - 1 - s], min(s, c)  # the first n tokens read the halo
            m = None if tap_mask is None else tap_mask[..., s, None].to(acc.dtype)
            if s < c:
                body = chunks[:, :, :c - s]
                acc[:, :, s:].addcmul_(body if m is None else body * m[:, :, s:], w)
            edge = halo[:, :, K - 1 - s:K - 1 - s + n]
            acc[:, :, :n].addcmul_(edge if m is None else edge * m[:, :, :n], w)
        ctx.save_for_backward(chunks, halo, weight, tap_mask)
        return acc

    @staticmethod
    def backward(ctx, d_acc):
        chunks, halo, weight, tap_mask = ctx.saved_tensors
        c, K = chunks.shape[2], weight.shape[1]
        d_chunks = d_acc * weight[:, K - 1]
        d_halo = torch.zeros_like(halo, dtype=d_chunks.dtype)
        d_weight = torch.empty_like(weight, dtype=d_acc.dtype)
        d_weight[:, K - 1] = (d_acc * chunks).sum(_TOKENS)
        for s in range(1, K):
            w, n = weight[:, K - 1 - s], min(s, c)
            m = None if tap_mask is None else tap_mask[..., s, None].to(d_acc.dtype)
            total = 0
            if s < c:
                g = d_acc[:, :, s:] if m is None else d_acc[:, :, s:] * m[:, :, s:]
                d_chunks[:, :, :c - s].addcmul_(g, w)
                total = (g * chunks[:, :, :c - s]).sum(_TOKENS)
            g = d_acc[:, :, :n] if m is None else d_acc[:, :, :n] * m[:, :, :n]
            edge = slice(K - 1 - s, K - 1 - s + n)
            d_halo[:, :, edge].addcmul_(g, w)
            d_weight[:, K - 1 - s] = total + (g * halo[:, :, edge]).sum(_TOKENS)
        return d_chunks.to(chunks.dtype), d_halo.to(halo.dtype), d_weight.to(weight.dtype), None


def causal_conv(chunks: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor,
                tap_mask: torch.Tensor | None) -> torch.Tensor:
    """The conv's pre-activation [B, 2, c, C] (see the module docstring; CausalConv)."""
    return CausalConv.apply(chunks, halo, weight, tap_mask)
