"""transformers configs in and out: the config a TSP model was built from, and the config.json it saves.

A model loaded from a checkpoint keeps the checkpoint's own config object (all its fields survive a round trip)
and its generation_config.json (generation_config_json);
one built from a bare ModelShape gets the transformers family that expresses it: with experts, grouped sigmoid
routing -> GLM-4.5, attention sinks with biased clamped-SwiGLU experts -> GPT-OSS, qk_norm -> Qwen3-MoE else
Mixtral; position-scaled queries -> Ministral 3; fused projections -> Phi-3; v norms, layer scalars, per-layer
inputs, the full layers' own head_dim -> Gemma 4; sandwich norms, GeGLU, scaled embeddings -> Gemma 3;
whole-projection q/k norms, post-norms -> OLMo 3; dense: qk_norm -> Qwen3, q/k/v bias -> Qwen2, one sliding window
on every layer -> Mistral, else Llama;
a hybrid shape (gated attention, layer_types) -> its hybrid_family (Qwen3.5 text, Qwen3-Next).
A Qwen3.5 multimodal checkpoint (Qwen3_5ForConditionalGeneration, model_type "qwen3_5") is read as its language
model: load_config returns its text_config, and the model saves a text-only Qwen3_5ForCausalLM checkpoint.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families import ARCHITECTURES, WRAPPERS, check_wrapped, family_of
from ds_tsp.core.shape.model_shape import ModelShape

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("ds_tsp.hf needs transformers: pip install 'ds_tsp[hf]'") from err
    return transformers


def load_config(directory: str | Path):
    """The transformers config object of a LOCAL checkpoint directory (never the Hub)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise TSPConfigError(f"{path} does not exist: from_pretrained takes a local checkpoint directory with a "
                             "config.json (download it first; ds_tsp never fetches from the Hub)")
    return config_from_dict(json.loads(path.read_text()))


def config_from_dict(values: dict):
    if values.get("model_type") in WRAPPERS:
        return language_model_config(import_transformers().AutoConfig.for_model(**values))
    family_of(values.get("model_type"))  # one error naming every family TSP converts
    return import_transformers().AutoConfig.for_model(**values)


def language_model_config(config):
    """The text_config of a multimodal config (carrying its dtype and tie_word_embeddings), else `config`."""
    if getattr(config, "model_type", None) not in WRAPPERS:
        return config
    check_wrapped(config.model_type, config.text_config)
    text = copy.deepcopy(config.text_config)
    for key in ("dtype", "tie_word_embeddings"):
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def config_json(config, dtype: torch.dtype) -> str:
    """config.json text for saving: the config with its architecture and the saved dtype set."""
    config = copy.deepcopy(config)
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = dtype
    return config.to_json_string(use_diff=False)


def generation_config_json(source) -> str | None:
    """The generation_config.json text of a checkpoint directory (its file, verbatim) or of an in-memory transformers
    model (its generation_config, as transformers' save_pretrained writes it); None when it has none."""
    if isinstance(source, (str, Path)):
        path = Path(source) / GENERATION_CONFIG_NAME
        return path.read_text() if path.is_file() else None
    generation = getattr(source, "generation_config", None)
    return generation.to_json_string(use_diff=True) if generation is not None else None


