"""ds_tsp training checkpoints for a DeepSpeed engine: weights and optimizer state per TSP shard, any ZeRO stage.

    step = ds_tsp.load_training_checkpoint(engine, "ckpt", loader=loader) or 0   # None: nothing saved yet
    ...
    ds_tsp.save_training_checkpoint(engine, "ckpt", step, loader=loader, keep_last=3)

The adapter reads each parameter's fp32 master copy and optimizer state whole over the data axis with DeepSpeed's
public tensor-fragment API (safe_get_full_fp32_param / safe_get_full_optimizer_state: one tensor at a time, for
ZeRO 1/2/3 and the bf16 optimizer) and falls back to the torch optimizer's own state without ZeRO. The format,
its checks and the resharding are ds_tsp.checkpoint.training's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_tsp.checkpoint.training.access import OptimizerAccess
from ds_tsp.checkpoint.training.shard_files import DEFAULT_FILE_BYTES
from ds_tsp.checkpoint.training.store import CheckpointStore
from ds_tsp.checkpoint.training.train_state import load_train_state, save_train_state
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.tokens.zigzag import shard_batch


class DeepSpeedAccess(OptimizerAccess):
    def __init__(self, engine: Any):
        # DeepSpeed counts its train_batch_size over the mpu's data-parallel ranks, data x cp; the cp groups of a
        # replica read the same samples, so the samples per step are that / cp_size
        self.cp_size = engine.tsp_groups.cp_size if getattr(engine, "tsp_groups", None) is not None else 1
        super().__init__(engine.optimizer, engine.lr_scheduler,
                         global_batch_size=engine.train_batch_size() // self.cp_size, zero_step=self._zero_step)
        self.engine = engine

    @property
    def base(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO / bf16 wrappers keep the torch one

    @staticmethod
    def _fragments(param: nn.Parameter) -> bool:
        return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")

    def weight(self, param):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(param) if self._fragments(param) else param.detach()

    def state(self, param, key):
        from deepspeed.utils import safe_get_full_optimizer_state

        return safe_get_full_optimizer_state(param, key) if self._fragments(param) else self.base.state[param][key]

    def set_weight(self, param, value):
        from deepspeed.utils import safe_set_full_fp32_param

        if self._fragments(param):
            safe_set_full_fp32_param(param, value.to(torch.float32))
        if not hasattr(param, "ds_id"):  # ZeRO-3's partitioned copy is refreshed in finish_load
            super().set_weight(param, value)

    def set_state(self, param, key, value):
        from deepspeed.utils import safe_set_full_optimizer_state

        if self._fragments(param):
            safe_set_full_optimizer_state(param, value.to(torch.float32), key)
        else:
            super().set_state(param, key, value)

    def finish_load(self) -> None:
        opt = self.optimizer
        if hasattr(opt, "fp16_partitioned_groups_flat"):  # ZeRO-3: the model's partitions from the fp32 masters
            # what DeepSpeed's own step does after the optimizer ran (stage3.py, 0.16-0.19): copy the masters into
            # the partitions, re-point the parameters at them, and re-gather the persistent (small) parameters
            opt._partition_all_parameters()
            for group in range(len(opt.fp16_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(group)
            if opt.persistent_parameters:
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
            opt.invalidate_secondary_tensor()

    def counters(self) -> dict[str, int]:
        """Saved in samples (layout-free): DeepSpeed's global_samples counts over its data-parallel ranks, data x
        cp, so it is divided by cp_size here and multiplied by this run's in set_counters (a resume at another cp
        degree continues as that layout's uninterrupted run would)."""
        e = self.engine
        return {"global_steps": int(e.global_steps), "global_samples": int(e.global_samples) // self.cp_size,
                "skipped_steps": int(e.skipped_steps)}

    def set_counters(self, counters: dict[str, int]) -> None:
        for key, value in counters.items():
            setattr(self.engine, key, value * self.cp_size if key == "global_samples" else value)

    def _zero_step(self) -> None:
        """A fresh engine has no optimizer state: one engine step with an all-zero loss creates it everywhere."""
        engine, groups = self.engine, self.engine.tsp_groups
        ids = torch.zeros(engine.train_micro_batch_size_per_gpu(), 2 * groups.tsp_size * groups.cp_size,
                          dtype=torch.long)
        batch = shard_batch(ids, tsp=groups.tsp_size, rank=groups.tsp_rank, cp=groups.cp_size, cp_rank=groups.cp_rank)
        inputs = [batch[k].to(engine.device) for k in ("input_ids", "shift_labels", "position_ids")]
        for _ in range(engine.gradient_accumulation_steps()):
            if engine.tsp_model is engine.module:
                loss = engine(*inputs)
            else:  # the HF-shaped TSPForCausalLM
                loss = engine(input_ids=inputs[0], shift_labels=inputs[1], position_ids=inputs[2],
                              tsp_shard=(groups.tsp_rank, groups.tsp_size), seq_len=ids.shape[1]).loss
            engine.backward(loss * 0.0)
            engine.step()


def _check_engine(engine: Any) -> None:
    if getattr(engine, "tsp_groups", None) is None:
        raise TSPConfigError("engine has no tsp_groups: build it with ds_tsp.initialize (not deepspeed.initialize)")
    if engine.tsp_model is None:
        raise TSPConfigError("ds_tsp training checkpoints need pipeline_stages=1; with pipeline stages use "
                             "engine.save_checkpoint / load_checkpoint (same layout only)")


def save_training_checkpoint(engine: Any, save_dir: str | Path, step: int, *, loader: Any = None,
                             keep_last: int = 3, max_file_bytes: int = DEFAULT_FILE_BYTES) -> Path:
    """Collective: write save_dir/step-<step> (weights + optimizer state per shard, manifest, RNG, data position
    when `loader` is a TSPDataLoader); keep the newest `keep_last`. Returns the checkpoint's directory."""
    _check_engine(engine)
    return save_train_state(DeepSpeedAccess(engine), engine.tsp_model, engine.tsp_groups,
                            CheckpointStore(save_dir, keep_last), step,
                            data_state=loader.state_dict() if loader is not None else None,
                            max_file_bytes=max_file_bytes)


def load_training_checkpoint(engine: Any, save_dir: str | Path, *, loader: Any = None,
                             path: str | Path | None = None) -> int | None:
    """Collective: resume from `path` or save_dir's newest complete checkpoint, on this engine's layout (TSP and
    data degrees may differ from the saving run's). Returns the step saved, or None when there is none."""
    _check_engine(engine)
    found = load_train_state(DeepSpeedAccess(engine), engine.tsp_model, engine.tsp_groups,
                             CheckpointStore(save_dir), path=path)
    if found is None:
        return None
    manifest, where = found
    if loader is not None:
        if manifest.data is None:
            raise TSPConfigError(f"{where}: saved without a data position (no loader= at save): pass the same "
                                 "loader to save_training_checkpoint so a resume continues the data order")
        loader.load_state_dict(manifest.data)
    return manifest.step
