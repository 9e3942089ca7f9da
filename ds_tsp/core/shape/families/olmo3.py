"""OLMo 3 (Olmo3ForCausalLM, model_type olmo3): q_norm / k_norm over a token's whole q / k projection (every head at
once, not per head), norms on each sublayer's output only (no input norms), sliding and full layers by layer_types
(by default every 4th layer full), each layer type with its own RoPE (rope_parameters per layer type; a legacy
rope_scaling applies to the full layers only, as Olmo3Config converts it), rope_theta 5e5, untied embeddings and
padding row 1 by default.
Refused by name: attention_bias (an o_proj bias too), attention_dropout, another activation than silu, experts."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.families.base import (
    Family,
    HFConfig,
    decoder_fields,
    dense_only,
    layer_type_windows,
    rope_fields,
)

_THETA = 500_000.0  # Olmo3Config.default_theta


def read(cfg: HFConfig) -> dict:
    dense_only(cfg)
    full, sliding = _ropes(cfg)
    fields = decoder_fields(cfg.with_values(rope_parameters=full, rope_scaling=None), eps=1e-5, theta=_THETA,
                            pad_token_id=1)
    local_theta, local = rope_fields(cfg.with_values(rope_parameters=sliding, rope_scaling=None), _THETA)
    layers = fields["num_layers"]
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                             for i in range(layers)]
    windows = layer_type_windows(cfg, layers, cfg.get("sliding_window", 4096), layer_types)
    own_rope = windows is not None and (local_theta, local) != (fields["rope_theta"], fields["rope_scaling"])
    return {**fields, "projection_qk_norm": True, "post_norms": True, "attention_windows": windows,
            "sliding_rope_theta": local_theta if own_rope else 0.0, "sliding_rope_scaling": local if own_rope else None}


def _ropes(cfg: HFConfig) -> tuple[dict, dict]:
    """(full layers' rope parameters, sliding layers'), from transformers 5's rope_parameters per layer type or a
    config.json's legacy rope_theta / rope_scaling (the scaling on the full layers only), Olmo3Config's defaults."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and not any(isinstance(v, dict) for v in params.values()):
        raise TSPConfigError(f"rope_parameters={params} on an olmo3 config: Olmo3Config reads rope_parameters per "
                             "layer type ({'full_attention': {...}, 'sliding_attention': {...}}) and ignores a flat "
                             "block; nest it, or give the legacy rope_theta / rope_scaling")
    theta = cfg.get("rope_theta") or _THETA
    if params:
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, sliding = dict(cfg.get("rope_scaling") or {}), {}
    for block in (full, sliding):
        block.setdefault("rope_type", "default")
        block.setdefault("rope_theta", theta)
    return full, sliding


FAMILY = Family({"olmo3": "Olmo3ForCausalLM"}, read)
