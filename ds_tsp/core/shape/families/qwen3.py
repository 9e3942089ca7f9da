"""Qwen3 (Qwen3ForCausalLM): Llama's layer with a per-head RMSNorm of q and k (weights [head_dim], replicated) before
RoPE, head_dim 128 by default, and Qwen's sliding windows (ds_tsp.core.shape.families.qwen2)."""
from __future__ import annotations

from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only
from ds_tsp.core.shape.families.qwen2 import qwen_windows


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    fields = decoder_fields(cfg, head_dim=128)
    return {**fields, "qk_norm": True, "attention_windows": qwen_windows(cfg, fields["num_layers"])}


FAMILY = Family({"qwen3": "Qwen3ForCausalLM"}, read)
