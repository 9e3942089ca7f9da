"""Rotary position embedding on GLOBAL positions, in the rotate-half convention of HF Llama.

Frequencies follow transformers exactly, rope type by rope type ("default", "linear", "llama3", "yarn",
"longrope", "proportional"): the
inverse frequencies are computed in float32 with the same operations transformers uses, so a checkpoint's
frequencies are bit-identical to what its own model computes. Angles (position * inv_freq) are then formed in
float64 for float64 models (the exactness reference) and in float32 otherwise, like HF; yarn's attention factor
scales cos and sin, as HF does.
"""
from __future__ import annotations

import math

import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             device: torch.device | str | None = None, longest: torch.Tensor | None = None,
             longrope: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [head_dim // 2] on `device`: the inverse frequencies transformers computes for this rope type.
    longrope: its [short, long] inverse frequencies [2, head_dim // 2] on `device`
    (ds_tsp.core.tokens.positions.longrope_inv_freqs), picked by longest, the batch's longest position + 1 (0-d)."""
    scaling = scaling or RopeScaling()
    if scaling.rope_type == "longrope":
        if longrope is None or longest is None:
            raise TSPConfigError("longrope frequencies need their [short, long] tables and the batch's longest "
                                 "position: pass longrope= and longest=")
        # picked on the device, so the step never reads the positions on the host
        return torch.where(longest > scaling.original_max_position_embeddings, longrope[1], longrope[0])
    base = _default_inv_freq(head_dim, theta, device)
    if scaling.rope_type == "default":
        return base
    if scaling.rope_type == "linear":
        return base / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(base, scaling)
    if scaling.rope_type == "proportional":
        return _proportional_inv_freq(base, scaling)
    return _yarn_inv_freq(head_dim, theta, scaling, device)


def attention_scaling(scaling: RopeScaling | None) -> float:
    """The factor HF multiplies cos and sin by (1 except for yarn and longrope)."""
    if scaling is not None and scaling.rope_type == "longrope":
        return _longrope_attention_factor(scaling)
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = _yarn_factor(scaling)
    if scaling.mscale and scaling.mscale_all_dim:
        return float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
    return _yarn_mscale(factor)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None, longest: torch.Tensor | None = None,
                 longrope: torch.Tensor | None = None):
    """cos, sin: [B, L, head_dim] for position_ids [B, L].

    longrope only: `longrope`, its [short, long] inverse frequencies on the positions' device, and `longest`, the
    whole batch's longest position + 1 (0-d; None: position_ids are the whole batch, so it is theirs). A TSP rank
    holds a shard and passes the group's (ds_tsp.core.tokens.positions.longest_position)."""
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if scaling is not None and scaling.switches_with_length and longest is None:
        longest = position_ids.max() + 1
    # built on the positions' device: a host-made table would be one host-to-device copy per step
    freq = inv_freq(head_dim, theta, scaling, device=position_ids.device, longest=longest,
                    longrope=longrope).to(angle_dtype)
    freqs = position_ids[..., None].to(angle_dtype) * freq
    angles = torch.cat((freqs, freqs), dim=-1)
    mscale = attention_scaling(scaling)
    return (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, L, H, d]; cos/sin: [B, L, r], r <= d: the first r dims of every head rotate (partial rotary, as
    transformers' Qwen3.5 / GLM apply_rotary_pos_emb), the other d - r pass through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def apply_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of apply_rope w.r.t. x: x*cos + R(x)*sin with R^T = -R, so the transpose uses -sin.

    (The rotation is only orthogonal when cos^2 + sin^2 == 1; with yarn's attention factor it is a scaled
    rotation, whose transpose is still this.)
    """
    return apply_rope(grad, cos, -sin)


def query_scale(position_ids: torch.Tensor, beta: float, period: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, L, 1, 1]: each query's scale after RoPE, 1 + beta * log(1 + floor(position / period)) (Ministral 3,
    transformers' llama_4_scaling_beta), in float32 as transformers computes it, then cast to the model's dtype."""
    scale = 1 + beta * torch.log(1 + torch.floor(position_ids / period))
    return scale.to(dtype)[:, :, None, None]


# --- the rope types, in transformers' float32 arithmetic ----------------------------------------------------

def _default_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32)
                            / head_dim))


def _llama3_inv_freq(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_freq_wavelen, base / s.factor, base)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor -
                                                                                   s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _proportional_inv_freq(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Gemma 4: the default frequencies of the whole head (exponents over head_dim) for the first
    int(partial_rotary_factor * head_dim // 2) pairs, 0 for the others (cos 1, sin 0: they pass through)."""
    head_dim = 2 * base.shape[0]
    angles = int((1.0 if s.partial_rotary_factor is None else s.partial_rotary_factor) * head_dim // 2)
    freq = torch.cat((base[:angles], torch.zeros(head_dim // 2 - angles, dtype=base.dtype, device=base.device)))
    return freq / (1.0 if s.factor is None else s.factor)


def _longrope_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    factor = s.factor if s.factor is not None else s.max_position_embeddings / s.original_max_position_embeddings
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings))


def _yarn_factor(s: RopeScaling) -> float:
    return s.factor if s.factor is not None else s.max_position_embeddings / s.original_max_position_embeddings


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling, device=None) -> torch.Tensor:
    """YaRN: interpolate low frequencies by factor, keep high ones, a linear ramp over the dims in between."""
    factor = _yarn_factor(s)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times into the original context
        return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).to(torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep
