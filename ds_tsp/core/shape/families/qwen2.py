"""Qwen2 (Qwen2ForCausalLM): Llama's layer with a bias on q/k/v (o_proj has none), and Qwen's sliding windows (shared
with Qwen3 and Qwen3-MoE): with use_sliding_window, the layers layer_types marks sliding_attention (or, without
layer_types, the layers from max_window_layers on) see sliding_window keys."""
from __future__ import annotations

from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only, layer_type_windows


def qwen_windows(cfg: HFConfig, layers: int):
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(layers)]
    return layer_type_windows(cfg, layers, window, layer_types)


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    fields = decoder_fields(cfg)
    return {**fields, "qkv_bias": True, "attention_windows": qwen_windows(cfg, fields["num_layers"])}


FAMILY = Family({"qwen2": "Qwen2ForCausalLM"}, read)
