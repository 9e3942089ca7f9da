"""Llama (LlamaForCausalLM): the decoder every other family starts from (ds_tsp.core.shape.families.base)."""
from __future__ import annotations

from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only, no_window


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    no_window(cfg)
    return decoder_fields(cfg)


FAMILY = Family({"llama": "LlamaForCausalLM"}, read)
