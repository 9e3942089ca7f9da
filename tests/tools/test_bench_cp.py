"""`ds-tsp bench --tsp D --cp C`: layout tsp_cp (C TSP groups of D ranks) against TSP = C x D and
Ulysses over C x D ranks, in one run.

- flags -> configs: tsp_cp on C groups of D, its peers on C x D ranks; "all" without --cp leaves tsp_cp out; an MoE
  shape runs tsp_cp and tsp under each schedule, and its step's cp ring bytes are the plan's;
- the bench's tsp_cp step trains the model the reference trains: one step at (D, C) = (2, 2) on 4 ranks, loss and
  EVERY gradient (averaged over cp by the bench's flat all-reduce) against the single-device ds_tsp reference on the
  same batch and weights (fp32, as the bench runs: relative error <= 1e-5, measured ~1e-7); its counters against
  `ds-tsp plan --cp` (cp ring + the input check's all-gather over cp = the plan's inter-node bytes exactly; every
  byte counted, TSP group + cp ring + cp grad sync + input check over cp = the plan's bytes per step exactly);
- a tiny `--tsp 2 --cp 2` run end to end: rows for all three layouts, bytes split by communicator, ratios, table;
  and `--max-seq` over tsp_cp and tsp = 4 (slow: opt-in);
- errors: one line naming --cp.
"""
from __future__ import annotations

import json

import pytest
import torch
from local_ranks import forked_ranks, run_on_local_ranks

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.bench.cli import build_parser, configs_from_args

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--ffn", "64", "--vocab", "64"]
SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
SEQ = 40  # a multiple of 2*D*C = 8
MOE_SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    with forked_ranks():
        yield


def _configs(*argv):
    return [(c.layout, c.tsp, c.cp, c.world) for c in configs_from_args(build_parser().parse_args(list(argv)))]


def test_cp_flags_map_to_tsp_cp_and_its_peers_on_c_x_d_ranks():
    assert _configs("--tsp", "2", "--cp", "2", "--quick") == [("tsp_cp", 2, 2, 4), ("tsp", 4, 1, 4),
                                                              ("ulysses_zero3", 4, 1, 4)]
    assert _configs("--tsp", "2", "4", "--cp", "2", "--layouts", "single,tsp_cp,ulysses_zero1", "--seq", "64") == [
        ("single", 4, 1, 1), ("tsp_cp", 2, 2, 4), ("ulysses_zero1", 4, 1, 4), ("tsp_cp", 4, 2, 8),
        ("ulysses_zero1", 8, 1, 8)]
    assert "tsp_cp" not in [name for name, *_ in _configs("--quick")]  # without --cp "all" leaves it out
    moe = configs_from_args(build_parser().parse_args(["--tsp", "2", "--cp", "2", "--num-experts", "4", "--seq", "64",
                                                       "--moe-dispatch", "ring,all_to_all"]))
    assert [(c.layout, c.moe_dispatch, c.tsp, c.cp) for c in moe] == [  # MoE: the TSP layouts only, as without --cp
        ("tsp_cp", "ring", 2, 2), ("tsp_cp", "all_to_all", 2, 2), ("tsp", "ring", 4, 1), ("tsp", "all_to_all", 4, 1)]


def _bench_step_at_2x2():
    """One bench step of layout tsp_cp at (D, C) = (2, 2): the full weights before it, the full grads the optimizer
    sees (after the bench's average over cp), this rank's returned loss, and both counters' bytes."""
    from ds_tsp.tools.bench import tsp_cp
    from ds_tsp.tools.bench.config import LAYOUTS, BenchConfig

    cfg = BenchConfig(layout="tsp_cp", seqs=(SEQ,), tsp=2, cp=2, batch=2, shape=SHAPE, steps=1, warmup=0, seed=3)
    session = tsp_cp.build(cfg, LAYOUTS["tsp_cp"].option_dict)
    full = session.model.full_state_dict()
    seen = {}
    step = session.optimizer.step

    def record_then_step():  # the step's bytes first: gathering the grads below is a collective of the test's
        seen["snapshot"] = workload.tsp_counter.snapshot()
        seen["grads"] = session.model.full_state_dict(grads=True)
        step()

    session.optimizer.step = record_then_step
    workload = session.workload(SEQ)
    workload.tsp_counter.reset()
    loss = float(workload.step())
    rank = torch.distributed.get_rank()
    moe = {}
    for schedule in ("ring", "all_to_all"):  # an MoE shape's step under each dispatch schedule: its bytes
        moe_cfg = BenchConfig(layout="tsp_cp", seqs=(SEQ,), tsp=2, cp=2, batch=2, shape=MOE_SHAPE, steps=1, warmup=0,
                              moe_dispatch=schedule)
        moe_workload = tsp_cp.build(moe_cfg, LAYOUTS["tsp_cp"].option_dict).workload(SEQ)
        moe_workload.tsp_counter.reset()
        moe_workload.step()
        moe[schedule] = moe_workload.tsp_counter.snapshot()
    return {"loss": loss, "snapshot": seen["snapshot"], "moe": moe,
            "full": full if rank == 0 else None, "grads": seen["grads"] if rank == 0 else None,
            "param_bytes": sum(p.numel() * p.element_size() for p in session.model.parameters())}