def config_dict_from_shape(shape: ModelShape, dtype: torch.dtype) -> dict:
    """A config.json dict transformers reads back into the same model (see module doc for the family)."""
    if shape.final_logit_softcapping is not None and not shape.sandwich_norms:
        raise TSPConfigError(f"final_logit_softcapping={shape.final_logit_softcapping}: only the Gemma families "
                             "(sandwich norms) soft-cap their logits in transformers")
    if shape.hybrid_family is not None or shape.attn_output_gate:
        return _hybrid_config_dict(shape, dtype)
    if shape.num_experts and shape.moe_routing == "sigmoid_grouped":
        return _glm4_moe_config_dict(shape, dtype)
    if shape.moe_family == "gpt_oss":
        return _gpt_oss_config_dict(shape, dtype)
    if shape.attention_sinks or shape.attention_out_bias:
        raise TSPConfigError("attention_sinks / attention_out_bias: GPT-OSS, the family with them, also has its "
                             "experts (moe_biases, expert_activation='clamped_swiglu', moe_routing='topk_softmax')")
    if shape.num_experts:
        return _moe_config_dict(shape, dtype)
    if shape.query_scale_beta:
        return _ministral3_config_dict(shape, dtype)
    if shape.fused_qkv or shape.fused_gate_up:
        return _phi3_config_dict(shape, dtype)
    if shape.value_norm or shape.layer_scalars or shape.per_layer_input_size or shape.full_head_dim or \
            shape.full_num_kv_heads or shape.full_values_from_keys or shape.kv_shared_layers:
        return _gemma4_config_dict(shape, dtype)
    if shape.projection_qk_norm or shape.post_norms:
        return _olmo3_config_dict(shape, dtype)
    if shape.sandwich_norms or shape.mlp_activation != "silu" or shape.embedding_scale != 1.0 or \
            shape.attention_scale is not None or shape.sliding_rope_theta:
        return _gemma3_config_dict(shape, dtype)
    windows = shape.attention_windows
    uniform_window = windows is not None and len(set(windows)) == 1 and windows[0] is not None
    model_type = ("qwen3" if shape.qk_norm else "qwen2" if shape.qkv_bias else
                  "mistral" if uniform_window else "llama")
    if windows is not None and model_type == "llama":
        raise TSPConfigError(f"attention_windows={windows}: no transformers Llama-family config expresses "
                             "per-layer windows without q/k/v bias or q/k norms (Qwen2/Qwen3 do)")
    config = _common_fields(shape, dtype, model_type)
    if model_type in ("llama", "qwen3"):
        config.update(attention_bias=False)
    if model_type == "llama":
        config.update(mlp_bias=False)
    if model_type == "mistral":
        config.update(sliding_window=windows[0])
    if model_type in ("qwen2", "qwen3"):
        sliding = windows is not None
        config.update(use_sliding_window=sliding,
                      sliding_window=next((w for w in windows if w), None) if sliding else None,
                      layer_types=["sliding_attention" if sliding and windows[i] else "full_attention"
                                   for i in range(shape.num_layers)])
        if sliding and len({w for w in windows if w}) > 1:
            raise TSPConfigError(f"attention_windows={windows}: Qwen configs have one sliding_window for all "
                                 "sliding layers")
    return config


def _common_fields(shape: ModelShape, dtype: torch.dtype, model_type: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        s = shape.rope_scaling
        rope.update({k: v for k, v in vars(s).items()
                     if v is not None and k not in ("max_position_embeddings", "truncate")})
        if s.rope_type == "yarn" and not s.truncate:
            rope["truncate"] = False
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.dim_per_head, "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tie_word_embeddings, "hidden_act": "silu", "dtype": str(dtype)[6:],
        "pad_token_id": shape.pad_token_id,
        "max_position_embeddings": (shape.rope_scaling.max_position_embeddings if shape.rope_scaling and
                                    shape.rope_scaling.max_position_embeddings else 131072),
        "rope_parameters": rope, "rope_theta": shape.rope_theta,
    }


def _ministral3_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Ministral 3: position-scaled queries (the rope's llama_4_scaling_beta, period
    original_max_position_embeddings)."""
    windows = shape.attention_windows
    if shape.qkv_bias or shape.qk_norm or (windows is not None and (len(set(windows)) != 1 or windows[0] is None)):
        raise TSPConfigError("query_scale_beta with q/k/v bias, q/k norms or per-layer windows: Ministral 3, the "
                             "family with position-scaled queries, has none of them")
    scaling = shape.rope_scaling
    if scaling is None or scaling.original_max_position_embeddings != shape.query_scale_period:
        raise TSPConfigError(f"query_scale_period={shape.query_scale_period}: Ministral 3 scales queries with the "
                             "period of its rope's original_max_position_embeddings; give a rope_scaling with it")
    config = _common_fields(shape, dtype, "ministral3")
    config["rope_parameters"] = {**config["rope_parameters"], "llama_4_scaling_beta": shape.query_scale_beta}
    return {**config, "sliding_window": None if windows is None else windows[0]}


def _phi3_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, partial rotary."""
    windows = shape.attention_windows
    if not (shape.fused_qkv and shape.fused_gate_up) or shape.qkv_bias or shape.qk_norm or (
            windows is not None and (len(set(windows)) != 1 or windows[0] is None)):
        raise TSPConfigError("fused_qkv / fused_gate_up: Phi-3, the family with fused projections, fuses both, and has "
                             "no q/k/v bias, no q/k norms and at most one window for every layer")
    config = _common_fields(shape, dtype, "phi3")
    if shape.head_dim is None:  # Phi3Config has no head_dim field: hidden / heads
        config.pop("head_dim")
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": shape.partial_rotary_factor}
    return {**config, "sliding_window": None if windows is None else windows[0]}


