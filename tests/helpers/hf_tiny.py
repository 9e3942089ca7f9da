"""Tiny transformers checkpoints for tests (a helper module, not a test file: nothing here is collected).

`FAMILIES` covers the architectures ds_tsp loads from the Hub: Llama (rope default / llama3 / linear / yarn,
explicit head_dim, tied and untied), Mistral (sliding window), Qwen2 (q/k/v bias, per-layer sliding window), Qwen3
(per-head q_norm/k_norm), Ministral 3 (yarn, position-scaled queries, sliding window) and Phi-3 (fused qkv_proj /
gate_up_proj, partial rotary, longrope, sliding window), Gemma 3 (sandwich norms, GeGLU, per-layer-type RoPE) and
Gemma 4 (per-layer head_dim, proportional RoPE, v norms, layer scalars, per-layer inputs, soft-capped logits).
Everything has 2 layers and 4 heads, so tensor degrees D=2 and D=4 divide the
heads, and vocab sizes are deliberately not all multiples of 4 (vocab padding). Rope scalings use a small
original_max_position_embeddings (16) so they really change the angles at test sequence lengths.

`MOE_FAMILIES` (tests/moe/test_hf_moe.py): Qwen3-MoE (one dense layer via mlp_only_layers, one sparse; 8 experts, top-2,
expert width 12, which 4 does not divide), Mixtral (4 experts, top-2, sliding window) and GPT-OSS (sinks, o_proj
bias, biased clamped-SwiGLU experts, sliding + full layers, yarn), all with output_router_logits and an aux
coefficient large enough to move the gradients visibly; GLM-4.5 (grouped sigmoid routing with a correction bias, a
shared expert, a dense first layer, no aux loss).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

_COMMON = dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128, hidden_act="silu",
               rms_norm_eps=1e-6)

FAMILIES: dict[str, dict] = {
    # default rope, GQA 4/2, untied
    "llama": dict(model_type="llama", vocab_size=70, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
    # "Llama-3-style": llama3 rope (factor 8, low 1, high 4, original 16), GQA, tied embeddings
    "llama3_tied": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
                        num_key_value_heads=2, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}),
    "llama_linear": dict(model_type="llama", vocab_size=67, hidden_size=32, intermediate_size=64,
                         num_key_value_heads=4, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # max_position_embeddings 64 = factor * original: transformers warns when the implicit yarn factor differs
    "llama_yarn": dict(model_type="llama", vocab_size=72, hidden_size=64, intermediate_size=96,
                       num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 16}),
    # explicit head_dim 12 != hidden/heads = 8
    "llama_head_dim": dict(model_type="llama", vocab_size=66, hidden_size=32, intermediate_size=64,
                           num_key_value_heads=2, head_dim=12, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral": dict(model_type="mistral", vocab_size=83, hidden_size=32, intermediate_size=64,
                    num_key_value_heads=2, sliding_window=5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # q/k/v bias, full attention everywhere
    "qwen2": dict(model_type="qwen2", vocab_size=90, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                  use_sliding_window=False, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # layer_types -> ["full_attention", "sliding_attention"] (layers >= max_window_layers slide)
    "qwen2_sliding": dict(model_type="qwen2", vocab_size=77, hidden_size=32, intermediate_size=64,
                          num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                          tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Ministral 3: yarn rope and position-scaled queries with a period of 8 (transformers' llama_4_scaling_beta:
    # queries from position 8 on are scaled, differently again from 24 on), a sliding window of 11
    "ministral3": dict(model_type="ministral3", vocab_size=85, hidden_size=32, intermediate_size=64,
                       num_key_value_heads=2, head_dim=8, sliding_window=11, tie_word_embeddings=False,
                       max_position_embeddings=32,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, partial rotary (half of every head, as Phi-4-mini's 0.75),
    # GQA, a sliding window, longrope as the 128k checkpoints (original context 16: the test batches run on the long
    # factors, packed documents shorter than 16 on the short ones)
    "phi3": dict(model_type="phi3", vocab_size=79, hidden_size=64, intermediate_size=96, num_key_value_heads=2,
                 sliding_window=9, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=64, original_max_position_embeddings=16,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.5, 3.0, 5.0, 8.0]}),
    # Gemma 3: sliding layers (window 7) with their own rope theta, a full layer with linear-scaled rope, softmax
    # scale from query_pre_attn_scalar, four (1 + w) norms per layer, GeGLU, scaled and tied embeddings, pad row 0,
    # soft-capped logits (cap 0.1: the tiny logits reach the tanh's bend)
    "gemma3": dict(model_type="gemma3_text", vocab_size=93, hidden_size=32, intermediate_size=64,
                   num_key_value_heads=2, head_dim=16, sliding_window=7, query_pre_attn_scalar=12,
                   layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=0.1,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    # OLMo 3: q/k norms over the whole projection, post-norms only, a sliding layer (window 5, shorter than a
    # rank's chunk at D=2) with default rope and a full layer with yarn, GQA 4/2 (one kv head per two ranks at D=4),
    # pad row 1 (Olmo3Config's default)
    "olmo3": dict(model_type="olmo3", vocab_size=87, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                  sliding_window=5, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                  eos_token_id=2,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 16}}),
    # Gemma 4: a sliding layer (window 3, shorter than a rank's chunk at D=4) with head_dim 8, 2 kv heads and
    # default rope, a full layer with head_dim 16, proportional rope and keys as values (k_eq_v: no v_proj) of one
    # kv head (replicated at D=2, 4), v norms, per-layer inputs (8 per layer, a per-layer vocab larger than the
    # vocab), soft-capped logits (cap 0.1: the tiny logits reach the tanh's bend); the layer scalars are set off 1
    # by init_tiny_weights_
    "gemma4": dict(model_type="gemma4_text", vocab_size=93, hidden_size=32, intermediate_size=64,
                   num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3,
                   attention_k_eq_v=True, num_global_key_value_heads=1,
                   layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=95, final_logit_softcapping=0.1),
    # "Qwen3-style": q_norm/k_norm, explicit head_dim 16 != 32/4, tied, GQA
    "qwen3": dict(model_type="qwen3", vocab_size=98, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                  head_dim=16, tie_word_embeddings=True, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


# Gemma 4 E2B / E4B's KV sharing: the last (full) layer attends over layer 1's K/V (keys as values, one kv head), its
# MLP twice as wide (use_double_wide_mlp)
FAMILIES["gemma4_kv_shared"] = {**FAMILIES["gemma4"], "num_hidden_layers": 3, "num_kv_shared_layers": 1,
                                "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                                "use_double_wide_mlp": True}


MOE_FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=91, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=12, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      mlp_only_layers=[0], decoder_sparse_step=1, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, use_sliding_window=False, output_router_logits=True,
                      router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral": dict(model_type="mixtral", vocab_size=75, hidden_size=32, intermediate_size=16, num_local_experts=4,
                    num_experts_per_tok=2, num_key_value_heads=2, sliding_window=5, tie_word_embeddings=False,
                    output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # GLM-4.5: a dense first layer then two sparse ones; 8 experts in 4 groups (2 kept), top-2, a shared expert,
    # a correction bias large enough that the choice differs from the scores' (set in init_tiny_weights_), scaled
    # weights; q/k/v biases, q/k norms, partial rotary
    "glm4_moe": dict(model_type="glm4_moe", vocab_size=71, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     use_qk_norm=True, attention_bias=True, num_key_value_heads=2, head_dim=16,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # GPT-OSS: a sliding layer (window 5, shorter than a rank's chunk at D=2 and 4) then a full one, yarn rope
    # (truncate False, original 16), attention sinks and q/k/v/o biases, 4 biased experts top-2 with a swiglu_limit
    # small enough that the clamps bind, and the aux loss
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=87, hidden_size=32, intermediate_size=12, num_local_experts=4,
                    num_experts_per_tok=2, num_key_value_heads=2, head_dim=16, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                    output_router_logits=True, router_aux_loss_coef=0.05, swiglu_limit=0.12, max_position_embeddings=64,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
}


def _attention(model_type: str) -> str:
    """sdpa, except for GPT-OSS, which transformers runs eager only (its attention sinks)."""
    return "eager" if model_type == "gpt_oss" else "sdpa"


def _config_class(model_type: str):
    import transformers
    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
            "ministral3": transformers.Ministral3Config, "phi3": transformers.Phi3Config,
            "gemma3_text": transformers.Gemma3TextConfig, "olmo3": transformers.Olmo3Config,
            "glm4_moe": transformers.Glm4MoeConfig, "gpt_oss": transformers.GptOssConfig,
            "gemma4_text": transformers.Gemma4TextConfig}[model_type]


def tiny_config(name: str, **overrides):
    """The transformers config of family `name` (FAMILIES or MOE_FAMILIES; overrides win), attn_implementation
    "sdpa" (GPT-OSS: "eager")."""
    kwargs = {**_COMMON, **FAMILIES.get(name, MOE_FAMILIES.get(name, {})), **overrides}
    model_type = kwargs.pop("model_type")
    return _config_class(model_type)(**kwargs, attn_implementation=_attention(model_type))


@torch.no_grad()
def init_tiny_weights_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Deterministic, thread-count independent: each parameter from a CPU generator seeded by (seed, name), float64.

    Same rule as ds_tsp.tools.reference_model.init_weights_: N(0, 0.02) for matrices, embeddings and biases, 1 + 0.1 N(0, 1)
    for norm weights (incl. q_norm/k_norm) so norm gradients are non-trivial, N(0, 0.5) for MoE routers, 0.3 N(0, 1)
    for GLM-4.5's e_score_correction_bias buffers (zero in transformers' init: it would not change the choice). A
    tied lm_head is listed once.
    """
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2 ** 63))
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        # MoE routers: logits spread enough to route unevenly; GPT-OSS's attention sinks: far enough from 0 to matter
        scale = 0.5 if name.endswith((".gate.weight", ".router.weight", ".sinks")) else 0.02
        param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    for name, buffer in model.named_buffers():  # GLM-4.5's choice bias: large enough to change which experts win
        if name.endswith("e_score_correction_bias"):
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen, dtype=torch.float64))
        if name.endswith("layer_scalar"):  # Gemma 4's checkpoint scalars (real ones: 0.005 to 0.92), not 1
            buffer.fill_(0.5 + 0.01 * (zlib.crc32(name.encode()) % 40))
    return model


