"""The hybrid-model part of a ModelShape: which fields of a Qwen3.5 / Qwen3-Next config TSP reads and which it refuses.

transformers' rules, mirrored here (models/{qwen3_5,qwen3_5_moe,qwen3_next}/configuration_*.py of transformers 5):
* layer_types: per layer "linear_attention" (Gated DeltaNet) or "full_attention"; when absent, every
  full_attention_interval-th layer (default 4) is full attention, the others linear.
* Full-attention layers are gated (q_proj emits [q, gate] per head), rotate the first partial_rotary_factor of every
  head (default 0.25 when the config omits it) and q/k-normalise every head; every RMSNorm of these families except
  the Gated DeltaNet's output norm is zero-centred (x_hat * (1 + w)).
* mrope (rope_parameters.mrope_section / mrope_interleaved): text positions give the three rows (t, h, w) the same
  position, so the interleaved frequencies are the plain RoPE frequencies (tests/hybrid/test_hybrid_models.py proves it
  against transformers' own rotary embedding); TSP takes 2-D text positions only.
* A Qwen3_5ForConditionalGeneration (Qwen3_5MoeForConditionalGeneration) config.json, model_type "qwen3_5"
  ("qwen3_5_moe"), is read through its text_config: TSP trains the language model (checkpoint names under
  model.language_model., ds_tsp.checkpoint.hf.hybrid_names).
* Qwen3-Next and Qwen3.5-MoE: sparse MoE blocks (Qwen3-MoE routing: softmax, top-k, renormalised when
  norm_topk_prob, always for Qwen3.5-MoE; Qwen3-Next's mlp_only_layers / decoder_sparse_step pick the sparse layers,
  Qwen3.5-MoE's are all sparse) plus a shared expert every sparse block adds: a dense SwiGLU of
  shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x)) (ds_tsp.model.modules.moe).
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError

HYBRID_TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
HYBRID_MODEL_TYPES = (*HYBRID_TEXT_MODEL_TYPES, "qwen3_5", "qwen3_5_moe")  # the last two: multimodal wrappers
_SHARED_EXPERT_TYPES = ("qwen3_5_moe_text", "qwen3_next")
_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def text_config(config):
    """The language-model config of a Qwen3.5 multimodal config (its text_config), else `config` itself."""
    if isinstance(config, dict):
        get = config.get
    else:
        def get(key, default=None):
            return getattr(config, key, default)
    if get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        inner = get("text_config")
        if inner is None:
            raise TSPConfigError(f"model_type={get('model_type')!r} config has no text_config: TSP trains the language "
                                 "model of a Qwen3.5 checkpoint and reads its shape from text_config")
        if isinstance(inner, dict) and "model_type" not in inner:
            inner = {**inner, "model_type": get("model_type") + "_text"}
        return inner
    return config


def _moe_fields(get, model_type: str, num_layers: int) -> dict:
    """The MoE fields of a Qwen3-Next / Qwen3.5-MoE config (transformers' rules: Qwen3-Next's layer i is sparse
    iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; Qwen3.5-MoE's every layer, top-k always
    renormalised), with the shared expert every sparse block adds."""
    experts = get("num_experts", 0) or 0
    if model_type not in _SHARED_EXPERT_TYPES or experts == 0:
        return {}
    step = get("decoder_sparse_step", 1) or 1
    mlp_only = set(get("mlp_only_layers", None) or ())
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step) if model_type == "qwen3_next" else ()
    shared = get("shared_expert_intermediate_size", 512)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise TSPConfigError(f"shared_expert_intermediate_size={shared!r} on a {model_type} config: must be a "
                             "positive integer (its MoE blocks always have a shared expert)")
    return dict(num_experts=experts, num_experts_per_tok=get("num_experts_per_tok", 10),
                moe_intermediate_size=get("moe_intermediate_size", 512),
                norm_topk_prob=True if model_type == "qwen3_5_moe_text" else bool(get("norm_topk_prob", True)),
                dense_mlp_layers=dense, router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(get("output_router_logits", False)), shared_expert_intermediate_size=shared)


def hybrid_fields_from_config(get, model_type: str, num_layers: int) -> dict:
    """ModelShape keyword arguments for the hybrid fields of a Qwen3.5 / Qwen3-Next text config."""
    layer_types = get("layer_types")
    if layer_types is None:
        interval = get("full_attention_interval", 4) or 4
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    params = dict(get("rope_parameters") or {})
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
    fields = dict(layer_types=tuple(layer_types), attn_output_gate=True, zero_centred_norms=True,
                  partial_rotary_factor=float(partial),
                  hybrid_family="qwen3_next" if model_type == "qwen3_next" else "qwen3_5")
    if "linear_attention" in layer_types:
        fields.update({name: get(name, default) for name, default in _LINEAR_DEFAULTS.items()})
    return {**fields, **_moe_fields(get, model_type, num_layers)}
