"""DeepSpeed engine setup shared by the Ulysses, AutoTP and hf_zero3_dp peers (CPU, gloo, torch AdamW)."""
from __future__ import annotations

import torch

from ds_tsp.tools.bench.common import require
from ds_tsp.tools.bench.config import BenchConfig


def ds_config(cfg: BenchConfig, *, zero_stage: int, extra: dict | None = None) -> dict:
    """Reduce buckets of cfg.ds_bucket_elements (DeepSpeed's 5e8 default alone would dominate a small model's
    memory); ZeRO-3 gathers ~one layer at a time and partitions every matrix (see below)."""
    bucket = int(cfg.ds_bucket_elements)
    zero = {"stage": zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": False, "contiguous_gradients": True}
    if zero_stage == 3:
        # ZeRO-3 in its memory-lean regime, scaled to this model as DeepSpeed's defaults are to a large one:
        # gather about one decoder layer at a time (prefetch one, at most two live, release after use), and keep
        # only vectors (norms) whole on every rank -- DeepSpeed's 1e5-element persistence threshold would keep
        # every attention matrix of a small model unpartitioned.
        layer = _layer_elements(cfg)
        zero.update(stage3_prefetch_bucket_size=layer, stage3_max_live_parameters=2 * layer,
                    stage3_max_reuse_distance=layer, stage3_param_persistence_threshold=cfg.shape.hidden_size)
        del zero["allgather_bucket_size"]
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    config.update(extra or {})
    return config


def _layer_elements(cfg: BenchConfig) -> int:
    s = cfg.shape
    q, kv = s.num_heads * s.dim_per_head, s.num_kv_heads * s.dim_per_head
    return 2 * s.hidden_size * q + 2 * s.hidden_size * kv + 3 * s.hidden_size * s.intermediate_size


def init_distributed():
    """deepspeed.comm on top of the gloo group the launcher already started."""
    deepspeed = require("deepspeed")
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def torch_optimizers(engine) -> list[torch.optim.Optimizer]:
    """The torch optimizer(s) inside a DeepSpeed engine (ZeRO wraps one; its state is what MemTracker tags OPT)."""
    found, obj = [], engine.optimizer
    for _ in range(4):
        if obj is None:
            break
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
        obj = getattr(obj, "optimizer", None)
    return found
