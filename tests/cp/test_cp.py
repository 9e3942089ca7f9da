"""The context-parallel (cp) axis: C TSP groups split one sequence, K/V passed around the cp ring.

- layout: coordinate-encoded tokens land on exactly one rank and come back (cp_shard -> cp_unshard), for several
  (C, D); rank arithmetic and groups of ParallelLayout with cp; the "tsp" block's cp_size errors;
- the ring's document geometry against a brute-force mask (every query, every key of every buffer);
- exactness: a float64 TSP model at (D, C) = (2, 2) (4 gloo ranks) against the single-device reference, loss and
  EVERY gradient to 1e-10 (measured ~1e-15), with GQA / MQA, biases, tied embeddings, packed documents that span
  cp chunks, padding, and the schedule options; gradients averaged over the data group (data x cp) as a
  data-parallel engine does;
- the same step's ops replayed under NCCL's queueing rules (tests/helpers/nccl_rules.py), TSP and cp groups together;
- refusals: logits under cp name cp_size; every layer kind runs (linear attention: tests/cp/test_cp_hybrid.py; MoE:
  tests/cp/test_cp_moe.py; sliding windows: tests/cp/test_cp_window.py).
(D, C) = (2, 3) and (4, 2) exactness runs are marked slow (6 and 8 ranks); (1, 3) runs by default.
"""
from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ParallelLayout
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import (
    cp_global_chunks,
    cp_shard,
    cp_unshard,
    cp_zigzag_positions,
    padded_length,
    shard_batch,
)
from ds_tsp.tools.verify import VerifyCase

LAYOUTS = [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 2)]  # (C, D)


