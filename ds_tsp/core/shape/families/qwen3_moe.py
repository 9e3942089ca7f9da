"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention; layer i is sparse iff i is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0 (dense layers: a SwiGLU of intermediate_size), experts SwiGLUs of
moe_intermediate_size, softmax top-k routing renormalised when norm_topk_prob; router_aux_loss_coef x the
load-balancing loss joins the loss when output_router_logits. One sliding window on every layer with
use_sliding_window. The experts' rules beyond the config (E/D whole experts per rank): ds_tsp.core.shape.moe."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, uniform_window

# Fields other MoE families use that change the math (shared experts, scaled / grouped routing): never ignored.
REFUSED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "moe_layer_freq",
                      "first_k_dense_replace", "n_group", "topk_group", "topk_method", "scoring_func",
                      "moe_shared_expert_intermediate_size")


def routed_experts(cfg: HFConfig) -> int:
    """The expert count of a Qwen3-MoE / Mixtral config, its foreign MoE fields refused by name."""
    for key in REFUSED_MOE_FIELDS:
        cfg.refuse(key, "shared experts / grouped routing are not part of Qwen3-MoE or Mixtral and TSP does not "
                        "implement them; remove the field")
    scaling = cfg.get("routed_scaling_factor")
    if scaling not in (None, 1, 1.0):
        raise TSPConfigError(f"routed_scaling_factor={scaling!r}: scaled routing weights are not supported; remove it")
    experts = cfg.get("num_local_experts", None)
    experts = cfg.get("num_experts", 0) if experts is None else experts
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise TSPConfigError(f"num_experts={experts!r}: must be an integer >= 0")
    return experts


def moe_fields(cfg: HFConfig, experts: int, top_k: int, ffn: int, norm_topk_prob: bool, dense: tuple) -> dict:
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn,
                norm_topk_prob=norm_topk_prob, dense_mlp_layers=dense,
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(cfg.get("output_router_logits", False)))


def read(cfg: HFConfig) -> dict:
    experts = routed_experts(cfg)
    fields = decoder_fields(cfg)
    layers = fields["num_layers"]
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise TSPConfigError(f"decoder_sparse_step={step!r}: must be an integer >= 1 (every step-th layer is sparse)")
    mlp_only = set(cfg.get("mlp_only_layers", None) or ())
    dense = tuple(i for i in range(layers) if i in mlp_only or experts == 0 or (i + 1) % step)
    # Qwen3MoeConfig drops the window unless use_sliding_window
    windows = uniform_window(cfg, layers, default=4096, enabled=bool(cfg.get("use_sliding_window", False)))
    return {**fields, "qk_norm": True, "attention_windows": windows,
            **moe_fields(cfg, experts, cfg.get("num_experts_per_tok", 8), cfg.get("moe_intermediate_size", 768),
                         bool(cfg.get("norm_topk_prob", False)), dense)}


FAMILY = Family({"qwen3_moe": "Qwen3MoeForCausalLM"}, read)
