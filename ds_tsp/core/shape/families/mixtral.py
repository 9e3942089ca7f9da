"""Mixtral (MixtralForCausalLM): every layer sparse, experts of intermediate_size, top-k always renormalised, rope
theta 1e6 and eps 1e-5 by default, one sliding window on every layer when set; router_jitter_noise > 0 multiplies
the router input by noise in training, which TSP does not implement (refused)."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, uniform_window
from ds_tsp.core.shape.families.qwen3_moe import moe_fields, routed_experts


def read(cfg: HFConfig) -> dict:
    experts = routed_experts(cfg)
    jitter = float(cfg.get("router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise TSPConfigError(f"router_jitter_noise={jitter}: router input noise is not supported (TSP routes "
                             "deterministically); set router_jitter_noise to 0.0")
    fields = decoder_fields(cfg, theta=1e6, eps=1e-5)
    return {**fields, "attention_windows": uniform_window(cfg, fields["num_layers"]),
            **moe_fields(cfg, experts, cfg.get("num_experts_per_tok", 2), cfg.get("intermediate_size"), True, ())}


FAMILY = Family({"mixtral": "MixtralForCausalLM"}, read)
