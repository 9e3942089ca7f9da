"""A weight shard a Function rebuilds in backward instead of keeping it alive from forward.

The attention and MLP Functions save the packed shard they stream, for backward's second pass. When that shard is
a parameter, saving it costs nothing. When it is a fresh tensor computed from smaller ones (ds_tsp.model.peft.lora: the
frozen base plus this rank's LoRA deltas), saving it would keep a second full copy of every adapted shard from
forward to backward. The producer therefore attaches a recipe, `attach_rebuild(shard, fn, *inputs)`: the Function
saves `inputs` (the base parameter and the factors as forward used them) and calls `fn(*inputs)` in backward, which
must return the same values bit for bit (the same ops on the same inputs). A cast copy (autocast's custom_fwd)
carries no recipe and is saved as itself, like any other shard.

    save_with_shard(ctx, shard, *tensors)     in forward, instead of ctx.save_for_backward(shard, *tensors)
    shard, tensors = saved_with_shard(ctx)    in backward, instead of shard, *tensors = ctx.saved_tensors
"""
from __future__ import annotations

from typing import Callable

import torch

_RECIPE = "_ds_tsp_rebuild"


def attach_rebuild(shard: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """Mark `shard` as fn(*inputs) for the Functions that save it; returns `shard`. fn must be a pure function of
    its arguments (it runs again in backward, under no_grad)."""
    setattr(shard, _RECIPE, (fn, inputs))
    return shard


def save_with_shard(ctx, shard: torch.Tensor, *tensors: torch.Tensor) -> None:
    """ctx.save_for_backward(shard, *tensors), the shard replaced by its recipe's inputs where it has one."""
    fn, inputs = getattr(shard, _RECIPE, (None, (shard,)))
    ctx.shard_rebuild, ctx.shard_inputs = fn, len(inputs)
    ctx.save_for_backward(*inputs, *tensors)


def saved_with_shard(ctx) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the shard, rebuilt if it was saved as a recipe; the other saved tensors in order)."""
    saved = ctx.saved_tensors
    inputs, rest = saved[:ctx.shard_inputs], list(saved[ctx.shard_inputs:])
    if ctx.shard_rebuild is None:
        return inputs[0], rest
    with torch.no_grad():
        return ctx.shard_rebuild(*inputs), rest
