"""Every load and save: safetensors/ (the sliced reader, the streaming writer), hf/ (HF checkpoints in by slices and
out streamed), consolidated checkpoints, per-rank local state, training/ (ds_tsp's training checkpoints). Works on
any model that answers the sharded-piece protocol of ds_tsp.model.state_dict, without importing the model
classes."""
from __future__ import annotations

import importlib

# names the pre-release ds_tsp.checkpoint (one module) exported: now in ds_tsp.checkpoint.consolidated
_MOVED = ("save_consolidated", "load_consolidated", "hf_config_dict")


def __getattr__(name: str):
    if name in _MOVED:
        from ds_tsp.core.deprecation import warn_moved

        face = "ds_tsp" if name != "hf_config_dict" else "ds_tsp.checkpoint.consolidated"
        warn_moved(f"ds_tsp.checkpoint.{name}", f"{face}.{name}")
        return getattr(importlib.import_module("ds_tsp.checkpoint.consolidated"), name)
    raise AttributeError(f"module 'ds_tsp.checkpoint' has no attribute {name!r}")
