"""Thin adapters to DeepSpeed, Accelerate, FSDP2 and the HF Trainer: each calls ds_tsp.core.setup.build_runtime and
ds_tsp.model.convert.to_tsp_model, and holds no TSP math."""
