"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on the data axis, TSP on the tsp axis: a thin adapter, no TSP math.

    groups = ProcessGroups.build(ParallelLayout.from_world_size(world, tsp=D))
    model = ShardedCausalLM(shape, TSPComm(groups.tsp_group), ...)          # or a ds_tsp.hf.TSPForCausalLM
    model.load_full_state_dict(full)                                    # load BEFORE sharding (params are local)
    shard_with_fsdp2(model, groups, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=...)
    share = model(input_ids, shift_labels, position_ids)                # batches from ds_tsp.TSPDataLoader
    share.backward()
    norm = clip_grad_norm_(model, 1.0, groups)      # ds_tsp.core.grads.clip: the FULL model's grad norm, every rank
    opt.step(); opt.zero_grad()

To FSDP each rank's TSP shards (packed_shard, vocab_shard) and replicated norm weights are ordinary local tensors:
it shards them again over the data sub-mesh (`groups.device_mesh()["data"]`) and AVERAGES their grads over it;
`set_data_parallel_group` makes that average the token-weighted mean over the global batch.
With a cp axis (tsp.cp_size = C: C TSP groups split each sequence) the "data" sub-mesh spans data x cp: the cp
groups hold the same shards, so FSDP2 shards them over data x cp and averages the cp groups' gradients like data
replicas'. The model must carry the cp ring (TSPComm(groups.tsp_group, cp=TSPComm(groups.cp_group)), what
ds_tsp.core.parallel.runtime.build_runtime builds) and the batches come cut over cp then TSP (TSPDataLoader,
shard_batch(..., cp=C, cp_rank=groups.cp_rank)); tests/cp/test_cp_fsdp.py checks it against one process. The TSP
collectives (weight broadcasts/rings, K/V all-gathers, the replicated-norm grad all-reduce) run inside the layers on the
other axis, on the unsharded parameters FSDP2 installs in its pre-forward hook.

Units: one per decoder layer, then the root (embedding + final norm + LM head). The tied LM head reads the
embedding's `vocab_shard` from another module, so both stay in the root unit that owns the shared parameter.

FSDP2 swaps every parameter for a new nn.Parameter(DTensor) and drops custom attributes; `shard_with_fsdp2`
re-marks the new parameters (`tsp_sharded`, `tensor_model_parallel`, `partition_dim`, `partition_stride`) and
records their names in `model.tsp_sharded_param_names`, so "is this a TSP shard" still has an answer.

Frozen parameters (requires_grad=False on the HF model converted) and a PEFT LoRA model (TSPForCausalLM.
from_pretrained(peft_model, ...)) shard like any other: build the optimizer on the trainable parameters; frozen
ones get no gradient and stay as loaded (tests/model/test_frozen_lora_compose.py: against single-device PEFT).

A vision-language model (ds_tsp.hf.TSPForConditionalGeneration): the language model shards as above; the vision
tower stays whole on every rank (FSDP2 ignores its parameters: replicated, small next to the language model), its
grads summed over the TSP group and averaged over the data group in its own backward (model.tower_data_group,
ds_tsp.core.layers.vision), so they arrive as plain tensors averaged like FSDP2's. Its weights stay in their own
dtype: a MixedPrecisionPolicy whose param_dtype differs from the tower's is refused by name.

