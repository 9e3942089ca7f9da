"""`ds-tsp bench --hf-config` on a hybrid model (Qwen3.5 / Qwen3-Next: Gated DeltaNet + gated attention layers).

TSP runs it (ShardedCausalLM builds TSPGatedDeltaNet for every linear_attention layer), and so does the baseline
every user has: layout hf_zero3_dp (ds_tsp.tools.bench.zero3_dp), transformers' own model of the same config under
DeepSpeed ZeRO-3 data parallelism, each rank a whole sequence, and, when named, hf_fsdp2_dp (ds_tsp.tools.bench.
fsdp2_dp: the same model under torch FSDP2 data parallelism). "all" means tsp, tsp_speed, hf_zero3_dp;
with --cp C, tsp_cp (C TSP groups sharing each sequence: the Gated DeltaNet gathers over cp) and tsp at C x D.

The sequence-parallel peers cannot run it, and are refused by name rather than run on a model they do not build:
- DeepSpeed Ulysses (ALST's UlyssesSPAttentionHF, layouts ulysses_zero3 / ulysses_zero1) swaps transformers'
  attention FUNCTION for one that all-to-alls sequence for heads around it. Nothing else in the layer sees the
  whole sequence: a Gated DeltaNet layer (linear_attn) calls no attention function, so under Ulysses it would run
  its causal conv (kernel K) and its delta-rule recurrence on the rank's contiguous 1/D of the tokens as if that
  were the whole sequence -- the conv would miss the K-1 tokens before the chunk and the recurrence the state
  carried from every earlier token: a different model, silently (the loss would still go down). A GDN-aware
  Ulysses (all-to-all around the Gated DeltaNet too, heads split over D) is deepspeedai/DeepSpeed#8114, an open
  pull request at the time of writing.
- The DTensor TP+SP and AutoTP peers build an HF Llama from the shape (ds_tsp.tools.bench.common.hf_config's Llama
  path) with Llama's tensor-parallel plan; neither has a plan for the Gated DeltaNet's fused in_proj_qkvz / conv1d
  / per-head A_log and dt_bias.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.core.shape.model_shape import ModelShape

HYBRID_PEER = "hf_zero3_dp"  # the peer that runs transformers' own hybrid model
_RUNS_HYBRIDS = ("tsp", "tsp_cp", "zero3_dp", "fsdp2_dp", "single")  # layout modules that build the hybrid model


def hybrid_layouts(shape: ModelShape, layouts_flag: str, layouts: list[str]) -> list[str]:
    """The layouts a hybrid shape runs on ("all": the TSP ones and hf_zero3_dp); ValueError naming the peers asked
    for explicitly that cannot run it. For other shapes "all" leaves hf_zero3_dp out (named, it runs)."""
    from ds_tsp.tools.bench.config import LAYOUTS

    explicit = layouts_flag.strip() != "all"
    if not explicit:
        layouts = [name for name in layouts if not LAYOUTS[name].named_only]
    if shape.layer_types is None:
        return layouts if explicit else [name for name in layouts if name != HYBRID_PEER]
    if not explicit:
        return [name for name in layouts if LAYOUTS[name].module in ("tsp", "tsp_cp") or name == HYBRID_PEER]
    peers = [name for name in layouts if LAYOUTS[name].module not in _RUNS_HYBRIDS]
    if peers:
        raise ValueError(f"--layouts {peers}: a hybrid model (Gated DeltaNet layers, --hf-config model_type "
                         f"{shape.hybrid_family!r}) runs on tsp, tsp_speed, {HYBRID_PEER} (transformers' own model, "
                         "ZeRO-3 data parallel), hf_fsdp2_dp (the same under torch FSDP2) and single: the other "
                         "peers' sessions build an HF Llama, and "
                         "DeepSpeed's Ulysses wraps the attention function only, so a Gated DeltaNet layer's conv "
                         "and recurrence would see 1/D of the sequence as the whole (deepspeedai/DeepSpeed#8114)")
    return layouts


def cut_layers(shape: ModelShape, layers: int) -> ModelShape:
    """A hybrid shape cut to its first `layers` layers (layer_types and an MoE hybrid's dense layers cut with
    them)."""
    return replace(shape, num_layers=layers, layer_types=shape.layer_types[:layers],
                   dense_mlp_layers=tuple(i for i in shape.dense_mlp_layers if i < layers))
