"""Hybrid models (Gated DeltaNet linear attention) under the cp axis: exact against transformers.

The tiny Qwen3.5 and dense Qwen3-Next of tests/helpers/hybrid_tiny.py (layer 0 linear_attention: 4 key / 8 value heads of
dim 4, conv kernel 4; layer 1 gated full attention, which takes the cp ring) are loaded by slices as
ds_tsp.hf.TSPForCausalLM on the cp runtime and called as transformers' model on the FULL batch, float64. ONE spawn
of 4 gloo ranks runs both layouts of 4 ranks:
| (D, C) | cases                                                                                                 |
|--------|-------------------------------------------------------------------------------------------------------|
| (2, 2) | qwen3_5 packed, padding, plain; qwen3_next packed, padding                                            |
| (1, 4) | qwen3_5 packed, padding; qwen3_next packed, plain                                                     |
- packed: documents (5, 4, 6) / (9, 6), S = 15 padded to 16: chunks of c = 2 tokens, shorter than the conv halo
  (K - 1 = 3), so a halo spans two chunks that may lie in another cp group; documents span cp chunks, so the
  state and the conv must reset at GLOBAL document starts (the whole sequence's layout);
- padding: tests/hybrid_tiny.padding_inputs (left and right padding, S = 21 padded to 24, c = 3 = K - 1) against
  the unpadded rows;
- plain: S = 29 padded to 32 (c = 4).
Loss and EVERY gradient (averaged over data x cp, as the data-parallel engine does) within 1e-10 norm-wise
relative of transformers' own model (widened to float64 by ds_tsp.tools.hf_reference; packed documents run one by
one). The comparison can fail: the same step with the chunks composed in the order of a cp-unaware layout misses
by far more (test_a_cp_unaware_chunk_order_is_caught).

The same spawn records a ShardedCausalLM step at (2, 2) for the NCCL-rules replay (tests/helpers/nccl_rules.py: the
halo and transition gathers over TSP then cp, their reduce-scatters over cp then TSP, in the same order on every
rank) and counts its host reads (only the input check's one); runs `ds-tsp verify --hf-model DIR --tsp 2 --cp 2
--dtype float64 --documents 3` (its run_cp_case); counts the cp communicator's bytes against the formula of
ds_tsp.core.layers.linear_attention.scan; and measures fp32 steps (with and without activation checkpointing) whose
counters `ds-tsp plan --cp 2` must equal exactly (TSP group: every kind; cp: the attention's K/V ring and the Gated
DeltaNet's gathers / reduce-scatters over cp). A meta-device cp step (subprocess, fake process group) creates
nothing off the device. (2, 3) and (4, 2) run under --runslow.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import packed_batch, shift  # noqa: E402
from hybrid_tiny import VOCAB, hybrid_config, padding_inputs, plain_inputs, rel, save_checkpoint  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

TOL = 1e-10
FAMILIES = ("qwen3_5", "qwen3_next")
PACKED_DOCUMENTS = ((5, 4, 6), (9, 6))
CASES = {(2, 2): [("qwen3_5", "packed"), ("qwen3_5", "padding"), ("qwen3_5", "plain"), ("qwen3_next", "packed"),
                  ("qwen3_next", "padding")],
         (1, 4): [("qwen3_5", "packed"), ("qwen3_5", "padding"), ("qwen3_next", "packed"), ("qwen3_next", "plain")]}
SLOW_CASES = [("qwen3_5", "packed"), ("qwen3_next", "padding")]
VERIFY_SEQ, VERIFY_DOCUMENTS = 24, 3


def inputs(batch: str) -> dict:
    if batch == "packed":
        return packed_batch(VOCAB, PACKED_DOCUMENTS, seed=4)
    return {"padding": lambda: padding_inputs()[1], "plain": plain_inputs}[batch]()


def _step(directory: str, runtime, batch: str) -> dict:
    """One float64 step of TSPForCausalLM on the full batch: loss and the HF-named grads (rank 0 keeps them)."""
    import torch.distributed as dist

    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.tools.verify import average_grads_over_data

    model = TSPForCausalLM.from_pretrained(directory, runtime.comm, dtype=torch.float64, options=runtime.options,
                                           data_group=runtime.data_group)
    out = model(**{k: v for k, v in inputs(batch).items() if k != "documents"})
    out.loss.backward()
    average_grads_over_data(model.tsp, runtime.data_group)
    grads = model.tsp.full_state_dict(grads=True)
    return {"loss": float(out.loss.detach()), "grads": grads if dist.get_rank() == 0 else None}


def _runtime(D: int, C: int):
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime

    return build_runtime(parse_tsp_config({"size": D, "cp_size": C}))


def _runs(checkpoints: dict) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.layers.linear_attention import scan as linear_attention_scan
    from ds_tsp.tools.verify import run_cp_case

    out = {"rank": dist.get_rank()}
    for (D, C), cases in CASES.items():
        runtime = _runtime(D, C)
        for family, batch in cases:
            out[(family, batch, D, C)] = _step(checkpoints[family], runtime, batch)
    runtime = _runtime(2, 2)
    # a cp-unaware chunk map (cp group i holding the i-th contiguous quarter): the comparison must catch it
    real = linear_attention_scan.cp_chunk_slot

    def contiguous_groups(chunk, tsp, cp):
        return (chunk // (2 * tsp), *linear_attention_scan.global_chunk_slot(chunk % (2 * tsp), tsp))

    linear_attention_scan.cp_chunk_slot = contiguous_groups
    try:
        out["unaware"] = _step(checkpoints["qwen3_5"], runtime, "packed")
    finally:
        linear_attention_scan.cp_chunk_slot = real
    out.update(_recorded_step(checkpoints["qwen3_5"], runtime))
    out["verify"] = run_cp_case(verify_case(checkpoints["qwen3_5"]), 2, 2)  # ds-tsp verify --hf-model --cp 2
    # the same with activation checkpointing: the recompute re-posts the halo and transition gathers over cp
    out["verify_checkpointing"] = run_cp_case(verify_case(checkpoints["qwen3_next"]), 2, 2,
                                              {"activation_checkpointing": True})
    out["measured"] = {ac: _measure_for_plan(runtime, ac) for ac in (False, True)}
    # tsp.cp_comm "all_to_all": the full-attention layer's heads over cp, the Gated DeltaNet's gathers as before
    out["verify_all_to_all"] = run_cp_case(verify_case(checkpoints["qwen3_5"]), 2, 2, {"cp_comm": "all_to_all"})
    return out


PLAN_SEQ, PLAN_BATCH = 15, 2  # padded 16: c = 2 < K - 1, the halo's tail is the whole chunk


def plan_shape(**overrides):
    from ds_tsp.core.shape.model_shape import ModelShape

    return ModelShape.from_hf_config(hybrid_config("qwen3_5", **overrides).to_dict())


def _measure_for_plan(runtime, checkpointing: bool) -> dict:
    """One fp32 ShardedCausalLM step of the Qwen3.5 shape at (D, C) = (2, 2): both communicators' counter bytes
    (and the input check's own all-gather over cp, read off the recorded ops)."""

    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    comm, groups = runtime.comm, runtime.groups
    options = runtime.options.replace(activation_checkpointing=checkpointing)
    model = ShardedCausalLM(plan_shape(), comm, options=options, data_group=runtime.data_group)
    model.init_weights_(0, std=0.2)
    ids = torch.randint(0, VOCAB, (PLAN_BATCH, PLAN_SEQ), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=2, rank=groups.tsp_rank, cp=2, cp_rank=groups.cp_rank)
    comm.counter.reset()
    comm.cp.counter.reset()
    with comm.recording() as rec:
        model(b["input_ids"], b["shift_labels"], b["position_ids"], seq_len=b["seq_len"]).backward()
    check = sum(o["nbytes"] for o in rec.ops if o["what"] == "input check over cp")  # x (C-1) = 1 arriving
    return {"tsp": dict(comm.counter.bytes), "cp": dict(comm.cp.counter.bytes), "input_check_cp": check}


def _slow_runs(checkpoints: dict, D: int, C: int) -> dict:
    runtime = _runtime(D, C)
    return {(family, batch): _step(checkpoints[family], runtime, batch) for family, batch in SLOW_CASES}


def verify_case(directory: str):
    from ds_tsp.tools.cli import _shape_from_checkpoint
    from ds_tsp.tools.verify import VerifyCase

    return VerifyCase(shape=_shape_from_checkpoint(directory), batch=2, seq=VERIFY_SEQ, dtype="float64",
                      documents=VERIFY_DOCUMENTS, hf_model=directory)


def _recorded_step(directory: str, runtime) -> dict:
    """One ShardedCausalLM step (the packed batch) recorded for the NCCL-rules replay, its host reads counted and
    both communicators' bytes."""
    from sync_counter import SyncCounter

    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.hf import TSPForCausalLM

    comm, groups = runtime.comm, runtime.groups
    model = label_modules(TSPForCausalLM.from_pretrained(directory, comm, dtype=torch.float64,
                                                         options=runtime.options,
                                                         data_group=runtime.data_group).tsp)
    batch = inputs("packed")
    local = shard_batch(batch["input_ids"], tsp=2, rank=groups.tsp_rank, cp=2, cp_rank=groups.cp_rank,
                        labels=batch["labels"], position_ids=batch["position_ids"])
    comm.counter.reset()
    comm.cp.counter.reset()
    with comm.recording() as rec:
        with SyncCounter() as forward:
            loss = model(local["input_ids"], local["shift_labels"], local["position_ids"], seq_len=local["seq_len"])
        with SyncCounter() as backward:
            loss.backward()
    return {"ops": rec.ops, "cp_bytes": dict(comm.cp.counter.bytes),
            "syncs": {phase: [(e.kind, e.op, e.region, e.where) for e in counter.events]
                      for phase, counter in (("forward", forward), ("backward", backward))}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_hybrid")
    return {family: save_checkpoint(root / family, hybrid_config(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints):
    from ds_tsp.tools.hf_reference import load_hf_reference

    return {family: load_hf_reference(directory, torch.float64) for family, directory in checkpoints.items()}


@pytest.fixture(scope="module")
def runs(checkpoints):
    return run_on_local_ranks(_runs, 4, checkpoints, timeout_s=300)


def _reference(model, batch: str):
    """transformers' loss and grads (padding: the unpadded rows; packed: every document alone)."""
    from ds_tsp.tools.hf_reference import hf_loss_and_grads

    if batch == "padding":
        ids = padding_inputs()[0]
        return hf_loss_and_grads(model, ids, shift(ids.clone()))
    data = inputs(batch)
    documents = {"documents": data["documents"]} if "documents" in data else {}
    return hf_loss_and_grads(model, data["input_ids"], shift(data["labels"]), **documents)


def _errors(got: dict, ref) -> tuple[float, str, float]:
    ref_loss, ref_grads = ref
    assert set(got["grads"]) == set(ref_grads)
    errors = {n: rel(got["grads"][n], g) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    return rel(torch.tensor(got["loss"], dtype=torch.float64), ref_loss), worst, errors[worst]


@pytest.mark.parametrize("family, batch, D, C", [(f, b, D, C) for (D, C), cases in CASES.items() for f, b in cases])
def test_cp_hybrid_matches_transformers_fp64(runs, references, family, batch, D, C):
    got = runs[0][(family, batch, D, C)]
    loss_err, worst, grad_err = _errors(got, _reference(references[family], batch))
    assert loss_err < TOL, (family, batch, D, C, got["loss"])
    assert grad_err < TOL, (family, batch, D, C, worst, grad_err)
    assert all(r[(family, batch, D, C)]["loss"] == got["loss"] for r in runs)  # every rank logs the same loss


def test_the_cases_cover_short_chunks_and_documents_across_cp_chunks():
    from ds_tsp.core.tokens.zigzag import padded_length

    K = hybrid_config().linear_conv_kernel_dim
    S = sum(PACKED_DOCUMENTS[0])
    for D, C in CASES:
        padded = padded_length(S, 2 * D * C)
        assert padded // (2 * C * D) < K - 1  # a chunk shorter than the conv halo
        cp_chunk = padded // (2 * C)
        starts = [sum(row[:k]) for row in PACKED_DOCUMENTS for k in range(len(row))]
        ends = [sum(row[:k + 1]) for row in PACKED_DOCUMENTS for k in range(len(row))]
        assert any(a // cp_chunk != (e - 1) // cp_chunk for a, e in zip(starts, ends))  # a document spans cp chunks
        assert any(a % cp_chunk for a in starts)  # a document starts inside a cp chunk


def test_a_cp_unaware_chunk_order_is_caught(runs, references):
    """The packed step with cp_chunk_slot replaced by a cp-unaware map (cp group i holding the i-th contiguous
    quarter of the sequence) is far from transformers: the halo and the states really cross cp groups."""
    loss_err, _, grad_err = _errors(runs[0]["unaware"], _reference(references["qwen3_5"], "packed"))
    assert max(loss_err, grad_err) > 1e-3, (loss_err, grad_err)


def test_cp_hybrid_step_obeys_nccl_rules(runs):
    from nccl_rules import check

    ops = [r["ops"] for r in runs]
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    assert {o["group"] for rank_ops in ops for o in rank_ops} == {(0, 1), (2, 3), (0, 2), (1, 3)}
    for rank_ops in ops:
        whats = [(o["kind"], o["what"]) for o in rank_ops if o["what"] and ("transitions" in o["what"]
                                                                           or "conv halo" in o["what"])]
        cp_ops = [w for w in whats if w[1].endswith("over cp")]
        # forward: the halo once and every block's transitions over cp (each rank's own piece) then TSP;
        # backward: each block's transitions re-gathered and reduce-scattered over TSP then cp, the halo's grad once
        assert ("all_gather", "conv halo (2 tokens per chunk) over cp") in cp_ops, whats
        assert ("reduce_scatter", "grad of conv halo (2 tokens per chunk) over cp") in cp_ops, whats
        gathers = [w for w in whats if w[1].startswith("gated delta rule chunk transitions")]
        assert gathers == [("all_gather", "gated delta rule chunk transitions over cp"),
                           ("all_gather", "gated delta rule chunk transitions")] * 4, gathers
        grads = [w for w in whats if w[1].startswith("grad of gated delta rule")]
        assert grads == [("reduce_scatter", "grad of gated delta rule chunk transitions"),
                         ("reduce_scatter", "grad of gated delta rule chunk transitions over cp")] * 2, grads
        assert any(o["kind"] == "p2p" and "cp hop" in o["what"] for o in rank_ops)  # the attention layer's ring


def test_cp_hybrid_step_host_reads(runs):
    """Only the input check reads the host (once); nothing in the Gated DeltaNet, attention or backward."""
    for r in runs:
        forward, backward = r["syncs"]["forward"], r["syncs"]["backward"]
        assert [e[:2] for e in forward] == [("read", "tolist")] and forward[0][2] == "input_checks", forward
        assert backward == [], backward


def test_cp_bytes_of_the_gated_deltanet_are_the_documented_formula(runs):
    """The cp communicator's all-gather / reduce-scatter bytes of the step are the module doc's: halo (C-1) 2 B
    min(c, K-1) h once forward (its reduce-scatter once backward), transitions (C-1) 2 B H_block dk (dk + dv)
    per block, gathered in forward and again in backward, reduce-scattered in backward (float64: 8 bytes): each
    rank's own pieces, not its TSP group's D of them."""
    config = hybrid_config()
    D, C, B, h = 2, 2, len(PACKED_DOCUMENTS), config.hidden_size
    c = 16 // (2 * C * D)
    K, dk, dv = config.linear_conv_kernel_dim, config.linear_key_head_dim, config.linear_value_head_dim
    H_block = config.linear_num_value_heads // D
    halo = (C - 1) * 2 * B * min(c, K - 1) * h * 8
    transitions = (C - 1) * 2 * B * H_block * dk * (dk + dv) * 8
    for r in runs:
        check = sum(o["nbytes"] * (C - 1) for o in r["ops"] if o["what"] == "input check over cp")  # cp_inputs
        assert r["cp_bytes"]["all_gather"] == check + halo + 2 * D * transitions, r["cp_bytes"]
        assert r["cp_bytes"]["reduce_scatter"] == halo + D * transitions, r["cp_bytes"]


def test_verify_hf_model_under_cp(runs):
    """ds-tsp verify --hf-model DIR --tsp 2 --cp 2 --dtype float64 --documents 3 (its run_cp_case, in this module's
    spawn) on the Qwen3.5 checkpoint, and on the Qwen3-Next one with activation checkpointing: loss and every
    gradient against transformers within the float64 tolerance."""
    for key in ("verify", "verify_checkpointing", "verify_all_to_all"):  # + Qwen3.5 under cp_comm all_to_all
        report = runs[0][key]
        assert all(r[key] is None for r in runs[1:])  # the report is rank 0's
        assert (report["tsp"], report["cp"], report["reference"], report["ok"]) == (2, 2, "transformers", True), \
            report
        assert report["loss_rel_err"] < TOL and report["grad_rel_err"] < TOL, report


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_cp_hybrid_equals_the_counters_of_a_real_step(runs, checkpointing):
    """ds-tsp plan --cp 2 for the hybrid shape: the TSP group's bytes are TSP's hybrid plan at the group's tokens
    (hybrid_counter_bytes, every kind exactly) plus the cp blocks' reassembly over TSP; the cp communicator's whole
    counter is the full-attention layer's K/V ring (cp_ring), the Gated DeltaNet's halo / transition gathers and
    reduce-scatters over cp and the input check's all-gather over cp (exactly), with and without activation
    checkpointing (the forward's cp traffic replayed in backward)."""
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.hybrid import hybrid_counter_bytes
    from ds_tsp.tools.plan.tsp_cp import group_input, plan_tsp_cp

    inp = PlanInput(model=plan_shape(), seq=PLAN_SEQ, batch=PLAN_BATCH, degree=2, dtype="fp32",
                    activation_checkpointing=checkpointing)
    plan = plan_tsp_cp(inp, 2)
    assert plan.layout == "tsp_cp"
    by_kind = {}
    described = [(t, 1) for t in plan.layer_fwd_terms + plan.layer_bwd_terms]  # one Gated DeltaNet layer
    for t, n in described + [(t, 1) for t in plan.step_terms]:
        if t.kind == "cp_ring" or t.name.endswith(("over cp", "over cp (per head block)")):
            by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes * n
    assert set(by_kind) == {"cp_ring", "all_gather", "reduce_scatter"}, by_kind
    assert plan.cp["inter_node_bytes_per_step"] == sum(by_kind.values())
    tsp = hybrid_counter_bytes(group_input(inp, 2))
    for kind, n in plan.cp["intra_node_cp_bytes_by_kind"].items():  # + the cp blocks' reassembly over TSP
        tsp[kind] = tsp.get(kind, 0) + n
    for r in runs:
        measured = r["measured"][checkpointing]
        assert measured["tsp"] == tsp, (r["rank"], measured["tsp"], tsp)
        assert measured["input_check_cp"] == plan.cp["input_check_cp_bytes_per_step"] > 0, r["rank"]
        assert measured["cp"] == {"ring": by_kind["cp_ring"], "all_gather": by_kind["all_gather"],
                                  "reduce_scatter": by_kind["reduce_scatter"]}, (r["rank"], measured["cp"], by_kind)


def test_plan_cli_cp_hybrid(tmp_path, capsys):
    from ds_tsp.tools.cli import main

    hybrid_config("qwen3_5").to_json_file(tmp_path / "config.json")
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), "--seq", "64k", "--tsp", "2", "--cp", "2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"] == "tsp_cp" and any("Gated DeltaNet layers' conv halo" in n for n in plan["notes"]), plan
    # O(1) in S: the Gated DeltaNet's cp bytes do not grow with the sequence, the attention ring's do
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), "--seq", "128k", "--tsp", "2", "--cp", "2",
                 "--json"]) == 0
    longer = json.loads(capsys.readouterr().out)
    gdn = [sum(t["bytes"] for t in p["layer_fwd_terms"] if "over cp" in t["name"]) for p in (plan, longer)]
    assert gdn[0] == gdn[1] > 0, gdn


@pytest.mark.slow
@pytest.mark.parametrize("D, C", [(2, 3), (4, 2)])
def test_cp_hybrid_at_larger_layouts(checkpoints, references, D, C):
    got = run_on_local_ranks(_slow_runs, D * C, checkpoints, D, C, timeout_s=600)[0]
    for family, batch in SLOW_CASES:
        loss_err, worst, grad_err = _errors(got[(family, batch)], _reference(references[family], batch))
        assert loss_err < TOL and grad_err < TOL, (family, batch, D, C, loss_err, worst, grad_err)


# --- device-correct by construction: a hybrid cp step on the meta device -------------------------------------------
def run_meta_cp_hybrid() -> list[str]:
    """Rank 1 of a fake world of 4 ((D, C) = (2, 2)) runs the tiny Qwen3.5 (Gated DeltaNet + gated attention) through
    the HF face on `meta` with right/left padding: every tensor it creates stays there (tests/model/test_meta_device.py's
    recorder). Returns what it found off the device."""
    import torch.distributed as dist
    from test_meta_device import META, DeviceRecorder, _meta_batch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.hf import TSPForCausalLM

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=1, world_size=4)
    tsp_group, _, cp_group, _ = (dist.new_group(r) for r in ([0, 1], [2, 3], [1, 3], [0, 2]))
    comm = TSPComm(tsp_group, cp=TSPComm(cp_group))
    model = TSPForCausalLM(hybrid_config("qwen3_5"), comm, dtype=torch.float32, device=META)
    with DeviceRecorder() as rec:
        out = model(**_meta_batch("padding"))
        out.loss.backward()
    assert out.loss.device == META
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())
    return rec.found


def test_cp_hybrid_step_creates_nothing_off_device():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cp_hybrid as t; found = t.run_meta_cp_hybrid(); "
            "print('\\n'.join(found)); print('done'); sys.exit(1 if found else 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
