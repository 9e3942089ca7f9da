"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's layer with fused projections: `qkv_proj` holds q, k and v rows (in that
order) and `gate_up_proj` the gate and up rows; partial rotary where the rope says so (Phi-4-mini), one sliding
window on every layer when set. A rank reads its head block's q, k and v rows of the fused tensor and its MLP
columns' gate and up rows (ModelShape.fused_qkv / fused_gate_up). The 128k checkpoints' longrope (the config's
"su" / "yarn" too, as transformers reads them) switches between its short and long factors by the whole batch's
longest position, which the step finds over the TSP group without a host read. Refused by name: residual or
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
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn", "longrope"):  # transformers reads all as longrope
        rope = {k: v for k, v in rope.items() if k != "type"}
        rope.update(rope_type="longrope", original_max_position_embeddings=rope.get(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings", 4096)))
        cfg = cfg.with_values(rope_parameters=rope, rope_scaling=None,
                              max_position_embeddings=cfg.get("max_position_embeddings", 4096))
    fields = decoder_fields(cfg, eps=1e-5, partial_rotary=True, pad_token_id=32000)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    return {**fields, "partial_rotary_factor": float(partial),
            "attention_windows": uniform_window(cfg, fields["num_layers"]), "fused_qkv": True,
            "fused_gate_up": True}


FAMILY = Family({"phi3": "Phi3ForCausalLM"}, read)
