"""The TSP models: sharded pieces (sharded_modules), the causal LM on this rank's shard (sharded_causal_lm), its HF
face (hf_causal_lm) and the one conversion entry point (convert.to_tsp_model)."""
from __future__ import annotations

import importlib

# names the previous release's ds_tsp.model (one module) exported -> (where they live now, their name there)
_MOVED = {
    "TSPCausalLM": ("ds_tsp.model.sharded_causal_lm", "ShardedCausalLM"),
    "TSPOptions": ("ds_tsp.core.config", "TSPOptions"),
    "normalise_over_data": ("ds_tsp.model.sharded_causal_lm", "normalise_over_data"),
    "count_valid_tokens": ("ds_tsp.model.sharded_causal_lm", "count_valid_tokens"),
}


def __getattr__(name: str):
    if name in _MOVED:
        from ds_tsp.core.deprecation import warn_moved

        module, new = _MOVED[name]
        face = "ds_tsp" if new in ("ShardedCausalLM", "TSPOptions") else module
        warn_moved(f"ds_tsp.model.{name}", f"{face}.{new}")
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'ds_tsp.model' has no attribute {name!r}")