Not covered: the core model's `full_state_dict` / `load_full_state_dict` / `init_weights_` expect local tensors, so
load weights before sharding (or use torch.distributed.checkpoint on the DTensor state dict).
"""
from __future__ import annotations

from torch import nn

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.clip import TSP_PARAM_ATTRS, group_ranks, is_tsp_sharded
from ds_tsp.core.parallel.topology import ProcessGroups
from ds_tsp.model.convert import core_model

__all__ = ["shard_with_fsdp2"]


def __getattr__(name: str):
    if name == "clip_grad_norm_":  # the pre-release ds_tsp.integrations.fsdp.clip_grad_norm_
        from ds_tsp.core.deprecation import warn_moved
        from ds_tsp.core.grads.clip import clip_grad_norm_

        warn_moved("ds_tsp.integrations.fsdp.clip_grad_norm_", "ds_tsp.clip_grad_norm_")
        return clip_grad_norm_
    raise AttributeError(f"module 'ds_tsp.integrations.fsdp' has no attribute {name!r}")

def shard_with_fsdp2(model: nn.Module, groups: ProcessGroups, *, mp_policy=None,
                     reshard_after_forward: bool | int = True, offload_policy=None) -> nn.Module:
    """fully_shard each decoder layer, then the root, over the data sub-mesh; returns `model` (sharded in place).

    `model` is a ShardedCausalLM or a TSPForCausalLM (the root is the object passed: its forward must be the call
    you train with). `mp_policy`: a torch.distributed.fsdp.MixedPrecisionPolicy, passed through (e.g. bf16
    params, fp32 reduce). `reshard_after_forward` applies to the layers (FSDP2 never reshards the root after
    forward). Collective over the data axis (FSDP2 broadcasts nothing, but every rank must call it).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    core = core_model(model)
    if core.comm.size != groups.tsp_size or (groups.layout.tsp_enabled and group_ranks(core.comm.group)
                                             != group_ranks(groups.tsp_group)):
        raise TSPConfigError(f"the model was built on a TSP group of size {core.comm.size}, not on groups.tsp_group "
                             f"(size {groups.tsp_size}): build it with TSPComm(groups.tsp_group)")
    model_cp = core.comm.cp_size
    if model_cp != groups.cp_size or (model_cp > 1 and group_ranks(core.comm.cp.group) != group_ranks(groups.cp_group)):
        # a model without the cp ring on cp-cut batches would attend within its own chunks only: silently wrong
        raise TSPConfigError(f"the model was built with a cp ring of size {model_cp}, the groups have tsp.cp_size="
                             f"{groups.cp_size}: build it with TSPComm(groups.tsp_group, cp=TSPComm(groups.cp_group)) "
                             "(ds_tsp.core.parallel.runtime.build_runtime's comm), or cp_size 1 throughout")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise TSPConfigError("the model already has DTensor parameters (sharded twice?): call shard_with_fsdp2 once, "
                             "on a model with plain local parameters")
    marks = {name: {a: getattr(p, a) for a in TSP_PARAM_ATTRS if hasattr(p, a)}
             for name, p in model.named_parameters() if is_tsp_sharded(p)}
    mesh = groups.device_mesh(core.device.type)["data"]
    kwargs = {"mesh": mesh, "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
              "offload_policy": offload_policy if offload_policy is not None else OffloadPolicy()}
    tower = _replicated_tower(model, kwargs["mp_policy"], offload_policy)
    for layer in core.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # Root: embed_tokens, the final norm and lm_head (whose tied weight IS embed_tokens.vocab_shard).
    fully_shard(model, ignored_params=set(tower.parameters()) if tower is not None else None, **kwargs)
    core.set_data_parallel_group(groups.data_group)
    if tower is not None:
        model.tower_data_group = groups.data_group
    params = dict(model.named_parameters())
    for name, attrs in marks.items():
        for attr, value in attrs.items():
            setattr(params[name], attr, value)
    model.tsp_sharded_param_names = frozenset(marks)
    return model


def _replicated_tower(model: nn.Module, mp_policy, offload_policy) -> nn.Module | None:
    """A TSPForConditionalGeneration's vision tower, which FSDP2 must leave whole (module docstring); None for a
    language model."""
    if not hasattr(model, "tower_data_group"):
        return None
    tower = model.visual
    dtypes = {p.dtype for p in tower.parameters()}
    if mp_policy.param_dtype is not None and dtypes != {mp_policy.param_dtype}:
        raise TSPConfigError(f"MixedPrecisionPolicy(param_dtype={mp_policy.param_dtype}) with a vision-language "
                             f"model under FSDP2: the vision tower stays whole in {sorted(map(str, dtypes))}, outside "
                             "FSDP2's casts; use no MixedPrecisionPolicy (mixed_precision 'no'), or DeepSpeed")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise TSPConfigError(f"offload_policy={type(offload_policy).__name__} with a vision-language model under "
                             "FSDP2: the vision tower stays whole on the device, outside FSDP2's offload; use no "
                             "offload_policy")
    return tower
