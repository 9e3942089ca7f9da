"""`from ds_tsp.accelerate import TSPAccelerator as Accelerator`: see ds_tsp.integrations.accelerate."""
from ds_tsp.integrations.accelerate import TSPAccelerator

__all__ = ["TSPAccelerator"]
