"""ds_tsp: TSP, tensor and sequence parallelism folded onto one mesh axis, for PyTorch and DeepSpeed."""
from __future__ import annotations

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """deepspeed.initialize with TSP: see ds_tsp.integrations.deepspeed.initialize."""
    from ds_tsp.integrations.deepspeed import initialize as _initialize

    return _initialize(*args, **kwargs)
