"""Single-device ground truth: the Llama-family causal LM every TSP test compares against.

Parameter names are exactly HF LlamaForCausalLM's (Qwen2ForCausalLM's with qkv_bias, Qwen3ForCausalLM's with
qk_norm), so
`hf_model.load_state_dict(full_state_dict(ref))` works both ways. Numerics follow HF's choices but never narrow a
wider dtype: RMSNorm and cross-entropy run in float32, or in the model dtype when that is float64; RoPE angles come
from ds_tsp.core.tokens.rope (float64 for float64 models). In float64 this model is the exactness reference.

    forward(input_ids [B, S], shift_labels [B, S], position_ids [B, S] | None) -> scalar loss
    shift_labels[b, t] is the target of position t (already shifted); -100 = ignored.
    loss = sum of per-token cross-entropy over non-ignored tokens / their count (0 when there are none).
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.positions import longrope_inv_freqs
from ds_tsp.core.tokens.rope import apply_rope, rope_cos_sin

IGNORE_INDEX = -100


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or the input dtype when it is wider (float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xw = x.to(_wide(x.dtype))
        xw = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xw.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, dtype=None, device=None, layer: int = 0):
        super().__init__()
        self.window = shape.layer_window(layer)
        h, d = shape.hidden_size, shape.dim_per_head
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=shape.qkv_bias, **kw)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias, **kw)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias, **kw)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False, **kw)
        if shape.qk_norm:  # Qwen3: RMSNorm over each head's dims, before RoPE
            self.q_norm = RMSNorm(d, shape.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, shape.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)  # [B, S, Hq, d]
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)  # [B, S, Hkv, d]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, d]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.window is None or self.window >= S:
            # Square (Lq == Lk) so SDPA's top-left causal alignment is the right one here.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5)
        else:  # sliding window, HF's rule: key s visible to query t iff t - window < s <= t (a reference: [S, S])
            t = torch.arange(S, device=x.device)
            visible = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - self.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, dtype=None, device=None):
        super().__init__()
        h, f = shape.hidden_size, shape.intermediate_size
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(h, f, **kw)
        self.up_proj = nn.Linear(h, f, **kw)
        self.down_proj = nn.Linear(f, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, dtype=None, device=None, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype, device)
        self.self_attn = Attention(shape, dtype, device, layer)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype, device)
        self.mlp = MLP(shape, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` submodule: embeddings, decoder layers, final norm."""

    def __init__(self, shape: ModelShape, dtype=None, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, shape.pad_token_id, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(DecoderLayer(shape, dtype, device, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype, device)


class ReferenceCausalLM(nn.Module):
    """The single-device causal LM TSP is checked against: the Llama-family model of a ModelShape, in plain torch,
    with the parameter names of transformers' checkpoints (full_state_dict gives its weights)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if shape.num_experts:
            raise TSPConfigError(f"num_experts={shape.num_experts}: the ds_tsp reference model is dense; check a "
                                 "mixture-of-experts model against transformers' own (ds-tsp verify --hf-model DIR)")
        if shape.attn_output_gate or shape.layer_types is not None or shape.zero_centred_norms:
            raise TSPConfigError("a hybrid (Qwen3.5 / Qwen3-Next) shape: the ds_tsp reference model is Llama-family; "
                                 "check a hybrid model against transformers' own (ds-tsp verify --hf-model DIR)")
        if shape.projection_qk_norm or shape.post_norms:
            raise TSPConfigError("projection_qk_norm / post_norms (OLMo 3): the ds_tsp reference model is "
                                 "Llama-family; check it against transformers' own (ds-tsp verify --hf-model DIR)")
        if shape.query_scale_beta:
            raise TSPConfigError("query_scale_beta (Ministral 3's position-scaled queries): the ds_tsp reference model "
                                 "does not scale queries; check it against transformers' own "
                                 "(ds-tsp verify --hf-model)")
        if shape.attention_sinks or shape.attention_out_bias:
            raise TSPConfigError("attention_sinks / attention_out_bias (GPT-OSS): the ds_tsp reference model has "
                                 "neither; check it against transformers' own (ds-tsp verify --hf-model DIR)")
        self.shape = shape
        self.model = Backbone(shape, dtype, device)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, dtype=dtype, device=device)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter, two state_dict names (like HF)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm output [B, S, h]."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        x = self.model.embed_tokens(input_ids)
        scaling = self.shape.rope_scaling
        longrope = (longrope_inv_freqs(self.shape.dim_per_head, self.shape.rope_theta, scaling).to(x.device)
                    if scaling is not None and scaling.switches_with_length else None)
        cos, sin = rope_cos_sin(position_ids, self.shape.dim_per_head, self.shape.rope_theta, x.dtype, scaling,
                                longrope=longrope)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, V] in the model dtype."""
        return self.lm_head(self.hidden_states(input_ids, position_ids))

    def forward(self, input_ids: torch.Tensor, shift_labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if shift_labels.shape != input_ids.shape:
            raise ValueError(f"shift_labels {tuple(shift_labels.shape)} must have input_ids' shape "
                             f"{tuple(input_ids.shape)}")
        logits = self.logits(input_ids, position_ids)
        logits = logits.to(_wide(logits.dtype))
        total = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        count = (shift_labels != IGNORE_INDEX).sum().clamp_min(1)
        return total / count


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic init, independent of thread count, parameter order, dtype and device.

    Each parameter draws from its own CPU generator seeded by (seed, name), in float64, then is cast:
    matrices and biases N(0, 0.02) (biases non-zero so bias gradients are exercised), norm weights 1 + 0.1 N(0, 1).
    A tied lm_head shares the embedding's values (named_parameters lists the Parameter once).
    """
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2 ** 63))
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise
        param.copy_(value)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named tensors (detached clones); a tied lm_head appears under both names, like HF's state_dict."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
