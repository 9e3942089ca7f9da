"""DeepSpeed: `ds_tsp.initialize` (engine), the Megatron-style mpu, pipeline stages of TSP blocks."""
