"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text): interleaved sliding and full layers (layer_types; by default
every 6th layer full), each with its own RoPE (rope_parameters per layer type: the full layers' theta 1e6 and
scaling, the sliding layers' theta 1e4), softmax scale query_pre_attn_scalar ** -0.5, per-head q/k norms, four
zero-centred (1 + w) norms per layer (a norm on each sublayer's input and output), embeddings scaled by
sqrt(hidden_size), a GeGLU MLP (gelu_pytorch_tanh), tied embeddings and padding row 0 by default, and the final
logits soft-capped (final_logit_softcapping).
The multimodal Gemma3ForConditionalGeneration reads as its language model (text_config; the vision tower's tensors
are never read). Refused by name in this version: attention-logit soft-capping and bidirectional attention."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import (
    Family,
    HFConfig,
    decoder_fields,
    dense_only,
    layer_type_windows,
    rope_fields,
)

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    if cfg.get("attn_logit_softcapping") is not None:
        raise TSPConfigError(f"attn_logit_softcapping={cfg.get('attn_logit_softcapping')} on a gemma3_text config: "
                             "attention-logit soft-capping is not implemented by TSP's fused attention kernels; set "
                             "it to null")
    cfg.refuse("use_bidirectional_attention", "TSP attention is causal (Gemma 3 embedding models are not)")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in _ACTIVATIONS:
        raise TSPConfigError(f"hidden_activation={activation!r} on a gemma3_text config: TSP's gated MLP computes "
                             "gelu_pytorch_tanh (GeGLU) or silu")
    full, sliding = _ropes(cfg)
    fields = decoder_fields(cfg.with_values(rope_parameters=full, rope_scaling=None), head_dim=256, pad_token_id=0,
                            act=None)
    _, local = rope_fields(cfg.with_values(rope_parameters=sliding, rope_scaling=None))
    layers = fields["num_layers"]
    pattern = int(cfg.get("sliding_window_pattern", 6))  # every pattern-th layer full, the others sliding
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(layers)]
    windows = layer_type_windows(cfg, layers, cfg.get("sliding_window", 4096), layer_types)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    return {**fields, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)), "qk_norm": True,
            "zero_centred_norms": True, "sandwich_norms": True, "mlp_activation": _ACTIVATIONS[activation],
            "embedding_scale": fields["hidden_size"] ** 0.5, "attention_scale": scalar ** -0.5,
            "attention_windows": windows,
            "sliding_rope_theta": float(sliding["rope_theta"]) if windows is not None else 0.0,
            "sliding_rope_scaling": local if windows is not None else None,
            "final_logit_softcapping": cfg.get("final_logit_softcapping")}


def _ropes(cfg: HFConfig) -> tuple[dict, dict]:
    """(full layers' rope parameters, sliding layers'), from transformers 5's rope_parameters per layer type or an
    older config's rope_theta / rope_scaling / rope_local_base_freq, with Gemma3TextConfig's defaults."""
    params = dict(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, sliding = {**params, **dict(cfg.get("rope_scaling") or {})}, {}
    full.setdefault("rope_type", "default")
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    sliding.setdefault("rope_type", "default")
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    return full, sliding


def check_wrapped(cfg: HFConfig) -> None:
    if cfg.get("final_logit_softcapping") is not None:
        raise TSPConfigError(f"final_logit_softcapping={cfg.get('final_logit_softcapping')} in a gemma3 "
                             "(Gemma3ForConditionalGeneration) text_config: transformers' multimodal model never "
                             "applies it, while Gemma3ForCausalLM, the model TSP trains and saves, does; set it to "
                             "null (what the multimodal model computes)")


FAMILY = Family({"gemma3_text": "Gemma3ForCausalLM"}, read, wrappers={"gemma3": "gemma3_text"},
                check_wrapped=check_wrapped)