def build_tiny_model(name_or_config, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    import transformers
    config = tiny_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation=_attention(config.model_type))
    return init_tiny_weights_(model.to(torch.float64), seed).to(dtype)


def save_tiny_checkpoint(directory, name_or_config, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                         max_shard_size=None) -> Path:
    """Build family `name_or_config` (or a config object), init deterministically, save_pretrained (safetensors)."""
    model = build_tiny_model(name_or_config, dtype=dtype, seed=seed)
    directory = Path(directory)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


# multimodal model_type -> (its text family in FAMILIES, a tiny vision tower): the ForConditionalGeneration checkpoints
# whose language model TSP trains
MULTIMODAL: dict[str, tuple[str, dict]] = {
    "gemma3": ("gemma3", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)),
    "mistral3": ("mistral", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14, head_dim=8)),
}


def save_tiny_multimodal_checkpoint(directory, model_type: str, *, seed: int = 0) -> Path:
    """A tiny transformers ForConditionalGeneration of MULTIMODAL[model_type] (its language model FAMILIES' tiny
    config), initialised deterministically and saved in float32 as transformers saves it."""
    import transformers

    family, vision = MULTIMODAL[model_type]
    text = {**_COMMON, **FAMILIES[family]}
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration never soft-caps (TSP refuses the cap there)
        text.pop("final_logit_softcapping", None)
    extra = {"mm_tokens_per_image": 4} if model_type == "gemma3" else {"spatial_merge_size": 1}
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **extra)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    init_tiny_weights_(model.to(torch.float64), seed).to(torch.float32).save_pretrained(directory)
    return Path(directory)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """HF labels (unshifted) -> shift_labels: the target of position t is labels[t + 1]; the last is -100."""
    return torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], -100)), dim=1)


def packed_batch(vocab_size: int, doc_lengths_per_row, seed: int = 0) -> dict:
    """Packed rows like DataCollatorWithFlattening: positions restart at 0 per document, and the first label of
    every document is -100 (labels are the input ids, unshifted). Also returns `documents` (the lengths)."""
    documents = [list(map(int, row)) for row in doc_lengths_per_row]
    lengths = {sum(row) for row in documents}
    if len(lengths) != 1 or min(min(row) for row in documents) < 1:
        raise ValueError(f"every row must have the same total length and documents >= 1 token: {documents}")
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (len(documents), lengths.pop()), generator=g)
    labels = input_ids.clone()
    position_ids = torch.empty_like(input_ids)
    for b, row in enumerate(documents):
        start = 0
        for n in row:
            position_ids[b, start:start + n] = torch.arange(n)
            labels[b, start] = -100
            start += n
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "documents": documents}


def randomize_lora_(wrapped, seed: int = 7):
    """PEFT initialises B to zero (the adapter starts as a no-op): random factors make every LoRA gradient, A's
    included, nonzero, so a comparison can fail."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return wrapped
