"""TSP inside each node x the all-to-all cp schedule across nodes (tsp.cp_comm "all_to_all",
ds_tsp.core.layers.attention.cp_all_to_all): each head block's heads scattered over the C cp groups.

One rank is planned as TSP (plan_tsp) at seq S_pad / C with dp x C data ranks, as for the ring (tsp_cp.group_input),
with these differences (L = S_pad / (C D) tokens per rank, nq' = nq_b / C query heads and nkv' = max(nkv_b / C, 1)
kv heads per cp rank, r = C nkv' / nkv_b the kv replication, b the dtype's bytes, lse 4 bytes (8 in float64)):

- inter-node bytes (the cp communicator's counter: (C-1)/C of each all-to-all's input): per layer and kv group the
  local K/V (B L 2 nkv' d, to each of C peers) forward, again in backward for the re-gather (not with
  keep_gathered_kv) and its dK/dV back; per head block q and out (B L nq' d each) and the lse (B L nq') forward;
  backward q, out, dout, the lse and dq. Activation checkpointing replays the forward. Every layer takes it (a
  sliding window needs no path of its own: the kernels mask at global positions), and every rank sends the same;
- intra-node (TSP group): the K/V gathered per kv group is the whole sequence's of nkv' heads: r times the ring's
  gather of S/C tokens of nkv_b heads (and the re-gather, the dK/dV reduce-scatter alike);
- memory: the whole sequence's K/V of nkv' heads per kv group (two live: this group's, the next in flight) instead
  of the group's, the all-to-all buffers (send and receive of q / out / dout and the local K/V, one block ahead and
  one behind the block computing), and in backward the whole-sequence dK/dV accumulator and its rank-ordered copy:
  an estimate added at the peak phase;
- time: the exchanges are pipelined a block deep (block j+1's q / out / dout posted before block j's attention,
  block j's output / dq waited after block j+1's, the next kv group's K/V a block ahead), so per layer and pass
  only the fill and drain are exposed (the first kv group's K/V and block 0's q in, the last block's out / lse or
  dq back, the last kv group's dK/dV; a group's dK/dV otherwise goes back behind the next block's attention
  backward); the rest hides behind D-1 of the D blocks' attention and is exposed only where it outlasts it
  (`exposed_seconds`). `cp` gives the seconds at `inter_node_gbps` (all, and exposed) beside the step's attention
  seconds at `gpu_tflops`, and the ring's inter-node bytes for the same input (`ring_inter_node_bytes_per_step`) to
  choose between them.
Hybrid models: Gated DeltaNet layers keep their cp gathers (hybrid_cp); MoE: the aux counts' all-reduce (moe_cp).
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.tools.cli_types import GIB
from ds_tsp.tools.plan.comm_terms import gather_bytes, recompute, term
from ds_tsp.tools.plan.hybrid_cp import gdn_cp_buffers, hybrid_cp_rows
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.moe_cp import with_moe_cp_terms
from ds_tsp.tools.plan.moe_terms import stage_layer_ids
from ds_tsp.tools.plan.offload import with_offload
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import stages
from ds_tsp.tools.plan.tsp import plan_tsp
from ds_tsp.tools.plan.tsp_comm import (
    KV_TERMS,
    TSPGeometry,
    tsp_counter_bytes,
    tsp_layer_terms,
)
from ds_tsp.tools.plan.tsp_cp import ATTENTION_BACKWARD_FLOPS, INTER_NODE_GBPS, cp_check_terms, group_input, plan_tsp_cp

__all__ = ["plan_tsp_cp_all_to_all", "all_to_all_lines", "tsp_counter_bytes_all_to_all", "CP_COMMS"]

CP_COMMS = ("ring", "all_to_all")  # the schedules a plan models (tsp.cp_comm also takes "auto": tsp_cp_auto)


def _heads(g: TSPGeometry, C: int) -> tuple[int, int, int]:
    """(nq', nkv', r) of cp_all_to_all.HeadSplit, or a PlanInputError naming cp_comm where the block does not split."""
    nq, nkv = g.nq_b, g.nkv_b
    if nq % C or (nkv % C and C % nkv):
        raise PlanInputError("cp_comm", f"cp_comm all_to_all with cp={C}: a head block of {nq} query and {nkv} kv "
                                        "heads does not split evenly over the cp groups; plan the ring")
    kv = max(nkv // C, 1)
    return nq // C, kv, C * kv // nkv


def _scaled_kv_terms(terms, r: int, D: int):
    """The TSP group's K/V gather / re-gather / dK/dV reduce-scatter terms of the whole sequence's nkv' heads."""
    out = []
    for t in terms:
        if r > 1 and any(t.name.endswith(name) for name in KV_TERMS):
            t = replace(t, payload_bytes=t.payload_bytes * r, bytes=t.calls * gather_bytes(t.payload_bytes * r, D))
        out.append(t)
    return tuple(out)


