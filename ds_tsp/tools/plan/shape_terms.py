"""Model shape terms: element counts of one model, head-sharding checks, and the pipeline stages of a layout."""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    return ceil_div(a, multiple) * multiple


@dataclass(frozen=True)
class Dims:
    """Element counts of one model (full, unsharded)."""

    h: int
    F: int
    V: int
    layers: int
    nq: int
    nkv: int
    d: int
    bias: bool
    tied: bool
    q_scaled: bool = False  # queries scaled per position after RoPE (Ministral 3): one more table per step
    sinks: bool = False  # GPT-OSS: one sink logit per query head, in the packed attention shard
    out_bias: bool = False  # GPT-OSS: o_proj's bias [h], replicated
    values_from_keys: bool = False  # Gemma 4's full layers under k_eq_v: no v rows (v is k's raw projection)
    kv_import: bool = False  # Gemma 4's KV-sharing layers: no k / v rows (they attend over an earlier layer's K/V)

    @classmethod
    def of(cls, m: ModelShape, layer: int | None = None) -> "Dims":
        """The model's dims; with `layer`, that decoder layer's attention shape (Gemma 4's full layers have their
        own head_dim, kv heads and no v_proj under k_eq_v; its KV-sharing layers no k/v rows and, under
        double_wide_shared_mlp, a twice wider MLP)."""
        nkv, d, vfk, imp, F = m.num_kv_heads, m.dim_per_head, False, False, m.intermediate_size
        if layer is not None:
            nkv, d, vfk = m.layer_kv_heads(layer), m.layer_head_dim(layer), m.layer_values_from_keys(layer)
            imp, F = m.kv_source(layer) is not None, m.layer_intermediate_size(layer)
        return cls(m.hidden_size, F, m.vocab_size, m.num_layers, m.num_heads, nkv, d, m.qkv_bias,
                   m.tie_word_embeddings, m.query_scale_beta > 0, m.attention_sinks, m.attention_out_bias, vfk, imp)

    def attn(self, nq: int, nkv: int) -> int:
        """Attention weights for nq query heads and nkv kv heads (the packed TSP layout: q, k, v, o + biases and
        sinks)."""
        q, kv = nq * self.d, nkv * self.d
        kv_mats = 0 if self.kv_import else 1 if self.values_from_keys else 2
        return (2 * q * self.h + kv_mats * kv * self.h + ((q + kv_mats * kv) if self.bias else 0)
                + (nq if self.sinks else 0))

    @property
    def replicated_attn(self) -> int:
        """Attention params every rank holds whole (GPT-OSS's o_proj bias)."""
        return self.h if self.out_bias else 0

    @property
    def layer(self) -> int:
        """One decoder layer: attention, the gated MLP (3hF) and its two norms."""
        return self.attn(self.nq, self.nkv) + self.replicated_attn + 3 * self.h * self.F + 2 * self.h

    @property
    def model(self) -> int:
        """Every parameter: layers, embedding, final norm and (untied) LM head."""
        return self.layers * self.layer + self.V * self.h + self.h + (0 if self.tied else self.V * self.h)

    def qk_rows(self, nq: int, nkv: int) -> int:
        """wq and wk of nq query and nkv kv heads: the rows OLMo's whole-projection q/k norms stream once more."""
        return (nq + nkv) * self.d * self.h

    def kv_heads_per_rank(self, n: int) -> int:
        """kv heads held per rank when heads are split n ways (one replicated head when nkv < n)."""
        return max(self.nkv // n, 1)


def mixed_attention_shapes(model: ModelShape) -> bool:
    """Whether decoder layers differ in attention shape (Gemma 4's full layers: their own head_dim, kv heads, no
    v_proj under k_eq_v), so that the planner counts each layer's own shard, K/V and norms."""
    return bool(model.full_head_dim or model.full_num_kv_heads or model.full_values_from_keys or
                model.kv_shared_layers)


def gemma4_peer_refusal(model: ModelShape) -> str | None:
    """What a peer layout's formulas would count wrong in a Gemma 4 shape (planned for tsp only), or None."""
    if mixed_attention_shapes(model):
        return ("full_head_dim / full_num_kv_heads / full_values_from_keys / kv_shared_layers (Gemma 4's full "
                "layers' own attention shape, KV sharing)")
    if model.per_layer_input_size:
        return "per_layer_input_size (Gemma 4's per-layer inputs)"
    return None


def qk_norm_elems(model: ModelShape, layer: int = 0) -> int:
    """Replicated q/k norm weights of attention layer `layer`: Qwen3's [d] each (Gemma 4's full layers: their own
    d; its KV-sharing layers: no k norm), OLMo's over the whole projection."""
    d = model.layer_head_dim(layer)
    if model.projection_qk_norm:
        return (model.num_heads + model.num_kv_heads) * d
    return (1 if model.kv_source(layer) is not None else 2) * d if model.qk_norm else 0


@dataclass(frozen=True)
class Stage:
    name: str
    embed: bool
    head: bool
    layers: int
    in_flight: int  # micro-batches whose activations are alive (1F1B: pp on the first stage)


def stages(inp: PlanInput) -> list[Stage]:
    """Pipeline stages worth evaluating: the only one (pp=1), else the first (embedding, pp micro-batches in
    flight under 1F1B) and the last (final norm + LM head); middle stages are never above both."""
    per = ceil_div(inp.model.num_layers, inp.pp)
    if inp.pp == 1:
        return [Stage("only", True, True, per, 1)]
    return [Stage("first", True, False, per, inp.pp),
            Stage("last", False, True, inp.model.num_layers - per * (inp.pp - 1), 1)]


def peer_dims(inp: PlanInput, layout: str) -> Dims:
    """The dims a peer layout's formulas count: one attention shape for every layer, so Gemma 4's full layers
    (their own head_dim / kv heads / no v_proj) are refused by name."""
    refused = gemma4_peer_refusal(inp.model)
    if refused:
        raise PlanInputError("layout", f"{layout}: {refused} planned for tsp only; use --layout tsp")
    return Dims.of(inp.model)


def check_heads(inp: PlanInput, layout: str) -> Dims:
    """Head-sharded layouts need num_heads % D == 0 and kv heads split (or replicated) evenly."""
    dims = peer_dims(inp, layout)
    n = inp.degree
    if dims.nq % n:
        raise PlanInputError("degree", f"{layout}: num_heads={dims.nq} is not divisible by degree={n}; pick a "
                                       f"degree among {[k for k in range(1, dims.nq + 1) if dims.nq % k == 0]}")
    if dims.nkv % n and n % dims.nkv:
        raise PlanInputError("degree", f"{layout}: num_kv_heads={dims.nkv} and degree={n} do not divide each other "
                                       "(kv heads are split, or replicated when fewer than ranks)")
    return dims


def check_ffn(dims: Dims, degree: int, layout: str) -> None:
    if dims.F % degree:
        raise PlanInputError("degree", f"{layout}: intermediate_size={dims.F} is not divisible by degree={degree}")
