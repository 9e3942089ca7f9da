"""TSP mixture-of-experts terms (Qwen3-MoE / Mixtral / GLM-4.5 sparse layers): params, saved tensors, transients and
bytes. GLM-4.5's ungated shared experts (a dense gated MLP of width Fs, 1/D per rank) add their weight ring, their
shard and, while they run after the routed experts, the block's output y plus a dense MLP's temporaries; their
input is the block's (saved once), and their output is added unscaled (nothing more saved). Its sigmoid router
saves its scores [T, E] (fp32) where the softmax router saves its probabilities. (Qwen3-Next / Qwen3.5-MoE's gated
shared expert: ds_tsp.tools.plan.hybrid.)

A sparse layer replaces the dense MLP's F/D columns by E/D whole experts (E_r x 3 x F_moe x h, one packed shard)
plus the replicated router [E, h] (its grad joins the replicated-grads bucket). Which layers are sparse:
ModelShape.is_moe_layer (Qwen3-MoE's decoder_sparse_step / mlp_only_layers; dense layers stay as tsp.py plans them).

Bytes per layer: ds_tsp.core.layers.moe.cost.moe_bytes_per_layer is the single source of truth (what the
CommCounter counts; "all_to_all" at even routing, R = T x top_k x (D-1)/D rows leaving the rank). The split into
forward and backward follows its docstring: ring D-1 of its 3(D-1) shard hops forward; all_to_all forward the count
exchange plus 2h of the 5h+2 elements per row. "auto" is choose_moe_dispatch for this batch shape (T = B x S_pad/D
local tokens), the same call TSPSparseMoE makes.

Saved for backward by the MoE block on top of the dense layer's own (tsp_layer_saved counts the block's input x):
the router softmax [T, E] (fp32), top-k indices [T, k] (int64), with norm_topk_prob the top-k probabilities and
their sum (fp32), the routing weights [T, k] (dtype), the sorted row order [T*k] and per-expert counts [E] (int64;
all_to_all adds the arrival permutation [~T*k]); with recompute_projections False the gate/up pre-activations of
every routed row (all_to_all: and the received rows). With output_router_logits each layer's logits [T, E] and the
aux loss's softmax of them stay alive too. Checked against saved-tensor hooks (tests/tools/test_plan_moe.py).

Transients (estimates of the temporaries alive at the worst point, the expert GEMM path as select_expert_gemm
picks it: per expert on the CPU / non-bf16 ("loop"), per ring step with grouped GEMMs):
- ring rows per step (MoEGeometry.ring_step_rows): every step slices exactly its owner's rows on both GEMM paths
  (ds_tsp.core.layers.moe.ring bounds them by one host read of the per-expert counts per layer forward), so the
  gathers, GEMMs, SiLU and scatters of a step touch the owner's rows only; planned at the balanced expectation
  R/D = T x top_k / D at even routing. PlanInput.moe_load L (1: even routing) plans a skewed one: the busiest
  expert meets L times its even share R/E (the loop path's per-expert GEMM block, at most T rows) and its owner's
  other experts their even share, so the owner meets (L + E_r - 1) / E_r times R/D per ring step (at most
  T x min(top_k, E_r)) and all_to_all delivers it that many times R rows (at most D T min(top_k, E_r)). Measured
  at random init (8 experts, top-2, D=2): one expert with 3.9x its share, its owner 1.7x. Bytes stay at even
  routing. `ds-tsp plan` reports it
  (ring_rows_per_step, ring_row_bytes_per_step, a note) and the host reads per sparse layer (host_reads_per_layer:
  one per forward, one more for the recompute under activation checkpointing, none in backward; all_to_all the same).
- ring fwd: the foreign shards of the ring in flight (as the dense MLP), y, this step's gathered rows and
  outputs (weighted in place; [rows per step, h] each) and their int64 token ids, one GEMM block's gate/up, SiLU and
  product, the router logits [T, E].
- ring bwd: the ring's shard and grad buffers plus the loop's zeroed expert-grad views, dx / dy, the routing
  weight grads, this step's rows, dy rows and row grads and indices, one block's ~10 F-wide backward temporaries.
- all_to_all fwd: rows out, rows in, the rows sorted by expert ([R, h] each), one block's gate/up/act, y.
- all_to_all bwd: the larger of the received [R, 2h+1] rows with their expert-order copy (alive together for one
  copy; both freed before the expert GEMMs) and the GEMMs' moment: the rows and dy rows copies, the routing weights,
  the row grads and one expert's backward temporaries; plus the expert grads and their packed copy (2 shards), dx
  and the incoming dy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ds_tsp.core.layers.moe.cost import SCHEDULES, choose_moe_dispatch, moe_bytes_per_layer
from ds_tsp.tools.cli_types import MIB
from ds_tsp.tools.plan.activation_terms import compute_bytes
from ds_tsp.tools.plan.comm_terms import all_reduce_bytes, recompute, term
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.result import CommTerm
from ds_tsp.tools.plan.shape_terms import Stage, ceil_div

INDEX_BYTES = 8  # int64 expert ids, row orders, counts


@dataclass(frozen=True)
class MoEGeometry:
    """One rank's share of a sparse layer under TSP."""

    E: int
    k: int
    F: int  # per-expert width (moe_intermediate_size)
    E_r: int  # experts per rank
    h: int
    D: int
    T: int  # local tokens B x S_pad/D
    b: int  # dtype bytes
    schedule: str  # the schedule planned ("ring" / "all_to_all"; "auto" resolved)
    auto: str  # what "auto" picks for this batch shape
    bytes_per_layer: dict  # schedule -> bytes one rank sends per sparse layer, fwd + bwd (moe_bytes_per_layer)
    grouped: bool = False  # the expert GEMMs run grouped (select_expert_gemm: bf16 on a GPU / meta), else the loop
    checkpointing: bool = False  # activation checkpointing: each sparse layer's forward (and its host read) reruns
    biases: bool = False  # GPT-OSS: every expert's gate_up / down biases (in the shard), the router's bias
    topk_softmax: bool = False  # GPT-OSS's routing: the softmax over the top-k logits only
    load: float = 1.0  # PlanInput.moe_load: the busiest expert's rows over its even share

    @property
    def shard(self) -> int:
        """This rank's packed experts, elements."""
        return self.E_r * (3 * self.F * self.h + ((2 * self.F + self.h) if self.biases else 0))

    @property
    def router(self) -> int:
        return self.E * self.h + (self.E if self.biases else 0)

    @property
    def rows(self) -> int:
        """(token, slot) rows this rank routes: T x top_k."""
        return self.T * self.k

    @staticmethod
    def _loaded(even: int, factor: float, cap: int) -> int:
        """`even` rows `factor` times (rounded up), at most `cap`."""
        return even if factor == 1 else min(cap, math.ceil(even * factor))

    @property
    def owner_load(self) -> float:
        """The busiest owner's rows over its even share: its busiest expert at `load`, the others at theirs."""
        return (self.load + self.E_r - 1) / self.E_r

    @property
    def ring_step_rows(self) -> int:
        """Rows one ring step gathers, computes and scatters: the owner's rows, on either GEMM path (host bounds,
        one read per layer); R/D at even routing, owner_load times that planned (at most T min(top_k, E_r))."""
        return self._loaded(ceil_div(self.rows, self.D), self.owner_load, self.T * min(self.k, self.E_r))

    @property
    def arrived_rows(self) -> int:
        """Rows all_to_all delivers to this rank's experts: R at even routing, owner_load times that planned (at
        most D T min(top_k, E_r): every rank's rows that can meet them)."""
        return self._loaded(self.rows, self.owner_load, self.D * self.T * min(self.k, self.E_r))

    @property
    def host_reads_per_layer(self) -> int:
        """Device-to-host reads of one sparse layer per step, either schedule: the per-expert counts in forward,
        again in the recompute under activation checkpointing; none in backward."""
        return 2 if self.checkpointing else 1

    def block_rows(self, grouped: bool) -> int:
        """Rows one expert GEMM block sees: ring, per step the owner's rows (grouped: one block over them) or this
        rank's R/E rows per expert at even routing (loop); all_to_all, the R rows arrived for the owned experts
        (grouped: one block; loop: R/E_r per expert)."""
        if self.schedule == "ring":
            return self.ring_step_rows if grouped else self._loaded(ceil_div(self.rows, self.E), self.load, self.T)
        return self.arrived_rows if grouped else self._loaded(ceil_div(self.rows, self.E_r), self.load,
                                                              self.D * self.T)


