"""Consolidated checkpoints: TSP shards as one plain HF checkpoint (safetensors + config.json), at any TSP degree.

The result loads in any plain transformers install (AutoModelForCausalLM.from_pretrained) and in ds_tsp at ANY
TSP degree (ds_tsp.hf.TSPForCausalLM.from_pretrained, or load_consolidated below), which is how a run moves from
D=4 to D=2. Saving streams one module at a time to the writing rank (ds_tsp.checkpoint.hf.save), so no rank holds
the whole model. DeepSpeed's own engine.save_checkpoint / load_checkpoint keep working for same-layout resumes
(one file per TSP rank, optimizer state included); this module is the layout-independent format.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ds_tsp.core.shape.model_shape import ModelShape

CONFIG_NAME = "config.json"


def hf_config_dict(shape: ModelShape, dtype: torch.dtype) -> dict:
    """A config.json transformers reads back into the same model (Llama, Mistral, Qwen2 or Qwen3)."""
    from ds_tsp.core.shape.hf_config import config_dict_from_shape

    return config_dict_from_shape(shape, dtype)


def save_consolidated(model: nn.Module, directory: str | Path, max_shard_size: int | str = "5GB") -> Path | None:
    """Collective over every rank; global rank 0 writes. Returns the directory on the writer, else None."""
    from ds_tsp.checkpoint.hf.save import save_streaming
    from ds_tsp.core.shape.hf_config import config_json

    source = getattr(model, "hf_config", None)  # the transformers config it was converted from (ds_tsp.initialize)
    config = (config_json(source, model.dtype) if source is not None
              else json.dumps(hf_config_dict(model.shape, model.dtype), indent=2))
    generation = getattr(model, "generation_config_json", None)
    return save_streaming(model, directory, config, max_shard_size=max_shard_size,
                          extra_files={"generation_config.json": generation} if generation else None)


def load_consolidated(directory: str | Path) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, HF-named full weights) of a consolidated or HF checkpoint directory: the FULL model in memory.

    For small models and tests; at scale build the model and call ds_tsp.checkpoint.hf.load.load_sharded, which
    reads only each rank's slices.
    """
    from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

    directory = Path(directory)
    shape = ModelShape.from_hf_config(json.loads((directory / CONFIG_NAME).read_text()))
    reader = CheckpointReader(directory)
    return shape, {name: reader.read(name) for name in reader.names()}
