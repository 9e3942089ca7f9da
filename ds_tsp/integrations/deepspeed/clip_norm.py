"""The clip norm of a DeepSpeed engine without ZeRO (stage 0), kept for get_global_grad_norm().

Without ZeRO (and in fp32), DeepSpeed clips through runtime.utils.clip_grad_norm_ and drops the norm it computed, so
engine.get_global_grad_norm() (what the HF Trainer and Accelerate log as grad_norm) is None there, where ZeRO's
optimizers keep it. The engine's own clip is kept as it is (the same call, the same mpu: TSP-sharded parameters
counted on every TSP rank, replicated ones once); only its result is stored where ZeRO stores it.
"""
from __future__ import annotations


def keep_clip_norm(engine) -> None:
    """Make a stage-0 engine's clip store the norm it computes (a no-op for the ZeRO and pipeline engines, whose
    optimizers record it)."""
    if not hasattr(engine, "clip_fp32_gradients") or engine.zero_optimization():
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients():
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients
