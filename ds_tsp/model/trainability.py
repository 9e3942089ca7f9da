"""Which TSP parameters train: `requires_grad` of an in-memory HF (or PEFT) model carried to the shards.

A TSP shard packs several HF tensors (a layer's q/k/v/o weights and biases in one attention shard, gate/up/down in
one MLP shard), and `requires_grad` belongs to the whole parameter. So a shard trains iff its HF tensors train, and
a shard whose tensors disagree cannot be honoured exactly: the frozen ones would still move under AdamW (weight
decay, or momentum from the trainable ones). That case is one error naming the tensors and the fix.

PEFT wraps the model (`base_model.model.` prefix) and each targeted linear (`q_proj.base_layer.weight`); `hf_name`
maps those names back to the plain transformers ones, so an optimizer built on a PeftModel's parameters, or a
PeftModel handed to a conversion, meets the names the checkpoint protocol knows.
"""
from __future__ import annotations

import re

from torch import nn

from ds_tsp.core.errors import TSPConfigError

_PEFT_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # lora_A.<adapter>.weight -> lora_A.weight


def hf_name(name: str) -> str:
    """The transformers name of a parameter of a transformers or PEFT model (LoRA factors: PEFT's saved key
    without the `base_model.model.` prefix, e.g. model.layers.0.self_attn.q_proj.lora_A.weight)."""
    return _ADAPTER_KEY.sub(r".\1.weight", name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."))


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """HF name -> parameter of the model's base weights (LoRA factors left out; tied weights under both names)."""
    return {hf_name(n): p for n, p in model.named_parameters(remove_duplicate=False)
            if not _ADAPTER_KEY.search(n)}


def load_hf_model(core: nn.Module, hf_model: nn.Module, state_dict: dict | None = None) -> nn.Module:
    """Fill `core` (a ShardedCausalLM) from an in-memory transformers or PEFT LoRA model: this rank's slices of its
    base weights (or of `state_dict`, HF names, when given), their requires_grad, and the LoRA adapter. Returns the
    transformers model under a PEFT wrapper (the model itself otherwise)."""
    from ds_tsp.model.lora import adapter_config_json, attach_lora, peft_adapter

    peft = peft_adapter(hf_model)  # (base model, adapter name, LoraConfig) of a PEFT LoRA model; None otherwise
    base = peft[0] if peft else hf_model
    params = base_parameters(base)
    core.load_full_state_dict(state_dict if state_dict is not None else {n: p.detach() for n, p in params.items()})
    carry_requires_grad(core.sharded_modules(), core.replicated_params(), params)
    if peft:
        attach_lora(core, base, peft[1])
        core.lora_adapter_config = adapter_config_json(peft[2], getattr(base, "name_or_path", None))
    return base


def require_all_trainable(model, where: str) -> None:
    """For conversion paths that train every weight: a PEFT model or frozen parameters are one clear error."""
    if hasattr(model, "peft_config"):
        raise TSPConfigError(f"a PEFT model with {where} is not supported: LoRA under TSP needs one pipeline stage")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad] if hasattr(model, "named_parameters") \
        else []
    if frozen:
        raise TSPConfigError(f"{frozen[0]} ({len(frozen)} parameters) has requires_grad=False, which {where} does not "
                             "carry over (every weight would train): unfreeze it, or use one pipeline stage")


def carry_requires_grad(sharded, replicated: dict[str, nn.Parameter], source: dict[str, nn.Parameter]) -> None:
    """Set requires_grad of every TSP parameter from the HF parameters it holds a part of.

    sharded: (HF prefix, sharded piece, its parameter) as ShardedCausalLM.sharded_modules() lists them;
    replicated: HF name -> parameter; source: HF name -> the HF parameter (base_parameters).
    """
    for prefix, module, param in sharded:
        names = [prefix + n for n in module.hf_shapes() if prefix + n in source]
        frozen = [n for n in names if not source[n].requires_grad]
        if frozen and len(frozen) < len(names):
            trainable = [n for n in names if source[n].requires_grad]
            raise TSPConfigError(
                f"{prefix.rstrip('.')}: {', '.join(frozen)} frozen but {', '.join(trainable)} trainable. TSP packs "
                "a layer's attention weights (q/k/v/o and their biases) into one shard per rank, and its MLP weights "
                "(gate/up/down) into another, so they train or freeze together: freeze or unfreeze the whole "
                f"{prefix.rstrip('.')} (e.g. `for p in layer.{prefix.split('.')[-2]}.parameters(): "
                "p.requires_grad_(False)`), or train a subset with LoRA (peft) instead")
        param.requires_grad_(not frozen)
    for name, param in replicated.items():
        if name in source:
            param.requires_grad_(source[name].requires_grad)
