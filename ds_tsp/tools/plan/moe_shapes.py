"""Mixture-of-experts model shapes for the planner: an MoE config of a family TSP does not convert refused by name
(the families' own configs are read by ModelShape.from_hf_config), and the --num-experts / --top-k / --moe-ffn
overrides."""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.plan.inputs import PlanInputError

# override key (CLI flag --num-experts, --top-k, --moe-ffn) -> ModelShape field
MOE_FIELDS = {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "moe_ffn": "moe_intermediate_size"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_next")
# config.json keys of MoE families TSP does not convert (DeepSeek, OLMoE, Qwen2-MoE, ...)
_FOREIGN_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def refuse_foreign_moe(cfg: dict, where: str) -> None:
    """An MoE config of a family TSP does not convert (DeepSeek, OLMoE, Qwen2-MoE, ...) is refused naming its field,
    never planned as a dense model."""
    for key in _FOREIGN_MOE_KEYS:
        if cfg.get(key):
            raise PlanInputError("hf_config", f"{where}: {key}={cfg[key]!r} on model_type={cfg.get('model_type')!r}: "
                                              "mixture-of-experts is planned for the MoE families TSP converts "
                                              f"({', '.join(MOE_FAMILIES)}) only")


def moe_shape_with(base: ModelShape, overrides: dict[str, int | None]) -> ModelShape:
    """`base` with the MoE fields overridden (keys of MOE_FIELDS; None = keep). A dense base made sparse by
    --num-experts gets every layer sparse, top-k 2 and experts as wide as its dense MLP unless given (Mixtral-like:
    top-k probabilities renormalised). --num-experts 0 makes an MoE base dense."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return base
    fields = {MOE_FIELDS[k]: v for k, v in given.items()}
    if given.get("num_experts", base.num_experts) and not base.num_experts:
        fields.setdefault("num_experts_per_tok", 2)
        fields.setdefault("moe_intermediate_size", base.intermediate_size)
        fields.update(norm_topk_prob=True, dense_mlp_layers=())
    if given.get("num_experts") == 0:
        fields.update(num_experts_per_tok=0, moe_intermediate_size=0, dense_mlp_layers=())
    elif not given.get("num_experts", base.num_experts):
        flag = next(iter(given))
        raise PlanInputError(flag, f"{flag}={given[flag]}: the model has no experts; add --num-experts N")
    try:
        return replace(base, **fields)
    except TSPConfigError as exc:
        text = str(exc)
        blame = [k for k, name in MOE_FIELDS.items() if k in given and text.startswith(name + "=")]
        blame += [k for k, name in MOE_FIELDS.items() if k in given and name in text]
        raise PlanInputError(blame[0] if blame else "num_experts", text) from None
