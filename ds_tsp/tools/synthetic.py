"""A built-in learnable causal-LM dataset, so examples and tests need no download.

Each sample repeats one of a few fixed random token patterns from a random phase: a model that memorises the
patterns predicts almost every token, so the loss falls quickly and visibly.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class RepeatingPatterns(Dataset):
    """`num_samples` samples {"input_ids": [seq_len]}, each one of `num_patterns` fixed random token patterns
    repeated from a random phase: a learnable dataset that needs no download."""

    def __init__(self, *, vocab_size: int, seq_len: int, num_samples: int = 1024, num_patterns: int = 8,
                 alphabet: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randperm(vocab_size, generator=g)[:min(alphabet, vocab_size)]
        lengths = torch.randint(8, 25, (num_patterns,), generator=g)
        self.patterns = [tokens[torch.randint(0, len(tokens), (int(n),), generator=g)] for n in lengths]
        self.seq_len, self.num_samples, self.seed = seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        pattern = self.patterns[int(torch.randint(len(self.patterns), (1,), generator=g))]
        phase = int(torch.randint(len(pattern), (1,), generator=g))
        reps = -(-(self.seq_len + phase) // len(pattern))
        return {"input_ids": pattern.repeat(reps)[phase:phase + self.seq_len].clone()}


def save_tiny_llama(directory, *, seed: int = 0, vocab_size: int = 256, hidden_size: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate_size: int = 176):
    """Build a tiny Llama-3-style model from a config (llama3 rope, GQA, tied), deterministic in `seed`, and save
    it with save_pretrained: a local checkpoint for examples and tests, never a download."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory
