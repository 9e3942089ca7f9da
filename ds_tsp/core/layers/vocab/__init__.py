"""The vocab-sharded ends of the model: the embedding ring (embedding), the LM head fused with cross-entropy (loss),
the logits of a few positions (logits) and per-token log-probabilities (token_stats)."""