@pytest.fixture(scope="module")
def step_2x2():
    return run_on_local_ranks(_bench_step_at_2x2, 4, timeout_s=300)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_tsp_cp_step_matches_the_single_device_reference(step_2x2):
    """Loss (the ranks' returned shares summed, as the bench does) and every gradient the optimizer steps on."""
    from ds_tsp.tools.bench.common import global_batch
    from ds_tsp.tools.bench.config import BenchConfig
    from ds_tsp.tools.reference_model import ReferenceCausalLM

    ids, labels, positions = global_batch(BenchConfig(layout="tsp", seqs=(SEQ,), batch=2, shape=SHAPE, seed=3), SEQ)
    ref = ReferenceCausalLM(SHAPE, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in step_2x2[0]["full"].items()}, strict=False)
    loss = ref(ids, labels, positions)
    loss.backward()
    loss = float(loss.detach())
    got_loss = sum(r["loss"] for r in step_2x2)
    assert abs(got_loss - loss) <= 1e-5 * loss, (got_loss, loss)
    grads = step_2x2[0]["grads"]
    errs = {name: _rel(grads[name], p.grad) for name, p in ref.named_parameters()}
    assert len(errs) == len(grads) and max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_tsp_cp_counters_are_the_plan(step_2x2):
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    plan = plan_tsp_cp(PlanInput(model=SHAPE, seq=SEQ, batch=2, degree=2, dtype="fp32"), 2)
    check = plan.cp["input_check_cp_bytes_per_step"]
    assert check == 2 * (7 + 1024) * 8  # (C-1) D payloads of INPUT_CHECK_COUNTS + DOCUMENT_LAYOUT_SLOTS int64
    for r in step_2x2:
        by_kind = r["snapshot"]["bytes"]
        assert by_kind["cp:ring"] + by_kind["cp:all_gather"] == plan.cp["inter_node_bytes_per_step"]
        assert by_kind["cp:all_gather"] == check and by_kind["cp:ring"] > 0, by_kind
        # the flat grad all-reduce over C = 2: 2 (C-1)/C x this rank's gradient bytes
        assert by_kind["cp:grad_sync"] == r["param_bytes"]
        assert r["snapshot"]["total_bytes"] == plan.comm_bytes_per_step
    assert len({json.dumps(r["snapshot"]["bytes"], sort_keys=True) for r in step_2x2}) == 1  # same on every rank


@pytest.mark.parametrize("schedule", ["ring", "all_to_all"])
def test_tsp_cp_moe_step_bytes_are_the_plan(step_2x2, schedule):
    """An MoE shape under tsp_cp (dispatch inside each TSP group): the cp communicator's bytes (ring + input check)
    are the plan's inter-node bytes exactly."""
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    plan = plan_tsp_cp(PlanInput(model=MOE_SHAPE, seq=SEQ, batch=2, degree=2, dtype="fp32", moe_dispatch=schedule), 2)
    for r in step_2x2:
        by_kind = r["moe"][schedule]["bytes"]
        cp = {k: v for k, v in by_kind.items() if k.startswith("cp:") and k != "cp:grad_sync"}
        assert cp == {"cp:ring": cp["cp:ring"], "cp:all_gather": plan.cp["input_check_cp_bytes_per_step"]}, cp
        assert sum(cp.values()) == plan.cp["inter_node_bytes_per_step"], (by_kind, plan.cp)
        if schedule == "ring":  # all_to_all's rows follow the routing; the plan assumes even routing
            assert r["moe"][schedule]["total_bytes"] == plan.comm_bytes_per_step, by_kind


