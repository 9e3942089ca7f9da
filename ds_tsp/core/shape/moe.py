"""The mixture-of-experts part of a ModelShape: which fields of a Qwen3-MoE / Mixtral config TSP reads, which it
refuses, and how the experts split over the TSP degree (rank p owns experts [p*E/D, (p+1)*E/D)).

transformers' rules, mirrored here (models/{qwen3_moe,mixtral}/modeling_*.py of transformers 5):
* Qwen3-MoE: layer i is sparse iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step
  == 0; dense layers are a SwiGLU of intermediate_size, experts SwiGLUs of moe_intermediate_size; norm_topk_prob
  decides whether the top-k probabilities are renormalised.
* Mixtral: every layer sparse, experts of intermediate_size, top-k always renormalised; router_jitter_noise > 0
  multiplies the router input by noise in training, which TSP does not implement (refused).
* Both add router_aux_loss_coef * load_balancing_loss to the loss only when output_router_logits is true.
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# Fields other MoE families use that change the math (shared experts, scaled / grouped routing): never ignored.
_REFUSED_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "moe_layer_freq",
                   "first_k_dense_replace", "n_group", "topk_group", "topk_method", "scoring_func",
                   "moe_shared_expert_intermediate_size")


def moe_fields_from_config(get, model_type: str, num_layers: int) -> dict:
    """ModelShape keyword arguments for the MoE fields of a transformers config (get(key, default) reads it)."""
    for key in _REFUSED_FIELDS:
        if get(key):
            raise TSPConfigError(f"{key}={get(key)!r} on a {model_type} config: shared experts / grouped routing are "
                                 "not part of Qwen3-MoE or Mixtral and TSP does not implement them; remove the field")
    scaling = get("routed_scaling_factor")
    if scaling not in (None, 1, 1.0):
        raise TSPConfigError(f"routed_scaling_factor={scaling!r}: scaled routing weights are not supported; remove it")
    experts = get("num_local_experts", None)
    experts = get("num_experts", 0) if experts is None else experts
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise TSPConfigError(f"num_experts={experts!r}: must be an integer >= 0")
    if model_type == "mixtral":
        jitter = float(get("router_jitter_noise", 0.0) or 0.0)
        if jitter > 0:
            raise TSPConfigError(f"router_jitter_noise={jitter}: router input noise is not supported (TSP routes "
                                 "deterministically); set router_jitter_noise to 0.0")
        return _fields(experts, get("num_experts_per_tok", 2), get("intermediate_size"), True, (), get)
    step = get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise TSPConfigError(f"decoder_sparse_step={step!r}: must be an integer >= 1 (every step-th layer is sparse)")
    mlp_only = set(get("mlp_only_layers", None) or ())
    dense = tuple(i for i in range(num_layers) if i in mlp_only or experts == 0 or (i + 1) % step)
    return _fields(experts, get("num_experts_per_tok", 8), get("moe_intermediate_size", 768),
                   bool(get("norm_topk_prob", False)), dense, get)


def _fields(experts, top_k, ffn, norm_topk_prob, dense, get) -> dict:
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn,
                norm_topk_prob=norm_topk_prob, dense_mlp_layers=dense,
                router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(get("output_router_logits", False)))


def check_moe_fields(shape) -> None:
    """ModelShape.__post_init__'s MoE checks (no-op for a dense shape)."""
    if shape.num_experts == 0:
        return
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TSPConfigError(f"{name}={value!r}: must be a positive integer in a mixture-of-experts model")
    if shape.num_experts_per_tok > shape.num_experts:
        raise TSPConfigError(f"num_experts_per_tok={shape.num_experts_per_tok} exceeds num_experts="
                             f"{shape.num_experts}: a token cannot pick more experts than exist")
    bad = [i for i in shape.dense_mlp_layers if not 0 <= i < shape.num_layers]
    if bad:
        raise TSPConfigError(f"dense_mlp_layers contains {bad[0]}: layer indices are 0..{shape.num_layers - 1}")


def check_moe_degree(shape, tsp: int) -> None:
    """Experts split whole over the TSP ranks; the per-expert width moe_intermediate_size need not divide."""
    if shape.num_experts and shape.num_experts % tsp:
        fits = [d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]
        raise TSPConfigError(
            f"num_experts={shape.num_experts} is not divisible by tsp={tsp}: every rank owns num_experts/tsp whole "
            f"experts; pick tsp among {fits}")
