"""Turn what a user script built for a plain HF model into its TSP counterpart, for Accelerate and the Trainer.

A script written for transformers builds `model = AutoModelForCausalLM...` and `optimizer = AdamW(model
.parameters())` before `prepare`. `to_tsp_model` converts the model (an HF Llama-family model, a local checkpoint
path, a config or ModelShape, or an existing TSP model); `rebind_optimizer` points the SAME optimizer object (so a
scheduler built on it keeps working) at the TSP shards, param group by param group, mapping HF parameter names to the
shard that holds them (a mixture-of-experts model's in-memory names, fused experts and Mixtral's `mlp.` block,
translated to the checkpoint names the shards use: ds_tsp.model.trainability.checkpoint_names).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.reliability.watchdog import label_modules
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.hf_causal_lm import TSPForCausalLM
from ds_tsp.model.trainability import checkpoint_names, hf_name, load_hf_model


def to_tsp_model(model, comm: TSPComm, *, options: TSPOptions = TSPOptions(), dtype=None, device=None,
                 data_group=None, state_dict: dict[str, torch.Tensor] | None = None,
                 seed: int = 0, hf_face: bool = False,
                 source: nn.Module | None = None) -> TSPForCausalLM | ShardedCausalLM:
    """The one conversion entry point: whatever a user script built, as a TSP model on `comm`'s group.

    - a transformers Llama-family model or a local checkpoint directory: a TSPForCausalLM (the HF call signature;
      a directory is read by slices, never whole on any rank);
    - a ModelShape, a transformers config or a config dict: a ShardedCausalLM (this rank's zigzag shard in, its
      loss share out), its shards taken from `source` (the in-memory transformers or PEFT LoRA model the config
      came from: weights unless `state_dict` overrides them, requires_grad, the LoRA adapter), from `state_dict`
      (HF names), or initialised in place from `seed`;
    - a TSPForCausalLM, TSPForConditionalGeneration or ShardedCausalLM already built: checked against `comm`'s
      degree, returned as it is (the Trainer converts a vision-language model itself: ds_tsp.integrations.multimodal).
    Every result is labelled for the stall watchdog (a stalled collective's report names its layer).
    hf_face=True (the Trainer and Accelerate, whose loops call the model the HF way) accepts only the first and
    TSPForCausalLM kinds.
    """
    from ds_tsp.model.hf_conditional_generation import TSPForConditionalGeneration

    if isinstance(model, (TSPForCausalLM, TSPForConditionalGeneration)) or \
            (not hf_face and isinstance(model, ShardedCausalLM)):
        core = model.tsp if isinstance(model, (TSPForCausalLM, TSPForConditionalGeneration)) else model
        if core.comm.size != comm.size:
            raise TSPConfigError(f"the {type(model).__name__} was built for tsp={core.comm.size} but the config asks "
                                 f"for tsp={comm.size}: pass the HF model (or its checkpoint path) instead")
        if not isinstance(model, TSPForConditionalGeneration):  # its data group is the Trainer's choice (None)
            core.set_data_parallel_group(data_group)
        return label_modules(model)
    if isinstance(model, (str, Path)) or (hasattr(model, "config") and hasattr(model, "state_dict")):
        if not isinstance(model, (str, Path)) and not hasattr(model.config, "model_type"):
            raise TSPConfigError(f"{type(model).__name__} has no config.model_type: TSP converts transformers "
                                 "Llama / Mistral / Qwen2 / Qwen3 causal LMs")
        if not isinstance(model, (str, Path)) and any(hasattr(p, "ds_id") for p in model.parameters()):
            # from_pretrained under a live ZeRO-3 config (TrainingArguments(deepspeed=<stage 3>) made earlier) leaves
            # every weight partitioned, empty on this rank: there is nothing to shard
            raise TSPConfigError(f"{type(model).__name__}'s weights are partitioned by DeepSpeed ZeRO-3 (it was "
                                 "loaded after TrainingArguments(deepspeed=<stage 3 config>)): pass the checkpoint "
                                 "directory instead of the model (TSP reads it by slices), or load the model before "
                                 "creating the TrainingArguments")
        converted = TSPForCausalLM.from_pretrained(model, comm, dtype=dtype or "auto", options=options,
                                                   device=device, data_group=data_group)
        if not isinstance(model, (str, Path)) and _checkpointing_enabled(model):
            converted.gradient_checkpointing_enable()
        return label_modules(converted)
    if not hf_face and (isinstance(model, ModelShape) or hasattr(model, "to_dict") or isinstance(model, dict)):
        shape = model if isinstance(model, ModelShape) else ModelShape.from_hf_config(model)
        sharded = ShardedCausalLM(shape, comm, options=options, dtype=dtype or torch.float32, device=device,
                                  data_group=data_group)
        if source is not None:
            load_hf_model(sharded, source, state_dict)
        elif state_dict is not None:
            sharded.load_full_state_dict(state_dict)
        else:
            sharded.init_weights_(seed)
        return label_modules(sharded)
    if hf_face:
        raise TSPConfigError(f"model={type(model).__name__}: TSP converts a transformers Llama / Mistral / Qwen2 / "
                             "Qwen3 causal LM, its local checkpoint directory, or a ds_tsp.hf.TSPForCausalLM")
    raise TSPConfigError(f"model={type(model).__name__}: TSP converts a transformers Llama / Mistral / Qwen2 / Qwen3 "
                         "causal LM, its local checkpoint directory, a transformers config or a ds_tsp ModelShape, "
                         "or a ds_tsp TSPForCausalLM / ShardedCausalLM")


def _shard_of_hf_name(tsp: ShardedCausalLM) -> dict[str, nn.Parameter]:
    """HF parameter name -> the TSP parameter holding (this rank's part of) it."""
    owner = dict(tsp.replicated_params())
    for prefix, module, param in tsp.sharded_modules():
        owner.update({prefix + name: param for name in module.hf_shapes()})
    if tsp.lm_head is not None and tsp.lm_head.tied:  # a sequence classifier has no LM head
        owner["lm_head.weight"] = tsp.model.embed_tokens.vocab_shard
    owner.update({name: param for name, param, _ in tsp.lora_tensors()})
    return owner


def parameter_names(model) -> dict[int, str]:
    """id(parameter) -> name, taken before conversion (and before FSDP2 re-creates the parameters)."""
    if not isinstance(model, nn.Module):
        return {}
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], new_model: TSPForCausalLM) -> None:
    """Make `optimizer` (built on the parameters `names` describes: an HF model's, or the TSP model's own before
    FSDP2 re-created them) optimise new_model's current parameters, keeping its param groups.

    A shard that holds parameters of different groups (q_proj in one, k_proj in another) cannot honour both: one
    clear error. Optimizer state is dropped (prepare comes before the first step).
    """
    owner = _shard_of_hf_name(new_model.tsp)
    tsp_named = dict(new_model.named_parameters())  # an optimizer built on a TSPForCausalLM: same names
    shapes = {hf_name(n): tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
              if (n := names.get(id(p))) is not None and n not in tsp_named}
    held = checkpoint_names(shapes, new_model.tsp.shape.moe_family)
    group_of: dict[int, int] = {}
    new_groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise TSPConfigError("the optimizer holds a parameter that is not the model's: build it on "
                                     "model.parameters() of the model passed to prepare")
            target = tsp_named.get(name)
            if target is None:  # HF names (PEFT: base_model.model..., base_layer; MoE: fused, Mixtral's mlp.)
                parts = held[hf_name(name)]
                unmapped = [c for c in parts if c not in owner]
                if unmapped:
                    raise TSPConfigError(f"parameter {name!r} has no TSP counterpart" + (
                        f" for {unmapped[0]} ({len(unmapped)} of its {len(parts)} tensors)" if len(parts) > 1 else ""))
                targets = {id(owner[c]): owner[c] for c in parts}
                if len(targets) != 1:  # a fused HF tensor split over several TSP parameters: no one slot for it
                    raise TSPConfigError(f"parameter {name!r} is held by {len(targets)} TSP parameters: rebinding "
                                         "cannot split it; build the optimizer on the TSP model's parameters")
                target = next(iter(targets.values()))
            if group_of.setdefault(id(target), g) != g:
                raise TSPConfigError(f"parameter {name!r} is in optimizer param group {g} but shares its TSP shard "
                                     f"with a parameter of group {group_of[id(target)]}: put all q/k/v/o (and "
                                     "gate/up/down) weights of a layer in one param group")
            if not any(target is q for q in new_groups[g]):
                new_groups[g].append(target)
    # Frozen parameters may be left out (the Trainer builds its optimizer on the trainable ones only)
    missing = [n for n, p in new_model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise TSPConfigError(f"the optimizer does not cover {missing[0]} ({len(missing)} trainable TSP parameters): "
                             "build it on the model's trainable parameters (or all of model.parameters())")
    for group, params in zip(optimizer.param_groups, new_groups):
        group["params"] = params
    optimizer.state.clear()


def core_model(model: nn.Module) -> ShardedCausalLM:
    """The ShardedCausalLM inside `model`: itself, a ds_tsp.hf.TSPForCausalLM's `.tsp`, or a DDP wrapper's module."""
    inner = model
    for _ in range(3):  # e.g. DDP(TSPForCausalLM(...)).module.tsp
        if isinstance(inner, ShardedCausalLM):
            return inner
        inner = (inner.tsp if isinstance(getattr(inner, "tsp", None), ShardedCausalLM)
                 else getattr(inner, "module", None))
        if not isinstance(inner, nn.Module):
            break
    raise TSPConfigError(f"{type(model).__name__} is not a ds_tsp model: pass a ShardedCausalLM or a "
                         "ds_tsp.hf.TSPForCausalLM")


def _checkpointing_enabled(model) -> bool:
    # transformers 5 renamed the flag; reading the old name on a new model only raises a FutureWarning
    if hasattr(type(model), "is_activation_checkpointing") or hasattr(model, "is_activation_checkpointing"):
        return bool(getattr(model, "is_activation_checkpointing", False))
    return bool(getattr(model, "is_gradient_checkpointing", False))