def test_bench_tsp2_cp2_rows_for_all_three_layouts(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--tsp", "2", "--cp", "2", "--quick", "--seq", "32", "64", "--steps", "1",
                                      "--quiet", "--out", str(out), *TINY])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["layout"], r["seq"], r["world"], r["tsp"], r["cp"]) for r in rows] == [
        ("tsp_cp", 32, 4, 2, 2), ("tsp_cp", 64, 4, 2, 2), ("tsp", 32, 4, 4, 1), ("tsp", 64, 4, 4, 1),
        ("ulysses_zero3", 32, 4, 4, 1), ("ulysses_zero3", 64, 4, 4, 1)]
    for r in rows:
        assert r["ok"] and r["tokens_per_s"] > 0 and r["peak_bytes_per_rank"] > 0, r
        assert r["comm_group_bytes"] > 0 and r["step_s_vs_tsp_cp"] > 0
        assert 2.0 < r["loss"] < 8.0  # ~ln(64) at init
        if r["layout"] == "tsp_cp":
            assert r["step_s_vs_tsp_cp"] == 1.0
            assert r["comm_cp_ring_bytes"] == r["plan_cp_ring_bytes"] > 0
            assert r["comm_cp_ring_bytes"] + r["comm_cp_input_check_bytes"] == r["plan_cp_bytes_per_step"]
            assert r["comm_bytes"] == r["plan_comm_bytes_per_step"]  # every byte of both communicators
            assert r["comm_bytes"] == r["comm_group_bytes"] + r["comm_cp_ring_bytes"] + \
                r["comm_cp_grad_sync_bytes"] + r["comm_cp_input_check_bytes"]
        else:
            assert "comm_cp_ring_bytes" not in r and r["comm_group_bytes"] == r["comm_bytes"]
    cp = {r["seq"]: r for r in rows if r["layout"] == "tsp_cp"}
    assert cp[64]["comm_cp_ring_bytes"] == 2 * cp[32]["comm_cp_ring_bytes"]  # the K/V hops grow with S / C
    table = (out / "results.md").read_text()
    assert "## tsp_cp against its peers on the same ranks" in table
    assert "| tsp_cp | off | 4 | 2 | 2 | 64 |" in table and "| ulysses_zero3 | off | 4 | 4 | 1 | 64 |" in table


@pytest.mark.slow
def test_max_seq_with_cp(tmp_path, capsys):
    """~150 s wall on 2 loaded cores (4 searches of 4 ranks each): opt-in."""
    out = tmp_path / "max_seq"
    args = build_parser().parse_args(["--max-seq", "--budget-mib", "0.5", "--tsp", "2", "--cp", "2", "--layouts",
                                      "tsp_cp,tsp", "--timeout", "120", "--quiet", "--out", str(out), *TINY])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["layout"], r["world"], r["activation_checkpointing"]) for r in rows] == [
        ("tsp_cp", 4, False), ("tsp_cp", 4, True), ("tsp", 4, False), ("tsp", 4, True)]
    for r in rows:
        assert r["ok"] and r["max_seq"] % 8 == 0 and r["peak_bytes_per_rank"] <= 0.5 * 2 ** 20, r
        assert r["next_probe_peak_bytes"] > 0.5 * 2 ** 20
        assert r["max_seq_vs_tsp_cp"] > 0
    assert "max S / tsp_cp's" in (out / "results.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "tsp_cp"], "add --cp C"),
    (["--cp", "2", "--tsp", "2", "--seq", "36"], "multiple of 2*--tsp*--cp=8"),
    (["--cp", "2", "--layer-memory"], "--cp 2 with --layer-memory"),
    (["--cp", "2", "--num-experts", "4", "--layouts", "tsp_cp,ulysses_zero3"], "runs on the TSP layouts only"),
    (["--cp", "2", "--max-seq", "--budget-mib", "1", "--heads", "6", "--tsp", "2"], "num_heads=6"),
])
def test_cp_errors_exit_2_with_one_line_naming_the_flag(argv, message, capsys, tmp_path):
    args = build_parser().parse_args([*argv, "--out", str(tmp_path)])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cp_runs_a_hybrid_model(capsys, tmp_path):
    """A hybrid model (Gated DeltaNet layers) is no longer refused under --cp: "all" keeps tsp_cp (and tsp at
    C x D) for it, and the model's and the planner's checks pass (its step: tests/cp/test_cp_hybrid.py)."""
    pytest.importorskip("transformers")
    from hybrid_tiny import hybrid_config

    hybrid_config().save_pretrained(tmp_path)
    args = build_parser().parse_args(["--hf-config", str(tmp_path), "--tsp", "2", "--cp", "2", "--seq", "64",
                                      "--out", str(tmp_path / "out")])
    assert [(c.layout, c.tsp, c.cp) for c in configs_from_args(args)] == [("tsp_cp", 2, 2), ("tsp", 4, 1)]


@pytest.mark.slow
def test_bench_cp_hybrid_bytes_are_the_plan(tmp_path, capsys):
    """`ds-tsp bench --hf-config <Qwen3.5> --tsp 2 --cp 2`: tsp_cp's layer bytes on the cp communicator (the
    attention's K/V ring + the Gated DeltaNet's gathers over cp) equal the plan's inter-node bytes exactly."""
    pytest.importorskip("transformers")
    from hybrid_tiny import hybrid_config

    hybrid_config().save_pretrained(tmp_path)
    out = tmp_path / "out"
    args = build_parser().parse_args(["--hf-config", str(tmp_path), "--tsp", "2", "--cp", "2", "--seq", "64",
                                      "--steps", "1", "--quiet", "--out", str(out)])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "results.json").read_text())}
    cp = rows["tsp_cp"]
    assert cp["ok"] and rows["tsp"]["ok"], rows
    assert cp["comm_cp_ring_bytes"] == cp["plan_cp_ring_bytes"] > cp["comm_by_op"]["cp:ring"], cp
    assert cp["comm_cp_ring_bytes"] + cp["comm_cp_input_check_bytes"] == cp["plan_cp_bytes_per_step"], cp
    assert cp["comm_bytes"] == cp["plan_comm_bytes_per_step"], cp


def test_cp_bad_value_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--cp", "0"])
    assert exc.value.code == 2 and "--cp" in capsys.readouterr().err


def test_cp_comm_flag_measures_tsp_cp_under_each_schedule(capsys, tmp_path):
    """--cp-comm ring,all_to_all: one tsp_cp row per cp schedule (tsp.cp_comm), labelled; refused by name without
    --cp, for an unknown schedule, and for heads the all-to-all cannot split (before any rank starts)."""
    configs = configs_from_args(build_parser().parse_args(["--tsp", "2", "--cp", "2", "--seq", "64", "--cp-comm",
                                                           "ring,all_to_all"]))
    assert [(c.label, c.cp_comm, c.tsp, c.cp) for c in configs] == [
        ("tsp_cp", "ring", 2, 2), ("tsp_cp[all_to_all]", "all_to_all", 2, 2), ("tsp", "ring", 4, 1),
        ("ulysses_zero3", "ring", 4, 1)]
    for argv, message in ((["--cp-comm", "all_to_all"], "--cp-comm: the cp schedules of layout tsp_cp; add --cp"),
                          (["--cp", "2", "--cp-comm", "pass_kv"], "--cp-comm: unknown ['pass_kv']"),
                          (["--cp", "2", "--tsp", "2", "--heads", "6", "--hidden", "48", "--layouts", "tsp_cp",
                            "--cp-comm", "all_to_all"],
                           "--cp 2 --cp-comm all_to_all: cp_comm all_to_all with cp=2: a head block of 3 query")):
        args = build_parser().parse_args([*argv, "--out", str(tmp_path)])
        assert args.run(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_bench_tsp2_cp2_all_to_all_bytes_are_the_plan(tmp_path, capsys):
    """`ds-tsp bench --tsp 2 --cp 2 --cp-comm ring,all_to_all --layouts tsp_cp`: each schedule's cp bytes and every
    byte of both communicators equal its plan's (~200 s on 2 loaded cores)."""
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--tsp", "2", "--cp", "2", "--cp-comm", "ring,all_to_all", "--layouts",
                                      "tsp_cp", "--quick", "--seq", "32", "--steps", "1", "--quiet", "--out", str(out),
                                      *TINY])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["label"], r["cp_comm"]) for r in rows] == [("tsp_cp", "ring"), ("tsp_cp[all_to_all]", "all_to_all")]
    for r in rows:
        assert r["ok"] and r["comm_cp_ring_bytes"] == r["plan_cp_ring_bytes"] > 0, r
        assert r["comm_bytes"] == r["plan_comm_bytes_per_step"], r
    assert rows[1]["comm_cp_ring_bytes"] < rows[0]["comm_cp_ring_bytes"]  # MHA, C = 2: half the ring's
    assert "| tsp_cp[all_to_all] | off | 4 | 2 | 2 | 32 |" in (out / "results.md").read_text()
