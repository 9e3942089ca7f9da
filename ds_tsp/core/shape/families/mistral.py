"""Mistral (MistralForCausalLM): Llama's layer with one sliding window on every layer (MistralConfig's default 4096;
None: full attention)."""
from __future__ import annotations

from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only, uniform_window


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    fields = decoder_fields(cfg)
    return {**fields, "attention_windows": uniform_window(cfg, fields["num_layers"], default=4096)}


# Mistral3ForConditionalGeneration (Mistral Small 3.x; Ministral 3's text_config says ministral3): its language model
FAMILY = Family({"mistral": "MistralForCausalLM"}, read, wrappers={"mistral3": "mistral"})
