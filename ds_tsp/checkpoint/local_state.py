"""Per-rank state (model and optimizer) as plain local tensors, so resumes do not depend on DTensor pickling.

Under FSDP2 parameters and Adam moments are DTensors; torch.save records their storages on "cpu:0", which
torch.load cannot restore on CPU, and a pickled DeviceMesh is not meant to outlive its process group anyway. Each
rank saves the LOCAL tensors of its own shards and, on load, writes them back into the (same-layout) DTensors.
"""
from __future__ import annotations

import torch
from torch import nn


def _dtensor():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        from torch.distributed._tensor import DTensor
    return DTensor


def to_local(obj):
    """The same nested structure with every DTensor replaced by its local tensor."""
    DTensor = _dtensor()
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local(v) for v in obj)
    return obj


@torch.no_grad()
def load_model_local(model: nn.Module, saved: dict) -> None:
    DTensor = _dtensor()
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    if missing:
        raise KeyError(f"saved state lacks {missing[0]} ({len(missing)} entries): saved by another model or layout")
    for name, value in current.items():
        target = value.to_local() if isinstance(value, DTensor) else value
        target.copy_(saved[name])


def load_optimizer_local(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """load_state_dict, then turn each moment back into a DTensor laid out like its parameter."""
    DTensor = _dtensor()
    optimizer.load_state_dict(saved)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == p.to_local().shape:
                    state[key] = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape,
                                                    stride=p.stride(), run_check=False)
