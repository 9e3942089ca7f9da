"""Checkpoint names of a multimodal checkpoint (Qwen3_5ForConditionalGeneration, Gemma3ForConditionalGeneration,
Mistral3ForConditionalGeneration) seen as its language model.

transformers saves these models with the language model under `model.language_model.{embed_tokens,layers,norm}.*`
(Qwen3.5) or under the Hub's older layout `language_model.model.*` and `language_model.lm_head.weight` (Gemma 3,
Mistral 3: transformers writes its checkpoint conversion back on save), the vision side beside it
(`model.visual.*`, `vision_tower.*`, `multi_modal_projector.*`, ...) and `lm_head.weight` (absent when tied). TSP
trains the language model, whose names are its ForCausalLM's: `model.{embed_tokens,layers,norm}.*` and
`lm_head.weight`. `LanguageModelReader` shows a reader under those names; in a multimodal checkpoint every tensor
outside the language model is hidden, never read. `hidden` adds prefixes hidden in any checkpoint of the family
(Qwen3.5's `mtp.*` multi-token-prediction head, which its transformers ForCausalLM ignores too). A checkpoint with
neither layout passes through unchanged except for `hidden`.
"""
from __future__ import annotations

import torch

# where a multimodal checkpoint keeps its language model -> the ForCausalLM's name
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}


def is_multimodal(names) -> bool:
    """Whether a checkpoint's tensor names are a multimodal model's (its language model under one of the
    LANGUAGE_MODEL_PREFIXES)."""
    return any(name.startswith(tuple(LANGUAGE_MODEL_PREFIXES)) for name in names)


class LanguageModelReader:
    """A CheckpointReader (or AliasedReader) under the language model's ForCausalLM names: names(), `in`, shape(),
    read()."""

    def __init__(self, reader, hidden: tuple[str, ...] = ()):
        self.reader = reader
        self.source: dict[str, str] = {}
        names = reader.names()
        multimodal = is_multimodal(names)
        for name in names:
            if name.startswith(hidden):
                continue
            prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                self.source[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):]] = name
            elif not multimodal or name.startswith("lm_head."):  # else: the vision tower, the projector
                self.source[name] = name

    def names(self) -> list[str]:
        return list(self.source)

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.source[name])

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int | None = None, *,
             out: torch.Tensor) -> torch.Tensor:
        return self.reader.read(self.source[name], dim, start, length, out=out)


def language_model_tensors(named: dict) -> dict:
    """{name: tensor} of a multimodal model (state_dict, grads) under its language model's ForCausalLM names, the
    vision side left out; any other dict unchanged."""
    if not is_multimodal(named):
        return named
    out = {}
    for name, value in named.items():
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            out[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):]] = value
        elif name.startswith("lm_head."):
            out[name] = value
    return out
