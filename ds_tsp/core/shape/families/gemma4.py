"""Gemma 4 (Gemma4ForCausalLM, model_type gemma4_text): Gemma 3's layer (sliding and full layers from layer_types,
the last always full; sandwich norms; per-head q/k norms; GeGLU; embeddings scaled by sqrt(hidden_size); tied
embeddings and padding row 0 by default) with what Gemma 4 changes:
* norms scale by w (not 1 + w), the softmax scale is 1 (the q/k norms set the logits' size), and every v head is
  RMS-normalised without a weight;
* the full layers have their own head_dim (per_layer_config, or global_head_dim, default 512) and rotate with
  'proportional' RoPE (the first partial_rotary_factor of the head's frequencies, the rest 0; theta 1e6), the
  sliding layers with default RoPE (theta 1e4);
* attention_k_eq_v: the full layers' values are their keys' raw projection (no v_proj), with their own kv heads
  (num_global_key_value_heads, or per_layer_config's);
* num_kv_shared_layers (E2B / E4B): the last layers attend over the K/V of the last earlier layer of their type
  (no k_proj / v_proj / k_norm), their MLPs twice as wide under use_double_wide_mlp;
* every layer's output is scaled by its layer_scalar (a checkpoint buffer);
* per-layer inputs (PLE, hidden_size_per_layer_input > 0): a [vocab_size_per_layer_input, layers * P] embedding
  plus a projection of the embeddings give each layer a [P] input, gated into its residual;
* final_logit_softcapping: logits = cap * tanh(logits / cap).
Refused by name in this version: enable_moe_block, use_bidirectional_attention, per_layer_config overrides other
than the full layers' head_dim and num_key_value_heads.
The multimodal Gemma4ForConditionalGeneration (model_type gemma4) is read as its language model (text_config; the
checkpoint's model.language_model. tensors, its vision and audio towers left unread) and saved as Gemma4ForCausalLM.
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, layer_type_windows, rope_fields
from ds_tsp.core.shape.rope_scaling import RopeScaling

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def read(cfg: HFConfig) -> dict:
    if not isinstance(cfg.raw, dict):  # its per-layer attributes (head_dim) are only readable from the dict
        cfg = HFConfig(cfg.raw.to_dict())
    _refuse(cfg)
    layers = cfg.get("num_hidden_layers", 30)
    layer_types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                                  for i in range(layers)])
    if layer_types:  # transformers forces the last layer to full attention
        layer_types[-1] = "full_attention"
    full, sliding = _ropes(cfg)
    theta, scaling = _full_rope(cfg, full)
    fields = decoder_fields(cfg.with_values(rope_parameters={"rope_type": "default", "rope_theta": theta},
                                            rope_scaling=None, num_hidden_layers=layers),
                            head_dim=256, pad_token_id=0, act=None)
    fields["rope_scaling"] = scaling
    _, local = rope_fields(cfg.with_values(rope_parameters=sliding, rope_scaling=None))
    windows = layer_type_windows(cfg, layers, cfg.get("sliding_window", 512), layer_types)
    head_dim, kv_heads = fields["head_dim"], fields["num_kv_heads"]
    full_head_dim, full_kv_heads = _full_layers(cfg, layer_types, head_dim, kv_heads)
    per_layer = cfg.get("hidden_size_per_layer_input", 256) or 0
    per_layer_vocab = cfg.get("vocab_size_per_layer_input", 262_144) if per_layer else 0
    if per_layer and per_layer_vocab < fields["vocab_size"]:
        raise TSPConfigError(f"vocab_size_per_layer_input={per_layer_vocab} < vocab_size={fields['vocab_size']} on "
                             "a gemma4_text config: token ids past its table have no per-layer input")
    return {**fields, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)), "qk_norm": True,
            "sandwich_norms": True, "mlp_activation": "gelu_tanh", "embedding_scale": fields["hidden_size"] ** 0.5,
            "attention_scale": 1.0, "attention_windows": windows,
            "sliding_rope_theta": float(sliding["rope_theta"]) if windows is not None else 0.0,
            "sliding_rope_scaling": local if windows is not None else None,
            "full_head_dim": full_head_dim if full_head_dim != head_dim else None, "value_norm": True,
            "full_num_kv_heads": full_kv_heads if full_kv_heads != kv_heads else None,
            "full_values_from_keys": bool(cfg.get("attention_k_eq_v", False)),
            "kv_shared_layers": int(cfg.get("num_kv_shared_layers", 0) or 0),
            "double_wide_shared_mlp": bool(cfg.get("use_double_wide_mlp", False)),
            "layer_scalars": True, "per_layer_input_size": per_layer, "per_layer_input_vocab_size": per_layer_vocab,
            "final_logit_softcapping": cfg.get("final_logit_softcapping")}


def _refuse(cfg: HFConfig) -> None:
    cfg.refuse("enable_moe_block", "Gemma 4's MoE block (a dense MLP beside routed experts) is not implemented "
                                   "under TSP yet")
    cfg.refuse("use_bidirectional_attention", "TSP attention is causal")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in _ACTIVATIONS:
        raise TSPConfigError(f"hidden_activation={activation!r} on a gemma4_text config: TSP computes Gemma 4's "
                             "MLP and per-layer input gate with gelu_pytorch_tanh")


def _full_layers(cfg: HFConfig, layer_types: list[str], head_dim: int, kv_heads: int) -> tuple[int, int]:
    """(head_dim, kv heads) of the full layers: per_layer_config (transformers 5 writes it), or global_head_dim
    (default 512) and, under attention_k_eq_v, num_global_key_value_heads, as Gemma4TextConfig derives it; any
    other per-layer override is refused by name."""
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", False) else None
        return cfg.get("global_head_dim", 512), global_kv or kv_heads
    overrides = {int(k): dict(v or {}) for k, v in overrides.items()}  # config.json keys are zero-padded strings
    read = ("head_dim", "num_key_value_heads")
    per_type: dict[str, set] = {"full_attention": set(), "sliding_attention": set()}
    for i, kind in enumerate(layer_types):
        layer = overrides.get(i, {})
        extra = sorted(set(layer) - set(read))
        if extra:
            raise TSPConfigError(f"per_layer_config overrides {extra} of layer {i} on a gemma4_text config: TSP reads "
                                 "only the full layers' head_dim and num_key_value_heads per layer")
        per_type[kind].add((layer.get("head_dim", head_dim), layer.get("num_key_value_heads", kv_heads)))
    if per_type["sliding_attention"] - {(head_dim, kv_heads)} or len(per_type["full_attention"]) > 1:
        raise TSPConfigError(f"per_layer_config (head_dim, num_key_value_heads) {per_type} on a gemma4_text config: "
                             "TSP takes the sliding layers' from head_dim and num_key_value_heads, and one pair for "
                             "all the full layers")
    return next(iter(per_type["full_attention"]), (head_dim, kv_heads))


def _ropes(cfg: HFConfig) -> tuple[dict, dict]:
    """(full layers' rope parameters, sliding layers'), with Gemma4TextConfig's defaults."""
    params = dict(cfg.get("rope_parameters") or {})
    defaults = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    if params and not all(isinstance(v, dict) for v in params.values()):
        raise TSPConfigError("rope_parameters of a gemma4_text config must give one block per layer type "
                             "(full_attention, sliding_attention)")
    return (dict(params.get("full_attention") or defaults["full_attention"]),
            dict(params.get("sliding_attention") or defaults["sliding_attention"]))


def _full_rope(cfg: HFConfig, full: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of the full layers: 'proportional' read here, the other rope types by the shared reader."""
    if full.get("rope_type") != "proportional":
        return rope_fields(cfg.with_values(rope_parameters=full, rope_scaling=None))
    unknown = sorted(set(full) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
    if unknown:
        raise TSPConfigError(f"rope_parameters.full_attention has {unknown} on a gemma4_text config: proportional "
                             "RoPE reads rope_theta, partial_rotary_factor and factor")
    return float(full["rope_theta"]), RopeScaling(rope_type="proportional", factor=full.get("factor"),
                                                  partial_rotary_factor=full.get("partial_rotary_factor"))


FAMILY = Family({"gemma4_text": "Gemma4ForCausalLM"}, read, wrappers={"gemma4": "gemma4_text"})
