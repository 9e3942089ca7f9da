"""RMSNorm with a replicated weight whose grad is summed over the TSP group (each rank saw other tokens).

`rms_norm_backward` is the same norm's backward written out, for fused layers (Qwen3's per-head q/k norms inside
the attention Function) that cannot run autograd over it.
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.comm_primitives import replicated_param


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm, computed in float32 or in the input dtype if that is wider."""
    xc = x.to(_compute_dtype(x.dtype))
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of rms_norm(x, weight, eps) for upstream grad dy; dweight sums over every leading dim.

    With n = x * r, r = rsqrt(mean(x^2) + eps): dx = r * (dn - n * mean(dn * n)), dn = dy * weight.
    """
    acc = _compute_dtype(x.dtype)
    xc = x.to(acc)
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    n = xc * r
    dweight = (dy * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
    dn = (dy * weight).to(acc)
    dx = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dweight


class TSPRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, comm: TSPComm, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.eps, self.comm = eps, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, replicated_param(self.weight, self.comm), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, replicated over tsp={self.comm.size}"
