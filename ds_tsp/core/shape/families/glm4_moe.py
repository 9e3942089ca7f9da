"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM, model_type glm4_moe): Llama's attention with q/k/v biases when
attention_bias (o_proj has none), per-head q/k norms when use_qk_norm, partial rotary (the first
partial_rotary_factor of every head, 0.5 by default, rotate_half within it); the first first_k_dense_replace layers
have a dense SwiGLU of intermediate_size, the others n_routed_experts SwiGLU experts of moe_intermediate_size plus
shared experts (one SwiGLU of moe_intermediate_size * n_shared_experts, added unscaled) and grouped sigmoid routing
with a score-correction bias (ModelShape.moe_routing "sigmoid_grouped", ds_tsp.core.layers.moe.routing).

transformers' model adds no load-balancing loss (output_router_logits only returns the router logits), so neither
does TSP. The num_nextn_predict_layers multi-token-prediction layers (model.layers.{num_hidden_layers + i}. of the
checkpoint) are not part of transformers' causal LM, which skips them when loading; TSP skips them too and does
not save them (ModelShape.mtp_layers).
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, no_window

_DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1,
             "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}


def _positive(cfg: HFConfig, key: str, minimum: int = 1) -> int:
    value = cfg.get(key, _DEFAULTS.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TSPConfigError(f"{key}={value!r} on a glm4_moe config: must be an integer >= {minimum}")
    return value


def read(cfg: HFConfig) -> dict:
    no_window(cfg)
    bias = bool(cfg.get("attention_bias", False))  # q/k/v only: decoder_fields refuses it for an o_proj bias
    fields = decoder_fields(cfg.with_values(attention_bias=False), eps=1e-5, partial_rotary=True)
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    experts, ffn = _positive(cfg, "n_routed_experts"), _positive(cfg, "moe_intermediate_size")
    dense = tuple(range(min(_positive(cfg, "first_k_dense_replace", 0), fields["num_layers"])))
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0
    return {**fields, "qkv_bias": bias, "qk_norm": bool(cfg.get("use_qk_norm", False)),
            "partial_rotary_factor": float(partial), "num_experts": experts,
            "num_experts_per_tok": _positive(cfg, "num_experts_per_tok"), "moe_intermediate_size": ffn,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "dense_mlp_layers": dense,
            "shared_expert_intermediate_size": ffn * _positive(cfg, "n_shared_experts"), "shared_expert_gate": False,
            "moe_routing": "sigmoid_grouped", "moe_groups": _positive(cfg, "n_group"),
            "moe_topk_groups": _positive(cfg, "topk_group"),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)), "mtp_layers": int(mtp)}


FAMILY = Family({"glm4_moe": "Glm4MoeForCausalLM"}, read)
