"""RMSNorm with a replicated weight whose grad is summed over the TSP group (each rank saw other tokens)."""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.comm import TSPComm, replicated_param


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm, computed in float32 or in the input dtype if that is wider."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute_dtype)
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


class TSPRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, comm: TSPComm, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.eps, self.comm = eps, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, replicated_param(self.weight, self.comm), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, replicated over tsp={self.comm.size}"
