"""`ds-tsp bench --hf-config` on a hybrid model (Qwen3.5 / Qwen3-Next: Gated DeltaNet + gated attention layers).

TSP runs it (ShardedCausalLM builds TSPGatedDeltaNet for every linear_attention layer). The peers cannot, and are
refused by name rather than run on a model they do not build: their sessions build an HF LlamaForCausalLM from the
shape (ds_tsp.tools.bench.common.hf_config), which has no Gated DeltaNet layer, and DeepSpeed's Ulysses
(UlyssesSPAttentionHF) wraps the attention function only -- a Gated DeltaNet layer's causal conv and recurrence would
see the local 1/D of the sequence as a whole sequence (a GDN-aware Ulysses wrapper is an open DeepSpeed pull request
at the time of writing, deepspeedai/DeepSpeed#8114). "all" means the TSP layouts.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.core.shape import ModelShape


def hybrid_layouts(shape: ModelShape, layouts_flag: str, layouts: list[str]) -> list[str]:
    """The layouts a hybrid shape runs on ("all": the TSP ones); ValueError naming the peers asked for explicitly."""
    from ds_tsp.tools.bench.config import LAYOUTS

    if shape.layer_types is None:
        return layouts
    if layouts_flag.strip() == "all":
        return [name for name in layouts if LAYOUTS[name].module == "tsp"]
    peers = [name for name in layouts if LAYOUTS[name].module != "tsp"]
    if peers:
        raise ValueError(f"--layouts {peers}: a hybrid model (Gated DeltaNet layers, --hf-config model_type "
                         f"{shape.hybrid_family!r}) runs on the TSP layouts only: the peers' sessions build an HF "
                         "Llama, and DeepSpeed's Ulysses wraps attention only, not the Gated DeltaNet's conv and "
                         "recurrence; use --layouts tsp or tsp_speed")
    return layouts


def cut_layers(shape: ModelShape, layers: int) -> ModelShape:
    """A hybrid shape cut to its first `layers` layers (layer_types cut with them)."""
    return replace(shape, num_layers=layers, layer_types=shape.layer_types[:layers])