def moe_geometry(inp: PlanInput, tokens_per_rank: int, schedule: str | None = None) -> MoEGeometry | None:
    """None for a dense model; `schedule` overrides inp.moe_dispatch (to plan the other one)."""
    m = inp.model
    if not m.num_experts:
        return None
    D, b = inp.degree, inp.dtype_bytes
    args = (tokens_per_rank, m.hidden_size, m.moe_intermediate_size, m.num_experts, m.num_experts_per_tok, D, b,
            m.moe_biases)
    requested = schedule or inp.moe_dispatch
    try:
        cost = moe_bytes_per_layer(*args)
        auto = choose_moe_dispatch("auto", *args)
        chosen = choose_moe_dispatch(requested, *args)
    except Exception as exc:  # TSPConfigError: E not divisible by D, unknown schedule
        raise PlanInputError("degree" if "num_experts" in str(exc) else "moe_dispatch", f"tsp: {exc}") from None
    return MoEGeometry(m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.num_experts // D,
                       m.hidden_size, D, tokens_per_rank, b, chosen, auto, cost, grouped=inp.dtype == "bf16",
                       checkpointing=inp.activation_checkpointing, biases=m.moe_biases,
                       topk_softmax=m.moe_routing == "topk_softmax", load=inp.moe_load)


