"""Ministral 3 (Ministral3ForCausalLM): Mistral's layer with yarn RoPE and position-scaled queries (transformers'
llama_4_scaling_beta): after RoPE each query is multiplied by 1 + beta * log(1 + floor(position /
original_max_position_embeddings)), so a query beyond the original context sharpens its attention
(ModelShape.query_scale_beta / query_scale_period; the attention layers apply it). One sliding window on every
layer when the config sets one. The multimodal Mistral3ForConditionalGeneration (Pixtral tower) is not read here."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only, uniform_window

# Ministral3Config.__post_init__'s rope when a config gives none
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    rope = dict(cfg.get("rope_parameters") or {}) or dict(DEFAULT_ROPE)
    rope.pop("max_position_embeddings", None)  # transformers keeps it there too; the config's own field is read
    beta = float(rope.pop("llama_4_scaling_beta", None) or 0.0)
    period = rope.get("original_max_position_embeddings")
    if beta and not period:
        raise TSPConfigError(f"rope_parameters.llama_4_scaling_beta={beta} without original_max_position_embeddings: "
                             "the query scale's period is that field; set it")
    longest = cfg.get("max_position_embeddings", 262144)
    fields = decoder_fields(cfg.with_values(rope_parameters=rope, max_position_embeddings=longest), head_dim=128,
                            eps=1e-5, theta=1e6, pad_token_id=11)
    return {**fields, "attention_windows": uniform_window(cfg, fields["num_layers"]),
            "query_scale_beta": beta, "query_scale_period": int(period) if beta else 0}


FAMILY = Family({"ministral3": "Ministral3ForCausalLM"}, read)
