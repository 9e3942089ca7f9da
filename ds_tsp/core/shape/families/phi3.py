"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's layer with fused projections: `qkv_proj` holds q, k and v rows (in that
order) and `gate_up_proj` the gate and up rows; partial rotary where the rope says so (Phi-4-mini), one sliding
window on every layer when set. A rank reads its head block's q, k and v rows of the fused tensor and its MLP
columns' gate and up rows (ModelShape.fused_qkv / fused_gate_up). Refused by name in this version: the longrope
scaling of the 128k checkpoints (its frequencies switch with the batch's longest position), and residual or
embedding dropout."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import Family, HFConfig, decoder_fields, dense_only, uniform_window


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    for key in ("resid_pdrop", "embd_pdrop"):
        if float(cfg.get(key, 0.0) or 0.0) > 0:
            raise TSPConfigError(f"{key}={cfg.get(key)} on a phi3 config: TSP has no dropout; set it to 0.0")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("longrope", "su", "yarn"):  # transformers reads Phi-3's "su" / "yarn" as longrope
        raise TSPConfigError(f"rope_parameters.rope_type={rope_type!r} on a phi3 config: longrope picks its short or "
                             "long factors by the batch's longest position, which this version of TSP does not "
                             "compute; use a checkpoint with default RoPE (Phi-3 4k, Phi-4)")
    fields = decoder_fields(cfg, eps=1e-5, partial_rotary=True, pad_token_id=32000)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    return {**fields, "partial_rotary_factor": float(partial),
            "attention_windows": uniform_window(cfg, fields["num_layers"]), "fused_qkv": True,
            "fused_gate_up": True}


FAMILY = Family({"phi3": "Phi3ForCausalLM"}, read)
