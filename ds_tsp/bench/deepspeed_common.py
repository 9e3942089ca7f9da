"""DeepSpeed engine setup shared by the Ulysses and AutoTP peers (CPU, gloo, torch AdamW: nothing compiles)."""
from __future__ import annotations

import torch

from ds_tsp.bench.common import require
from ds_tsp.bench.config import BenchConfig


def ds_config(cfg: BenchConfig, *, zero_stage: int, extra: dict | None = None) -> dict:
    """Buckets of cfg.ds_bucket_elements (DeepSpeed's 5e8 default alone would dominate a small model's memory)."""
    bucket = int(cfg.ds_bucket_elements)
    zero = {"stage": zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": False, "contiguous_gradients": True}
    if zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=bucket,
                    stage3_max_reuse_distance=bucket)
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
