"""The least work one TSP rank's step can do per layer type: the floor `ds-tsp bench --profile` sets the counted work
against (group_work: executed / minimum per layer type, summed over the group's ranks).

GEMM FLOPs (2 m n k per product, FlopCounterMode's convention), forward + backward with nothing recomputed: every
weight matrix W [out, in] that n local tokens pass through costs 2 n in out forward and twice that backward (the
input grad and the weight grad), 6 n in out in all; n = B S / (D C) tokens per rank (the experts: n top_k routed
rows, dropless: each token meets exactly top_k experts).
- mlp: a dense gated MLP layer (gate, up, down: 3 h F matrices) 18 n h F;
- moe: the experts of an MoE layer (the same three matrices of width F_moe over n top_k rows) 18 n k h F_moe; the
  router GEMM runs outside the experts' Function (layer type "rest", as transformers' router is outside its experts);
- attention: the q, k, v, o projections 6 n h d (2 H + 2 H_kv) per attention layer; gated attention (Qwen3.5,
  Qwen3-Next: q_proj emits a gate beside every query head) 6 n h d (3 H + 2 H_kv); in a hybrid only its full
  attention layers count. The attention kernel itself is no GEMM op on these paths, so it is on neither side of
  the ratio;
- vocab: the LM head 6 n h V (the embedding lookup is no GEMM).
A layer type whose floor is not a closed form here (Gated DeltaNet, sink attention, shared experts, GPT-OSS biases)
gets None: its counted work is shown without a ratio.

Bytes (the CommCounter's logical volume, per rank): the weight ring of the dense MLP and of the MoE ring schedule
carries a rank's packed shard D-1 hops forward, D-1 hops backward and its grad D-1 hops home, 3 (D-1) x shard bytes
per layer (ds_tsp.core.comm.primitives); the MoE all_to_all schedule's volume follows its rows
(ds_tsp.core.layers.moe.cost: R (5h + 2) with the rows re-sent in backward, R (4h + 2) when recompute_projections is
off and the owner keeps them), R taken at even routing, so its ratio also shows how uneven the routing was.
"""
from __future__ import annotations

from ds_tsp.core.layers.moe.cost import COUNT_BYTES, choose_moe_dispatch
from ds_tsp.core.shape.model_shape import ModelShape


def _closed_form_attention(shape: ModelShape) -> bool:
    """Whether the attention layers' projections are q (optionally with its gate), k, v, o of one head size."""
    return not (shape.attention_sinks or shape.fused_qkv or shape.full_head_dim or shape.kv_shared_layers
                or shape.full_values_from_keys)


def moe_layers(shape: ModelShape) -> list[int]:
    return [i for i in range(shape.num_layers) if shape.num_experts and shape.is_moe_layer(i)]


def minimum_work(shape: ModelShape, seq: int, batch: int, tsp: int, cp: int = 1, moe_dispatch: str = "auto",
                 recompute_projections: bool = True, dtype_bytes: int = 4) -> dict:
    """layer type -> {"gemm_flops": minimal GEMM FLOPs per rank and step or None, "comm_bytes": the minimal bytes
    the schedule moves per rank (TSP group) or None} (see module doc)."""
    n = batch * seq // (tsp * cp)
    h = shape.hidden_size
    sparse = moe_layers(shape)
    dense = [i for i in range(shape.num_layers) if i not in sparse]
    out: dict[str, dict] = {}
    plain_mlp = shape.mlp_activation == "silu" and not shape.fused_gate_up
    mlp_shard = 3 * h * shape.intermediate_size // tsp * dtype_bytes
    out["mlp"] = {"gemm_flops": 18 * n * h * shape.intermediate_size * len(dense) if plain_mlp else None,
                  "comm_bytes": 3 * (tsp - 1) * mlp_shard * len(dense) if tsp > 1 and plain_mlp else None}
    if sparse:
        e, k, f = shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size
        plain = not (shape.moe_biases or shape.shared_expert_intermediate_size or shape.expert_activation != "silu")
        schedule = choose_moe_dispatch(moe_dispatch, n, h, f, e, k, tsp, dtype_bytes, shape.moe_biases)
        if schedule == "ring":
            per_layer = 3 * (tsp - 1) * (e // tsp) * 3 * f * h * dtype_bytes
        else:
            rows = n * k * (tsp - 1) // tsp
            per_layer = rows * ((5 if recompute_projections else 4) * h + 2) * dtype_bytes \
                + (tsp - 1) * (e // tsp) * COUNT_BYTES
        out["moe"] = {"gemm_flops": 18 * n * k * h * f * len(sparse) if plain else None,
                      "comm_bytes": per_layer * len(sparse) if tsp > 1 and plain else None, "schedule": schedule}
    d = shape.dim_per_head
    attention = sum(shape.layer_type(i) == "full_attention" for i in range(shape.num_layers))
    if _closed_form_attention(shape) and attention:
        q_rows = (2 if shape.attn_output_gate else 1) * shape.num_heads  # gated: [q, gate] per head
        out["attention"] = {"gemm_flops": 6 * n * h * d * (q_rows + shape.num_heads + 2 * shape.num_kv_heads)
                            * attention, "comm_bytes": None}
    out["vocab"] = {"gemm_flops": 6 * n * h * shape.vocab_size, "comm_bytes": None}
    return out


def against_minimum(work: dict, minimum: dict | None) -> dict:
    """Counted work per layer type (ds_tsp.tools.bench.profile.counted_work) with, where `minimum` gives a layer
    type's least GEMM FLOPs or bytes, that minimum and executed / minimum beside it; layer types with nothing
    counted are left out."""
    out = {}
    for layer, counted in work.items():
        if not any(counted.values()):
            continue
        row = dict(counted)
        floor = (minimum or {}).get(layer, {})
        for key, ratio in (("gemm_flops", "flops_over_min"), ("comm_bytes", "bytes_over_min")):
            least = floor.get(key)
            row[f"min_{key}"] = least
            row[ratio] = (counted[key] / least) if least else None
        out[layer] = row
    return out


def group_work(cfg, seq: int, per_rank: list[dict], tsp_options: dict) -> dict:
    """The whole group's counted work per layer type (every rank's counted_work summed) against the group's
    minimum (minimum_work x the ranks): per rank the all_to_all owners run the rows routed to their experts, which
    vary with the routing, while the group's total does not."""
    summed: dict[str, dict] = {}
    for work in per_rank:
        for layer, counted in work.items():
            row = summed.setdefault(layer, dict.fromkeys(counted, 0))
            for key, value in counted.items():
                row[key] += value
    minimum = None
    if cfg.vision is None:
        per = minimum_work(cfg.shape, seq, cfg.batch, cfg.tsp, cfg.cp, cfg.moe_dispatch,
                           tsp_options.get("recompute_projections", True))
        minimum = {layer: {k: (v * cfg.world if isinstance(v, int) and not isinstance(v, bool) else v)
                           for k, v in floor.items()} for layer, floor in per.items()}
    return against_minimum(summed, minimum)
