"""Hugging Face models in and out: HF-shaped TSP model, sharded loading, streaming save, Trainer.

    from ds_tsp.hf import TSPForCausalLM, TSPTrainer
    model = TSPForCausalLM.from_pretrained("local/llama-3.2-1b", tsp_group=group)
"""
from ds_tsp.model.hf_causal_lm import TSPForCausalLM

__all__ = ["TSPForCausalLM", "TSPTrainer"]


def __getattr__(name):  # TSPTrainer imports transformers' Trainer and accelerate: only when asked for
    if name == "TSPTrainer":
        from ds_tsp.integrations.hf_trainer import TSPTrainer

        return TSPTrainer
    raise AttributeError(f"module 'ds_tsp.hf' has no attribute {name!r}")
