"""Qwen3.5 dense and MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; the language model of the multimodal
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, read through its text_config) and the
reading they share with Qwen3-Next (ds_tsp.core.shape.families.qwen3_next): hybrid models whose layers are Gated
DeltaNet linear attention or gated full attention.

transformers' rules, mirrored here (models/{qwen3_5,qwen3_5_moe,qwen3_next}/configuration_*.py of transformers 5):
* layer_types: per layer "linear_attention" (Gated DeltaNet) or "full_attention"; when absent, every
  full_attention_interval-th layer (default 4) is full attention, the others linear.
* Full-attention layers are gated (q_proj emits [q, gate] per head), rotate the first partial_rotary_factor of every
  head (default 0.25 when the config omits it) and q/k-normalise every head; every RMSNorm of these families except
  the Gated DeltaNet's output norm is zero-centred (x_hat * (1 + w)).
* mrope (rope_parameters.mrope_section / mrope_interleaved): text positions give the three rows (t, h, w) the same
  position, so the interleaved frequencies are the plain RoPE frequencies (tests/hybrid/test_hybrid_models.py
  proves it against transformers' own rotary embedding); TSP takes 2-D text positions only.
* The multimodal checkpoints' language model is named under model.language_model.
  (ds_tsp.checkpoint.hf.language_model_names).
* Qwen3-Next and Qwen3.5-MoE: sparse MoE blocks (Qwen3-MoE routing: softmax, top-k, renormalised when
  norm_topk_prob, always for Qwen3.5-MoE; Qwen3-Next's mlp_only_layers / decoder_sparse_step pick the sparse layers,
  Qwen3.5-MoE's are all sparse) plus a shared expert every sparse block adds: a dense SwiGLU of
  shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x)) (ds_tsp.model.modules.moe).
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, no_window

_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def shared_expert_moe(cfg: HFConfig, layers: int, sparse_layers_by_step: bool, always_renormalise: bool) -> dict:
    """The MoE fields of a Qwen3-Next / Qwen3.5-MoE config, with the shared expert every sparse block adds
    (sparse_layers_by_step: Qwen3-Next's mlp_only_layers / decoder_sparse_step pick the sparse layers)."""
    experts = cfg.get("num_experts", 0) or 0
    if experts == 0:
        return {}
    step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers", None) or ())
    dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step) if sparse_layers_by_step else ()
    shared = cfg.get("shared_expert_intermediate_size", 512)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise TSPConfigError(f"shared_expert_intermediate_size={shared!r} on a {cfg.model_type} config: must be a "
                             "positive integer (its MoE blocks always have a shared expert)")
    return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 10),
                moe_intermediate_size=cfg.get("moe_intermediate_size", 512),
                norm_topk_prob=True if always_renormalise else bool(cfg.get("norm_topk_prob", True)),
                dense_mlp_layers=dense, router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(cfg.get("output_router_logits", False)),
                shared_expert_intermediate_size=shared)


def hybrid_fields(cfg: HFConfig, hybrid_family: str, moe: dict) -> dict:
    """Every field of a Qwen3.5 / Qwen3-Next text config: the decoder, the layer types, the Gated DeltaNet shape."""
    no_window(cfg)
    fields = decoder_fields(cfg, head_dim=256, partial_rotary=True)
    layers = fields["num_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4) or 4
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    params = dict(cfg.get("rope_parameters") or {})
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    fields.update(layer_types=tuple(layer_types), attn_output_gate=True, zero_centred_norms=True, qk_norm=True,
                  partial_rotary_factor=float(partial), hybrid_family=hybrid_family)
    if "linear_attention" in layer_types:
        fields.update({name: cfg.get(name, default) for name, default in _LINEAR_DEFAULTS.items()})
    # Qwen3.5-MoE has no dense MLP and no intermediate_size: the (unused) dense width is its experts'
    fields["intermediate_size"] = fields["intermediate_size"] or moe.get("moe_intermediate_size")
    return {**fields, **moe}


def read_dense(cfg: HFConfig) -> dict:
    return hybrid_fields(cfg, "qwen3_5", {})


def read_moe(cfg: HFConfig) -> dict:
    layers = cfg.get("num_hidden_layers")
    return hybrid_fields(cfg, "qwen3_5", shared_expert_moe(cfg, layers, sparse_layers_by_step=False,
                                                           always_renormalise=True))


DENSE = Family({"qwen3_5_text": "Qwen3_5ForCausalLM"}, read_dense, wrappers={"qwen3_5": "qwen3_5_text"})
MOE = Family({"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}, read_moe, wrappers={"qwen3_5_moe": "qwen3_5_moe_text"})
