"""How a training loop's weights and optimizer state are read and written, one parameter at a time.

`OptimizerAccess` covers a plain torch optimizer over the TSP model's parameters (the state lives in
`optimizer.state[param]`, shaped like the parameter: this rank's TSP shard). Engines that keep an fp32 master copy
or shard the state over the data axis (DeepSpeed ZeRO) subclass it (ds_tsp.checkpoint.training.deepspeed_access).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ds_tsp.core.errors import TSPConfigError


def _first_state(optimizer: torch.optim.Optimizer) -> dict:
    return next(iter(optimizer.state.values()), {})


def jsonable(value: Any, where: str) -> Any:
    """Plain JSON data (numbers, strings, lists, dicts) or one clear error: a checkpoint never pickles."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): jsonable(v, f"{where}.{k}") for k, v in value.items()}
    raise TSPConfigError(f"{where} is a {type(value).__name__}: ds_tsp checkpoints store only JSON data and "
                         "safetensors (nothing is pickled); use a scheduler/optimizer whose state_dict() is plain "
                         "numbers, or drop it")


class OptimizerAccess:
    def __init__(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None, *,
                 global_batch_size: int, zero_step: Callable[[], None] | None = None):
        """zero_step: one training step with an all-zero loss, to create the optimizer's state in a fresh run
        (default: zero grads and optimizer.step())."""
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self._global_batch_size, self._zero_step = global_batch_size, zero_step

    # --- what the optimizer is ---------------------------------------------------------------------------------
    @property
    def base(self) -> torch.optim.Optimizer:
        """The torch optimizer that holds the state (an engine may wrap it)."""
        return self.optimizer

    def name(self) -> str:
        return type(self.base).__name__

    def global_batch_size(self) -> int:
        return self._global_batch_size

    def state_keys(self) -> list[str]:
        """Per-element state tensors (Adam: exp_avg, exp_avg_sq); scalars like `step` are saved once."""
        return sorted(k for k, v in _first_state(self.base).items() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def has_state(self) -> bool:
        return len(self.base.state) > 0

    # --- per parameter (a TSP shard, whole over the data axis) ------------------------------------------------
    def weight(self, param: nn.Parameter) -> torch.Tensor:
        return param.detach()

    def state(self, param: nn.Parameter, key: str) -> torch.Tensor:
        return self.base.state[param][key]

    def set_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    def set_state(self, param: nn.Parameter, key: str, value: torch.Tensor) -> None:
        target = self.base.state[param][key]
        target.copy_(value.to(target.dtype))

    def finish_load(self) -> None:
        """After every set_*: engines refresh derived copies here."""

    # --- scalars -----------------------------------------------------------------------------------------------
    def step_count(self) -> float | int | None:
        step = _first_state(self.base).get("step")
        return None if step is None else jsonable(step, "optimizer step")

    def set_step_count(self, value: float | int | None) -> None:
        if value is None:
            return
        for state in self.base.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].fill_(value)
            elif "step" in state:
                state["step"] = type(state["step"])(value)

    def param_groups(self) -> list[dict]:
        return [jsonable({k: v for k, v in g.items() if k != "params"}, f"optimizer.param_groups[{i}]")
                for i, g in enumerate(self.base.param_groups)]

    def set_param_groups(self, groups: list[dict]) -> None:
        if len(groups) != len(self.base.param_groups):
            raise TSPConfigError(f"the checkpoint's optimizer has {len(groups)} param groups, this one "
                                 f"{len(self.base.param_groups)}: resume with the same optimizer setup")
        for saved, group in zip(groups, self.base.param_groups):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v

    def scheduler_state(self) -> dict | None:
        if self.lr_scheduler is None:
            return None
        return jsonable(self.lr_scheduler.state_dict(), "lr_scheduler.state_dict()")

    def load_scheduler_state(self, state: dict | None) -> None:
        if (state is None) != (self.lr_scheduler is None):
            have = "has no" if state is None else "has an"
            raise TSPConfigError(f"the checkpoint {have} lr scheduler state but this run "
                                 f"{'has one' if self.lr_scheduler is not None else 'has none'}: configure the same "
                                 "scheduler as the run that saved it")
        if state is not None:
            self.lr_scheduler.load_state_dict(state)

    def counters(self) -> dict[str, int]:
        return {}

    def set_counters(self, counters: dict[str, int]) -> None:
        pass

    # --- a fresh run has no optimizer state yet ---------------------------------------------------------------
    def ensure_state(self, params: list[nn.Parameter]) -> None:
        """Create the optimizer state (collective where the engine is): a step whose gradients are all zero.
        Every value it touches is overwritten by the checkpoint right after."""
        if self.has_state():
            return
        if self._zero_step is not None:
            self._zero_step()
            return
        for p in params:
            p.grad = torch.zeros_like(p)
        self.base.step()
        self.base.zero_grad(set_to_none=True)
