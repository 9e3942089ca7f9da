"""Analytic per-rank memory and communication of TSP and its peers, for one model, sequence and layout.

Layouts (D = the degree of the one parallel axis, `PlanInput.degree`):

| layout             | weights per rank             | tokens per rank      | per-layer traffic (per rank)           |
|--------------------|------------------------------|----------------------|----------------------------------------|
| tsp                | 1/D (head block, F/D, V/D)   | S/D (zigzag)         | shard broadcast + MLP ring, K/V gather |
| tp                 | 1/D (Megatron, no SP)        | S (replicated)       | 2 all-reduces of B*S*h each way        |
| tp_sp              | 1/D (Megatron seq. parallel) | S/D outside attn/MLP | 4 all-gathers/reduce-scatters each way |
| ulysses            | 1/(D*dp) (ZeRO-3)            | S/D                  | 4 all-to-alls + ZeRO-3 layer gather    |
| ulysses_replicated | whole model                  | S/D                  | 4 all-to-alls (grads all-reduced)      |
| fsdp_cp            | 1/(D*dp) (FSDP)              | S/D (zigzag)         | ring K/V passes + FSDP layer gather    |

Accounting (the same for every layout; it is ds_tsp.comm.CommCounter's): bytes per rank, logical volume —
broadcast counts on receivers, reduce on senders, all-gather (D-1)/D of its output, reduce-scatter (D-1)/D of its
input, all-to-all (D-1)/D of its input, all-reduce 2(D-1)/D of its payload (a ring all-reduce; the "2x" textbook
figure is its D -> infinity limit), a ring or pipeline hop what it sends. Integer floor as CommCounter does it.

Memory model (bytes per rank, one pipeline stage, the stage with the highest peak):
    peak = params + grads + optimizer + activations + max(transients over phases)
- params and grads in `dtype`; optimizer AdamW with 2 fp32 states (m, v) = 8 B/param, plus a 4 B fp32 master copy
  when dtype is bf16/fp16 (mixed precision as DeepSpeed and Megatron do it): 16 B/param in total either way.
- activations = everything saved for backward of one micro-batch (times the micro-batches in flight on pipeline
  stage 0 under 1F1B: pp), all alive when backward starts; with activation checkpointing, each layer's input plus
  one layer's full set (the layer being recomputed).
- transients = the largest set of temporaries of one phase (layer forward / backward, LM head): streamed shards,
  gathered weights, gathered K/V, logits, activation grads. Grads are assumed allocated for the whole step.
This additive model is an upper-bound style estimate of a peak allocator reading (it ignores fragmentation and the
CUDA context). Data parallelism (dp) divides grads/optimizer only where a ZeRO stage says so: tsp, tp, tp_sp and
ulysses_replicated use `zero_stage` over the dp axis (0: DDP, 1: optimizer / dp, 2: + grads / dp); ulysses and
fsdp_cp shard params, grads and optimizer over the D*dp ranks (ZeRO-3 / FSDP) and move the dp traffic into their
per-layer gathers and reduce-scatters. Pipeline parallelism (pp) gives each stage ceil(layers / pp) layers; the
first stage holds the embedding, the last the final norm and LM head (a tied table is held by both).

`comm_bytes_per_step` is one forward and backward of ONE micro-batch of `batch` sequences on the busiest stage,
plus one gradient synchronisation over dp (grads in `dtype`) and the pipeline hops of that micro-batch.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from ds_tsp.errors import TSPConfigError
from ds_tsp.model_config import ModelShape

__all__ = ["PRESETS", "LAYOUTS", "DEFAULT_LAYOUTS", "DTYPE_BYTES", "PlanInput", "PlanInputError", "CommTerm",
           "LayoutPlan", "shape_from_hf_config", "plan_tsp", "plan_tp", "plan_tp_sp", "plan_ulysses",
           "plan_ulysses_replicated", "plan_fsdp_cp", "plan_layouts", "tsp_counter_bytes", "megatron_tp_example"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_STATE_BYTES = 8  # AdamW exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # fp32 master weights under bf16/fp16 mixed precision

# Llama-family shapes. "zyphra-7b" is the 7B dense of Zyphra's TSP blog (h 4096, 32 layers, MHA, SwiGLU); the blog
# gives neither the MLP width nor the vocabulary, so Llama-2-7B's (11008, 32000) are assumed.
PRESETS: dict[str, ModelShape] = {
    "7b": ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, rms_norm_eps=1e-5),
    "8b": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5),
    "70b": ModelShape(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                      num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5),
    "zyphra-7b": ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                            num_heads=32, num_kv_heads=32, rms_norm_eps=1e-5),
}


class PlanInputError(TSPConfigError):
    """Bad planner input; `field` names the PlanInput field (the CLI maps it to its flag)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class PlanInput:
    """What the planner needs. `seq` is the global sequence length per sample, `batch` the micro-batch size.

    degree: D of the one parallel axis (TSP degree, TP degree, Ulysses / context-parallel degree).
    dp, pp: data-parallel and pipeline degrees (world size = degree * dp * pp).
    zero_stage: ZeRO stage over the dp axis for tsp / tp / tp_sp / ulysses_replicated (0, 1 or 2).
    keep_gathered_kv: TSP keeps each block's gathered K/V for backward (ds_tsp.model.TSPOptions).
    recompute_projections: False = TSP saves local q (k/v) per block and the MLP gate/up (TSPOptions.speed()).
    """

    model: ModelShape
    seq: int
    batch: int = 1
    degree: int = 1
    dp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    keep_gathered_kv: bool = False
    recompute_projections: bool = True
    zero_stage: int = 0

    def __post_init__(self):
        for name in ("seq", "batch", "degree", "dp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanInputError(name, f"{name}={value!r}: must be an integer >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise PlanInputError("dtype", f"dtype={self.dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        if self.zero_stage not in (0, 1, 2):
            raise PlanInputError("zero_stage", f"zero_stage={self.zero_stage!r}: choose 0, 1 or 2 (ZeRO-3 is the "
                                               "ulysses / fsdp_cp layouts)")
        if self.pp > self.model.num_layers:
            raise PlanInputError("pp", f"pp={self.pp} exceeds num_layers={self.model.num_layers}: every pipeline "
                                       f"stage needs at least one layer; pick pp <= {self.model.num_layers}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def world_size(self) -> int:
        return self.degree * self.dp * self.pp

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out


@dataclass(frozen=True)
class CommTerm:
    """One kind of transfer: `calls` collectives of `payload_bytes` each, `bytes` per rank in total."""

    name: str
    kind: str  # CommCounter kind for TSP terms; the collective's name for the peers
    payload_bytes: int
    calls: int
    bytes: int


@dataclass(frozen=True)
class LayoutPlan:
    layout: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transients_bytes: int
    peak_bytes_per_rank: int
    comm_bytes_per_layer_fwd: int
    comm_bytes_per_layer_bwd: int
    comm_bytes_per_step: int
    activation_bytes_per_layer: int  # saved for backward by one decoder layer without checkpointing
    stage: str  # "only" (pp=1), or the pipeline stage whose peak is reported ("first" / "last")
    layers_per_stage: int
    layer_fwd_terms: tuple[CommTerm, ...]
    layer_bwd_terms: tuple[CommTerm, ...]
    step_terms: tuple[CommTerm, ...]  # per step, besides layers_per_stage * (fwd + bwd)
    transients: dict[str, int] = field(default_factory=dict)  # phase -> bytes; the max is transients_bytes
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


# --- model shapes -------------------------------------------------------------------------------------------------

def shape_from_hf_config(path_or_dict: str | Path | dict) -> ModelShape:
    """ModelShape from a Hugging Face config.json (path, its directory, or the parsed dict); no transformers import.

    Reads hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
    num_attention_heads), head_dim (default hidden/heads), vocab_size, tie_word_embeddings (default False),
    attention_bias (or model_type qwen2: bias on q/k/v), rope_theta, rms_norm_eps. A multimodal config's
    text_config is used when the top level has no hidden_size.
    """
    if isinstance(path_or_dict, dict):
        cfg, where = path_or_dict, "config"
    else:
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanInputError("hf_config", f"{path}: no such file; pass a config.json or its directory") from None
        except json.JSONDecodeError as exc:
            raise PlanInputError("hf_config", f"{path}: not valid JSON ({exc})") from None
        where = str(path)
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                     cfg["text_config"].get("tie_word_embeddings"))}
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not isinstance(cfg.get(k), int)]
    if missing:
        raise PlanInputError("hf_config", f"{where}: missing or non-integer {missing}; a Llama/Mistral/Qwen2-style "
                                          "config.json has all of " + ", ".join(required))
    heads = cfg["num_attention_heads"]
    try:
        return ModelShape(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or None,
            rope_theta=float(cfg.get("rope_theta") or 10000.0), rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings") or False),
            qkv_bias=bool(cfg.get("attention_bias") or cfg.get("model_type") == "qwen2"))
    except TSPConfigError as exc:
        raise PlanInputError("hf_config", f"{where}: {exc}") from None


