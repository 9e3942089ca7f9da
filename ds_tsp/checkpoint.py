"""Consolidated checkpoints: gather TSP shards into HF-named full tensors, save as plain safetensors + config.json.

The result loads in any plain transformers install (LlamaForCausalLM / Qwen2ForCausalLM.from_pretrained) and in
ds_tsp at ANY TSP degree (TSPCausalLM.load_full_state_dict), which is how a run moves from D=4 to D=2.
DeepSpeed's own engine.save_checkpoint / load_checkpoint keep working for same-layout resumes (one file per TSP
rank, optimizer state included); this module is the layout-independent format.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tsp.model import TSPCausalLM
from ds_tsp.model_config import ModelShape

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def _gathered_zero3_params(model: torch.nn.Module):
    """Under ZeRO-3 params are partitioned over the data axis: gather them for the duration (else a no-op)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def consolidated_state_dict(model: TSPCausalLM) -> dict[str, torch.Tensor]:
    """Collective over the TSP group: HF-named full tensors (tied models omit lm_head.weight, like HF)."""
    with _gathered_zero3_params(model):
        full = model.full_state_dict()
    if model.shape.tie_word_embeddings:
        full.pop("lm_head.weight", None)
    return {k: v.detach().cpu().contiguous() for k, v in full.items()}


def hf_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """A config.json transformers reads: Llama, or Qwen2 when the model has q/k/v biases."""
    model_type = "qwen2" if shape.qkv_bias else "llama"
    config = {
        "architectures": ["Qwen2ForCausalLM" if shape.qkv_bias else "LlamaForCausalLM"],
        "model_type": model_type, "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.dim_per_head, "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": str(dtype)[6:],
        "max_position_embeddings": 131072,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


def save_consolidated(model: TSPCausalLM, directory: str | Path) -> Path | None:
    """Collective over the TSP group; global rank 0 writes. Returns the directory on the writer, else None."""
    from safetensors.torch import save_file

    full = consolidated_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(full, directory / WEIGHTS_NAME, metadata={"format": "pt", "producer": "ds_tsp"})
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config_dict(model.shape, model.dtype), indent=2))
    return directory


def load_consolidated(directory: str | Path) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, HF-named full weights) of a consolidated or HF checkpoint directory, for any TSP degree."""
    from safetensors.torch import load_file

    directory = Path(directory)
    shape = ModelShape.from_hf_config(json.loads((directory / CONFIG_NAME).read_text()))
    return shape, load_file(directory / WEIGHTS_NAME)