def _layer_types(shape: ModelShape, family: str) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of a family with one window for all its sliding layers."""
    windows = shape.attention_windows or (None,) * shape.num_layers
    sliding = {w for w in windows if w is not None}
    if len(sliding) > 1:
        raise TSPConfigError(f"attention_windows={windows}: {family} has one sliding_window for its sliding layers")
    return ["sliding_attention" if w is not None else "full_attention" for w in windows], next(iter(sliding), None)


def _sliding_rope(shape: ModelShape) -> dict:
    """The sliding layers' rope_parameters block (their own theta and scaling)."""
    local = {"rope_type": "default", "rope_theta": shape.sliding_rope_theta or shape.rope_theta}
    if shape.sliding_rope_scaling is not None:
        local.update({k: v for k, v in vars(shape.sliding_rope_scaling).items()
                      if v is not None and k not in ("max_position_embeddings", "truncate")})
    return local


def _gemma3_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Gemma 3 text: sandwich (1 + w) norms, GeGLU, sqrt(hidden)-scaled embeddings, query_pre_attn_scalar, per-layer-
    type RoPE."""
    if not (shape.sandwich_norms and shape.zero_centred_norms and shape.qk_norm and shape.mlp_activation == "gelu_tanh"
            and abs(shape.embedding_scale - shape.hidden_size ** 0.5) < 1e-12) or shape.qkv_bias:
        raise TSPConfigError("sandwich_norms / mlp_activation / embedding_scale / attention_scale / "
                             "sliding_rope_theta: Gemma 3, the family with them, has all of sandwich (1 + w) norms, "
                             "q/k norms, GeGLU and "
                             "sqrt(hidden)-scaled embeddings, and no q/k/v bias")
    layer_types, window = _layer_types(shape, "Gemma 3")
    config = _common_fields(shape, dtype, "gemma3_text")
    full = config.pop("rope_parameters")
    scalar = round((shape.attention_scale or shape.dim_per_head ** -0.5) ** -2, 6)
    if scalar != int(scalar):
        raise TSPConfigError(f"attention_scale={shape.attention_scale}: Gemma 3's softmax scale is "
                             "query_pre_attn_scalar ** -0.5 for an integer query_pre_attn_scalar")
    config.pop("hidden_act")
    return {**config, "rope_parameters": {"full_attention": full, "sliding_attention": _sliding_rope(shape)},
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": int(scalar),
            "sliding_window": window, "final_logit_softcapping": shape.final_logit_softcapping,
            "attn_logit_softcapping": None, "layer_types": layer_types}


def _gemma4_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Gemma 4 text: Gemma 3's layer with w-scaled norms, softmax scale 1, v norms, layer scalars, the full layers'
    head_dim and proportional RoPE, per-layer inputs."""
    if not (shape.sandwich_norms and shape.qk_norm and shape.value_norm and shape.layer_scalars and
            shape.mlp_activation == "gelu_tanh" and shape.attention_scale == 1.0 and not shape.zero_centred_norms
            and abs(shape.embedding_scale - shape.hidden_size ** 0.5) < 1e-12) or shape.qkv_bias:
        raise TSPConfigError("value_norm / layer_scalars / per_layer_input_size / full_head_dim: Gemma 4, the family "
                             "with them, has all of sandwich w-scaled norms, q/k/v norms, layer scalars, GeGLU, "
                             "softmax scale 1 and sqrt(hidden)-scaled embeddings, and no q/k/v bias")
    layer_types, window = _layer_types(shape, "Gemma 4")
    config = _common_fields(shape, dtype, "gemma4_text")
    full = config.pop("rope_parameters")
    config.pop("rope_theta")
    config.pop("hidden_act")
    full_layer = {"head_dim": shape.full_head_dim or shape.dim_per_head}
    if shape.full_num_kv_heads:
        full_layer["num_key_value_heads"] = shape.full_num_kv_heads
    return {**config, "rope_parameters": {"full_attention": full, "sliding_attention": _sliding_rope(shape)},
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512 if window is None else window,
            "layer_types": layer_types, "final_logit_softcapping": shape.final_logit_softcapping,
            "per_layer_config": {str(i): dict(full_layer) for i, t in enumerate(layer_types)
                                 if t == "full_attention"},
            "hidden_size_per_layer_input": shape.per_layer_input_size,
            "vocab_size_per_layer_input": shape.per_layer_input_vocab_size or shape.vocab_size,
            "attention_k_eq_v": shape.full_values_from_keys, "num_kv_shared_layers": shape.kv_shared_layers,
            "enable_moe_block": False, "use_double_wide_mlp": shape.double_wide_shared_mlp}


