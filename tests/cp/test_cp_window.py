"""Sliding-window attention under the cp axis (ds_tsp.core.layers.attention.cp_window): only the keys a window reaches travel.

- geometry: what every rank computes (own cp chunk, own past chunk, every received range cut into unmasked and
  reversed-causal blocks) covers exactly the keys HF's window rule with packed documents allows, each key once,
  for several (C, D, window) against a brute-force mask; the hop plan leaves out distances no rank needs;
- exactness: float64 TSP models at (D, C) = (2, 2) (4 gloo ranks) against the single-device reference, loss and
  EVERY gradient to 1e-10 (measured ~1e-15): a window below one cp chunk, one spanning several chunks, packed
  documents with a window, Qwen2's mix of window and full layers; and at (D, C) = (1, 4), where a window below one
  cp chunk skips the ring distance 2 altogether (world of the same 4 ranks);
- the recorded windowed step: obeys NCCL's rules, posts only the planned hops with the planned sizes (the skipped
  ones are absent), and the cp counter's bytes equal `ds-tsp plan --cp`'s.
(D, C) = (2, 3) and (4, 2) exactness runs are marked slow (6 and 8 ranks).
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from local_ranks import run_on_local_ranks

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.verify import VerifyCase


def _doc_of(starts, t):
    return max(s for s in starts if s <= t)


def _block_keys(t, q0, q1, k0, k1, flip, t0, g0):
    """Global keys query t sees in one block (relative indices, see cp_window._segment_blocks)."""
    x = t - t0
    if not q0 <= x < q1:
        return []
    if not flip:
        return list(range(g0 + k0, g0 + k1))
    j, Q = q1 - 1 - x, (k1 - k0) - (q1 - q0)  # reversed: query j sees reversed keys 0..Q+j
    return [g0 + k1 - 1 - y for y in range(Q + j + 1)]


@pytest.mark.parametrize("C, D, window", [(2, 2, 3), (2, 1, 7), (3, 2, 2), (3, 2, 9), (4, 1, 4), (4, 2, 13),
                                          (3, 1, 1), (4, 1, 40)])
def test_window_geometry_matches_brute_force(C, D, window):
    from ds_tsp.core.layers.attention.cp_window import _chunk_layout, _Chunks, _segment_blocks, _segments, window_hops
    from ds_tsp.core.tokens.documents import DocumentLayout

    c = 3
    S = 2 * C * D * c
    Ccp = D * c
    rng = random.Random(C * 100 + D * 10 + window)
    rows = tuple(tuple([0] + sorted(rng.sample(range(1, S), k))) for k in (0, 2, 7))
    layout = DocumentLayout(rows)
    for i, p in itertools.product(range(C), range(D)):
        hops = window_hops(window, C, D, p, c)
        chunks = _Chunks(C, i, D, p, 2 * c)
        segments = [(g0, g1) for g0, g1 in [(i * Ccp, (i + 1) * Ccp)]]  # own cp chunk i: past of query chunk 2
        for s, ranges in hops:
            lo, hi = ranges[i]
            segments += [(g0, g1) for _, g0, g1 in _segments(C, Ccp, (i - s) % C, lo, hi)]
        for b, starts in enumerate(rows):
            for local, t0, g, _ in chunks.queries:
                own = _chunk_layout(layout, g, Ccp).rows[b]
                for t in range(t0, t0 + c):
                    want = sorted(s for s in range(S)
                                  if t - window < s <= t and _doc_of(starts, s) == _doc_of(starts, t))
                    got = [s for s in range(g, t + 1)  # own chunk: the masked kernels' rule in chunk coordinates
                           if t - window < s and _doc_of(own, s - g) == _doc_of(own, t - g)]
                    for g0, g1 in segments:
                        if g1 > t0:
                            continue
                        for rws, blocks in _segment_blocks(layout, t0, c, g0, g1, window):
                            if any(r.start <= b < r.stop for r in rws):
                                for blk in blocks:
                                    got += _block_keys(t, *blk, t0, g0)
                    assert sorted(got) == want, (C, D, window, i, p, b, t)  # every key once, none outside


def test_window_hops_skip_what_no_rank_needs():
    from ds_tsp.core.layers.attention.cp_window import group_hops, hop_elements, window_hops

    # C = 4, D = 1, window below a cp chunk (10): group i needs w-1 keys of i-1 (first half), of i+1 (second half)
    hops = window_hops(4, 4, 1, 0, 10)
    assert [s for s, _ in hops] == [1, 3]  # distance 2 is never posted
    assert dict(hops)[1] == ((0, 0), (7, 10), (7, 10), (7, 10))  # group 0 needs nothing before it
    assert dict(hops)[3] == ((17, 20), (17, 20), (17, 20), (0, 0))  # i+1's second half; group 3's is its own
    # (exchanges, tokens each group sends, tokens it gathers) per head block; pass-KV sends 3 x 20
    assert hop_elements(4, 4, 1, 10) == ([2, 2, 2, 2], [3, 6, 6, 3], [3, 6, 6, 3])
    assert group_hops(4, 4, 1, 10) == ((1, ((0, 0), (7, 3), (7, 3), (7, 3))), (3, ((17, 3), (17, 3), (17, 3), (0, 0))))
    assert window_hops(1, 3, 1, 0, 10) == ()  # a query sees only itself: no hop at all
    # C = 2: the one distance is needed, but only w - 1 keys of it travel
    assert window_hops(5, 2, 1, 0, 10) == ((1, ((16, 20), (6, 10))),)
    # a window spanning chunks reaches the full causal ranges: a past group's first half, a later group's buffer
    assert window_hops(100, 2, 1, 0, 10) == ((1, ((0, 20), (0, 10))),)
    # D = 4 (TSP chunks of 5, cp chunks of 20), window below a TSP chunk: only the query chunks that start a cp
    # chunk reach another group: TSP rank 0's first (group i-1), TSP rank 3's second (group i+1)
    assert window_hops(4, 2, 4, 0, 5) == ((1, ((0, 0), (17, 20))),)
    assert window_hops(4, 2, 4, 3, 5) == ((1, ((37, 40), (0, 0))),)
    assert window_hops(4, 2, 4, 1, 5) == window_hops(4, 2, 4, 2, 5) == ()  # their queries need nothing
    # what crosses nodes: each group's hull in D slices of m keys (padded inside the buffer), every TSP rank one
    assert group_hops(4, 2, 4, 5) == ((1, ((36, 1), (17, 1))),)  # [37, 40) padded down to [36, 40); [17, 21)
    # a window spanning chunks: the D ranks' ranges overlap; the hull crosses once, not once per rank
    assert [window_hops(23, 2, 2, p, 5) for p in range(2)] == [((1, ((3, 20), (0, 10))),),
                                                               ((1, ((0, 20), (0, 10))),)]
    assert group_hops(23, 2, 2, 5) == ((1, ((0, 10), (0, 5))),)  # slices of 10 and 5: 20 and 10 keys per group


# --- multi-rank: exactness, the NCCL rules, the hops posted, plan bytes -------------------------------------------
def _shape(heads=4, kv=2, windows=None, layers=2, **kw):
    return ModelShape(vocab_size=61, hidden_size=8 * heads, intermediate_size=48, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, attention_windows=windows, **kw)


EXACT_2x2 = [  # (name, case, extra "tsp" options); seq 40 at (D, C) = (2, 2): cp chunks of 10 tokens
    ("window_below_cp_chunk", VerifyCase(shape=_shape(windows=(4, 4)), seq=40, batch=2, dtype="float64", seed=11),
     {}),
    ("window_spans_chunks", VerifyCase(shape=_shape(kv=1, windows=(23, 23)), seq=37, batch=2, dtype="float64",
                                       seed=12), {}),
    ("documents_window_keep_kv", VerifyCase(shape=_shape(windows=(6, 6)), seq=44, batch=3, dtype="float64", seed=13,
                                            documents=5), {"keep_gathered_kv": True}),
    ("window_and_full_layers_checkpointing",
     VerifyCase(shape=_shape(windows=(None, 5, 5), layers=3, tie_word_embeddings=True), seq=40, batch=2,
                dtype="float64", seed=14, documents=3),
     {"activation_checkpointing": True, "recompute_projections": False}),
]
EXACT_1x4 = [  # (D, C) = (1, 4), seq 40: cp chunks of 5; a window of 4 skips distance 2
    ("window_skips_distance_2", VerifyCase(shape=_shape(windows=(4, 4)), seq=40, batch=2, dtype="float64", seed=15,
                                           documents=3), {}),
]
STEP_SHAPE, STEP_DOCS = _shape(kv=1, windows=(None, 5)), [9, 14, 17]  # the recorded step: a full and a window layer


def _recorded_step(D: int, C: int) -> dict:
    """One recorded training step of STEP_SHAPE (forward, backward, grads over data x cp, SGD)."""
    from sync_counter import SyncCounter

    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.tokens.documents import documents_of_lengths
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.verify import average_grads_over_data

    runtime = build_runtime(parse_tsp_config({"size": D, "cp_size": C}))
    comm, groups = runtime.comm, runtime.groups
    model = label_modules(ShardedCausalLM(STEP_SHAPE, comm, dtype=torch.float64,
                                          data_group=runtime.data_group).init_weights_(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 61, (2, sum(STEP_DOCS)), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=D, rank=groups.tsp_rank, cp=C, cp_rank=groups.cp_rank,
                        position_ids=documents_of_lengths(STEP_DOCS)[None])
    before = dict(comm.cp.counter.bytes)
    with comm.recording() as rec, SyncCounter() as syncs:
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
    average_grads_over_data(model, runtime.data_group)
    opt.step()
    cp_bytes = {kind: n - before.get(kind, 0) for kind, n in comm.cp.counter.bytes.items()}
    return {"ops": rec.ops, "cp_bytes": {kind: n for kind, n in cp_bytes.items() if n}, "cp_rank": groups.cp_rank,
            "cp_group": list(comm.cp._ranks), "tsp_rank": groups.tsp_rank,
            "syncs": [(e.kind, e.op, e.region, e.where) for e in syncs.events]}


def _all_on_4_ranks():
    from ds_tsp.tools.verify import run_cp_case

    return {"2x2": [run_cp_case(case, 2, 2, options) for _, case, options in EXACT_2x2],
            "1x4": [run_cp_case(case, 1, 4, options) for _, case, options in EXACT_1x4],
            "step_2x2": _recorded_step(2, 2), "step_1x4": _recorded_step(1, 4)}


@pytest.fixture(scope="module")
def on_4_ranks():
    return run_on_local_ranks(_all_on_4_ranks, 4, timeout_s=400)


@pytest.mark.parametrize("layout, cases", [("2x2", EXACT_2x2), ("1x4", EXACT_1x4)])
def test_windowed_cp_is_exact_in_float64(on_4_ranks, layout, cases):
    for (name, _, _), report in zip(cases, on_4_ranks[0][layout]):
        assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10, (layout, name, report)


def _window_hops_of(ops):
    return [o for o in ops if o["kind"] == "p2p" and "(window" in (o["what"] or "")]


@pytest.mark.parametrize("layout, D, C", [("step_2x2", 2, 2), ("step_1x4", 1, 4)])
def test_windowed_step_posts_only_the_planned_hops(on_4_ranks, layout, D, C):
    """Recorded ops: the window layer's hops are exactly group_hops' (distance, slice sizes), in forward, backward
    and the dK/dV return, each received hull gathered (and its dK/dV reduce-scattered) over TSP; the full layer
    keeps the pass-KV ring; the whole step obeys NCCL's rules; no host read
    inside the layers."""
    from nccl_rules import check

    from ds_tsp.core.layers.attention.cp_window import group_hops
    from ds_tsp.core.tokens.zigzag import padded_length

    runs = [r[layout] for r in on_4_ranks]
    ops = [r["ops"] for r in runs]
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    c = padded_length(sum(STEP_DOCS), 2 * C * D) // (2 * C * D)
    B, nkv_b, d = 2, 1, STEP_SHAPE.hidden_size // STEP_SHAPE.num_heads  # one kv head: one head block per rank
    hops = group_hops(STEP_SHAPE.layer_window(1), C, D, c)
    if C == 4:
        assert [s for s, _ in hops] == [1, 3]  # distance 2 skipped
    token = B * 2 * nkv_b * d  # elements per token of one head block's K/V
    for run in runs:
        i = run["cp_rank"]
        for phase in ("K/V", "K/V (backward)", "dK/dV"):
            got = [(o["what"], o["p2p"]) for o in _window_hops_of(run["ops"]) if o["what"].startswith(phase + " cp")]
            want = []
            for h, (s, spans) in enumerate(hops):  # every TSP rank moves its slice: m keys
                out_m, in_m = spans[(i + s) % C][1], spans[i][1]
                if phase == "dK/dV":  # the received slice's grads go back, the sent slice's come home
                    out_m, in_m = in_m, out_m
                sign = -1 if phase == "dK/dV" else 1
                links = []
                if out_m:
                    links.append(("send", _global(run, (i + sign * s) % C), out_m * token))
                if in_m:
                    links.append(("recv", _global(run, (i - sign * s) % C), in_m * token))
                if links:
                    want.append((f"{phase} cp hop {h + 1}/{len(hops)} (window, distance {s})", tuple(links)))
            assert got == want * D, (phase, i, got, want)  # one per head block (D blocks of one kv head each)
        slices = [o for o in run["ops"] if "cp window slices" in (o["what"] or "")]  # the TSP side, per received hull
        received = sum(1 for _, spans in hops if spans[i][1]) if D > 1 else 0  # D = 1: nothing to gather
        assert [o["kind"] for o in slices] == ["all_gather"] * received * D + [  # forward; backward's per hop
            k for _ in range(D) for _ in range(received) for k in ("all_gather", "reduce_scatter")]
        full = [o for o in run["ops"] if o["kind"] == "p2p" and " cp hop" in o["what"] and "(window" not in o["what"]]
        assert len(full) == D * (C - 1) * 3  # the full layer: pass-KV forward, backward and dK/dV, C-1 hops each
        assert [e for e in run["syncs"] if e[2] != "input_checks"] == [], run["syncs"]


def _global(run, cp_rank):
    return run["cp_group"][cp_rank]


@pytest.mark.parametrize("layout, D, C", [("step_2x2", 2, 2), ("step_1x4", 1, 4)])
def test_plan_cp_ring_bytes_of_a_windowed_model_match_the_run(on_4_ranks, layout, D, C):
    """`ds-tsp plan --cp`'s inter-node bytes per cp rank are what the cp communicator counted in the recorded step,
    every kind: the full layer's pass-KV ring and the window layer's hops (float64 there: twice the plan's float32
    bytes) and the input check's all-gather over cp (int64: the same in every dtype)."""
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    plan = plan_tsp_cp(PlanInput(model=STEP_SHAPE, seq=sum(STEP_DOCS), batch=2, degree=D, dtype="fp32"), C)
    per_rank = plan.cp["inter_node_bytes_per_rank"]  # cp-major
    assert plan.cp["windowed_layers"] == 1 and plan.cp["inter_node_bytes_per_step"] == max(per_rank)
    check = plan.cp["input_check_cp_bytes_per_step"]
    assert check == (C - 1) * D * (7 + 1024) * 8  # (C-1) D payloads of INPUT_CHECK_COUNTS + DOCUMENT_LAYOUT_SLOTS
    for run in (r[layout] for r in on_4_ranks):
        k = run["cp_rank"] * D + run["tsp_rank"]
        assert run["cp_bytes"] == {"ring": 2 * (per_rank[k] - check), "all_gather": check}, (k, run["cp_bytes"],
                                                                                              per_rank)
        # intra-node: the TSP counter's bytes of the blocks' reassembly and the window slices' gathers and dK/dV
        # reduce-scatters (each counts (D-1) x the recorded per-rank tensor), the plan's for this rank
        intra = sum(o["nbytes"] * (D - 1) for o in run["ops"]
                    if o["what"] and (" cp block " in o["what"] or "cp window slices" in o["what"]))
        assert intra == 2 * plan.cp["intra_node_cp_bytes_per_rank"][k], (k, intra, plan.cp)
    full = plan_tsp_cp(PlanInput(model=_shape(kv=1), seq=sum(STEP_DOCS), batch=2, degree=D, dtype="fp32"), C)
    assert max(per_rank) < full.cp["inter_node_bytes_per_step"]  # the window layer moves less than a full one


