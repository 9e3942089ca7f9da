"""One adapter per transformers model family: what its config says, read into a ModelShape (base.Family).

    llama, mistral, qwen2, qwen3          dense decoders (q/k/v bias, q/k norms, sliding windows)
    qwen3_moe, mixtral                    mixtures of experts
    qwen3_5 (dense, MoE), qwen3_next      hybrids: Gated DeltaNet and gated full attention
    ministral3                            Mistral's layer with yarn RoPE and position-scaled queries
    phi3                                  Llama's layer with fused qkv_proj / gate_up_proj (Phi-3, Phi-4)
    gemma3                                Gemma 3's text model: GeGLU, sandwich norms, per-layer-type RoPE
    gemma4                                Gemma 4's text model: Gemma 3's layer, v norms, layer scalars, PLE
    olmo3                                 OLMo 3: whole-projection q/k norms, post-norms, per-layer-type RoPE
    glm4_moe                              GLM-4.5 / 4.6: grouped sigmoid routing, shared experts, partial rotary
    gpt_oss                               GPT-OSS: attention sinks, o_proj bias, biased clamped-SwiGLU experts

Adding a family is one module here (its reader, with transformers' defaults and every field TSP does not compute
refused by name) plus its entry in FAMILIES; a family that brings a new mechanism adds the ModelShape field that
names it and the layer code that honours it. Checkpoint names are the shared ones (q_proj, gate_proj, ...) unless
the family's fields say otherwise.
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families import (
    gemma3,
    gemma4,
    glm4_moe,
    gpt_oss,
    llama,
    ministral3,
    mistral,
    mixtral,
    olmo3,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from ds_tsp.core.shape.families.base import Family, HFConfig

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                mixtral.FAMILY, qwen3_5.DENSE, qwen3_5.MOE, qwen3_next.FAMILY, ministral3.FAMILY,
                                phi3.FAMILY, gemma3.FAMILY, olmo3.FAMILY, glm4_moe.FAMILY, gpt_oss.FAMILY,
                                gemma4.FAMILY)
# text model_type -> (its family, the ForCausalLM class a checkpoint of it names)
ARCHITECTURES = {t: arch for f in FAMILIES for t, arch in f.architectures.items()}
# multimodal model_type -> the text model_type of its language model (read through its text_config)
WRAPPERS = {outer: inner for f in FAMILIES for outer, inner in f.wrappers.items()}
MODEL_TYPES = (*ARCHITECTURES, *WRAPPERS)
_BY_TYPE = {t: f for f in FAMILIES for t in f.architectures}

__all__ = ["ARCHITECTURES", "FAMILIES", "MODEL_TYPES", "WRAPPERS", "HFConfig", "check_wrapped", "family_of",
           "language_model",
           "shape_fields"]


def language_model(config):
    """The language-model config of a multimodal config (its text_config, a dict given the text model_type when it
    lacks one), else `config` itself."""
    cfg = HFConfig(config)
    inner_type = WRAPPERS.get(cfg.model_type)
    if inner_type is None:
        return config
    inner = cfg.get("text_config")
    if inner is None:
        raise TSPConfigError(f"model_type={cfg.model_type!r} config has no text_config: TSP trains the language "
                             "model of this checkpoint and reads its shape from text_config")
    if isinstance(inner, dict) and "model_type" not in inner:
        inner = {**inner, "model_type": inner_type}
    check_wrapped(cfg.model_type, inner)
    return inner


def check_wrapped(outer_type: str, text_config) -> None:
    """Refuse a multimodal checkpoint's text_config where its model computes otherwise than the text model TSP
    trains and saves (the family's check_wrapped)."""
    check = family_of(WRAPPERS[outer_type]).check_wrapped
    if check is not None:
        check(HFConfig(text_config))


def family_of(model_type: str | None) -> Family:
    """The adapter of a text model_type; one error listing every family when TSP has none for it."""
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise TSPConfigError(f"model_type={model_type!r} is not supported; TSP converts {', '.join(ARCHITECTURES)} "
                             f"and the language model of {', '.join(WRAPPERS)}")
    return family


def shape_fields(config) -> dict:
    """ModelShape keyword arguments of a transformers config (object or config.json dict; a multimodal one is read
    through its text_config)."""
    cfg = HFConfig(language_model(config))
    if cfg.model_type is None:  # a bare config.json dict: read as Llama, as transformers' LlamaConfig would
        cfg = cfg.with_values(model_type="llama")
    return family_of(cfg.model_type).read(cfg)
