"""RMSNorm with a replicated weight whose grad is summed over the TSP group (each rank saw other tokens).

`tsp_rms_norm` is a fused Function that saves only its input and the per-row rstd ([..., 1], compute dtype): plain
autograd over HF's formula keeps an fp32 copy of a bf16 input (twice) AND the normalised output as well. Measured
with saved_tensors_hooks for x [4096, 4096] bf16: 160 MiB packed (96 MiB of distinct storages) per call before,
32 MiB + 16 KiB now (x itself and rstd).
The weight it takes is the caller's already-wrapped one (`replicated_param`): the Function returns the weight grad of
this rank's tokens, and the wrapper's backward sums it over the group.

`rms_norm` / `rms_norm_backward` are the same norm's forward and backward written out, for fused layers (Qwen3's
per-head q/k norms inside the attention Function) that cannot run autograd over it.

zero_centred=True is the Qwen3.5 / Qwen3-Next RMSNorm: the weight w is stored zero-centred and the normalised rows
are multiplied by (1 + w) in the compute dtype (float32 or wider), rounded to the input dtype only at the end.
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.layers.amp import AUTOCAST_KEEP_DTYPE, apply_autocast


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, [..., 1] in the compute dtype."""
    xc = x.to(_compute_dtype(x.dtype))
    return torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)


def _normed_times_weight(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                         zero_centred: bool = False) -> torch.Tensor:
    # x * rstd is a fresh tensor: the weight multiplies it in place where the product keeps its dtype (the same
    # operation and rounding as the out-of-place product, one [..., h] temporary less)
    if weight is None:  # Gemma 4's v_norm: no scale, normalised in the compute dtype, rounded at the end
        return (x.to(rstd.dtype) * rstd).to(x.dtype)
    if zero_centred:  # HF Qwen3_5RMSNorm: (x_hat * (1 + w)) in the compute dtype, then rounded to the input dtype
        return (x.to(rstd.dtype) * rstd).mul_(1.0 + weight.to(rstd.dtype)).to(x.dtype)
    # HF LlamaRMSNorm: the normalised rows are rounded to the input dtype BEFORE the weight multiplies them
    normed = (x.to(rstd.dtype) * rstd).to(x.dtype)
    return normed.mul_(weight) if torch.result_type(normed, weight) == normed.dtype else weight * normed


def _backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """With n = x * r, r = rstd: dx = r * (dn - n * mean(dn * n)), dn = dy * weight; dweight = sum dy * n
    (zero-centred: the scale is 1 + weight, all in the compute dtype). The row-sized steps after dn run in place in
    n's and dn's own buffers (fresh tensors here, never x or dy): the same operations in the same order as the
    formula, so the same bits, with three [..., h] temporaries instead of seven."""
    n = x.to(rstd.dtype) * rstd
    if weight is None:
        dweight, dn = None, dy.to(rstd.dtype, copy=True)
    elif zero_centred:
        dyc = dy.to(rstd.dtype)
        dweight = (dyc * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dn = dyc * (1.0 + weight.to(rstd.dtype))
    else:
        dweight = (dy * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        dn = (dy * weight).to(rstd.dtype)
    mean = (dn * n).mean(-1, keepdim=True)
    dx = dn.sub_(n.mul_(mean)).mul_(rstd)
    return dx.to(x.dtype), dweight


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """HF Llama's RMSNorm (zero_centred: Qwen3.5's; weight None: no scale, Gemma 4's v_norm), computed in float32
    or in the input dtype if that is wider (plain ops, no Function)."""
    return _normed_times_weight(x, _rstd(x, eps), weight, zero_centred)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      eps: float, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight) of rms_norm(x, weight, eps, zero_centred) for upstream grad dy; dweight sums over every
    leading dim (None without a weight)."""
    return _backward(dy, x, _rstd(x, eps), weight, zero_centred)


class _TSPRMSNorm(torch.autograd.Function):
    """Saves exactly (x, rstd): the weight is a parameter (kept by reference, not an activation to save)."""

    AUTOCAST = AUTOCAST_KEEP_DTYPE  # autocast's fp32 list: the norm computes in fp32 whatever autocast says

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centred: bool = False):
        rstd = _rstd(x, eps)
        # detach: a view of the parameter's storage, not a reference to the autograd graph that produced it
        ctx.weight, ctx.zero_centred = weight.detach(), zero_centred
        ctx.save_for_backward(x, rstd)
        return _normed_times_weight(x, rstd, weight, zero_centred)

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        dx, dweight = _backward(dy, x, rstd, ctx.weight, ctx.zero_centred)
        return dx, (dweight if ctx.needs_input_grad[1] else None), None, None


def tsp_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """forward: HF's RMSNorm of x [..., h] with weight [h] (zero_centred: Qwen3.5's (1 + w) form); backward: dx,
    and dweight summed over this rank's tokens (wrap a replicated weight with replicated_param first to sum it over
    the group)."""
    return apply_autocast(_TSPRMSNorm, x.device.type, x, weight, eps, zero_centred)


class TSPRMSNorm(nn.Module):
    """zero_centred: the weight starts at 0 and scales by (1 + w) (Qwen3.5 / Qwen3-Next); else starts at 1."""

    def __init__(self, hidden: int, eps: float, comm: TSPComm, dtype=None, device=None, zero_centred: bool = False):
        super().__init__()
        init = torch.zeros if zero_centred else torch.ones
        self.weight = nn.Parameter(init(hidden, dtype=dtype, device=device))
        self.eps, self.comm, self.zero_centred = eps, comm, zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tsp_rms_norm(x, replicated_param(self.weight, self.comm), self.eps, self.zero_centred)

    def extra_repr(self) -> str:
        centred = ", zero_centred (1 + w)" if self.zero_centred else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{centred}, replicated over tsp={self.comm.size}"
