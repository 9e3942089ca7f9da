"""The TSP models: the sharded pieces (modules/), the causal LM on this rank's shard (causal_lm) with its loss
reductions (loss) and checkpoint protocol (state_dict), its HF face (hf_causal_lm, TRL's fused head call in
fused_lm_head), PEFT LoRA (peft/), and the one conversion entry point (convert.to_tsp_model)."""
from __future__ import annotations

import importlib

# names the pre-release ds_tsp.model (one module) exported -> (where they live now, their name there)
_MOVED = {
    "TSPCausalLM": ("ds_tsp.model.causal_lm", "ShardedCausalLM"),
    "TSPOptions": ("ds_tsp.core.config", "TSPOptions"),
    "normalise_over_data": ("ds_tsp.model.loss", "normalise_over_data"),
    "count_valid_tokens": ("ds_tsp.model.loss", "count_valid_tokens"),
}


def __getattr__(name: str):
    if name in _MOVED:
        from ds_tsp.core.deprecation import warn_moved

        module, new = _MOVED[name]
        face = "ds_tsp" if new in ("ShardedCausalLM", "TSPOptions") else module
        warn_moved(f"ds_tsp.model.{name}", f"{face}.{new}")
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'ds_tsp.model' has no attribute {name!r}")
