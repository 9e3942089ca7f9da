"""A hybrid model (Gated DeltaNet + gated full attention) under the cp ring: what cp adds to TSP's hybrid rows.

Each TSP group is planned as TSP alone at S_pad / C tokens (ds_tsp.tools.plan.tsp_cp.group_input; its Gated
DeltaNet rows are ds_tsp.tools.plan.hybrid's at the group's local length L = S_pad / (C D), c = L / 2). On the cp
communicator (across nodes), per Gated DeltaNet layer (ds_tsp.core.layers.linear_attention.scan: each rank's own
piece is gathered over cp first, then the TSP group gathers the [C, ...] pieces):
- forward: the conv halo's all-gather over cp, (C-1) x 2 x B x min(c, K-1) x h elements (once a layer; none for
  K = 1), and per head block the chunk transitions' (C-1) x 2 x B x H_block x dk (dk + dv) (compute dtype: float32
  for 16/32-bit models);
- backward: per head block the transitions re-gathered and their grads reduce-scattered over cp (the same bytes
  each), the halo's grad reduce-scattered once; activation checkpointing replays the forward's.
The TSP stage then moves C times TSP's own pieces: (C-1) (D-1) x each piece more than TSP alone, intra-node
(gdn_cp_tsp_terms). Nothing grows with S. Full-attention layers take the K/V ring (ds_tsp.tools.plan.tsp_cp's
terms). As in plan_tsp_hybrid, the plan's layer terms describe the most numerous Gated DeltaNet kind and every
other kind's cp terms come in the step terms ("full-attention layers xN: cp ring K/V hops"); with pipeline stages,
over the layers of the stage the plan reports.
tests/cp/test_cp_hybrid.py checks the bytes against both communicators' CommCounters of a real step.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.tools.plan.comm_terms import gather_bytes, recompute, term
from ds_tsp.tools.plan.hybrid import HybridGeometry, described_kind, keeps_gdn_blocks, layer_kinds
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.moe_terms import stage_layer_ids
from ds_tsp.tools.plan.result import CommTerm
from ds_tsp.tools.plan.shape_terms import Stage

__all__ = ["gdn_cp_terms", "gdn_cp_tsp_terms", "gdn_cp_buffers", "hybrid_cp_rows"]


def _payloads(group: PlanInput, cp: int) -> tuple[HybridGeometry, int, int]:
    """(geometry, the cp-gathered halo [C, 2, B, tail, h] and one block's transitions [C, 2, B, vb, dk, dk + dv], in
    bytes: one rank's pieces from every cp group)."""
    hg = HybridGeometry.of(group)
    B, h = group.batch, hg.tsp.dims.h
    halo = cp * 2 * B * hg.tail * h * group.dtype_bytes
    trans = cp * 2 * B * hg.vb * hg.dk * (hg.dk + hg.dv) * hg.transition_bytes
    return hg, halo, trans


def _terms(hg: HybridGeometry, halo: int, trans: int, n: int, where: str, checkpointing: bool, calls: bool = True,
           regather: bool = True) -> tuple[list[CommTerm], list[CommTerm]]:
    """The halo's and one layer's transitions' gathers / reduce-scatters over n ranks of the given payloads;
    regather False: speed mode (recompute_projections off) keeps the forward's gathered transitions."""
    halo_calls, blocks = (1 if hg.K > 1 else 0), hg.tsp.D

    def t(name, kind, payload, k):
        return term(name, kind, payload, k if calls else 0, k * gather_bytes(payload, n))

    fwd = [t(f"conv halo all-gather {where}", "all_gather", halo, halo_calls),
           t(f"chunk transition all-gather {where} (per head block)", "all_gather", trans, blocks)]
    bwd = [t(f"chunk transition re-gather {where} (per head block)", "all_gather", trans if regather else 0, blocks),
           t(f"transition grad reduce-scatter {where} (per head block)", "reduce_scatter", trans, blocks),
           t(f"conv halo grad reduce-scatter {where}", "reduce_scatter", halo, halo_calls)]
    fwd, bwd = [x for x in fwd if x.bytes], [x for x in bwd if x.bytes]
    return fwd, bwd + (recompute(fwd) if checkpointing else [])


def gdn_cp_terms(group: PlanInput, cp: int) -> tuple[list[CommTerm], list[CommTerm]]:
    """One Gated DeltaNet layer's terms on the cp communicator (module docstring): (forward, backward)."""
    if cp == 1:
        return [], []
    hg, halo, trans = _payloads(group, cp)
    return _terms(hg, halo, trans, cp, "over cp", group.activation_checkpointing,
                  regather=not keeps_gdn_blocks(group))


def gdn_cp_tsp_terms(group: PlanInput, cp: int) -> tuple[list[CommTerm], list[CommTerm]]:
    """What cp adds to one Gated DeltaNet layer's TSP-group bytes (intra-node): its TSP stage gathers every cp
    group's pieces, [D, C, ...] instead of TSP alone's [D, ...] (the same calls; (C-1) (D-1) x each piece more)."""
    hg = HybridGeometry.of(group)
    D = hg.tsp.D
    if cp == 1 or D == 1:
        return [], []
    _, halo, trans = _payloads(group, cp)
    extra_halo, extra_trans = (cp - 1) * D * halo // cp, (cp - 1) * D * trans // cp  # gathered: (D-1)/D of these
    return _terms(hg, extra_halo, extra_trans, D, "over TSP (the other cp groups' pieces)",
                  group.activation_checkpointing, calls=False, regather=not keeps_gdn_blocks(group))


def gdn_cp_buffers(group: PlanInput, cp: int) -> int:
    """What the cp stage adds to a Gated DeltaNet layer's temporaries: the gathered halo and transitions grow C
    times ((C-1) x each more), and backward holds their grads as well."""
    if cp == 1 or not any(t == "linear_attention" for t in group.model.layer_types):
        return 0
    _, halo, trans = _payloads(group, cp)
    return 2 * (halo + trans) * (cp - 1) // cp


def hybrid_cp_rows(group: PlanInput, cp: int, attention_fwd: list[CommTerm], attention_bwd: list[CommTerm],
                   stage: Stage | None = None) -> tuple[list[CommTerm], list[CommTerm], list[CommTerm], int]:
    """(layer forward terms, layer backward terms, step terms, cp bytes per step) of a hybrid model's cp
    communicator over the layers of `stage` (default: every layer, pp = 1): each layer kind's cp terms (Gated
    DeltaNet: gdn_cp_terms; full attention: the K/V ring's attention_fwd / attention_bwd), the described kind's as
    layer terms, the others' x their count on the stage as step terms."""
    all_kinds = layer_kinds(group)
    kinds = all_kinds if stage is None else [all_kinds[i] for i in stage_layer_ids(group, stage)]
    counts = {k: kinds.count(k) for k in kinds}
    described = described_kind(group)
    moe_model = bool(group.model.num_experts)
    gdn = gdn_cp_terms(group, cp)

    def of(kind):
        return gdn if kind.mixer == "linear_attention" else (attention_fwd, attention_bwd)

    steps = [replace(t, name=f"{k.title(moe_model)} x{n}: {t.name}", calls=t.calls * n, bytes=t.bytes * n)
             for k, n in counts.items() if k != described for t in (*of(k)[0], *of(k)[1])]
    fwd, bwd = of(described)
    per_step = counts.get(described, 0) * sum(t.bytes for t in (*fwd, *bwd)) + sum(t.bytes for t in steps)
    return list(fwd), list(bwd), steps, per_step
