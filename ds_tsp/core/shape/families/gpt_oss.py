"""GPT-OSS (GptOssForCausalLM, model_type gpt_oss): alternating sliding-window and full layers (layer_types; by
default even layers slide, window 128), yarn RoPE (its truncate flag read), q/k/v AND o_proj biases
(attention_bias), a learned per-head attention sink in every softmax's denominator, and a mixture of experts on
every layer: a biased router whose top-k logits are softmaxed, experts held as fused 3D tensors with biases
(gate_up_proj [E, h, 2F] with gate / up interleaved, down_proj [E, F, h]) computing the clamped SwiGLU
(swiglu_alpha, swiglu_limit); the load-balancing loss joins the loss when output_router_logits.
Refused by name in this version: quantization_config (the released checkpoints are MXFP4: dequantize them to
bf16 first, e.g. transformers' Mxfp4Config(dequantize=True), and save that)."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, layer_type_windows
from ds_tsp.core.shape.families.qwen3_moe import moe_fields, routed_experts

# GptOssConfig.__post_init__'s rope block for a config that gives none
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def read(cfg: HFConfig) -> dict:
    if cfg.get("quantization_config") is not None:
        raise TSPConfigError("quantization_config on a gpt_oss config: TSP trains dense weights and does not read "
                             "MXFP4 (or other quantized) experts; dequantize the checkpoint first (load it with "
                             "transformers' Mxfp4Config(dequantize=True), save_pretrained in bf16) and convert that")
    experts = routed_experts(cfg.with_values(num_local_experts=cfg.get("num_local_experts", 128)))
    if experts < 1:
        raise TSPConfigError(f"num_local_experts={experts}: GPT-OSS has experts on every layer")
    bias = bool(cfg.get("attention_bias", True))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or _DEFAULT_ROPE
    # the shared reader refuses attention_bias (an o_proj bias): GPT-OSS's is read here; its MLP has no
    # hidden_act (the experts' clamped SwiGLU is fixed), so none is checked
    fields = decoder_fields(cfg.with_values(attention_bias=False, rope_parameters=rope, rope_scaling=None,
                                            max_position_embeddings=cfg.get("max_position_embeddings", 131072)),
                            head_dim=64, eps=1e-5, theta=150000.0, act=None)
    layers = fields["num_layers"]
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(layers)]
    windows = layer_type_windows(cfg, layers, cfg.get("sliding_window", 128), layer_types)
    ffn = fields["intermediate_size"]
    return {**fields, "qkv_bias": bias, "attention_out_bias": bias, "attention_sinks": True,
            "attention_windows": windows,
            **moe_fields(cfg, experts, cfg.get("num_experts_per_tok", 4), ffn, True, ()),
            "moe_biases": True, "expert_activation": "clamped_swiglu", "moe_routing": "topk_softmax",
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


FAMILY = Family({"gpt_oss": "GptOssForCausalLM"}, read)