# --- shared arithmetic ---------------------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, multiple: int) -> int:
    return _ceil_div(a, multiple) * multiple


def _ar(payload: int, n: int) -> int:
    """All-reduce bytes per rank (ring): 2 (n-1)/n of the payload."""
    return 2 * payload * (n - 1) // n if n > 1 else 0


def _ag(output: int, n: int) -> int:
    """All-gather / reduce-scatter / all-to-all bytes per rank: (n-1)/n of the full buffer."""
    return output * (n - 1) // n if n > 1 else 0


def _term(name, kind, payload, calls, nbytes) -> CommTerm:
    return CommTerm(name, kind, int(payload), int(calls), int(nbytes))


def _nonzero(terms):
    return tuple(t for t in terms if t.bytes)


def _total(terms) -> int:
    return sum(t.bytes for t in terms)


@dataclass(frozen=True)
class _Dims:
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

    @classmethod
    def of(cls, m: ModelShape) -> "_Dims":
        return cls(m.hidden_size, m.intermediate_size, m.vocab_size, m.num_layers, m.num_heads, m.num_kv_heads,
                   m.dim_per_head, m.qkv_bias, m.tie_word_embeddings)

    def attn(self, nq: int, nkv: int) -> int:
        """Attention weights for nq query heads and nkv kv heads (the packed TSP layout: q, k, v, o + biases)."""
        q, kv = nq * self.d, nkv * self.d
        return 2 * q * self.h + 2 * kv * self.h + ((q + 2 * kv) if self.bias else 0)

    @property
    def layer(self) -> int:
        return self.attn(self.nq, self.nkv) + 3 * self.h * self.F + 2 * self.h

    def kv_heads_per_rank(self, n: int) -> int:
        """kv heads held per rank when heads are split n ways (one replicated head when nkv < n)."""
        return max(self.nkv // n, 1)


@dataclass(frozen=True)
class _Stage:
    name: str
    embed: bool
    head: bool
    layers: int
    in_flight: int  # micro-batches whose activations are alive (1F1B: pp on the first stage)


def _stages(inp: PlanInput) -> list[_Stage]:
    per = _ceil_div(inp.model.num_layers, inp.pp)
    if inp.pp == 1:
        return [_Stage("only", True, True, per, 1)]
    return [_Stage("first", True, False, per, inp.pp),
            _Stage("last", False, True, inp.model.num_layers - per * (inp.pp - 1), 1)]


def _optimizer_bytes_per_param(inp: PlanInput) -> int:
    return ADAM_STATE_BYTES + (MASTER_BYTES if inp.dtype_bytes < 4 else 0)


def _norm_saved(tokens: int, dims: _Dims, b: int) -> int:
    """HF-style RMSNorm (as ds_tsp.layers.norm): input in the compute dtype, rsqrt, and the normalised input."""
    cb = max(b, 4)
    return tokens * (dims.h * cb + cb + dims.h * b)


def _check_heads(inp: PlanInput, layout: str) -> _Dims:
    """Head-sharded layouts need num_heads % D == 0 and kv heads split (or replicated) evenly."""
    dims = _Dims.of(inp.model)
    n = inp.degree
    if dims.nq % n:
        raise PlanInputError("degree", f"{layout}: num_heads={dims.nq} is not divisible by degree={n}; pick a "
                                       f"degree among {[k for k in range(1, dims.nq + 1) if dims.nq % k == 0]}")
    if dims.nkv % n and n % dims.nkv:
        raise PlanInputError("degree", f"{layout}: num_kv_heads={dims.nkv} and degree={n} do not divide each other "
                                       "(kv heads are split, or replicated when fewer than ranks)")
    return dims


def _layout_plan(layout: str, inp: PlanInput, stage_fn: Callable[[_Stage], dict], layer_fwd, layer_bwd,
                 per_layer: int, notes: tuple[str, ...]) -> LayoutPlan:
    """Evaluate every pipeline stage with stage_fn and report the one with the highest peak."""
    best = None
    comm_max = 0
    for stage in _stages(inp):
        s = stage_fn(stage)
        transient = max(s["transients"].values())
        peak = s["params"] + s["grads"] + s["optimizer"] + s["activations"] + transient
        step = stage.layers * (_total(layer_fwd) + _total(layer_bwd)) + _total(s["step_terms"])
        comm_max = max(comm_max, step)
        if best is None or peak > best[0]:
            best = (peak, stage, s, transient)
    peak, stage, s, transient = best
    return LayoutPlan(
        layout=layout, params_bytes=s["params"], grads_bytes=s["grads"], optimizer_bytes=s["optimizer"],
        activations_bytes=s["activations"], transients_bytes=transient, peak_bytes_per_rank=peak,
        comm_bytes_per_layer_fwd=_total(layer_fwd), comm_bytes_per_layer_bwd=_total(layer_bwd),
        comm_bytes_per_step=comm_max, activation_bytes_per_layer=per_layer, stage=stage.name,
        layers_per_stage=stage.layers,
        layer_fwd_terms=_nonzero(layer_fwd), layer_bwd_terms=_nonzero(layer_bwd),
        step_terms=_nonzero(s["step_terms"]), transients=dict(s["transients"]), notes=notes)


def _state(inp: PlanInput, params: int, *, grads_div: int = 1, opt_div: int = 1) -> dict:
    b = inp.dtype_bytes
    return {"params": params * b, "grads": _ceil_div(params, grads_div) * b,
            "optimizer": _ceil_div(params, opt_div) * _optimizer_bytes_per_param(inp)}


def _dp_sync(inp: PlanInput, grad_elems: int, group: int) -> list[CommTerm]:
    """Gradient synchronisation over `group` ranks: all-reduce, or reduce-scatter + param all-gather (ZeRO-1/2):
    the same 2 (n-1)/n volume either way."""
    payload = grad_elems * inp.dtype_bytes
    return [_term("grad sync over dp (all-reduce or ZeRO reduce-scatter + all-gather)", "all_reduce", payload,
                  1 if group > 1 else 0, _ar(payload, group))]


def _p2p(inp: PlanInput, stage: _Stage, tokens_per_rank: int) -> list[CommTerm]:
    """Pipeline hops of one micro-batch sent by one rank: activations forward (all stages but the last), grads
    backward (all but the first); a middle stage (pp > 2) sends both."""
    if inp.pp == 1:
        return []
    payload = tokens_per_rank * inp.model.hidden_size * inp.dtype_bytes
    sends = 2 if inp.pp > 2 else 1
    return [_term("pipeline send (activations fwd / grads bwd)", "p2p", payload, sends, sends * payload)]


def _zero_divs(inp: PlanInput) -> dict:
    return {"grads_div": inp.dp if inp.zero_stage >= 2 else 1, "opt_div": inp.dp if inp.zero_stage >= 1 else 1}


# --- TSP -----------------------------------------------------------------------------------------------------------

def _tsp_geometry(inp: PlanInput) -> dict:
    dims = _Dims.of(inp.model)
    D = inp.degree
    try:
        inp.model.check_tsp_degree(D)
    except TSPConfigError as exc:
        raise PlanInputError("degree", f"tsp: {exc}") from None
    nq_b, nkv_b = dims.nq // D, dims.kv_heads_per_rank(D)
    S_pad = _round_up(inp.seq, 2 * D)
    kv_replicas = max(D // dims.nkv, 1)
    return dict(dims=dims, D=D, S_pad=S_pad, L=S_pad // D, nq_b=nq_b, nkv_b=nkv_b, kv_replicas=kv_replicas,
                A=dims.attn(nq_b, nkv_b), M=3 * dims.h * (dims.F // D), Vd=_ceil_div(dims.V, D))


def _tsp_layer_terms(inp: PlanInput) -> tuple[list[CommTerm], list[CommTerm]]:
    """Exactly what ds_tsp.layers.attention / mlp / norm put on the CommCounter for one decoder layer.

    forward:  (D-1) attention shard broadcasts, D K/V all-gathers (one per head block), D-1 MLP ring hops.
    backward: the broadcasts again (re-stream), D-1 grad reduces to the owners, D K/V re-gathers (none with
              keep_gathered_kv), D dK/dV reduce-scatters, MLP ring D-1 weight hops + D grad hops, 2 norm-grad
              all-reduces of h, and with kv_replicas > 1 one all-gather of the kv weight grads (replica sum);
              with activation checkpointing the forward terms once more (the recompute).
    In the design doc's terms (W = a layer's weights, KV = B*S*h_kv, rho = (D-1)/D): fwd rho*W + rho*2KV; bwd
    rho*W (re-stream) + rho*W_attn + W_mlp (grads to owners: the ring's D grad hops carry D/D of W_mlp) + rho*2KV
    (re-gather) + rho*2KV (reduce-scatter). With kv_replicas = D/n_kv > 1 every block gathers its one kv head, so
    the K/V terms are D/n_kv times rho*2KV.
    """
    g = _tsp_geometry(inp)
    D, b, B, L, dims = g["D"], inp.dtype_bytes, inp.batch, g["L"], g["dims"]
    if D == 1:
        return [], []
    shard, mlp = g["A"] * b, g["M"] * b
    kv_out = D * 2 * B * L * g["nkv_b"] * dims.d * b  # one block's gathered K/V: [D, 2, B, L, nkv_b, d]
    fwd = [
        _term("attention shard broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
        _term("K/V all-gather (per head block)", "all_gather", kv_out, D, D * _ag(kv_out, D)),
        _term("MLP weight ring (D-1 hops)", "ring", mlp, D - 1, (D - 1) * mlp),
    ]
    bwd = [
        _term("attention shard re-broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
        _term("attention grad reduce to owner", "reduce", shard, D - 1, (D - 1) * shard),
        _term("K/V re-gather (per head block)", "all_gather", kv_out, 0 if inp.keep_gathered_kv else D,
              0 if inp.keep_gathered_kv else D * _ag(kv_out, D)),
        _term("dK/dV reduce-scatter (per head block)", "reduce_scatter", kv_out, D, D * _ag(kv_out, D)),
        _term("MLP ring (D-1 weight + D grad hops)", "ring", mlp, 2 * D - 1, (2 * D - 1) * mlp),
        _term("norm weight grad all-reduce (2 norms)", "replicated_grad", dims.h * b, 2, 2 * _ar(dims.h * b, D)),
    ]
    if g["kv_replicas"] > 1:
        kv_grad = (2 * g["nkv_b"] * dims.d * dims.h + (2 * g["nkv_b"] * dims.d if dims.bias else 0)) * b
        bwd.append(_term("kv weight grad all-gather (replica sum)", "all_gather", D * kv_grad, 1,
                         _ag(D * kv_grad, D)))
    if inp.activation_checkpointing:
        bwd += [replace(t, name="recompute: " + t.name) for t in fwd]
    return fwd, bwd


def _tsp_extra_terms(inp: PlanInput, stage: _Stage) -> list[CommTerm]:
    g = _tsp_geometry(inp)
    D, b, h = g["D"], inp.dtype_bytes, g["dims"].h
    if D == 1:
        return []
    table = g["Vd"] * h * b
    terms = []
    if stage.embed:
        check = D * (4 + inp.batch * g["L"]) * 8  # per rank: 4 counts + the local position_ids, int64
        terms += [_term("input size check all-gather (1 int64 per rank)", "all_gather", D * 8, 1, _ag(D * 8, D)),
                  _term("input check + positions all-gather (4 + B*S/D int64 per rank)", "all_gather", check, 1,
                        _ag(check, D)),
                  _term("embedding ring fwd (D-1 hops)", "ring", table, D - 1, (D - 1) * table),
                  _term("embedding ring bwd (D-1 weight + D grad hops)", "ring", table, 2 * D - 1,
                        (2 * D - 1) * table)]
    if stage.head:
        terms += [_term("LM head ring fwd (D-1 hops)", "ring", table, D - 1, (D - 1) * table),
                  _term("LM head ring bwd (D-1 weight + D grad hops)", "ring", table, 2 * D - 1,
                        (2 * D - 1) * table),
                  _term("final norm grad all-reduce", "replicated_grad", h * b, 1, _ar(h * b, D))]
    return terms


def tsp_counter_bytes(inp: PlanInput) -> dict[str, int]:
    """Predicted CommCounter.bytes (kind -> bytes) of one TSP forward + backward of the whole model (pp = 1)."""
    fwd, bwd = _tsp_layer_terms(inp)
    out: dict[str, int] = {}
    stage = _Stage("only", True, True, inp.model.num_layers, 1)
    for t in [*fwd, *bwd] * inp.model.num_layers + _tsp_extra_terms(inp, stage):
        if t.bytes:
            out[t.kind] = out.get(t.kind, 0) + t.bytes
    return out


def _tsp_layer_saved(inp: PlanInput, g: dict) -> int:
    """Saved for backward by one TSP decoder layer (ds_tsp.layers): per norm its input (compute dtype), rsqrt and
    normalised input; attention: its input x, per head block the output [B, L, nq/D, d] and two LSEs (fp32);
    MLP: its input x only (q/k/v and the gate/up activations are recomputed in backward)."""
    dims, b, T = g["dims"], inp.dtype_bytes, inp.batch * g["L"]
    saved = 2 * _norm_saved(T, dims, b) + 2 * T * dims.h * b + T * dims.nq * dims.d * b + T * dims.nq * 4
    if inp.keep_gathered_kv:
        saved += g["D"] * 2 * inp.batch * g["S_pad"] * g["nkv_b"] * dims.d * b
    if not inp.recompute_projections:
        saved += T * dims.nq * dims.d * b + 2 * T * dims.F * b  # q of every block; MLP gate and up
        if not inp.keep_gathered_kv:
            saved += g["D"] * 2 * T * g["nkv_b"] * dims.d * b  # local k/v of every block
    return saved


def plan_tsp(inp: PlanInput) -> LayoutPlan:
    """TSP (ds_tsp): 1/D of every weight and 1/D of the tokens (zigzag) per rank, one axis.

    Params per rank: per layer the packed attention shard (nq/D q heads, max(nkv/D, 1) kv heads) + F/D MLP columns
    + 2 replicated norms; ceil(V/D) rows of the embedding and of the LM head; the final norm.
    Activations: _tsp_layer_saved per layer plus cos/sin [B, L, d] x2, the final norm, the LM head input and its
    LSE, ids and labels. Transients (the implementation, not an ideal): layer forward = 2 attention shards (current
    + prefetch) + a block's gathered K/V twice (rank order and global order) + q and the kernel's partial outputs;
    attention backward = 2 shards + up to 3 grad contributions in flight (ShardGradReducer) + the own grad + gathered K/V, dK/dV and their rank-order copy + q, dout, dq + activation grads; MLP = 2 weight
    shards (+ 4 grad shards in backward) + gate/up/act temporaries of [B*L, F/D]; LM head = 2 vocab shards +
    logits of one vocab shard [B*L, V/D] (+ their exp / grad).
    """
    g = _tsp_geometry(inp)
    dims, D, b, B, L = g["dims"], g["D"], inp.dtype_bytes, inp.batch, g["L"]
    cb = max(b, 4)
    T = B * L
    fwd, bwd = _tsp_layer_terms(inp)
    layer_params = g["A"] + g["M"] + 2 * dims.h
    kvb = 2 * B * g["S_pad"] * g["nkv_b"] * dims.d  # one head block's gathered K/V, elements
    qb = T * g["nq_b"] * dims.d
    act_grads = 3 * T * dims.h * b
    f_r = dims.F // D
    transients = {
        "attention_fwd": (2 * g["A"] + 2 * kvb + 2 * T * g["nkv_b"] * dims.d + 3 * qb) * b,
        "attention_bwd": ((2 + min(D, 3) + 1) * g["A"] + 3 * kvb + 4 * qb) * b + act_grads,
        "mlp_fwd": (2 * g["M"] + 4 * T * f_r) * b,
        "mlp_bwd": (6 * g["M"] + 8 * T * f_r) * b + act_grads,
        "lm_head_fwd": 2 * g["Vd"] * dims.h * b + T * g["Vd"] * (b + 2 * cb),
        "lm_head_bwd": 6 * g["Vd"] * dims.h * b + T * g["Vd"] * (2 * b + 2 * cb) + act_grads,
    }
    per_layer = _tsp_layer_saved(inp, g)

    def stage_fn(stage: _Stage) -> dict:
        params = stage.layers * layer_params
        act = 2 * T * dims.d * b  # cos, sin (shared by every layer)
        if inp.activation_checkpointing:
            act += stage.layers * T * dims.h * b + per_layer
        else:
            act += stage.layers * per_layer
        if stage.embed:
            params += g["Vd"] * dims.h
            act += T * 8  # input ids
        if stage.head:
            params += dims.h + (0 if (dims.tied and stage.embed) else g["Vd"] * dims.h)
            # final norm; LM head: input, lse, labels and the loss denominator (a scalar in dtype)
            act += _norm_saved(T, dims, b) + T * dims.h * b + T * cb + T * 8 + b
        act *= stage.in_flight
        grad_elems = params
        s = _state(inp, params, **_zero_divs(inp))
        s["activations"] = act
        s["transients"] = {k: v for k, v in transients.items() if stage.head or not k.startswith("lm_head")}
        s["step_terms"] = (_tsp_extra_terms(inp, stage) + _dp_sync(inp, grad_elems, inp.dp) + _p2p(inp, stage, T))
        return s

    notes = [f"zigzag: seq padded to {g['S_pad']} (multiple of 2D)"]
    if g["kv_replicas"] > 1:
        notes.append(f"num_kv_heads={dims.nkv} < D={D}: each head block gathers its one kv head; blocks sharing it "
                     f"gather it {g['kv_replicas']}x (K/V traffic D/n_kv x the design's rho*2KV)")
    if inp.keep_gathered_kv:
        notes.append("keep_gathered_kv: every block's gathered K/V saved (O(S) per rank), no backward re-gather")
    return _layout_plan("tsp", inp, stage_fn, fwd, bwd, per_layer, tuple(notes))


# --- peers: common activation pieces ----------------------------------------------------------------------------------

def _peer_layer_saved(inp: PlanInput, dims: _Dims, *, norm_tokens: int, linear_in_tokens: int, attn_tokens: int,
                      heads_div: int, kv_heads: int, mlp_tokens: int, mlp_div: int, extra_attn_out_tokens: int = 0
                      ) -> int:
    """Saved for backward by one decoder layer of a conventional implementation with flash attention and a fused
    SwiGLU (Megatron / Liger style: gate, up and the product are saved, 3F per token):
    2 norms (as _norm_saved), the inputs of the qkv and gate/up linears (h each), q, k, v after RoPE and the
    attention output (the o-proj input) and LSE (fp32), the MLP's 3F; each on the tokens the layout holds there.
    kv_heads: kv heads per rank inside attention."""
    b = inp.dtype_bytes
    q = dims.nq // heads_div * dims.d
    kv = kv_heads * dims.d
    return (2 * _norm_saved(norm_tokens, dims, b) + 2 * linear_in_tokens * dims.h * b
            + attn_tokens * ((2 * q + 2 * kv) * b + dims.nq // heads_div * 4)
            + extra_attn_out_tokens * dims.nq * dims.d * b
            + mlp_tokens * 3 * (dims.F // mlp_div) * b)


def _peer_stage(inp: PlanInput, stage: _Stage, *, params_layer: int, params_embed: int, params_head: int,
                state_kw: dict, per_layer: int, layer_input_bytes: int, head_act: int, transients: dict,
                step_terms: Callable[[_Stage], list[CommTerm]]) -> dict:
    params = stage.layers * params_layer
    act = stage.layers * layer_input_bytes + per_layer if inp.activation_checkpointing else stage.layers * per_layer
    if stage.embed:
        params += params_embed
    if stage.head:
        params += (0 if (inp.model.tie_word_embeddings and stage.embed) else params_head)
        act += head_act
    act *= stage.in_flight
    s = _state(inp, params, **state_kw)
    s["activations"] = act
    s["transients"] = {k: v for k, v in transients.items() if stage.head or not k.startswith("lm_head")}
    s["step_terms"] = step_terms(stage)
    s["grad_elems"] = params
    return s


# --- Megatron TP (no sequence parallelism) --------------------------------------------------------------------------

def _tp_params(inp: PlanInput, dims: _Dims) -> tuple[int, int, int]:
    T = inp.degree
    layer = dims.attn(dims.nq // T, dims.kv_heads_per_rank(T)) + 3 * dims.h * (dims.F // T) + 2 * dims.h
    table = _ceil_div(dims.V, T) * dims.h
    return layer, table, table + dims.h


def plan_tp(inp: PlanInput) -> LayoutPlan:
    """Megatron tensor parallelism without sequence parallelism, degree T = D.

    Weights: q/k/v and gate/up column-parallel, o/down row-parallel (1/T; kv heads replicated when n_kv < T), norms
    replicated, vocab-parallel embedding and LM head (ceil(V/T) rows). Every rank holds all S tokens.
    Comm: per layer forward 2 all-reduces of B*S*h (after o-proj and after down-proj), backward 2 (the duals of the
    column-parallel inputs' identity); embedding forward 1 all-reduce of B*S*h; vocab-parallel cross-entropy 3
    all-reduces of B*S fp32 (max, sum-exp, target logit) forward and 1 all-reduce of the LM head input grad
    backward. Activations: norms and linear inputs on all S tokens, attention/MLP internals 1/T; the cross-entropy
    saves the fp32 softmax [B*S, V/T].
    """
    dims = _check_heads(inp, "tp")
    T, b, B, S = inp.degree, inp.dtype_bytes, inp.batch, inp.seq
    if dims.F % T:
        raise PlanInputError("degree", f"tp: intermediate_size={dims.F} is not divisible by degree={T}")
    P = B * S * dims.h * b
    fwd = [_term("all-reduce after o-proj and down-proj", "all_reduce", P, 2 if T > 1 else 0, 2 * _ar(P, T))]
    bwd = [_term("all-reduce of the qkv and gate/up input grads", "all_reduce", P, 2 if T > 1 else 0,
                 2 * _ar(P, T))]
    if inp.activation_checkpointing:
        bwd += [replace(t, name="recompute: " + t.name) for t in fwd]
    layer_p, embed_p, head_p = _tp_params(inp, dims)
    tokens = B * S
    per_layer = _peer_layer_saved(inp, dims, norm_tokens=tokens, linear_in_tokens=tokens, attn_tokens=tokens,
                                  heads_div=T, kv_heads=dims.kv_heads_per_rank(T), mlp_tokens=tokens, mlp_div=T)
    Vt = _ceil_div(dims.V, T)
    cb = max(b, 4)
    head_act = _norm_saved(tokens, dims, b) + tokens * dims.h * b + tokens * Vt * 4
    qkv_r = (dims.nq // T + 2 * dims.kv_heads_per_rank(T)) * dims.d
    transients = {"layer_fwd": P + tokens * 2 * (dims.F // T) * b + tokens * qkv_r * b,
                  "layer_bwd": 3 * P + tokens * 3 * (dims.F // T) * b + tokens * qkv_r * b,
                  "lm_head": P + tokens * Vt * (b + cb)}

    def step_terms(stage):
        terms = []
        if stage.embed:
            terms.append(_term("embedding all-reduce fwd", "all_reduce", P, 1 if T > 1 else 0, _ar(P, T)))
        if stage.head:
            terms += [_term("cross-entropy all-reduces (max, sum-exp, target) fwd", "all_reduce", B * S * 4,
                            3 if T > 1 else 0, 3 * _ar(B * S * 4, T)),
                      _term("LM head input grad all-reduce bwd", "all_reduce", P, 1 if T > 1 else 0, _ar(P, T))]
        return terms

    def stage_fn(stage):
        s = _peer_stage(inp, stage, params_layer=layer_p, params_embed=embed_p, params_head=head_p,
                        state_kw=_zero_divs(inp), per_layer=per_layer, layer_input_bytes=tokens * dims.h * b,
                        head_act=head_act, transients=transients, step_terms=lambda st: [])
        s["step_terms"] = (step_terms(stage) + _dp_sync(inp, s["grad_elems"], inp.dp)
                           + _p2p(inp, stage, _ceil_div(tokens, T)))
        return s

    return _layout_plan("tp", inp, stage_fn, fwd, bwd, per_layer,
                        ("all-reduce counted 2(T-1)/T of its payload (ring); the textbook '2x' is its upper bound",))


# --- Megatron TP + sequence parallelism (one axis) ------------------------------------------------------------------

def plan_tp_sp(inp: PlanInput, *, save_gathered_inputs: bool = True) -> LayoutPlan:
    """Megatron tensor + sequence parallelism on one axis of T = D ranks (Korthikanti et al. 2022).

    Norms, residuals and dropout-free regions hold S/T tokens; before the qkv and gate/up linears an all-gather of
    B*S*h, after the o-proj and down-proj a reduce-scatter: 4 collectives of a B*S*h buffer forward and their 4
    duals backward. save_gathered_inputs=True (default) saves the gathered linear inputs (full S: activations only
    partly /T); False saves the S/T shards and re-gathers them in backward (2 more all-gathers, everything /T).
    Norm weight grads are all-reduced over the group (each rank saw other tokens). Embedding: reduce-scatter
    forward / all-gather backward; LM head: all-gather of its input forward / reduce-scatter backward, plus the
    vocab-parallel cross-entropy all-reduces. Seq padded to a multiple of T.
    """
    dims = _check_heads(inp, "tp_sp")
    T, b, B = inp.degree, inp.dtype_bytes, inp.batch
    if dims.F % T:
        raise PlanInputError("degree", f"tp_sp: intermediate_size={dims.F} is not divisible by degree={T}")
    S = _round_up(inp.seq, T)
    P = B * S * dims.h * b
    n = 1 if T > 1 else 0
    fwd = [_term("all-gather before qkv and gate/up", "all_gather", P, 2 * n, 2 * _ag(P, T)),
           _term("reduce-scatter after o-proj and down-proj", "reduce_scatter", P, 2 * n, 2 * _ag(P, T))]
    bwd = [_term("all-gather of the o-proj/down-proj output grads", "all_gather", P, 2 * n, 2 * _ag(P, T)),
           _term("reduce-scatter of the qkv/gate-up input grads", "reduce_scatter", P, 2 * n, 2 * _ag(P, T)),
           _term("norm weight grad all-reduce (2 norms)", "all_reduce", dims.h * b, 2 * n, 2 * _ar(dims.h * b, T))]
    if not save_gathered_inputs:
        bwd.append(_term("re-gather of the linear inputs", "all_gather", P, 2 * n, 2 * _ag(P, T)))
    if inp.activation_checkpointing:
        bwd += [replace(t, name="recompute: " + t.name) for t in fwd]
    layer_p, embed_p, head_p = _tp_params(inp, dims)
    full, local = B * S, B * S // T
    per_layer = _peer_layer_saved(inp, dims, norm_tokens=local, linear_in_tokens=full if save_gathered_inputs else
                                  local, attn_tokens=full, heads_div=T, kv_heads=dims.kv_heads_per_rank(T),
                                  mlp_tokens=full, mlp_div=T)
    Vt = _ceil_div(dims.V, T)
    cb = max(b, 4)
    head_act = _norm_saved(local, dims, b) + full * dims.h * b + full * Vt * 4
    qkv_r = (dims.nq // T + 2 * dims.kv_heads_per_rank(T)) * dims.d
    transients = {"layer_fwd": 2 * P + full * 2 * (dims.F // T) * b + full * qkv_r * b,
                  "layer_bwd": 3 * P + full * 3 * (dims.F // T) * b + full * qkv_r * b,
                  "lm_head": P + full * Vt * (b + cb)}

    def step_terms(stage):
        terms = []
        if stage.embed:
            terms += [_term("embedding reduce-scatter fwd", "reduce_scatter", P, n, _ag(P, T)),
                      _term("embedding grad all-gather bwd", "all_gather", P, n, _ag(P, T))]
        if stage.head:
            terms += [_term("LM head input all-gather fwd", "all_gather", P, n, _ag(P, T)),
                      _term("cross-entropy all-reduces (max, sum-exp, target) fwd", "all_reduce", full * 4, 3 * n,
                            3 * _ar(full * 4, T)),
                      _term("LM head input grad reduce-scatter bwd", "reduce_scatter", P, n, _ag(P, T)),
                      _term("final norm grad all-reduce", "all_reduce", dims.h * b, n, _ar(dims.h * b, T))]
        return terms

    def stage_fn(stage):
        s = _peer_stage(inp, stage, params_layer=layer_p, params_embed=embed_p, params_head=head_p,
                        state_kw=_zero_divs(inp), per_layer=per_layer, layer_input_bytes=local * dims.h * b,
                        head_act=head_act, transients=transients, step_terms=lambda st: [])
        s["step_terms"] = step_terms(stage) + _dp_sync(inp, s["grad_elems"], inp.dp) + _p2p(inp, stage, local)
        return s

    notes = [f"seq padded to {S} (multiple of T)"]
    if save_gathered_inputs:
        notes.append("gathered linear inputs saved for backward (no re-gather; 10 collectives/layer otherwise)")
    return _layout_plan("tp_sp", inp, stage_fn, fwd, bwd, per_layer, tuple(notes))


# --- ZeRO-3 / FSDP weight traffic (ulysses, fsdp_cp) ----------------------------------------------------------------

def _sharded_weight_terms(inp: PlanInput, elems: int, group: int, what: str):
    """ZeRO-3 / FSDP over `group` ranks: all-gather of the weights forward; all-gather again and reduce-scatter of
    the grads backward (one gather serves the recompute and the backward under activation checkpointing)."""
    full = elems * inp.dtype_bytes
    n = 1 if group > 1 else 0
    fwd = [_term(f"{what} weight all-gather", "all_gather", full, n, _ag(full, group))]
    bwd = [_term(f"{what} weight re-gather", "all_gather", full, n, _ag(full, group)),
           _term(f"{what} grad reduce-scatter", "reduce_scatter", full, n, _ag(full, group))]
    return fwd, bwd


def _zero3_params(inp: PlanInput, dims: _Dims, group: int) -> tuple[int, int, int]:
    return (_ceil_div(dims.layer, group), _ceil_div(dims.V * dims.h, group),
            _ceil_div(dims.V * dims.h + dims.h, group))


def _head_extras_sharded(inp: PlanInput, dims: _Dims, stage: _Stage, group: int) -> list[CommTerm]:
    terms = []
    if stage.embed:
        f, bw = _sharded_weight_terms(inp, dims.V * dims.h, group, "embedding")
        terms += f + bw
    if stage.head:
        head = dims.h + (0 if dims.tied and stage.embed else dims.V * dims.h)
        f, bw = _sharded_weight_terms(inp, head, group, "LM head + final norm")
        terms += f + bw
    return terms


def _local_logits(inp: PlanInput, dims: _Dims, tokens: int) -> tuple[int, int]:
    """(saved, transient) of a plain LM head + cross-entropy on `tokens` tokens and the full vocabulary: the fp32
    log-softmax is saved; the logits in dtype and their fp32 copy are transient (HF default; a tiled / fused loss
    such as ALST's or Liger's removes both)."""
    b = inp.dtype_bytes
    return tokens * dims.V * 4, tokens * dims.V * (b + max(b, 4))


def plan_ulysses(inp: PlanInput, *, zero3: bool = True) -> LayoutPlan:
    """DeepSpeed-Ulysses (ALST) sequence parallelism of degree D, with ZeRO-3 over the D*dp ranks (zero3=True) or
    replicated weights (zero3=False: grads all-reduced over D*dp each step; zero_stage 1/2 partitions the
    optimizer / grads over those D*dp ranks).

    Tokens S/D per rank outside attention; 4 all-to-alls per layer forward (q, k, v to head-sharded full
    sequence, the output back), 4 in backward, each (D-1)/D of its input B*S/D*(width). With n_kv < D the kv
    heads are replicated to D before the all-to-all. ZeRO-3: each layer's weights all-gathered forward, gathered
    again backward and their grads reduce-scattered; transient = the gathered layer (+ one prefetched) and its
    full grads. Activations: every piece on S/D tokens, attention internals head-sharded over the full sequence,
    plus the o-proj input (the output after the reverse all-to-all). LM head: full-vocab logits of the local
    tokens (see _local_logits).
    """
    dims = _check_heads(inp, "ulysses")
    D, b, B = inp.degree, inp.dtype_bytes, inp.batch
    S = _round_up(inp.seq, D)
    local = B * S // D
    kv_eff = max(dims.nkv, D)
    G = D * inp.dp
    a2a = [("q", dims.nq * dims.d), ("k", kv_eff * dims.d), ("v", kv_eff * dims.d), ("attention output",
                                                                                      dims.nq * dims.d)]
    fwd = [_term(f"all-to-all {name}", "all_to_all", local * w * b, 1 if D > 1 else 0, _ag(local * w * b, D))
           for name, w in a2a]
    bwd = [replace(t, name=t.name + " grad") for t in fwd]
    if inp.activation_checkpointing:
        bwd += [replace(t, name="recompute: " + t.name) for t in fwd]
    if zero3:
        wf, wb = _sharded_weight_terms(inp, dims.layer, G, "layer")
        fwd, bwd = fwd + wf, bwd + wb
        layer_p, embed_p, head_p = _zero3_params(inp, dims, G)
        state_kw = {}
    else:  # the D sequence ranks are data-parallel for the weights: ZeRO-1/2 partitions over all D*dp of them
        layer_p, embed_p, head_p = dims.layer, dims.V * dims.h, dims.V * dims.h + dims.h
        state_kw = {"grads_div": G if inp.zero_stage >= 2 else 1, "opt_div": G if inp.zero_stage >= 1 else 1}
    per_layer = _peer_layer_saved(inp, dims, norm_tokens=local, linear_in_tokens=local, attn_tokens=local,
                                  heads_div=1, kv_heads=kv_eff, mlp_tokens=local, mlp_div=1,
                                  extra_attn_out_tokens=local)
    logits_saved, logits_tmp = _local_logits(inp, dims, local)
    head_act = _norm_saved(local, dims, b) + local * dims.h * b + logits_saved
    width = (2 * dims.nq + 2 * kv_eff) * dims.d
    gathered = dims.layer * b if zero3 else 0
    transients = {"layer_fwd": 2 * gathered + 2 * local * width * b + local * 2 * dims.F * b,
                  "layer_bwd": 3 * gathered + 2 * local * width * b + local * 3 * dims.F * b
                  + 3 * local * dims.h * b,
                  "lm_head": (dims.V * dims.h * b if zero3 else 0) + logits_tmp}

    def stage_fn(stage):
        s = _peer_stage(inp, stage, params_layer=layer_p, params_embed=embed_p, params_head=head_p,
                        state_kw=state_kw, per_layer=per_layer, layer_input_bytes=local * dims.h * b,
                        head_act=head_act, transients=transients, step_terms=lambda st: [])
        if zero3:
            s["step_terms"] = _head_extras_sharded(inp, dims, stage, G) + _p2p(inp, stage, local)
        else:
            s["step_terms"] = _dp_sync(inp, s["grad_elems"], G) + _p2p(inp, stage, local)
        return s

    notes = [f"seq padded to {S} (multiple of D)"]
    if kv_eff > dims.nkv:
        notes.append(f"num_kv_heads={dims.nkv} < D={D}: kv heads replicated to {kv_eff} for the all-to-all")
    if zero3:
        notes.append(f"ZeRO-3 over D*dp={G} ranks: params, grads, optimizer / {G}; transient gathered layer")
    return _layout_plan("ulysses" if zero3 else "ulysses_replicated", inp, stage_fn, fwd, bwd, per_layer,
                        tuple(notes))


def plan_ulysses_replicated(inp: PlanInput) -> LayoutPlan:
    return plan_ulysses(inp, zero3=False)


# --- FSDP + context parallelism (ring attention) ---------------------------------------------------------------------

def plan_fsdp_cp(inp: PlanInput) -> LayoutPlan:
    """FSDP (ZeRO-3 style) over the cp*dp = D*dp ranks + context parallelism of degree D with ring attention.

    Tokens S/D per rank (zigzag, seq padded to 2D), all heads. Per layer forward: the layer's weights all-gathered
    and D-1 ring hops of the local K and V (2*B*S/D*h_kv each hop); backward: re-gather + grad reduce-scatter and
    2(D-1) hops (K/V again and dK/dV). Activations: the conventional layer (_peer_layer_saved) on S/D tokens with
    local q, k, v, output and LSE saved. Transient: gathered layer (+ prefetch), its full grads, the K/V ring's
    send/receive buffers. LM head: full-vocab logits of the local tokens.
    """
    dims = _Dims.of(inp.model)
    D, b, B = inp.degree, inp.dtype_bytes, inp.batch
    S = _round_up(inp.seq, 2 * D)
    local = B * S // D
    G = D * inp.dp
    kv_hop = 2 * local * dims.nkv * dims.d * b
    fwd = [_term("ring attention K/V hops", "ring", kv_hop, D - 1, (D - 1) * kv_hop)]
    bwd = [_term("ring attention K/V + dK/dV hops", "ring", kv_hop, 2 * (D - 1), 2 * (D - 1) * kv_hop)]
    if inp.activation_checkpointing:
        bwd += [replace(t, name="recompute: " + t.name) for t in fwd]
    wf, wb = _sharded_weight_terms(inp, dims.layer, G, "layer")
    fwd, bwd = fwd + wf, bwd + wb
    layer_p, embed_p, head_p = _zero3_params(inp, dims, G)
    per_layer = _peer_layer_saved(inp, dims, norm_tokens=local, linear_in_tokens=local, attn_tokens=local,
                                  heads_div=1, kv_heads=dims.nkv, mlp_tokens=local, mlp_div=1)
    logits_saved, logits_tmp = _local_logits(inp, dims, local)
    head_act = _norm_saved(local, dims, b) + local * dims.h * b + logits_saved
    gathered = dims.layer * b
    transients = {"layer_fwd": 2 * gathered + 2 * kv_hop + local * 2 * dims.F * b,
                  "layer_bwd": 3 * gathered + 4 * kv_hop + local * 3 * dims.F * b + 3 * local * dims.h * b,
                  "lm_head": dims.V * dims.h * b + logits_tmp}

    def stage_fn(stage):
        s = _peer_stage(inp, stage, params_layer=layer_p, params_embed=embed_p, params_head=head_p, state_kw={},
                        per_layer=per_layer, layer_input_bytes=local * dims.h * b, head_act=head_act,
                        transients=transients, step_terms=lambda st: [])
        s["step_terms"] = _head_extras_sharded(inp, dims, stage, G) + _p2p(inp, stage, local)
        return s

    return _layout_plan("fsdp_cp", inp, stage_fn, fwd, bwd, per_layer,
                        (f"seq padded to {S} (multiple of 2D)", f"FSDP over D*dp={G} ranks",
                         "ring attention backward counted as 2(D-1) hops of K/V size"))


# --- entry points --------------------------------------------------------------------------------------------------

LAYOUTS: dict[str, Callable[[PlanInput], LayoutPlan]] = {
    "tsp": plan_tsp, "tp": plan_tp, "tp_sp": plan_tp_sp, "ulysses": plan_ulysses, "fsdp_cp": plan_fsdp_cp,
    "ulysses_replicated": plan_ulysses_replicated,
}
DEFAULT_LAYOUTS = ("tsp", "tp", "tp_sp", "ulysses", "fsdp_cp")


def plan_layouts(inp: PlanInput, layouts: tuple[str, ...] | list[str] = DEFAULT_LAYOUTS) -> list[LayoutPlan]:
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise PlanInputError("layout", f"layout {unknown}: choose among {sorted(LAYOUTS)}")
    return [LAYOUTS[name](inp) for name in layouts]


def megatron_tp_example() -> dict:
    """The textbook Megatron TP check: TP=8, b=1, s=4096, h=8192, bf16.

    One all-reduce payload is 2*b*s*h bytes = 64 MiB; a layer's forward has two. Counted as a ring all-reduce
    (2(T-1)/T of the payload) that is 2 * 2 * 7/8 * 64 MiB = 224 MiB per rank; the commonly quoted ~268 MB is the
    same with the factor rounded up to 2 (2 * 2 * 64 MiB = 268,435,456 bytes).
    """
    shape = ModelShape(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=1, num_heads=64,
                       num_kv_heads=8)
    tp = plan_tp(PlanInput(model=shape, seq=4096, batch=1, degree=8, dtype="bf16"))
    (term,) = tp.layer_fwd_terms
    return {"payload_bytes": term.payload_bytes, "all_reduces_per_layer_fwd": term.calls,
            "comm_bytes_per_layer_fwd": tp.comm_bytes_per_layer_fwd,
            "comm_bytes_per_layer_fwd_2x": 2 * term.calls * term.payload_bytes}