@pytest.mark.parametrize("C, D", LAYOUTS)
def test_every_token_on_exactly_one_rank_and_back(C, D):
    S = 2 * C * D * 3
    x = torch.arange(S)[None].expand(2, S) * 10 + torch.arange(2)[:, None]  # coordinate-encoded: row and position
    shards = [[cp_shard(x, D, p, C, i) for p in range(D)] for i in range(C)]
    held = torch.cat([s[0] // 10 for group in shards for s in group])
    assert sorted(held.tolist()) == list(range(S))  # every position exactly once
    assert torch.equal(cp_unshard(shards), x)
    c = S // (2 * C * D)
    for i, p in itertools.product(range(C), range(D)):
        positions = cp_zigzag_positions(S, D, p, C, i)
        assert torch.equal(shards[i][p][0] // 10, positions)
        first, second = cp_global_chunks(D, p, C, i)
        assert positions.tolist() == list(range(first * c, first * c + c)) + list(range(second * c, second * c + c))
    # one cp group holds cp chunks i and 2C-1-i, in order
    Ccp = S // (2 * C)
    for i in range(C):
        group = torch.cat([cp_zigzag_positions(S, D, p, C, i) for p in range(D)]).sort().values.tolist()
        assert group == list(range(i * Ccp, (i + 1) * Ccp)) + list(range((2 * C - 1 - i) * Ccp, (2 * C - i) * Ccp))


def test_shard_batch_with_cp_pads_to_2cd_and_shards_both_levels():
    ids = torch.arange(1, 20)[None]
    out = shard_batch(ids, tsp=2, rank=1, cp=2, cp_rank=1, labels=ids)
    assert out["padded_len"] == padded_length(19, 4) == 24
    assert out["position_ids"].tolist() == [cp_zigzag_positions(24, 2, 1, 2, 1).tolist()]
    assert out["input_ids"].tolist() == [[p + 1 if p < 19 else 0 for p in out["position_ids"][0].tolist()]]
    with pytest.raises(TSPConfigError, match="rank=2 is outside"):
        shard_batch(ids, tsp=2, rank=0, cp=2, cp_rank=2)


def test_layout_with_cp_axis():
    layout = ParallelLayout.from_world_size(16, tsp=2, cp=2, pipe=2)
    assert (layout.pipe, layout.data, layout.cp, layout.tsp) == (2, 2, 2, 2)
    seen = set()
    for rank in range(16):
        p, d, t = layout.coords(rank)
        c = layout.cp_index(rank)
        assert rank == ((p * 2 + d) * 2 + c) * 2 + t == layout.rank_of(p, d, t, c)
        seen.add((p, d, c, t))
    assert len(seen) == 16
    for groups in (layout.all_tsp_groups(), layout.all_cp_groups(), layout.all_data_groups(), layout.all_pipe_groups()):
        assert sorted(r for g in groups for r in g) == list(range(16))  # each axis partitions the world
    assert layout.tsp_group_ranks(5) == [4, 5]  # tsp innermost: adjacent ranks
    assert layout.cp_group_ranks(5) == [5, 7]  # cp next
    assert layout.data_group_ranks(5) == [1, 3, 5, 7]  # the data group spans data x cp: gradients of one shard
    assert layout.seq_len_divisor == 8
    assert layout.mesh_ranks()[0, :, 1].tolist() == layout.data_group_ranks(1)  # FSDP2's "data" axis
    assert ParallelLayout(data=2, tsp=2).all_data_groups() == [[0, 2], [1, 3]]  # cp = 1: as before
    with pytest.raises(TSPConfigError, match=r"tsp\*cp\*pipe=12"):
        ParallelLayout.from_world_size(8, tsp=2, cp=3, pipe=2)


@pytest.mark.parametrize("block, match", [
    ({"cp_size": 0}, r"tsp.cp_size=0: .*>= 1"),
    ({"cp_size": "2"}, r"tsp.cp_size='2': .*valid integer"),
])
def test_cp_size_errors_name_the_field(block, match):
    with pytest.raises(TSPConfigError, match=match):
        parse_tsp_config(block)
    assert parse_tsp_config({"size": 2, "cp_size": 4}).cp_size == 4
    assert parse_tsp_config({"cp_size": 2, "pipeline_stages": 2}).cp_size == 2  # pipeline stages take the cp axis


def _doc_of(starts, t):
    return max(s for s in starts if s <= t)


@pytest.mark.parametrize("C, D", [(2, 2), (3, 1), (3, 2)])
def test_ring_document_geometry_matches_brute_force(C, D):
    """What each rank computes from each group's buffer (own block under local_layout, foreign blocks by
    _buffer_offset suffixes and the causal skip) is exactly the keys a global causal, per-document mask allows."""
    from ds_tsp.core.layers.attention.cp_ring import _buffer_offset, _Geometry, local_layout
    from ds_tsp.core.tokens.documents import DocumentLayout

    c = 3
    S = 2 * C * D * c
    Ccp = D * c
    rng = random.Random(C * 10 + D)
    rows = tuple(tuple([0] + sorted(rng.sample(range(1, S), k))) for k in (0, 2, 6, 12))
    layout = DocumentLayout(rows)

    class _Cp:
        size = C

    for i, p in itertools.product(range(C), range(D)):
        cp = _Cp()
        cp.rank = i
        geo = _Geometry(cp, p, D, 2 * c)
        buffer_positions = {r: cp_shard(torch.arange(S)[None], 1, 0, C, r)[0].tolist() for r in range(C)}
        own = local_layout(layout, C, i, Ccp)
        for b, starts in enumerate(rows):
            for chunk, (_, local_start, t0) in enumerate(geo.queries):
                for x in range(c):
                    t = t0 + x
                    want = {s for s in range(S) if s <= t and _doc_of(starts, s) == _doc_of(starts, t)}
                    got = set()
                    # own block: causal over cp-local order, documents by the mapped starts
                    lt = local_start + x
                    got |= {buffer_positions[i][s] for s in range(lt + 1)
                            if _doc_of(own.rows[b], s) == _doc_of(own.rows[b], lt)}
                    for r in set(range(C)) - {i}:
                        for seen_chunk, n_keys in geo.visible(r):
                            if seen_chunk == chunk:
                                k0 = _buffer_offset(_doc_of(starts, t), r, C, Ccp)
                                got |= set(buffer_positions[r][k0:n_keys])
                    assert got == want, (i, p, b, t)


# --- multi-rank: exactness and the NCCL rules at (D, C) = (2, 2) ----------------------------------------------------
def _shape(heads, kv, **kw):
    return ModelShape(vocab_size=61, hidden_size=8 * heads, intermediate_size=48, num_layers=2, num_heads=heads,
                      num_kv_heads=kv, **kw)


EXACT_CASES = [  # (name, case, extra "tsp" options)
    ("gqa_padded", VerifyCase(shape=_shape(4, 2), seq=37, batch=2, dtype="float64", seed=1), {}),
    ("mqa_tied_documents", VerifyCase(shape=_shape(4, 1, tie_word_embeddings=True), seq=45, batch=2,
                                      dtype="float64", seed=2, documents=3), {}),
    ("bias_documents_keep_kv", VerifyCase(shape=_shape(4, 2, qkv_bias=True), seq=64, batch=3, dtype="float64",
                                          seed=3, documents=9), {"keep_gathered_kv": True}),
    ("gqa_checkpointing_saved_projections", VerifyCase(shape=_shape(4, 2), seq=29, batch=1, dtype="float64",
                                                       seed=4, documents=2),
     {"activation_checkpointing": True, "recompute_projections": False}),
]


NCCL_DOCUMENTS = [9, 14, 6]


def _nccl_step(documents, D: int = 2, C: int = 2) -> dict:
    """One recorded training step (forward, backward, grads averaged over data x cp, SGD) at the world's layout."""
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.tokens.documents import documents_of_lengths
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.verify import average_grads_over_data

    runtime = build_runtime(parse_tsp_config({"size": D, "cp_size": C}))
    comm, groups = runtime.comm, runtime.groups
    model = label_modules(ShardedCausalLM(_shape(4, 1), comm, dtype=torch.float64,
                                          data_group=runtime.data_group).init_weights_(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 61, (2, sum(documents)), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=D, rank=groups.tsp_rank, cp=C, cp_rank=groups.cp_rank,
                        position_ids=documents_of_lengths(documents)[None])
    from sync_counter import SyncCounter

    with comm.recording() as rec, SyncCounter() as syncs:
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
    average_grads_over_data(model, runtime.data_group)
    opt.step()
    return {"ops": rec.ops, "cp_bytes": dict(comm.cp.counter.bytes),
            "syncs": [(e.kind, e.op, e.region, e.where) for e in syncs.events]}


def _hf_face_loss(case: VerifyCase) -> float:
    """ds_tsp.hf.TSPForCausalLM under cp, called as transformers' model on the FULL batch (labels=, it shards it
    over cp and TSP itself): the loss every rank returns."""
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.shape.hf_config import config_dict_from_shape, config_from_dict
    from ds_tsp.model.hf_causal_lm import TSPForCausalLM
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_
    from ds_tsp.tools.verify import make_batch

    runtime = build_runtime(parse_tsp_config({"size": 2, "cp_size": 2}))
    model = TSPForCausalLM(config_from_dict(config_dict_from_shape(case.shape, torch.float64)), runtime.comm,
                           dtype=torch.float64, data_group=runtime.data_group)
    reference = ReferenceCausalLM(case.shape, dtype=torch.float64)
    init_weights_(reference, case.seed)
    model.tsp.load_full_state_dict(full_state_dict(reference))
    ids, labels, positions = make_batch(case)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels, position_ids=positions).loss)


def _all_at_2x2():
    from test_cp_all_to_all import all_to_all_at_2x2
    from test_cp_comm_auto import cp_auto_at_2x2

    from ds_tsp.tools.verify import run_cp_case

    reports = [run_cp_case(case, 2, 2, options) for _, case, options in EXACT_CASES]
    return {"reports": reports, **_nccl_step(NCCL_DOCUMENTS), "rank": dist.get_rank(),
            "hf_face_loss": _hf_face_loss(EXACT_CASES[1][1]),
            "all_to_all": all_to_all_at_2x2(),  # tests/cp/test_cp_all_to_all.py's, in the same spawn
            "cp_auto": cp_auto_at_2x2()}  # tests/cp/test_cp_comm_auto.py's


@functools.cache
def spawn_at_2x2() -> list:
    """The 4-rank spawn, once per session: tests/cp/test_cp_all_to_all.py reads it too."""
    return run_on_local_ranks(_all_at_2x2, 4, timeout_s=300)


@pytest.fixture(scope="module")
def at_2x2():
    return spawn_at_2x2()


@pytest.mark.parametrize("index", range(len(EXACT_CASES)), ids=[name for name, _, _ in EXACT_CASES])
def test_cp_2x2_is_exact_in_float64(at_2x2, index):
    report = at_2x2[0]["reports"][index]
    assert (report["tsp"], report["cp"]) == (2, 2)
    assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10, (EXACT_CASES[index][0], report)


def test_hf_face_shards_full_batches_over_cp(at_2x2):
    ref = at_2x2[0]["reports"][1]["ref_loss"]  # the packed-documents case's single-device loss
    assert all(abs(r["hf_face_loss"] - ref) <= 1e-10 * abs(ref) for r in at_2x2), ([r["hf_face_loss"] for r in
                                                                                   at_2x2], ref)


def test_cp_step_obeys_nccl_rules(at_2x2):
    from nccl_rules import check, unbatched

    ops = [r["ops"] for r in at_2x2]
    report = check(ops)
    assert all(o["layer"] for rank_ops in ops for o in rank_ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    groups = {o["group"] for rank_ops in ops for o in rank_ops}
    assert groups == {(0, 1), (2, 3), (0, 2), (1, 3)}  # TSP groups and cp rings
    ring = [o for o in ops[0] if o["group"] == (0, 2) and o["kind"] == "p2p"]
    assert ring and all(o["batched"] for o in ring)
    assert {o["what"].split(" cp hop")[0] for o in ring} == {"K/V", "K/V (backward)", "dK/dV"}
    assert all(o["layer"] for o in ring)
    assert check([unbatched(rank_ops) for rank_ops in ops]).deadlock  # bare isend-then-irecv would hang NCCL


@pytest.mark.slow
@pytest.mark.parametrize("D, C", [(4, 2), (2, 3)])
def test_cp_step_obeys_nccl_rules_at_larger_layouts(D, C):
    from nccl_rules import check

    ops = [r["ops"] for r in run_on_local_ranks(_nccl_step, D * C, NCCL_DOCUMENTS, D, C, timeout_s=600)]
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    assert any(o["kind"] == "p2p" and "cp hop" in o["what"] for o in ops[0])


def _exact_at(D, C):
    from ds_tsp.tools.verify import run_cp_case

    cases = [VerifyCase(shape=_shape(4, 2), seq=41, batch=2, dtype="float64", seed=5, documents=4),
             VerifyCase(shape=_shape(4, 1, tie_word_embeddings=True), seq=50, batch=1, dtype="float64", seed=6)]
    return [run_cp_case(case, D, C) for case in cases]


def test_cp_is_exact_on_an_odd_ring():
    """C=3 (an odd ring: the zigzag pairs and the hop schedule differ from C=2), D=1 so it stays 3 ranks in the
    default run; (2, 3) and (4, 2) are the slow runs below."""
    for report in run_on_local_ranks(_exact_at, 3, 1, 3, timeout_s=600)[0]:
        assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10, report


@pytest.mark.slow
@pytest.mark.parametrize("D, C", [(2, 3), (4, 2)])
def test_cp_is_exact_at_larger_layouts(D, C):
    for report in run_on_local_ranks(_exact_at, D * C, D, C, timeout_s=600)[0]:
        assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10, report


# --- ds-tsp verify --cp -------------------------------------------------------------------------------------------
def test_verify_cli_cp_usage_errors(monkeypatch, capsys):
    from ds_tsp.tools.cli import main

    assert main(["verify", "--cp", "0"]) == 2  # argparse: --cp must be >= 1
    assert main(["verify", "--cp", "2", "--hf-model", "somewhere"]) == 2  # --hf-model with --cp: tests/cp/test_cp_moe.py
    assert "--hf-model somewhere: no config.json there" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["verify", "--tsp", "2", "--cp", "2"]) == 2
    assert "needs 4 ranks" in capsys.readouterr().err


def test_verify_cli_cp2_float64(capsys):
    """`ds-tsp verify --cp 2` end to end in the default run (TSP 1: two ranks); the TSP 2 x cp 2 run is slow."""
    import json

    from ds_tsp.tools.cli import main

    assert main(["verify", "--tsp", "1", "--cp", "2", "--dtype", "float64", "--documents", "3", "--seq", "30",
                 "--timeout", "300"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["tsp"], report["cp"], report["ok"]) == (1, 2, True) and report["grad_rel_err"] < 1e-10, report


@pytest.mark.slow
def test_verify_cli_tsp2_cp2_float64(capsys):
    import json

    from ds_tsp.tools.cli import main

    assert main(["verify", "--tsp", "2", "--cp", "2", "--dtype", "float64", "--documents", "3", "--kv-heads", "2",
                 "--seq", "50", "--timeout", "300"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["tsp"], report["cp"], report["ok"]) == (2, 2, True) and report["grad_rel_err"] < 1e-10, report


def test_cp_step_reads_the_host_once(at_2x2):
    """The host-sync budget of tests/reliability/test_host_syncs.py holds with the cp ring: nothing inside the layers (ring hops,
    merges, document runs are host ints), ONE read per step in the input check (its cp all-gather adds none)."""
    for r in at_2x2:
        assert [e for e in r["syncs"] if e[2] != "input_checks"] == [], r["syncs"]
        assert [e[:2] for e in r["syncs"]] == [("read", "tolist")], r["syncs"]


# --- ds-tsp plan --cp ---------------------------------------------------------------------------------------------
def test_plan_cp_ring_bytes_match_the_run(at_2x2):
    """The plan's inter-node bytes are what the cp communicator's whole counter measured in the recorded 2 x 2 step:
    the ring's (float64 there: twice the plan's float32 bytes, float32 dK/dV accumulators included) and the input
    check's all-gather over cp (int64 payloads: the same in every dtype)."""
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    plan = plan_tsp_cp(PlanInput(model=_shape(4, 1), seq=sum(NCCL_DOCUMENTS), batch=2, degree=2, dtype="fp32"), 2)
    assert plan.layout == "tsp_cp" and plan.cp["cp"] == 2
    check = plan.cp["input_check_cp_bytes_per_step"]
    assert check == (2 - 1) * 2 * (7 + 1024) * 8  # (C-1) D payloads of INPUT_CHECK_COUNTS + DOCUMENT_LAYOUT_SLOTS
    ring = plan.cp["inter_node_bytes_per_step"] - check
    assert all(r["cp_bytes"] == {"ring": 2 * ring, "all_gather": check} for r in at_2x2), [r["cp_bytes"]
                                                                                           for r in at_2x2]


def test_plan_llama3_8b_15m_tokens_on_4_nodes_of_8_h200():
    """The cp axis's goal in plan numbers: Llama-3-8B, D=8 x C=4 (32 H200, 141 GiB), activation checkpointing with
    offload, ZeRO-1 over dp x cp: >= 15M tokens per sequence fit, and the cp ring at 400 Gb/s per GPU is hidden
    behind the attention it overlaps (at 400 TFLOP/s)."""
    from ds_tsp.tools.plan import PRESETS, PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp, recommend_tsp_cp

    inp = PlanInput(model=PRESETS["8b"], seq=15_000_000, degree=8, activation_checkpointing=True,
                    offload_activations=True, zero_stage=1)
    plan = plan_tsp_cp(inp, 4)
    assert plan.peak_bytes_per_rank < 141 * 2 ** 30, plan.peak_bytes_per_rank / 2 ** 30  # ~66 GiB
    cp = plan.cp
    assert cp["tokens_per_rank"] == 15_000_000 // 32 and cp["inter_node_gbps"] == 400
    assert cp["cp_ring_seconds_per_step"] < cp["overlapped_attention_seconds_per_step"]
    assert cp["hop_seconds"] < cp["hop_attention_seconds"]
    assert plan.comm_bytes_per_step > cp["inter_node_bytes_per_step"] + cp["intra_node_bytes_per_step"]
    choice, tried = recommend_tsp_cp(inp, devices=32, gpu_mem_bytes=141 * 2 ** 30)
    assert choice is not None and choice[0] == 8  # TSP fills the node; C as small as fits
    assert all(p.peak_bytes_per_rank > 141 * 2 ** 30 for d, c, p in tried[:-1])


def test_plan_cli_cp(capsys):
    from ds_tsp.tools.cli import main

    assert main(["plan", "--model", "8b", "--seq", "1m", "--tsp", "8", "--cp", "4", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "C=4 (cp ring across nodes)" in out and "inter-node (cp axis)" in out and "at 400 Gb/s per GPU" in out
    assert main(["plan", "--model", "8b", "--seq", "1m", "--recommend", "--cp", "auto", "--devices", "32",
                 "--gpu-mem-gib", "141", "--activation-checkpointing"]) == 0
    assert 'recommended: "tsp": {"size": 8, "cp_size":' in capsys.readouterr().out
    assert main(["plan", "--model", "8b", "--cp", "0"]) == 2
    assert main(["plan", "--model", "8b", "--cp", "auto"]) == 2


# --- ds_tsp.initialize (DeepSpeed ZeRO over data x cp) ----------------------------------------------------------------
def _ds_train(configs, steps=6, final=False):
    from engine_steps import train_from_shape

    return train_from_shape(_shape(4, 2), configs, steps, 32, final)


def _ds_config(tsp, cp, stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
            "gradient_clipping": 0.5, "tsp": {"size": tsp, "cp_size": cp}}


def _assert_zero_runs_match(runs: list[dict], ref: dict, stages) -> None:
    """Per-step loss 1e-5 and clip norm 1e-4 (fp32 sums reordered, ~1e-7 seen); final weights, where returned, 1e-4
    norm-wise per tensor (AdamW at lr 1e-2 turns last-bit rounding of near-zero gradients into +-lr steps: 2e-5
    seen after 6 steps)."""
    assert ref["losses"][-1] < ref["losses"][0], ref  # it learns, or equal losses prove nothing
    assert max(ref["grad_norms"]) > 0.5, ref  # clipping is active, or the norms prove less
    for stage, run in zip(stages, runs):
        assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0), (stage, run)
        assert torch.allclose(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4), (stage, run)
        if "final" in run:
            worst = max(float((run["final"][k] - v).norm() / v.norm()) for k, v in ref["final"].items())
            assert worst < 1e-4, (stage, worst)


def test_deepspeed_zero2_and_zero3_over_cp_match_one_rank():
    """The default-run form of the 4-rank test below: {"size": 1, "cp_size": 2} on 2 ranks (ZeRO partitions and
    averages over the cp pair, whose ranks hold the same weights and half of each sequence), ZeRO-2 and 3."""
    pytest.importorskip("deepspeed")
    env = {"DS_ACCELERATOR": "cpu"}
    ref = run_on_local_ranks(_ds_train, 1, [_ds_config(1, 1, 1)], 6, True, timeout_s=300, env=env)[0][0]
    runs = run_on_local_ranks(_ds_train, 2, [_ds_config(1, 2, s) for s in (2, 3)], 6, True, timeout_s=600,
                              env=env)[0]
    _assert_zero_runs_match(runs, ref, (2, 3))


@pytest.mark.slow
def test_deepspeed_zero_stages_over_data_x_cp_match_one_rank():
    """ds_tsp.initialize with {"size": 2, "cp_size": 2} on 4 ranks trains like one rank on the same batches (ZeRO
    1/2/3 over data x cp, clipping active): per-step loss 1e-5, grad norm 1e-4 (fp32)."""
    pytest.importorskip("deepspeed")
    env = {"DS_ACCELERATOR": "cpu"}
    ref = run_on_local_ranks(_ds_train, 1, [_ds_config(1, 1, 1)], timeout_s=300, env=env)[0][0]
    runs = run_on_local_ranks(_ds_train, 4, [_ds_config(2, 2, s) for s in (1, 2, 3)], timeout_s=600, env=env)[0]
    _assert_zero_runs_match(runs, ref, (1, 2, 3))


# --- device-correct by construction: a cp step on the meta device -----------------------------------------------------
def run_meta_cp(attention_windows=None, cp_comm: str = "ring") -> list[str]:
    """Rank 1 of a fake world of 4 ((D, C) = (2, 2)) runs a cp step on `meta`: every tensor it creates stays there
    (tests/model/test_meta_device.py's recorder). Returns what it found off the device. attention_windows: per layer
    (tests/cp/test_cp_window.py runs the windowed layers' path)."""
    from test_meta_device import META, DeviceRecorder
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.model.causal_lm import ShardedCausalLM

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=1, world_size=4)
    tsp_group, _, cp_group, _ = (dist.new_group(r) for r in ([0, 1], [2, 3], [1, 3], [0, 2]))
    comm = TSPComm(tsp_group, cp=TSPComm(cp_group))
    from ds_tsp.core.config import TSPOptions

    model = ShardedCausalLM(_shape(4, 1, attention_windows=attention_windows), comm, device=META,
                            options=TSPOptions(cp_comm=cp_comm))
    b = shard_batch(torch.randint(0, 61, (2, 30)), tsp=2, rank=1, cp=2, cp_rank=1)
    with DeviceRecorder() as rec:
        loss = model(*(b[k].to(META) for k in ("input_ids", "shift_labels", "position_ids")))
        loss.backward()
    assert loss.device == META
    dist.destroy_process_group()  # the next call (another schedule) starts its own fake world
    return rec.found


def test_cp_step_creates_nothing_off_device():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cp as t; found = t.run_meta_cp(); "
            "found += t.run_meta_cp((5, None), cp_comm='all_to_all'); "  # tests/cp/test_cp_all_to_all.py's schedule
            "print('\\n'.join(found)); print('done'); sys.exit(1 if found else 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]


# --- a pipeline stage's positions under cp (what StepPositions finds documents in) ------------------------------------
def test_global_positions_gather_over_tsp_and_cp():
    """A pipeline stage sees only position_ids: global_positions must put the whole sequence back in order, over the
    TSP group and then the cp ring. Gathered over the TSP group alone, a cp group's two chunks sit side by side and
    their jump reads as a document start (the (PP, D, C) = (2, 2, 2) pipeline's losses were 6e-5 off)."""
    from concurrent.futures import ThreadPoolExecutor

    from thread_comm import ThreadComm, _World

    from ds_tsp.core.tokens.documents import document_starts
    from ds_tsp.core.tokens.positions import global_positions

    C, D, S = 2, 2, 24
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None].repeat(2, 1)
    pos[1] = torch.arange(S)
    tsp_worlds, cp_worlds = [_World(D, 60) for _ in range(C)], [_World(C, 60) for _ in range(D)]

    def rank(i, p):
        comm = ThreadComm(tsp_worlds[i], p)
        comm.cp = ThreadComm(cp_worlds[p], i)
        comm.cp_axis = lambda: comm.cp
        shard = shard_batch(torch.zeros_like(pos), tsp=D, rank=p, cp=C, cp_rank=i, position_ids=pos)
        return global_positions(shard["position_ids"], comm)

    with ThreadPoolExecutor(max_workers=C * D) as pool:
        got = [f.result() for f in [pool.submit(rank, i, p) for i in range(C) for p in range(D)]]
    for out in got:
        assert torch.equal(out, pos)
    assert document_starts(got[0]) == document_starts(pos) is not None


def test_plan_pipeline_stages_with_cp():
    """pp x cp: one stage's layers take the cp ring (half the K/V hops of pp 1 at 2 stages), and the step gathers
    each stage's position_ids over cp instead of the input check's payload; a sliding-window model's windowed
    layers are counted per stage too."""
    from dataclasses import replace

    from ds_tsp.tools.cli import main
    from ds_tsp.tools.plan import PRESETS, PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp
    from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all

    inp = PlanInput(model=PRESETS["8b"], seq=65536, degree=8, zero_stage=1)
    one, two = plan_tsp_cp(inp, 4), plan_tsp_cp(replace(inp, pp=2), 4)
    assert two.layers_per_stage * 2 == one.layers_per_stage == PRESETS["8b"].num_layers
    ring = [p.cp["inter_node_bytes_per_step"] - p.cp["input_check_cp_bytes_per_step"] for p in (one, two)]
    assert ring[1] * 2 == ring[0] > 0
    positions = 1 * 65536 * 8  # [C, D, B, S / (C D)] int64, 3/4 of it from the other cp groups
    assert two.cp["input_check_cp_bytes_per_step"] == positions * 3 // 4
    assert [t.name for t in two.step_terms if "over cp" in t.name] == [
        "position_ids all-gather over cp (each stage's document layout)"]
    assert plan_tsp_cp_all_to_all(replace(inp, pp=2), 4).cp["input_check_cp_bytes_per_step"] == positions * 3 // 4
    windowed = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, attention_windows=(8, None))
    # per stage: the reported stage's windowed layers (tests/tools/test_plan_hybrid_pipeline.py: against counters)
    assert plan_tsp_cp(PlanInput(model=windowed, seq=64, degree=2, pp=2), 2).cp["windowed_layers"] == 1
    assert main(["plan", "--model", "8b", "--tsp", "8", "--cp", "4", "--pp", "2", "--seq", "64k"]) == 0