def _olmo3_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """OLMo 3: whole-projection q/k norms, post-norms, sliding and full layers, a rope per layer type."""
    if not (shape.projection_qk_norm and shape.post_norms) or shape.zero_centred_norms or \
            shape.mlp_activation != "silu" or shape.embedding_scale != 1.0 or shape.attention_scale is not None:
        raise TSPConfigError("projection_qk_norm / post_norms: OLMo 3, the family with them, has both, plain "
                             "(w * x_hat) norms, a SwiGLU MLP, unscaled embeddings and the head_dim ** -0.5 softmax "
                             "scale")
    layer_types, window = _layer_types(shape, "OLMo 3")
    config = _common_fields(shape, dtype, "olmo3")
    full = config.pop("rope_parameters")
    local = _sliding_rope(shape) if shape.sliding_rope_theta else dict(full)
    return {**config, "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "sliding_window": window, "attention_bias": False, "layer_types": layer_types}


def _moe_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Qwen3-MoE (q/k norms) or Mixtral: the MoE shape's family (ModelShape.moe_family)."""
    model_type = shape.moe_family
    windows = shape.attention_windows
    window = None if windows is None else windows[0]
    if windows is not None and (len(set(windows)) != 1 or window is None):
        raise TSPConfigError(f"attention_windows={windows}: Qwen3-MoE and Mixtral configs have one sliding_window "
                             "for every layer")
    if shape.qkv_bias:
        raise TSPConfigError("qkv_bias=True with experts: neither Qwen3-MoE nor Mixtral has q/k/v biases")
    config = {**_common_fields(shape, dtype, model_type), "num_local_experts": shape.num_experts,
              "num_experts_per_tok": shape.num_experts_per_tok, "router_aux_loss_coef": shape.router_aux_loss_coef,
              "output_router_logits": shape.output_router_logits, "sliding_window": window}
    if model_type == "mixtral":
        if shape.dense_mlp_layers or not shape.norm_topk_prob:
            raise TSPConfigError(f"dense_mlp_layers={shape.dense_mlp_layers}, norm_topk_prob={shape.norm_topk_prob} "
                                 "without q/k norms: Mixtral has no dense layers and always renormalises the top-k; "
                                 "set qk_norm=True for a Qwen3-MoE shape")
        if shape.intermediate_size != shape.moe_intermediate_size:
            raise TSPConfigError(f"intermediate_size={shape.intermediate_size} != moe_intermediate_size="
                                 f"{shape.moe_intermediate_size}: a Mixtral expert's width is its intermediate_size")
        return {**config, "router_jitter_noise": 0.0}
    return {**config, "moe_intermediate_size": shape.moe_intermediate_size, "norm_topk_prob": shape.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(shape.dense_mlp_layers),
            "use_sliding_window": window is not None, "attention_bias": False}


def _glm4_moe_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """GLM-4.5: grouped sigmoid routing, unscaled shared experts after first_k_dense_replace dense layers."""
    dense = tuple(range(len(shape.dense_mlp_layers)))
    shared, ffn = shape.shared_expert_intermediate_size, shape.moe_intermediate_size
    if shape.dense_mlp_layers != dense or shape.attention_windows is not None or shape.shared_expert_gate or \
            not shared or shared % ffn:
        raise TSPConfigError(f"dense_mlp_layers={shape.dense_mlp_layers}, attention_windows, shared expert "
                             f"{shared} (gate: {shape.shared_expert_gate}): GLM-4.5 has its dense layers first, no "
                             "window, and ungated shared experts a multiple of moe_intermediate_size wide")
    config = _common_fields(shape, dtype, "glm4_moe")
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": shape.partial_rotary_factor}
    return {**config, "attention_bias": shape.qkv_bias, "use_qk_norm": shape.qk_norm,
            "n_routed_experts": shape.num_experts, "num_experts_per_tok": shape.num_experts_per_tok,
            "moe_intermediate_size": ffn, "n_shared_experts": shared // ffn, "first_k_dense_replace": len(dense),
            "n_group": shape.moe_groups, "topk_group": shape.moe_topk_groups,
            "routed_scaling_factor": shape.routed_scaling_factor, "norm_topk_prob": shape.norm_topk_prob,
            "num_nextn_predict_layers": 0}


def _gpt_oss_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """GPT-OSS: attention sinks, q/k/v and o_proj biases (one attention_bias), sliding / full layer_types, experts
    on every layer (biased, clamped SwiGLU, top-k-then-softmax routing)."""
    if not shape.attention_sinks or shape.qkv_bias != shape.attention_out_bias or shape.dense_mlp_layers or \
            shape.intermediate_size != shape.moe_intermediate_size:
        raise TSPConfigError(f"attention_sinks={shape.attention_sinks}, qkv_bias={shape.qkv_bias}, attention_out_bias="
                             f"{shape.attention_out_bias}, dense_mlp_layers={shape.dense_mlp_layers}, "
                             f"moe_intermediate_size={shape.moe_intermediate_size}: GPT-OSS has attention sinks, one "
                             "attention_bias for q/k/v and o_proj, experts of intermediate_size on every layer")
    layer_types, window = _layer_types(shape, "GPT-OSS")
    config = _common_fields(shape, dtype, "gpt_oss")
    config.pop("hidden_act")
    return {**config, "attention_bias": shape.qkv_bias, "num_local_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok, "router_aux_loss_coef": shape.router_aux_loss_coef,
            "output_router_logits": shape.output_router_logits, "swiglu_alpha": shape.swiglu_alpha,
            "swiglu_limit": shape.swiglu_limit, "sliding_window": window, "layer_types": layer_types}


def _hybrid_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """Qwen3.5 text (Qwen3_5ForCausalLM) or dense Qwen3-Next: gated attention, partial rotary, zero-centred norms."""
    family = shape.hybrid_family or "qwen3_5"
    if not (shape.attn_output_gate and shape.zero_centred_norms and shape.qk_norm) or shape.qkv_bias:
        raise TSPConfigError(f"hybrid_family={family!r} needs attn_output_gate, zero_centred_norms and qk_norm and no "
                             "qkv_bias: its transformers model has exactly those")
    model_type = ("qwen3_next" if family == "qwen3_next" else
                  "qwen3_5_moe_text" if shape.num_experts else "qwen3_5_text")
    config = _common_fields(shape, dtype, model_type)
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": shape.partial_rotary_factor}
    config.update(attention_bias=False, layer_types=list(shape.layer_types or ["full_attention"] * shape.num_layers))
    config.update({name: getattr(shape, name) or default for name, default in (
        ("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4))})
    if shape.num_experts:
        if model_type == "qwen3_5_moe_text" and (shape.dense_mlp_layers or not shape.norm_topk_prob):
            raise TSPConfigError(f"dense_mlp_layers={shape.dense_mlp_layers}, norm_topk_prob={shape.norm_topk_prob}:"
                                 " Qwen3.5-MoE has no dense layers and always renormalises the top-k")
        config.update(num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                      moe_intermediate_size=shape.moe_intermediate_size,
                      shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
                      router_aux_loss_coef=shape.router_aux_loss_coef,
                      output_router_logits=shape.output_router_logits)
        if model_type == "qwen3_5_moe_text":
            config.pop("intermediate_size")
    if model_type == "qwen3_next":
        config.update(norm_topk_prob=shape.norm_topk_prob, mlp_only_layers=list(shape.dense_mlp_layers),
                      decoder_sparse_step=1, num_experts=shape.num_experts)
    return config
