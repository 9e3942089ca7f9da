"""Thin adapters to DeepSpeed, Accelerate, FSDP2, the HF Trainer and TRL: each calls
ds_tsp.core.parallel.runtime.build_runtime and ds_tsp.model.convert.to_tsp_model, and holds no TSP math."""
