"""Hugging Face models in and out: HF-shaped TSP model, sharded loading, streaming save.

    from ds_tsp.hf import TSPForCausalLM
    model = TSPForCausalLM.from_pretrained("local/llama-3.2-1b", tsp_group=group)
"""
from ds_tsp.hf.causal_lm import TSPForCausalLM

__all__ = ["TSPForCausalLM"]