def test_plan_window_ring_attention_pairs_match_brute_force():
    """The attention a window layer's hops overlap (tsp_cp_window._pairs) is the count of visible pairs."""
    from ds_tsp.tools.plan.tsp_cp_window import _own_chunk_pairs, _pairs

    for t0, n, g0, g1, w in itertools.product((20, 27), (1, 6), (0, 5), (10, 20), (1, 3, 9, 30)):
        if g0 < g1:
            want = sum(1 for t in range(t0, t0 + n) for s in range(g0, g1) if t - w < s <= t)
            assert _pairs(t0, n, g0, g1, w) == want, (t0, n, g0, g1, w)
    for x0, n, w in itertools.product((0, 3, 12), (1, 5, 9), (1, 4, 10, 40)):  # own chunk: causal, from key 0
        assert _own_chunk_pairs(x0, n, w) == sum(1 for x in range(x0, x0 + n) for s in range(x + 1) if x - w < s)


def test_windowed_cp_step_creates_nothing_off_device():
    """tests/cp/test_cp.py's meta-device cp step with a window layer (and a full one): every tensor the window path
    creates (received ranges, dK/dV returns, the flipped blocks) follows its input's device."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cp as t; found = t.run_meta_cp((5, None)); "
            "print('\\n'.join(found)); print('done'); sys.exit(1 if found else 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]


def _exact_and_step_at(D, C):
    from ds_tsp.tools.verify import run_cp_case

    cases = [VerifyCase(shape=_shape(windows=(5, None)), seq=47, batch=2, dtype="float64", seed=16, documents=4),
             VerifyCase(shape=_shape(kv=1, windows=(29, 29)), seq=48, batch=1, dtype="float64", seed=17)]
    return [run_cp_case(case, D, C) for case in cases], _recorded_step(D, C)["ops"]


@pytest.mark.slow
@pytest.mark.parametrize("D, C", [(2, 3), (4, 2)])
def test_windowed_cp_is_exact_and_obeys_nccl_rules_at_larger_layouts(D, C):
    from nccl_rules import check

    runs = run_on_local_ranks(_exact_and_step_at, D * C, D, C, timeout_s=600)
    for report in runs[0][0]:
        assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10, report
    ops = [ops for _, ops in runs]
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    assert any("(window" in (o["what"] or "") for o in ops[0])
