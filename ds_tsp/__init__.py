"""ds_tsp: TSP, tensor and sequence parallelism folded onto one mesh axis, for PyTorch and DeepSpeed."""
from __future__ import annotations

from ds_tsp.core.version import __version__

__all__ = ["__version__", "initialize", "load_training_checkpoint", "save_training_checkpoint"]


def initialize(*args, **kwargs):
    """deepspeed.initialize with TSP: see ds_tsp.integrations.deepspeed.engine.initialize."""
    from ds_tsp.integrations.deepspeed.engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def save_training_checkpoint(*args, **kwargs):
    """ds_tsp's own training checkpoint of a ds_tsp.initialize engine: see
    ds_tsp.checkpoint.training.deepspeed_access.save_training_checkpoint."""
    from ds_tsp.checkpoint.training.deepspeed_access import save_training_checkpoint as _save

    return _save(*args, **kwargs)


def load_training_checkpoint(*args, **kwargs):
    """Resume a ds_tsp.initialize engine (any TSP x data layout): see
    ds_tsp.checkpoint.training.deepspeed_access.load_training_checkpoint."""
    from ds_tsp.checkpoint.training.deepspeed_access import load_training_checkpoint as _load

    return _load(*args, **kwargs)
