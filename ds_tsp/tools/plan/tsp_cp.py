"""TSP inside each node x a context-parallel (cp) ring across nodes: C TSP groups of D ranks share one sequence.

Each TSP group holds S_pad / C tokens (S padded to 2CD; zigzag over the 2C cp chunks, then TSP's inside,
ds_tsp.core.tokens.zigzag) and 1/D of every weight; weights are replicated over cp and their grads and optimizer
states go with the data axis (ZeRO over data x cp). So one rank is planned as TSP (plan_tsp) at seq S_pad / C with
dp x C data ranks, plus the cp ring (ds_tsp.core.layers.attention.cp_ring):

- inter-node bytes: per decoder layer and head block, C-1 hops of this rank's 1/D share of its group's K/V of that
  block (B x S/(CD) x 2 nkv_b x d elements: each token's K/V crosses nodes once) forward; backward the same K/V
  hops again plus C-1 hops of the share's dK/dV (float32 accumulators under bf16/fp16); activation checkpointing
  replays the forward hops. Every TSP rank sends its hops on its own NIC (TSP rank p of each group talks to TSP
  rank p of the next);
- intra-node bytes the ring adds: each received block reassembled over the TSP group (two all-gathers of the
  block, per zigzag half), in backward again, plus its dK/dV reduce-scattered to the shares the ring carries back
  (`intra_node_cp_bytes_per_step`, by kind in `intra_node_cp_bytes_by_kind`; layer terms, or step terms where not
  every layer takes the full ring). Sliding-window layers
  send only the keys their window reaches (ds_tsp.core.layers.attention.cp_window; tsp_cp_window): their bytes differ
  between cp ranks, so the step's bytes are the busiest rank's (`inter_node_bytes_per_rank` gives each, cp-major);
- the input check: its fixed-size payloads all-gathered over cp once per step (ds_tsp.core.tokens.input_check.over_cp;
  input_check_cp_bytes), an inter-node step term every rank pays (`input_check_cp_bytes_per_step`, in
  `inter_node_bytes_per_step` and each `inter_node_bytes_per_rank`);
- memory: the ring's buffers on top of the TSP peak (conservatively, at the peak phase): two received K/V blocks
  forward; backward also two dK/dV accumulators and one contribution buffer (float32 under bf16);
- hybrid models (Gated DeltaNet layers): the full-attention layers take the ring above; each Gated DeltaNet layer
  all-gathers its conv halo and chunk transitions over cp too (each rank its own pieces, then the TSP group
  gathers the [C, ...] pieces: more intra-node bytes), O(1) in S (ds_tsp.tools.plan.hybrid_cp); the
  layer terms describe the most numerous Gated DeltaNet kind, the other kinds' cp terms come in the step terms.
  Sliding-window hybrids do not exist (ModelShape refuses sliding windows with layer_types: neither Qwen3.5 nor
  Qwen3-Next has them), so neither does their plan;
- pipeline stages (pp > 1): the cp rows (K/V ring, windowed layers, Gated DeltaNet gathers) count the layers of the
  stage the plan reports (its highest peak), and each stage gathers its position_ids over cp (cp_check_terms);
- overlap: each hop's transfer runs behind the attention of the previous block: per hop and head block
  c = S/(2CD) queries x S/C keys (zigzag: the same on every rank), 4 c (S/C) nq_b d FLOPs forward, 2.5x that in
  backward. `cp` in the result gives both per step: ring seconds at `inter_node_gbps` per GPU against the attention
  seconds at `gpu_tflops`.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.core.layers.attention.cp_cost import ATTENTION_BACKWARD_FLOPS, INTER_NODE_GBPS  # the model's too
from ds_tsp.tools.cli_types import GIB, MIB
from ds_tsp.tools.plan.comm_terms import gather_bytes, recompute, term
from ds_tsp.tools.plan.hybrid_cp import gdn_cp_buffers, gdn_cp_terms, gdn_cp_tsp_terms, hybrid_cp_rows
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.moe_cp import with_moe_cp_terms
from ds_tsp.tools.plan.moe_terms import stage_layer_ids
from ds_tsp.tools.plan.offload import with_offload
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import mixed_attention_shapes, round_up, stages
from ds_tsp.tools.plan.tsp import plan_tsp
from ds_tsp.tools.plan.tsp_comm import TSPGeometry, input_check_cp_bytes, input_check_cp_payload
from ds_tsp.tools.plan.tsp_cp_window import window_ring


def group_input(inp: PlanInput, cp: int) -> PlanInput:
    """What one TSP group of the cp ring is planned as: TSP at S_pad / C tokens, ZeRO over dp x C ranks."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanInputError("cp", f"cp={cp!r}: must be an integer >= 1")
    if cp > 1 and mixed_attention_shapes(inp.model):
        raise PlanInputError("cp", f"cp={cp} with full_head_dim / full_num_kv_heads / full_values_from_keys / "
                                   "kv_shared_layers (Gemma 4's full layers' own attention shape, KV sharing): the "
                                   "cp ring's K/V terms count one attention shape; plan tsp (cp 1) or measure with "
                                   "ds-tsp bench")
    S = round_up(inp.seq, 2 * inp.degree * cp)
    return replace(inp, seq=S // cp, dp=inp.dp * cp)


def cp_check_terms(group: PlanInput, cp: int, layers: int = 0) -> tuple[int, tuple]:
    """(bytes, step terms) of what a step gathers over cp to find the documents (group: group_input's): the input
    check's fixed payload (ds_tsp.core.tokens.input_check.over_cp), or with pipeline stages, where every stage
    finds them in the position_ids it receives, those of the TSP group gathered over cp once per stage and
    micro-batch (ds_tsp.core.tokens.positions.global_positions), and under activation checkpointing once more per
    recomputed layer of the stage (`layers`: DeepSpeed's checkpoint hands each its detached inputs)."""
    D = group.degree
    if cp == 1:
        return 0, ()
    if group.pp > 1:
        positions = group.batch * group.seq * cp * 8  # [C, D, B, S_pad / (C D)] int64
        check = gather_bytes(positions, cp)
        again = layers if group.activation_checkpointing else 0
        return (1 + again) * check, (
            term("position_ids all-gather over cp (each stage's document layout)", "all_gather", positions, 1, check),
            *([term("recompute: position_ids re-gather over cp (per checkpointed layer)", "all_gather", positions,
                    again, again * check)] if again else []))
    check = input_check_cp_bytes(D, cp)
    return check, (term("input check + document layout all-gather over cp", "all_gather",
                        input_check_cp_payload(D, cp), 1, check),)


def plan_tsp_cp(inp: PlanInput, cp: int, *, inter_node_gbps: float = INTER_NODE_GBPS, gpu_tflops: float = 400.0,
                gpus_per_node: int = 8) -> LayoutPlan:
    """One rank of C TSP groups of D (inp.degree) sharing each sequence; layout "tsp_cp" (cp=1: TSP alone)."""
    group = group_input(inp, cp)
    hybrid = inp.model.layer_types is not None and cp > 1  # Gated DeltaNet layers: their cp terms (hybrid_cp)
    base = with_offload(plan_tsp(group), group, TSPGeometry.of(group), gpu_tflops=gpu_tflops,
                        gpus_per_node=gpus_per_node)
    g = TSPGeometry.of(group)
    D, C, B, b = inp.degree, cp, inp.batch, inp.dtype_bytes
    acc_b = max(b, 4)  # dK/dV accumulators are float32 under bf16 / fp16
    group_tokens = group.seq  # S_pad / C
    kv_hop = B * group_tokens * 2 * g.nkv_b * g.dims.d * b  # one head block's K/V of a whole group
    grad_hop = kv_hop // b * acc_b
    kv_share, grad_share = kv_hop // D, grad_hop // D  # what a hop carries: one TSP rank's share of the block
    hops = D * (C - 1)  # per layer: every head block's K/V goes around once
    fwd = [term("cp ring K/V hops (1/D share each)", "cp_ring", kv_share, hops, hops * kv_share)] if C > 1 else []
    bwd = ([term("cp ring K/V hops (backward, 1/D share each)", "cp_ring", kv_share, hops, hops * kv_share),
            term("cp ring dK/dV hops (1/D share each)", "cp_ring", grad_share, hops, hops * grad_share)]
           if C > 1 else [])
    # intra-node: each received block reassembled over the TSP group (two all-gathers, one per zigzag half), its
    # dK/dV reduce-scattered to the shares the ring carries back (cp_ring._KVRing, _scatter_grad)
    half_gather, half_scatter = gather_bytes(kv_hop // 2, D), gather_bytes(grad_hop // 2, D)
    tsp_fwd = ([term("cp block K/V reassembly all-gather over TSP", "all_gather", kv_hop // 2, 2 * hops,
                     2 * hops * half_gather)] if C > 1 and D > 1 else [])
    tsp_bwd = ([term("cp block K/V reassembly all-gather over TSP (backward)", "all_gather", kv_hop // 2, 2 * hops,
                     2 * hops * half_gather),
                term("cp block dK/dV reduce-scatter over TSP", "reduce_scatter", grad_hop // 2, 2 * hops,
                     2 * hops * half_scatter)] if C > 1 and D > 1 else [])
    if inp.activation_checkpointing:
        bwd += recompute(fwd)
        tsp_bwd += recompute(tsp_fwd)
    ring_buffers = min(C - 1, 2)  # gathered blocks: one attended, one in flight; plus two shares
    extra_fwd = ring_buffers * kv_hop + (2 * kv_share if C > 1 else 0)
    # backward: two dK/dV blocks (one computed, one reduce-scattered) + the second half's reversed copy, two shares
    extra_bwd = extra_fwd + (5 * grad_hop // 2 + 2 * grad_share if C > 1 else 0)
    extra = max(extra_fwd, extra_bwd, gdn_cp_buffers(group, C) if hybrid else 0)
    layers = base.layers_per_stage
    cp_fwd, cp_bwd = sum(t.bytes for t in fwd), sum(t.bytes for t in bwd)
    stage = next(s for s in stages(group) if s.name == base.stage)  # the reported stage (pp > 1: first or last)
    # sliding-window layers send only the keys their window reaches (tsp_cp_window); the rest take the full ring
    win = window_ring(inp.model, group_tokens * C, C, D, kv_hop // group_tokens, grad_hop // group_tokens,
                      checkpointing=inp.activation_checkpointing, layer_ids=stage_layer_ids(group, stage))
    full_layers = layers - win.layers
    per_rank = [full_layers * (cp_fwd + cp_bwd) + win.fwd_bytes[k] + win.bwd_bytes[k] for k in range(C * D)]
    hybrid_steps = []
    stage_types = [inp.model.layer_types[i] for i in stage_layer_ids(group, stage)] if hybrid else []
    if hybrid:  # every rank the same: the K/V ring of the full-attention layers, the Gated DeltaNet's gathers
        if win.layers:  # unreachable today: ModelShape refuses sliding windows with layer_types (no such family)
            raise PlanInputError("cp", f"cp={C}: sliding-window layers in a hybrid (Gated DeltaNet) model are not "
                                       "modelled under cp; plan TSP alone (--cp 1)")
        full_layers = stage_types.count("full_attention")
        fwd, bwd, hybrid_steps, hybrid_bytes = hybrid_cp_rows(group, C, fwd, bwd, stage)
        cp_fwd, cp_bwd = sum(t.bytes for t in fwd), sum(t.bytes for t in bwd)
        per_rank = [hybrid_bytes] * (C * D)
    busiest = max(range(C * D), key=per_rank.__getitem__)  # cp-major: cp rank busiest // D, TSP rank busiest % D
    ring_bytes = per_rank[busiest]
    check, check_terms = cp_check_terms(group, C, layers)  # the same on every rank: the busiest stays the busiest
    if win.layers:  # per-layer figures: the mean over the layers (their terms: per layer of their kind)
        calls = win.hop_calls[busiest] // win.layers
        win_fwd, win_bwd = win.fwd_bytes[busiest] // win.layers, win.bwd_bytes[busiest] // win.layers
        fwd, bwd = (fwd, bwd) if full_layers else ([], [])
        fwd = fwd + [term("cp ring window K/V hops (per windowed layer)", "cp_ring", win_fwd // max(calls, 1),
                          calls, win_fwd)]
        bwd = bwd + [term("cp ring window K/V + dK/dV hops (backward, per windowed layer)", "cp_ring",
                          win_bwd // max(calls, 1), 2 * calls, win_bwd)]
        cp_fwd = (full_layers * cp_fwd + win.fwd_bytes[busiest]) // layers
        cp_bwd = (full_layers * cp_bwd + win.bwd_bytes[busiest]) // layers
    # the intra-node reassembly of the full-attention layers' blocks: layer terms when every layer takes that ring,
    # else step terms (x the full-attention layers), as hybrid_cp_rows lays out the other kinds
    intra_cp, intra_by_kind = 0, {}
    for t in tsp_fwd + tsp_bwd:
        intra_cp += full_layers * t.bytes
        intra_by_kind[t.kind] = intra_by_kind.get(t.kind, 0) + full_layers * t.bytes
    tsp_steps = []
    if hybrid or win.layers:
        tsp_steps = [replace(t, name=f"full-attention layers x{full_layers}: {t.name}", calls=t.calls * full_layers,
                             bytes=t.bytes * full_layers) for t in tsp_fwd + tsp_bwd if full_layers]
        tsp_fwd, tsp_bwd = [], []
    if hybrid:  # the Gated DeltaNet layers' TSP stage gathers every cp group's pieces (hybrid_cp.gdn_cp_tsp_terms)
        n_gdn = stage_types.count("linear_attention")
        for t in (t for terms in gdn_cp_tsp_terms(group, C) for t in terms):
            intra_cp += n_gdn * t.bytes
            intra_by_kind[t.kind] = intra_by_kind.get(t.kind, 0) + n_gdn * t.bytes
            tsp_steps.append(replace(t, name=f"Gated DeltaNet layers x{n_gdn}: {t.name}", bytes=t.bytes * n_gdn))
    intra_per_rank = [intra_cp] * (C * D)
    if win.layers:  # the windowed layers' slices gathered and their dK/dV reduce-scattered over TSP (per rank)
        intra_per_rank = [intra_cp + g + r for g, r in zip(win.intra_gather, win.intra_scatter)]
        for kind, n in (("all_gather", win.intra_gather[busiest]), ("reduce_scatter", win.intra_scatter[busiest])):
            if n:
                intra_by_kind[kind] = intra_by_kind.get(kind, 0) + n
                tsp_steps.append(term(f"windowed layers x{win.layers}: cp window slices {kind} over TSP "
                                      f"(cp rank {busiest // D})", kind, 0, 0, n))
        intra_cp = intra_per_rank[busiest]
    # attention FLOPs the hops overlap: per hop and block c = S/(2CD) queries x S/C keys x nq_b heads
    c = group_tokens // (2 * D)
    hop_flops = 4 * B * c * group_tokens * g.nq_b * g.dims.d
    passes = 1 + ATTENTION_BACKWARD_FLOPS + (1 if inp.activation_checkpointing else 0)
    per_layer_flops = hops * hop_flops * passes
    window_flops = D * 4 * B * win.pairs[busiest] * g.nq_b * g.dims.d * passes  # the blocks its hops run behind
    bytes_per_s = inter_node_gbps * 1e9 / 8
    summary = {
        "cp": C, "tsp": D, "seq_padded": group_tokens * C, "tokens_per_rank": B * group_tokens // D,
        "inter_node_bytes_per_step": ring_bytes + check, "inter_node_bytes_per_rank": [b + check for b in per_rank],
        "input_check_cp_bytes_per_step": check,
        "windowed_layers": win.layers,
        "intra_node_bytes_per_step": layers * (base.comm_bytes_per_layer_fwd + base.comm_bytes_per_layer_bwd)
        + intra_cp,
        "intra_node_cp_bytes_per_step": intra_cp, "intra_node_cp_bytes_by_kind": intra_by_kind,
        "intra_node_cp_bytes_per_rank": intra_per_rank,
        "grad_sync_bytes_per_step": base.comm_bytes_per_step - layers * (base.comm_bytes_per_layer_fwd
                                                                         + base.comm_bytes_per_layer_bwd),
        "ring_buffer_bytes": extra, "kv_hop_bytes": kv_share, "kv_block_bytes": kv_hop,
        "inter_node_gbps": inter_node_gbps, "gpu_tflops": gpu_tflops,
        "cp_ring_seconds_per_step": ring_bytes / bytes_per_s,
        "overlapped_attention_seconds_per_step": (full_layers * per_layer_flops + window_flops) / (gpu_tflops * 1e12),
        "hop_seconds": kv_share / bytes_per_s, "hop_attention_seconds": hop_flops / (gpu_tflops * 1e12),
    }
    transients = {phase: size + extra for phase, size in base.transients.items()}
    notes = tuple(n for n in base.notes if not n.startswith("zigzag:")) + (
        f"cp: {C} TSP groups of {D} share each sequence (seq padded to {group_tokens * C}, multiple of 2CD); "
        f"ZeRO / grad sync over dp x cp = {group.dp} ranks",
        f"cp ring: {hops} K/V hops of {kv_share / MIB:.1f} MiB (1/{D} of a block: each token's K/V crosses "
        f"nodes once, reassembled over TSP) per layer forward, twice that (+ dK/dV) backward; "
        f"ring buffers {extra / GIB:.2f} GiB added at the peak phase (conservative)",
    ) + ((f"cp: the Gated DeltaNet layers' conv halo and chunk transitions are all-gathered over cp too "
          f"({sum(t.bytes for t in gdn_cp_terms(group, C)[0])} B per layer forward; O(1) in S; "
          "ds_tsp.tools.plan.hybrid_cp)",) if hybrid else ()) + (
        (f"cp ring of the {win.layers} sliding-window layers: only the keys a window reaches travel "
          f"(busiest: cp rank {busiest // D}, TSP rank {busiest % D}, {win.hop_calls[busiest] // win.layers} "
          "exchanges per layer)",)
         if win.layers else ()) if C > 1 else base.notes
    return with_moe_cp_terms(replace(  # MoE: TSP's rows at the group's tokens, + the aux counts over cp (moe_cp)
        base, layout="tsp_cp" if C > 1 else base.layout,
        transients_bytes=base.transients_bytes + extra, peak_bytes_per_rank=base.peak_bytes_per_rank + extra,
        transients=transients, phase_bytes={k: v + extra for k, v in base.phase_bytes.items()},
        comm_bytes_per_layer_fwd=base.comm_bytes_per_layer_fwd + cp_fwd + sum(t.bytes for t in tsp_fwd),
        comm_bytes_per_layer_bwd=base.comm_bytes_per_layer_bwd + cp_bwd + sum(t.bytes for t in tsp_bwd),
        comm_bytes_per_step=base.comm_bytes_per_step + ring_bytes + check + intra_cp,
        layer_fwd_terms=base.layer_fwd_terms + tuple(fwd) + tuple(tsp_fwd),
        layer_bwd_terms=base.layer_bwd_terms + tuple(bwd) + tuple(tsp_bwd),
        step_terms=base.step_terms + tuple(hybrid_steps) + tuple(tsp_steps) + check_terms, notes=notes, cp=summary),
        inp, C)


def recommend_tsp_cp(inp: PlanInput, *, devices: int, gpu_mem_bytes: int, gpus_per_node: int = 8,
                     **rates) -> tuple[tuple[int, int] | None, list[tuple[int, int, LayoutPlan | str]]]:
    """(D, C) for `devices` GPUs of `gpu_mem_bytes` in nodes of `gpus_per_node`: TSP inside a node (D the
    largest divisor of the node that fits the model's heads), then the fewest cp groups C whose plan fits
    (fewest inter-node hops); the rest of the devices go to data parallelism. Returns (choice or None, every
    (D, C, plan or why not) tried)."""
    tried: list[tuple[int, int, LayoutPlan | str]] = []
    for D in sorted((d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0), reverse=True):
        if devices % D:
            continue
        for C in (c for c in range(1, devices // D + 1) if (devices // D) % c == 0):
            try:
                plan = plan_tsp_cp(replace(inp, degree=D, dp=devices // (D * C)), C,
                                   gpus_per_node=gpus_per_node, **rates)
            except PlanInputError as exc:
                tried.append((D, C, str(exc)))
                break
            tried.append((D, C, plan))
            if plan.peak_bytes_per_rank <= gpu_mem_bytes:
                return (D, C), tried
    return None, tried
