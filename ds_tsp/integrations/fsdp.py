"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on the data axis, TSP on the tsp axis: a thin adapter, no TSP math.

    groups = ProcessGroups.build(ParallelLayout.from_world_size(world, tsp=D))
    model = TSPCausalLM(shape, TSPComm(groups.tsp_group), ...)          # or a ds_tsp.hf.TSPForCausalLM
    model.load_full_state_dict(full)                                    # load BEFORE sharding (params are local)
    shard_with_fsdp2(model, groups, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=...)
    share = model(input_ids, shift_labels, position_ids)                # batches from ds_tsp.data.TSPDataLoader
    share.backward()
    norm = clip_grad_norm_(model, 1.0, groups)                          # the FULL model's grad norm, every rank
    opt.step(); opt.zero_grad()

To FSDP each rank's TSP shards (packed_shard, vocab_shard) and replicated norm weights are ordinary local tensors:
it shards them again over the data sub-mesh (`groups.device_mesh()["data"]`) and AVERAGES their grads over it;
`set_data_parallel_group` makes that average the token-weighted mean over the global batch. The TSP collectives
(weight broadcasts/rings, K/V all-gathers, the replicated-norm grad all-reduce) run inside the layers on the other
axis, on the unsharded parameters FSDP2 installs in its pre-forward hook.

Units: one per decoder layer, then the root (embedding + final norm + LM head). The tied LM head reads the
embedding's `vocab_shard` from another module, so both stay in the root unit that owns the shared parameter.

FSDP2 swaps every parameter for a new nn.Parameter(DTensor) and drops custom attributes; `shard_with_fsdp2`
re-marks the new parameters (`tsp_sharded`, `tensor_model_parallel`, `partition_dim`, `partition_stride`) and
records their names in `model.tsp_sharded_param_names`, so "is this a TSP shard" still has an answer.

Not covered: the core model's `full_state_dict` / `load_full_state_dict` / `init_weights_` expect local tensors, so
load weights before sharding (or use torch.distributed.checkpoint on the DTensor state dict).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.errors import TSPConfigError
from ds_tsp.model import TSPCausalLM
from ds_tsp.topology import ProcessGroups

__all__ = ["shard_with_fsdp2", "clip_grad_norm_", "core_model", "is_tsp_sharded", "TSP_PARAM_ATTRS"]

# What ds_tsp.modules.mark_sharded sets on a TSP-sharded parameter (DeepSpeed/Megatron read the first three).
TSP_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "tsp_sharded")


def core_model(model: nn.Module) -> TSPCausalLM:
    """The TSPCausalLM inside `model`: itself, a ds_tsp.hf.TSPForCausalLM's `.tsp`, or a DDP wrapper's module."""
    inner = model
    for _ in range(3):  # e.g. DDP(TSPForCausalLM(...)).module.tsp
        if isinstance(inner, TSPCausalLM):
            return inner
        inner = inner.tsp if isinstance(getattr(inner, "tsp", None), TSPCausalLM) else getattr(inner, "module", None)
        if not isinstance(inner, nn.Module):
            break
    raise TSPConfigError(f"{type(model).__name__} is not a ds_tsp model: pass a TSPCausalLM or a "
                         "ds_tsp.hf.TSPForCausalLM")


def is_tsp_sharded(param: torch.Tensor) -> bool:
    """True for a parameter that holds this rank's 1/D TSP shard (also after FSDP2 re-created it)."""
    return bool(getattr(param, "tsp_sharded", False))


def shard_with_fsdp2(model: nn.Module, groups: ProcessGroups, *, mp_policy=None,
                     reshard_after_forward: bool | int = True, offload_policy=None) -> nn.Module:
    """fully_shard each decoder layer, then the root, over the data sub-mesh; returns `model` (sharded in place).

    `model` is a TSPCausalLM or a TSPForCausalLM (the root is the object passed: its forward must be the call
    you train with). `mp_policy`: a torch.distributed.fsdp.MixedPrecisionPolicy, passed through (e.g. bf16
    params, fp32 reduce). `reshard_after_forward` applies to the layers (FSDP2 never reshards the root after
    forward). Collective over the data axis (FSDP2 broadcasts nothing, but every rank must call it).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    core = core_model(model)
    if core.comm.size != groups.tsp_size or (groups.tsp_size > 1 and _group_ranks(core.comm.group)
                                             != _group_ranks(groups.tsp_group)):
        raise TSPConfigError(f"the model was built on a TSP group of size {core.comm.size}, not on groups.tsp_group "
                             f"(size {groups.tsp_size}): build it with TSPComm(groups.tsp_group)")
    if any(isinstance(p, _dtensor_type()) for p in model.parameters()):
        raise TSPConfigError("the model already has DTensor parameters (sharded twice?): call shard_with_fsdp2 once, "
                             "on a model with plain local parameters")
    marks = {name: {a: getattr(p, a) for a in TSP_PARAM_ATTRS if hasattr(p, a)}
             for name, p in model.named_parameters() if is_tsp_sharded(p)}
    mesh = groups.device_mesh(core.device.type)["data"]
    kwargs = {"mesh": mesh, "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
              "offload_policy": offload_policy if offload_policy is not None else OffloadPolicy()}
    for layer in core.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # Root: embed_tokens, the final norm and lm_head (whose tied weight IS embed_tokens.vocab_shard).
    fully_shard(model, **kwargs)
    core.set_data_parallel_group(groups.data_group)
    params = dict(model.named_parameters())
    for name, attrs in marks.items():
        for attr, value in attrs.items():
            setattr(params[name], attr, value)
    model.tsp_sharded_param_names = frozenset(marks)
    return model


def _dtensor_type():
    from torch.distributed.tensor import DTensor
    return DTensor


def _group_ranks(group) -> frozenset[int]:
    return frozenset(dist.get_process_group_ranks(group))


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
            if (_group_ranks(group) & tsp_ranks) - {own_rank}:
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
    tsp_ranks = _group_ranks(groups.tsp_group) if groups.tsp_size > 1 else frozenset({groups.rank})
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
    if not all_local:
        return torch.tensor(0.0)
    device = all_local[0].device
    acc = torch.float64 if any(g.dtype == torch.float64 for g in all_local) else torch.float32

    def local_part(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=acc, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in grads])
        return norms.max() if inf else norms.pow(norm_type).sum()

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=acc, device=device)
    for reduce_over, grads in buckets.values():  # first-seen order: the same parameter order on every rank
        part = local_part(grads)
        for group in reduce_over:
            dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if inf else total + part
    if groups.tsp_size > 1:
        dist.all_reduce(total, op=op, group=groups.tsp_group)
    total_norm = total if inf else total.pow(1.0 / norm_type)

    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in all_local:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, clip_coef.to(dtype))
    return total_norm
