"""Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5's hybrid layers (ds_tsp.core.shape.families.qwen3_5) in its own
checkpoint layout (per-key-head in_proj_qkvz / in_proj_ba), dense or MoE with a shared expert; its sparse layers are
picked by mlp_only_layers / decoder_sparse_step, the top-k renormalised when norm_topk_prob."""
from __future__ import annotations

from ds_tsp.core.shape.families.base import Family, HFConfig
from ds_tsp.core.shape.families.qwen3_5 import hybrid_fields, shared_expert_moe


def read(cfg: HFConfig) -> dict:
    moe = shared_expert_moe(cfg, cfg.get("num_hidden_layers"), sparse_layers_by_step=True, always_renormalise=False)
    return hybrid_fields(cfg, "qwen3_next", moe)


FAMILY = Family({"qwen3_next": "Qwen3NextForCausalLM"}, read)
