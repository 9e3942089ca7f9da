"""Rotary position embedding on GLOBAL positions, in the rotate-half convention of HF Llama."""
from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin: [B, L, head_dim] for position_ids [B, L].

    Angles are computed in float64 when the model runs in float64 (exactness), else in float32 like HF.
    """
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=angle_dtype, device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].to(angle_dtype) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, L, H, d]; cos/sin: [B, L, d]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def apply_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of apply_rope w.r.t. x: the rotation is orthogonal, so its transpose rotates by -angle."""
    return apply_rope(grad, cos, -sin)
