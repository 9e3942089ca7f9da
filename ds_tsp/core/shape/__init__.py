"""What a model is, read from its HF config: the shape (model_shape) with its MoE (moe) and hybrid (hybrid) parts,
and the transformers config in and out (hf_config)."""