def tsp_counter_bytes_all_to_all(group: PlanInput, cp: int) -> dict[str, int]:
    """Predicted TSP-group CommCounter.bytes of one forward + backward of a dense model under the all-to-all
    (group: tsp_cp.group_input's): TSP's at the group's tokens, its K/V gathers and dK/dV reduce-scatters of the
    whole sequence's nkv' heads."""
    out = tsp_counter_bytes(group)
    _, _, r = _heads(TSPGeometry.of(group), cp)
    terms = [t for terms in tsp_layer_terms(group) for t in terms]
    for before, after in zip(terms, _scaled_kv_terms(terms, r, group.degree)):
        if after.bytes != before.bytes:
            out[after.kind] += (after.bytes - before.bytes) * group.model.num_layers
    return out


def all_to_all_terms(group: PlanInput, C: int) -> tuple[list, list, int]:
    """(forward terms, backward terms, extra live bytes) of one attention layer's cp all-to-alls, per rank."""
    g = TSPGeometry.of(group)
    D, B, b, d = group.degree, group.batch, group.dtype_bytes, g.dims.d
    nq, nkv, r = _heads(g, C)
    lse_b = 8 if b == 8 else 4  # the kernels' lse: float32, float64 in a float64 run
    L = group.seq // D  # tokens per rank (group.seq = S_pad / C, a multiple of 2D)
    groups = D // g.kv_replicas
    kv = C * B * L * 2 * nkv * d * b  # the K/V all-to-all's input [C, 2, c, B, 2, nkv', d]
    q = C * B * L * nq * d * b  # one [C, B, L, nq', d] all-to-all (q, out or dq)
    lse = C * B * nq * L * lse_b
    fwd = [term("cp all-to-all K/V (per kv group)", "cp_all_to_all", kv, groups, groups * gather_bytes(kv, C)),
           term("cp all-to-all q + out (per head block)", "cp_all_to_all", q, 2 * D, 2 * D * gather_bytes(q, C)),
           term("cp all-to-all lse (per head block)", "cp_all_to_all", lse, D, D * gather_bytes(lse, C))]
    regather = 0 if group.keep_gathered_kv else groups
    bwd = [term("cp all-to-all K/V re-gather (per kv group)", "cp_all_to_all", kv, regather,
                regather * gather_bytes(kv, C)),
           term("cp all-to-all q / out / dout (per head block)", "cp_all_to_all", 3 * q, D, D * gather_bytes(3 * q, C)),
           term("cp all-to-all lse (backward, per head block)", "cp_all_to_all", lse, D, D * gather_bytes(lse, C)),
           term("cp all-to-all dq (per head block)", "cp_all_to_all", q, D, D * gather_bytes(q, C)),
           term("cp all-to-all dK/dV (per kv group)", "cp_all_to_all", kv, groups, groups * gather_bytes(kv, C))]
    if group.activation_checkpointing:
        bwd += recompute(fwd)
    full_kv = C * D * B * L * 2 * nkv * d * b  # the whole sequence's K/V of nkv' heads
    group_kv = D * B * L * 2 * g.nkv_b * d * b  # what TSP's own plan holds per kv group
    acc_b = max(b, 4)
    kv_part = 2 * max(full_kv - group_kv, 0) + 2 * kv
    # pipelined a block deep (cp_all_to_all's module doc): forward block j+1's q (local, sent, received), block j's
    # received q and output, block j-1's output and lse on their way back; backward block j+1's q / out / dout sent
    # and received, block j's received and its dq, block j-1's dq on its way back, two kv groups' dK/dV in flight
    extra_fwd = kv_part + 6 * q + 4 * lse
    extra_bwd = kv_part + full_kv * acc_b // b + full_kv + 2 * kv + 14 * q + 4 * lse
    return fwd, bwd, max(extra_fwd, extra_bwd)


# per term, the calls a layer's pass cannot hide (pipeline fill and drain); the others travel behind attention
_EXPOSED_CALLS = {"cp all-to-all K/V (per kv group)": 1, "cp all-to-all q + out (per head block)": 2,
                  "cp all-to-all lse (per head block)": 1, "cp all-to-all K/V re-gather (per kv group)": 1,
                  "cp all-to-all q / out / dout (per head block)": 1,
                  "cp all-to-all lse (backward, per head block)": 1, "cp all-to-all dq (per head block)": 1,
                  "cp all-to-all dK/dV (per kv group)": 1}