def stage_layer_ids(inp: PlanInput, stage: Stage) -> range:
    """Decoder layer indices on `stage` (stages(): "first" holds the first ones, "last" / "only" the last)."""
    n = inp.model.num_layers
    return range(0, stage.layers) if stage.name == "first" else range(n - stage.layers, n)


def sparse_count(inp: PlanInput, stage: Stage) -> int:
    return sum(inp.model.is_moe_layer(i) for i in stage_layer_ids(inp, stage))


def sparse_layer_params(m: MoEGeometry) -> int:
    """A sparse layer's MLP part per rank (replacing the dense F/D columns): E_r experts + the replicated router."""
    return m.shard + m.router


# --- communication --------------------------------------------------------------------------------------------
def moe_mlp_terms(m: MoEGeometry) -> tuple[list[CommTerm], list[CommTerm]]:
    """The sparse MLP's CommCounter terms of one layer under m.schedule (totals from moe_bytes_per_layer)."""
    D, total = m.D, m.bytes_per_layer[m.schedule]
    if D == 1:
        return [], []
    if m.schedule == "ring":
        shard = total // (3 * (D - 1))  # the ring moves 3(D-1) shards per layer
        return ([term("MoE expert ring (D-1 hops)", "ring", shard, D - 1, (D - 1) * shard)],
                [term("MoE expert ring (D-1 weight + D-1 grad hops)", "ring", shard, 2 * (D - 1),
                      2 * (D - 1) * shard)])
    counts = moe_bytes_per_layer(0, m.h, m.F, m.E, m.k, D, m.b)["all_to_all"]  # the count exchange alone
    unit = (total - counts) // (5 * m.h + 2)  # bytes of one element in each of the R rows that leave the rank
    return ([term("MoE expert row counts all-to-all", "all_to_all", counts, 1, counts),
             term("MoE token rows out + expert outputs back (all-to-all)", "all_to_all", unit * m.h, 2,
                  2 * unit * m.h)],
            [term("MoE x, dy, weight rows out (all-to-all)", "all_to_all", unit * (2 * m.h + 1), 1,
                  unit * (2 * m.h + 1)),
             term("MoE row grads + weight grads back (all-to-all)", "all_to_all", unit * (m.h + 1), 1,
                  unit * (m.h + 1))])


