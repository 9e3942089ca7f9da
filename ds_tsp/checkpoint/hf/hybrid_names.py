"""Checkpoint names of a Qwen3.5 multimodal checkpoint (Qwen3_5ForConditionalGeneration) seen as its language model
(and likewise Gemma 4's, Gemma4ForConditionalGeneration: model.language_model., its towers hidden).

transformers saves the multimodal model as `model.language_model.{embed_tokens,layers,norm}.*`, `model.visual.*`,
`lm_head.weight` (and the Hub checkpoints add `mtp.*`, the multi-token-prediction head transformers does not build).
TSP trains the language model, whose names are Qwen3_5ForCausalLM's: `model.{embed_tokens,layers,norm}.*` and
`lm_head.weight`. `LanguageModelReader` shows a reader under those names: `model.X` reads `model.language_model.X`;
the vision tower and the mtp head are hidden (never read; what transformers' Qwen3_5ForCausalLM ignores too).
A checkpoint without `model.language_model.` names passes through unchanged except that `mtp.*` is hidden.
"""
from __future__ import annotations

import torch

LANGUAGE_MODEL_PREFIX = "model.language_model."
_HIDDEN_PREFIXES = ("model.visual.", "mtp.",  # Qwen3_5ForCausalLM's _keys_to_ignore_on_load_unexpected
                    # Gemma4ForConditionalGeneration's vision and audio towers and their embedders
                    "model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


class LanguageModelReader:
    """A CheckpointReader (or AliasedReader) under Qwen3_5ForCausalLM names: names(), `in`, shape(), read()."""

    def __init__(self, reader):
        self.reader = reader
        self.source: dict[str, str] = {}
        for name in reader.names():
            if name.startswith(_HIDDEN_PREFIXES):
                continue
            own = "model." + name[len(LANGUAGE_MODEL_PREFIX):] if name.startswith(LANGUAGE_MODEL_PREFIX) else name
            self.source[own] = name

    def names(self) -> list[str]:
        return list(self.source)

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.source[name])

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int | None = None, *,
             out: torch.Tensor) -> torch.Tensor:
        return self.reader.read(self.source[name], dim, start, length, out=out)
