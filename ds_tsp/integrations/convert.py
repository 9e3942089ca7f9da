"""Turn what a user script built for a plain HF model into its TSP counterpart, for Accelerate and the Trainer.

A script written for transformers builds `model = AutoModelForCausalLM...` and `optimizer = AdamW(model
.parameters())` before `prepare`. `to_tsp_model` converts the model (an HF Llama-family model, a local checkpoint
path, or an existing TSPForCausalLM); `rebind_optimizer` points the SAME optimizer object (so a scheduler built on
it keeps working) at the TSP shards, param group by param group, mapping HF parameter names to the shard that holds
them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ds_tsp.comm import TSPComm
from ds_tsp.errors import TSPConfigError
from ds_tsp.hf import TSPForCausalLM
from ds_tsp.model import TSPCausalLM, TSPOptions
from ds_tsp.watchdog import label_modules


def to_tsp_model(model, comm: TSPComm, *, options: TSPOptions = TSPOptions(), dtype=None,
                 data_group=None) -> TSPForCausalLM:
    if isinstance(model, TSPForCausalLM):
        if model.tsp.comm.size != comm.size:
            raise TSPConfigError(f"the TSPForCausalLM was built for tsp={model.tsp.comm.size} but the config asks "
                                 f"for tsp={comm.size}: pass the HF model (or its checkpoint path) instead")
        model.tsp.set_data_parallel_group(data_group)
        return label_modules(model)
    if isinstance(model, (str, Path)) or (hasattr(model, "config") and hasattr(model, "state_dict")):
        if not isinstance(model, (str, Path)) and not hasattr(model.config, "model_type"):
            raise TSPConfigError(f"{type(model).__name__} has no config.model_type: TSP converts transformers "
                                 "Llama / Mistral / Qwen2 / Qwen3 causal LMs")
        converted = TSPForCausalLM.from_pretrained(model, comm, dtype=dtype or "auto", options=options,
                                                   data_group=data_group)
        if not isinstance(model, (str, Path)) and getattr(model, "is_gradient_checkpointing", False):
            converted.gradient_checkpointing_enable()
        return label_modules(converted)  # a stalled collective's report names its layer
    raise TSPConfigError(f"model={type(model).__name__}: TSP converts a transformers Llama / Mistral / Qwen2 / Qwen3 "
                         "causal LM, its local checkpoint directory, or a ds_tsp.hf.TSPForCausalLM")


def _shard_of_hf_name(tsp: TSPCausalLM) -> dict[str, nn.Parameter]:
    """HF parameter name -> the TSP parameter holding (this rank's part of) it."""
    owner = dict(tsp.replicated_params())
    for prefix, module, param in tsp.sharded_modules():
        owner.update({prefix + name: param for name in module.hf_shapes()})
    if tsp.lm_head.tied:
        owner["lm_head.weight"] = tsp.model.embed_tokens.vocab_shard
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
    owner.update(dict(new_model.named_parameters()))  # an optimizer built on a TSPForCausalLM: same names
    group_of: dict[int, int] = {}
    new_groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise TSPConfigError("the optimizer holds a parameter that is not the model's: build it on "
                                     "model.parameters() of the model passed to prepare")
            target = owner.get(name)
            if target is None:
                raise TSPConfigError(f"parameter {name!r} has no TSP counterpart")
            if group_of.setdefault(id(target), g) != g:
                raise TSPConfigError(f"parameter {name!r} is in optimizer param group {g} but shares its TSP shard "
                                     f"with a parameter of group {group_of[id(target)]}: put all q/k/v/o (and "
                                     "gate/up/down) weights of a layer in one param group")
            if not any(target is q for q in new_groups[g]):
                new_groups[g].append(target)
    missing = [n for n, p in new_model.named_parameters() if id(p) not in group_of]
    if missing:
        raise TSPConfigError(f"the optimizer does not cover {missing[0]} ({len(missing)} TSP parameters): build it "
                             "on all of model.parameters()")
    for group, params in zip(optimizer.param_groups, new_groups):
        group["params"] = params
    optimizer.state.clear()
