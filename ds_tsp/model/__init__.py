"""The TSP models: sharded pieces (sharded_modules), the causal LM on this rank's shard (sharded_causal_lm), its HF
face (hf_causal_lm) and the one conversion entry point (convert.to_tsp_model)."""
