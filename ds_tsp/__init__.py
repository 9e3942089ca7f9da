"""ds_tsp: TSP, tensor and sequence parallelism folded onto one mesh axis, for PyTorch and DeepSpeed.

The public surface is what these faces export (their __all__); every other module path is internal and may move:
    ds_tsp             launching, the TSP group, the sharded model on raw shards, DeepSpeed and FSDP2 on the data axis,
                       checkpoints, a launched script's stdout and exit (this module; names load on first use, so
                       `import ds_tsp` stays light)
    ds_tsp.hf          Hugging Face models in and out, the Trainer, TRL's SFTTrainer
    ds_tsp.accelerate  the Accelerate face (TSPAccelerator)
    ds_tsp.testing     single-device references, tolerances and synthetic data for checking TSP
Pre-release module paths (ds_tsp.launch, ds_tsp.comm, ...) still import, with a DeprecationWarning
naming the new import (ds_tsp/_moved.py)."""
from __future__ import annotations

import importlib

from ds_tsp import _moved
from ds_tsp.core.version import __version__

# public name -> the module that defines it (loaded on first access)
_LAZY = {
    # launching and the TSP group
    "init_from_env": "ds_tsp.core.parallel.launch",
    "run_on_local_ranks": "ds_tsp.core.parallel.launch",
    "local_device": "ds_tsp.core.parallel.launch",
    "exit_rank": "ds_tsp.core.parallel.launch",
    "TSPComm": "ds_tsp.core.comm.communicator",
    "ParallelLayout": "ds_tsp.core.parallel.topology",
    "ProcessGroups": "ds_tsp.core.parallel.topology",
    # configuration and errors
    "TSPConfig": "ds_tsp.core.config",
    "TSPOptions": "ds_tsp.core.config",
    "parse_tsp_config": "ds_tsp.core.config",
    "TSPConfigError": "ds_tsp.core.errors",
    "TSPNonFiniteError": "ds_tsp.core.errors",
    # data and the model on raw shards
    "shard_batch": "ds_tsp.core.tokens.zigzag",
    "TSPDataLoader": "ds_tsp.core.tokens.loader",
    "pipeline_batches": "ds_tsp.core.tokens.loader",
    "ModelShape": "ds_tsp.core.shape.model_shape",
    "ShardedCausalLM": "ds_tsp.model.causal_lm",
    "to_tsp_model": "ds_tsp.model.convert",
    # DeepSpeed: deepspeed.initialize with TSP, and ds_tsp's own training checkpoints of its engine
    "initialize": "ds_tsp.integrations.deepspeed.engine",
    "save_training_checkpoint": "ds_tsp.checkpoint.training.deepspeed_access",
    "load_training_checkpoint": "ds_tsp.checkpoint.training.deepspeed_access",
    # the data axis
    "load_ds_config": "ds_tsp.integrations.deepspeed.engine",
    "shard_with_fsdp2": "ds_tsp.integrations.fsdp",
    "clip_grad_norm_": "ds_tsp.core.grads.clip",
    # checkpoints
    "save_consolidated": "ds_tsp.checkpoint.consolidated",
    "load_consolidated": "ds_tsp.checkpoint.consolidated",
    # a launched script: JSON lines only on stdout, one line and exit 2 for a bad config
    "run_main": "ds_tsp.tools.entry_point",
    "reserve_stdout": "ds_tsp.tools.json_stdout",
    "emit": "ds_tsp.tools.json_stdout",
    "json_stream": "ds_tsp.tools.json_stdout",
}

_moved.install(_LAZY)

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'ds_tsp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
