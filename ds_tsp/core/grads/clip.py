"""The grad norm of the FULL model from its TSP shards, and the marks that say which parameter is a shard.

A TSP-sharded parameter holds 1/D of a weight, so its squared grad norm is summed over the TSP group; a replicated
one (the norms, Qwen3's q/k norms) holds the same grad on every TSP rank and is counted once. DeepSpeed and
Megatron read the first three marks; `tsp_sharded` is ds_tsp's own, which FSDP2, Accelerate and plain loops read
through `is_tsp_sharded` and `clip_grad_norm_`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ProcessGroups
from ds_tsp.core.reliability.watchdog import guard

__all__ = ["TSP_PARAM_ATTRS", "mark_sharded", "is_tsp_sharded", "clip_grad_norm_", "group_ranks"]

TSP_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "tsp_sharded")


def mark_sharded(param: nn.Parameter) -> nn.Parameter:
    # DeepSpeed/Megatron read these to count a sharded param on every model-parallel rank in the grad norm.
    param.tensor_model_parallel = True
    param.partition_dim = 0
    param.partition_stride = 1
    param.tsp_sharded = True
    return param


def is_tsp_sharded(param: torch.Tensor) -> bool:
    """True for a parameter that holds this rank's 1/D TSP shard (also after FSDP2 re-created it)."""
    return bool(getattr(param, "tsp_sharded", False))


def group_ranks(group) -> frozenset[int]:
    return frozenset(dist.get_process_group_ranks(group))


def _dtensor_type():
    from torch.distributed.tensor import DTensor
    return DTensor


def _dtensor_reduce_groups(grad, tsp_ranks: frozenset[int], own_rank: int) -> tuple:
    """The process groups a DTensor grad is sharded over (its local squares must be summed over them)."""
    from torch.distributed.tensor import Partial, Shard

    out = []
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Partial):
            raise TSPConfigError(f"a gradient has a Partial placement on mesh dim {dim} ({grad.placements}): reduce "
                                 "gradients (finish backward / the FSDP reduce-scatter) before clipping")
        if isinstance(placement, Shard) or getattr(placement, "is_shard", lambda: False)():
            group = grad.device_mesh.get_group(dim)
            if (group_ranks(group) & tsp_ranks) - {own_rank}:
                raise TSPConfigError("a DTensor gradient is sharded over a mesh dim that contains other ranks of "
                                     "this TSP group: FSDP must shard over the data axis only (shard_with_fsdp2 "
                                     "uses groups.device_mesh()['data'])")
            out.append(group)
    return tuple(out)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module | list, max_norm: float, groups: ProcessGroups,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip grads to `max_norm` by the norm of the FULL model's gradient; return that norm (identical on every rank).

    norm^p = sum over TSP-sharded params of |local grad|^p summed over the TSP group (and, for DTensor grads as
    FSDP2 leaves them, over the mesh dims they are sharded on, i.e. the data axis) + sum over replicated params
    (norm weights: identical on every TSP rank, counted once) of |grad|^p. Plain grads (no data engine, or DDP's
    already-averaged ones) are taken as they are on this rank. norm_type: any p > 0 or inf (max instead of sum).
    Grads are scaled by min(1, max_norm / (norm + 1e-6)) like torch.nn.utils.clip_grad_norm_; no device-to-host
    sync. `model` may also be a list of parameters (their `tsp_sharded` marks decide).
    """
    norm_type = float(norm_type)
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise TSPConfigError(f"norm_type={norm_type}: clip_grad_norm_ supports p > 0 (e.g. 2.0) or inf")
    inf = norm_type == math.inf
    if isinstance(model, nn.Module):
        names = getattr(model, "tsp_sharded_param_names", frozenset())
        params = [(p, is_tsp_sharded(p) or n in names) for n, p in model.named_parameters()]
    else:
        params = [(p, is_tsp_sharded(p)) for p in model]
    DTensor = _dtensor_type()
    tsp_ranks = group_ranks(groups.tsp_group) if groups.layout.tsp_enabled else frozenset({groups.rank})
    count_replicated = groups.tsp_rank == 0  # replicated grads are identical on every TSP rank: count them once

    # buckets: key -> (groups to reduce over, [local grads]); key () = plain local grads
    buckets: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
    all_local: list[torch.Tensor] = []
    for p, sharded in params:
        g = p.grad
        if g is None:
            continue
        reduce_over: tuple = ()
        if isinstance(g, DTensor):
            reduce_over = _dtensor_reduce_groups(g, tsp_ranks, groups.rank)
            g = g.to_local()
        all_local.append(g)
        key = tuple(id(x) for x in reduce_over)
        bucket = buckets.setdefault(key, (reduce_over, []))
        if g.numel() and (sharded or count_replicated or inf):
            bucket[1].append(g)
    if not all_local:  # as torch.nn.utils.clip_grad_norm_ does, on the parameters' device
        return torch.zeros((), device=params[0][0].device if params else None)
    device = all_local[0].device
    acc = torch.float64 if any(g.dtype == torch.float64 for g in all_local) else torch.float32

    def local_part(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=acc, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in grads])
        return norms.max() if inf else norms.pow(norm_type).sum()

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    # every all-reduce is guarded (the model's comm gives timeout_s): a stalled peer ends this rank with one line
    comm = next((m.comm for m in model.modules() if hasattr(getattr(m, "comm", None), "timeout_s")), None) \
        if isinstance(model, nn.Module) else None
    timeout_s = comm.timeout_s if comm is not None else None
    total = torch.zeros((), dtype=acc, device=device)
    for reduce_over, grads in buckets.values():  # first-seen order: the same parameter order on every rank
        part = local_part(grads)
        for group in reduce_over:
            with guard("grad norm all_reduce", timeout_s=timeout_s, group=group, comm=comm, context="clip_grad_norm_"):
                dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if inf else total + part
    if groups.layout.tsp_enabled:
        with guard("grad norm all_reduce", timeout_s=timeout_s, group=groups.tsp_group, comm=comm,
                   context="clip_grad_norm_"):
            dist.all_reduce(total, op=op, group=groups.tsp_group)
    total_norm = total if inf else total.pow(1.0 / norm_type)

    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in all_local:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, clip_coef.to(dtype))
    return total_norm