def shared_expert_shard(inp: PlanInput) -> int:
    """Elements of this rank's shared-expert shard in a non-hybrid sparse layer (GLM-4.5: 3 x h x Fs/D); 0 without.
    A gated one only comes with the hybrid families, planned by ds_tsp.tools.plan.hybrid."""
    m = inp.model
    if not (m.num_experts and m.shared_expert_intermediate_size):
        return 0
    if m.shared_expert_gate:
        raise PlanInputError("model", "a gated shared expert without layer_types: planned for the hybrid families "
                                      "(Qwen3-Next, Qwen3.5-MoE) only")
    return 3 * m.hidden_size * (m.shared_expert_intermediate_size // inp.degree)


def sparse_layer_terms(inp: PlanInput, dense_fwd: list[CommTerm], dense_bwd: list[CommTerm],
                       m: MoEGeometry) -> tuple[list[CommTerm], list[CommTerm]]:
    """A sparse layer's terms: the dense layer's (tsp_comm.tsp_layer_terms) without its MLP ring, plus the MoE
    schedule's and the shared expert's weight ring (and their recompute under activation checkpointing)."""
    def attention_only(terms):
        return [t for t in terms if not (t.kind == "ring" and "MLP" in t.name)]

    fwd, bwd = moe_mlp_terms(m)
    shared = shared_expert_shard(inp) * m.b
    if shared and m.D > 1:
        fwd = fwd + [term("shared expert weight ring (D-1 hops)", "ring", shared, m.D - 1, (m.D - 1) * shared)]
        bwd = bwd + [term("shared expert ring (D-1 weight + D-1 grad hops)", "ring", shared, 2 * (m.D - 1),
                          2 * (m.D - 1) * shared)]
    return (attention_only(dense_fwd) + fwd,
            attention_only(dense_bwd) + bwd + (recompute(fwd) if inp.activation_checkpointing else []))


def router_grad_elems(inp: PlanInput, stage: Stage) -> int:
    """Router weights on `stage`, whose grads join the one replicated-grads all-reduce (pp = 1)."""
    m = inp.model
    per_layer = m.num_experts * m.hidden_size + (m.num_experts if m.moe_biases else 0)  # GPT-OSS: + the bias
    return sparse_count(inp, stage) * per_layer if m.num_experts else 0


def moe_step_terms(inp: PlanInput, stage: Stage) -> list[CommTerm]:
    """Per step: the routers' grad all-reduces on a pipeline stage (no bucket there), and with output_router_logits
    the aux loss's one all-reduce of the per-expert counts and the row total (compute dtype)."""
    m, D = inp.model, inp.degree
    n = sparse_count(inp, stage) if m.num_experts else 0
    if not n or D == 1:
        return []
    out = []
    if inp.pp > 1:
        router = m.num_experts * m.hidden_size * inp.dtype_bytes
        out.append(term("MoE router grad all-reduce (per sparse layer)", "replicated_grad", router, n,
                        n * all_reduce_bytes(router, D)))
        if m.moe_biases:  # GPT-OSS: the router's bias, its own replicated param
            bias = m.num_experts * inp.dtype_bytes
            out.append(term("MoE router bias grad all-reduce (per sparse layer)", "replicated_grad", bias, n,
                            n * all_reduce_bytes(bias, D)))
    if m.output_router_logits and stage.embed and stage.head:
        payload = (m.num_experts + 1) * compute_bytes(inp.dtype_bytes)
        out.append(term("MoE aux loss counts all-reduce", "all_reduce", payload, 1, all_reduce_bytes(payload, D)))
    return out


# --- memory ---------------------------------------------------------------------------------------------------
def moe_saved(inp: PlanInput, m: MoEGeometry) -> int:
    """Saved for backward by one sparse MLP beyond its input x (module docstring)."""
    T, R, b, model = m.T, m.rows, m.b, inp.model
    if m.topk_softmax:  # GPT-OSS: top-k of the logits (indices), softmax of those k (its output: the weights)
        saved = R * INDEX_BYTES + R * b + R * INDEX_BYTES + m.E * INDEX_BYTES
    else:
        saved = T * m.E * 4 + R * INDEX_BYTES + R * b + R * INDEX_BYTES + m.E * INDEX_BYTES
    if model.norm_topk_prob and not m.topk_softmax:
        saved += R * 4 + T * 4  # the division's numerator and denominator
    if m.schedule == "all_to_all":
        saved += m.arrived_rows * INDEX_BYTES  # arrival permutation (even routing: R rows arrive)
    if not inp.recompute_projections:  # ring: every own row's gate / up; all_to_all: the arrived rows' and the rows
        saved += (R if m.schedule == "ring" else m.arrived_rows) * (2 * m.F * b + (m.h * b if m.schedule ==
                                                                                  "all_to_all" else 0))
    if model.output_router_logits:
        saved += 2 * T * m.E * b  # logits kept for the aux loss, and its softmax
    return saved


def moe_transients(inp: PlanInput, m: MoEGeometry, ring_buffers: int) -> dict[str, int]:
    """{"mlp_fwd", "mlp_bwd"}: the sparse MLP's temporaries under m.schedule (module docstring)."""
    grouped = m.grouped
    T, R, h, F, b, D = m.T, m.rows, m.h, m.F, m.b, m.D
    blk = m.block_rows(grouped)
    x = T * h * b
    shard = m.shard * b
    logits = T * m.E * b
    if m.schedule == "ring":
        step = m.ring_step_rows
        index = step * INDEX_BYTES  # the step's token ids (its sorted rows are a view of the layer's order)
        return {"mlp_fwd": min(D - 1, 2) * shard + x + 2 * step * h * b + index + 4 * blk * F * b + logits,
                "mlp_bwd": (ring_buffers + 2) * shard + 2 * x + R * b + 3 * step * h * b + index
                + 10 * blk * F * b}
    # backward (ds_tsp.core.layers.moe.all_to_all), the larger of two moments: the received rows (2h+1) and their
    # expert-order copy, alive together for the permutation copy; then the expert GEMMs over the rows and dy rows
    # copies, the routing weights, the row grads and one expert block's temporaries
    A = m.arrived_rows  # rows out are this rank's R; rows in (and their expert order) the owner's
    return {"mlp_fwd": (R + 2 * A) * h * b + 4 * blk * F * b + x + logits,
            "mlp_bwd": max(2 * A * (2 * h + 1) * b, 3 * A * h * b + A * b + 10 * blk * F * b) + 2 * shard + 2 * x}


def ring_row_bytes_per_step(m: MoEGeometry) -> int:
    """Bytes the ring's row gathers, scatters and elementwise passes move per step: the owner's x rows, outputs
    and weighted outputs (h each) and gate/up, SiLU product (3F), read and written, plus the indices (the sorted
    rows read, their token ids written)."""
    return m.ring_step_rows * (2 * (3 * m.h + 3 * m.F) * m.b + 2 * INDEX_BYTES)


def moe_summary(m: MoEGeometry, per_schedule_peak: dict[str, int] | None = None) -> dict:
    """What LayoutPlan.moe carries (and `ds-tsp plan` prints)."""
    out = {"schedule": m.schedule, "auto": m.auto, "bytes_per_layer": dict(m.bytes_per_layer),
           "num_experts": m.E, "top_k": m.k, "moe_ffn": m.F, "experts_per_rank": m.E_r,
           "expert_params_per_layer": m.shard, "router_params_per_layer": m.router, "tokens_per_rank": m.T,
           "ring_rows_per_step": m.ring_step_rows, "ring_row_bytes_per_step": ring_row_bytes_per_step(m),
           "host_reads_per_layer": m.host_reads_per_layer}
    if per_schedule_peak is not None:
        out["peak_bytes"] = dict(per_schedule_peak)
    return out


def moe_note(m: MoEGeometry, sparse: int, layers: int) -> str:
    mib = {s: m.bytes_per_layer[s] / MIB for s in SCHEDULES}
    rows = m.ring_step_rows
    share = ("R/D at even routing" if m.load == 1 else
             f"R/D x {m.owner_load:.3g}, the busiest expert at --moe-load {m.load:g} x its share")
    window = (f"; ring rows per step {rows} of {m.rows} ({ring_row_bytes_per_step(m) / MIB:.2f} MiB of row "
              f"traffic per step, the owner's rows: {share})" if m.schedule == "ring" and m.D > 1 else "")
    recompute = " + 1 recompute" if m.checkpointing else ""
    return (f"MoE: {sparse} of {layers} layers sparse, {m.E} experts ({m.E_r}/rank) top-{m.k}, F_moe={m.F}; bytes "
            f"per sparse layer ring {mib['ring']:.2f} MiB, all_to_all {mib['all_to_all']:.2f} MiB (even routing): "
            f"auto -> {m.auto}; planned: {m.schedule}{window}; host reads: 1{recompute} per sparse layer forward "
            f"(the per-expert row counts), none in backward")