def exposed_seconds(terms, attention_s: float, D: int, bytes_per_s: float) -> float:
    """Seconds of one layer pass's all-to-all terms not hidden behind its attention (attention_s for the pass):
    the fill / drain calls (_EXPOSED_CALLS) in full, the rest where it outlasts D-1 of the D
    blocks' attention (what the pipelined exchanges travel behind)."""
    exposed = hidden = 0
    for t in terms:
        name = t.name.removeprefix("recompute: ")
        calls = min(_EXPOSED_CALLS.get(name, t.calls), t.calls)
        per_call = t.bytes / t.calls if t.calls else 0
        exposed += calls * per_call
        hidden += (t.calls - calls) * per_call
    return exposed / bytes_per_s + max(hidden / bytes_per_s - attention_s * (D - 1) / D, 0.0)


def plan_tsp_cp_all_to_all(inp: PlanInput, cp: int, *, inter_node_gbps: float = INTER_NODE_GBPS,
                           gpu_tflops: float = 400.0, gpus_per_node: int = 8) -> LayoutPlan:
    """One rank of C TSP groups of D sharing each sequence under the all-to-all schedule; layout "tsp_cp"."""
    if cp == 1:
        return plan_tsp_cp(inp, cp, inter_node_gbps=inter_node_gbps, gpu_tflops=gpu_tflops,
                           gpus_per_node=gpus_per_node)
    group = group_input(inp, cp)
    D, C = inp.degree, cp
    g = TSPGeometry.of(group)
    _, _, r = _heads(g, C)
    base = with_offload(plan_tsp(group), group, g, gpu_tflops=gpu_tflops, gpus_per_node=gpus_per_node)
    base = replace(base, layer_fwd_terms=_scaled_kv_terms(base.layer_fwd_terms, r, D),
                   layer_bwd_terms=_scaled_kv_terms(base.layer_bwd_terms, r, D),
                   step_terms=_scaled_kv_terms(base.step_terms, r, D))
    tsp_fwd, tsp_bwd = sum(t.bytes for t in base.layer_fwd_terms), sum(t.bytes for t in base.layer_bwd_terms)
    layers = base.layers_per_stage
    fwd, bwd, extra = all_to_all_terms(group, C)
    attention_fwd, attention_bwd = fwd, bwd  # one attention layer's, before a hybrid's rows replace them
    attention_layers = layers
    hybrid_steps = []
    if inp.model.layer_types is not None:  # Gated DeltaNet layers: their own cp gathers (hybrid_cp)
        stage = next(s for s in stages(group) if s.name == base.stage)  # the reported stage's layers (pp > 1)
        attention_layers = [inp.model.layer_types[i] for i in stage_layer_ids(group, stage)].count("full_attention")
        fwd, bwd, hybrid_steps, a2a_bytes = hybrid_cp_rows(group, C, fwd, bwd, stage)
        extra = max(extra, gdn_cp_buffers(group, C))
    else:
        a2a_bytes = layers * sum(t.bytes for t in (*fwd, *bwd))
    check, check_terms = cp_check_terms(group, C, layers)
    S = group.seq * C
    passes = 1 + ATTENTION_BACKWARD_FLOPS + (1 if inp.activation_checkpointing else 0)
    # causal attention of the whole sequence, every head, shared by the C D ranks
    attention_flops = attention_layers * 4 * inp.batch * (S * S // 2) * g.dims.nq * g.dims.d * passes // (C * D)
    bytes_per_s = inter_node_gbps * 1e9 / 8
    forward_s = attention_flops / passes / attention_layers / (gpu_tflops * 1e12) if attention_layers else 0.0
    recomputed = [t for t in attention_bwd if t.name.startswith("recompute: ")]
    exposed = attention_layers * (
        exposed_seconds(attention_fwd, forward_s, D, bytes_per_s)
        + exposed_seconds([t for t in attention_bwd if t not in recomputed], forward_s * ATTENTION_BACKWARD_FLOPS, D,
                          bytes_per_s)
        + exposed_seconds(recomputed, forward_s, D, bytes_per_s))
    try:  # the ring's figure for the same input, to choose between the schedules
        ring = plan_tsp_cp(inp, cp, inter_node_gbps=inter_node_gbps, gpu_tflops=gpu_tflops,
                           gpus_per_node=gpus_per_node).cp["inter_node_bytes_per_step"]
    except PlanInputError:
        ring = None
    intra = layers * (tsp_fwd + tsp_bwd)
    summary = {
        "cp": C, "tsp": D, "cp_comm": "all_to_all", "seq_padded": S, "tokens_per_rank": inp.batch * group.seq // D,
        "inter_node_bytes_per_step": a2a_bytes + check, "inter_node_bytes_per_rank": [a2a_bytes + check] * (C * D),
        "input_check_cp_bytes_per_step": check, "ring_inter_node_bytes_per_step": ring,
        "kv_replication": r,
        "intra_node_bytes_per_step": intra,
        "grad_sync_bytes_per_step": base.comm_bytes_per_step - layers * (base.comm_bytes_per_layer_fwd
                                                                         + base.comm_bytes_per_layer_bwd),
        "all_to_all_buffer_bytes": extra, "inter_node_gbps": inter_node_gbps, "gpu_tflops": gpu_tflops,
        "cp_all_to_all_seconds_per_step": (a2a_bytes + check) / bytes_per_s,
        # the attention layers' all-to-alls not hidden behind attention (exposed_seconds), plus the input check's
        "cp_all_to_all_exposed_seconds_per_step": exposed + check / bytes_per_s,
        "attention_seconds_per_step": attention_flops / (gpu_tflops * 1e12),
    }
    grad_sync = summary["grad_sync_bytes_per_step"]
    notes = tuple(n for n in base.notes if not n.startswith("zigzag:")) + (
        f"cp: {C} TSP groups of {D} share each sequence (seq padded to {S}, multiple of 2CD); ZeRO / grad sync over "
        f"dp x cp = {group.dp} ranks",
        f"cp all-to-all: each head block's heads scattered over the {C} cp groups (K/V of each kv head replicated "
        f"x{r}); buffers {extra / GIB:.2f} GiB added at the peak phase (estimate)",
    )
    return with_moe_cp_terms(replace(
        base, layout="tsp_cp",
        transients_bytes=base.transients_bytes + extra, peak_bytes_per_rank=base.peak_bytes_per_rank + extra,
        transients={phase: size + extra for phase, size in base.transients.items()},
        phase_bytes={k: v + extra for k, v in base.phase_bytes.items()},
        comm_bytes_per_layer_fwd=tsp_fwd + sum(t.bytes for t in fwd),
        comm_bytes_per_layer_bwd=tsp_bwd + sum(t.bytes for t in bwd),
        comm_bytes_per_step=intra + grad_sync + a2a_bytes + check,
        layer_fwd_terms=base.layer_fwd_terms + tuple(fwd), layer_bwd_terms=base.layer_bwd_terms + tuple(bwd),
        step_terms=base.step_terms + tuple(hybrid_steps) + check_terms, notes=notes, cp=summary), inp, C)


def all_to_all_lines(plan: LayoutPlan) -> list[str]:
    """`ds-tsp plan --cp C --cp-comm all_to_all`'s lines: memory, inter- vs intra-node bytes beside the ring's,
    seconds of all-to-all against the step's attention."""
    cp = plan.cp
    ring = cp["ring_inter_node_bytes_per_step"]
    return [
        f"D={cp['tsp']} (TSP inside a node) x C={cp['cp']} (cp all-to-all across nodes): seq {cp['seq_padded']}, "
        f"{cp['tokens_per_rank']} tokens per rank; peak {plan.peak_bytes_per_rank / GIB:.2f} GiB per rank"
        + (f", host {plan.host_bytes_per_rank / GIB:.2f} GiB per rank (offloaded layer inputs)"
           if plan.host_bytes_per_rank else ""),
        f"per step and rank: inter-node (cp axis) {cp['inter_node_bytes_per_step'] / GIB:.1f} GiB"
        + (f" (the cp ring: {ring / GIB:.1f} GiB)" if ring is not None else "")
        + f", intra-node (TSP) {cp['intra_node_bytes_per_step'] / GIB:.1f} GiB, grad sync over dp x cp "
        f"{cp['grad_sync_bytes_per_step'] / GIB:.2f} GiB",
        f"cp all-to-all at {cp['inter_node_gbps']:g} Gb/s per GPU: {cp['cp_all_to_all_seconds_per_step']:.2f} s per "
        f"step ({cp['cp_all_to_all_exposed_seconds_per_step']:.2f} s not hidden behind attention) beside "
        f"{cp['attention_seconds_per_step']:.2f} s of attention at "
        f"{cp['gpu_tflops']:g} TFLOP/s",
    ]
