"""Attention sinks (GPT-OSS): a learned logit per query head in every softmax's denominator, with no value behind it.

Any attention path here returns a query row's output o and the log-sum-exp lse of its scaled scores (the kernels,
the masked and varlen pieces, the cp ring: each after its own merge). With the sink s of the row's head, the
softmax over [scores, s] with the sink's column dropped gives

    o' = o * g,    g = exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)

so the sink is applied once, to the merged (o, lse), and no kernel changes. Backward: a kernel backward handed
out = o', dout = dO' * g and the ORIGINAL lse returns the exact dq, dk, dv. It forms P = exp(S - lse) and
Dv = rowsum(dout * out) = g * rowsum(dO' * o'), so its dS = P * (dout V^T - Dv) = (g P) * (dO' V^T - rowsum(dO' * o')),
which is the sinked softmax's own (its probabilities are g P, and the dropped sink column has no value). The sink's
own grad: d s = -sum over the rows of (1 - g) * rowsum(dO' * o') (the sink column's probability is 1 - g).

Shapes: out [B, L, H, d], lse [B, H, L] (the kernels' contract), sinks [H]; the gate is computed in lse's dtype
(float32, or float64 for float64 inputs).
"""
from __future__ import annotations

import torch


def _gate(lse: torch.Tensor, sinks: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """sigmoid(sign * (lse - sink)) as [B, L, H, 1]: g for sign 1, 1 - g for sign -1 (no cancellation)."""
    return torch.sigmoid(sign * (lse - sinks.to(lse.dtype)[:, None])).transpose(1, 2).unsqueeze(-1)


def sinks_forward(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinked output o' = o * sigmoid(lse - sink), in out's dtype."""
    return (out.to(lse.dtype) * _gate(lse, sinks)).to(out.dtype)


def sinks_backward(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dout to hand the kernel backward with out = o' and the original lse, d sinks [H]) from dO' and o'."""
    rows = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1, keepdim=True)  # rowsum(dO' * o') [B, L, H, 1]
    dsinks = -(_gate(lse, sinks, -1.0) * rows).sum(dim=(0, 1, 3))
    return (dout.to(lse.dtype) * _gate(lse, sinks)).to(dout.dtype), dsinks.to(sinks.dtype)
