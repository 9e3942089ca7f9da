"""`from ds_tsp.accelerate import TSPAccelerator as Accelerator`: see ds_tsp.integrations.accelerate.accelerator."""
from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

__all__ = ["TSPAccelerator"]
