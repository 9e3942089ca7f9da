"""LoRA on mixture-of-experts experts: refused by name.

ds_tsp folds a LoRA delta into the attention / dense-MLP shard each autograd Function streams (ds_tsp.model.peft.lora);
an MoE layer's experts are one packed shard per rank, cut by expert, with no place for per-expert factors yet. PEFT
adapts fused experts through `target_parameters` (on Qwen3-MoE it turns target_modules gate_proj/up_proj/down_proj
into target_parameters gate_up_proj/down_proj), or per-expert Linears under `.experts.`: both are one error naming
the targeted expert modules and what to target instead, never a silently unadapted expert.
"""
from __future__ import annotations

from torch import nn

from ds_tsp.core.errors import TSPConfigError


def check_no_expert_lora(base: nn.Module, config, adapter: str) -> None:
    """Raise when the LoRA adapter `adapter` (LoraConfig `config`) of the PEFT model whose transformers model is
    `base` targets an MoE layer's experts."""
    targeted = sorted({name.replace(".base_layer", "") for name, module in base.named_modules()
                       if adapter in getattr(module, "lora_A", {}) and ".experts" in f".{name}"})
    parameters = sorted(getattr(config, "target_parameters", None) or [])
    if not targeted and not any("expert" in p or p.endswith(("gate_up_proj", "down_proj")) for p in parameters):
        return
    what = ", ".join(targeted[:3]) + (f" (+{len(targeted) - 3} more)" if len(targeted) > 3 else "")
    modules = config.target_modules
    modules = sorted(modules) if isinstance(modules, (set, list, tuple)) else modules
    raise TSPConfigError(
        f"LoRA on mixture-of-experts experts ({what or 'no module matched yet'}; LoraConfig target_parameters="
        f"{parameters}, target_modules={modules!r}) is not supported under TSP: each rank holds its experts packed "
        "in one shard, with no per-expert LoRA factors. Target the attention projections and dense MLPs only, "
        "e.g. target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"] (PEFT turns gate_proj/up_proj/"
        "down_proj into expert target_parameters on fused experts), or train the "
        "experts fully (requires_grad) without LoRA")
