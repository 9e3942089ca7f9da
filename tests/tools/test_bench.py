"""`ds-tsp bench`: the quick path end to end at tiny shapes, the collective byte counter, reports and failures."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist
from local_ranks import forked_ranks, run_on_local_ranks

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.bench.cli import build_parser
from ds_tsp.tools.bench.comm_count import CollectiveBytes
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.report import PLOTS, markdown_table, write_report
from ds_tsp.tools.bench.runner import run_layout


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    """`ds-tsp bench`, called in-process below, starts its ranks with the package's launcher: they fork
    from the session's pre-imported server instead of each importing torch afresh (tests/helpers/local_ranks.py)."""
    with forked_ranks():
        yield


REQUIRED_KEYS = ("layout", "seq", "tsp", "peak_bytes_per_rank", "comm_bytes", "step_s", "tokens_per_s")
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--vocab", "64"]
MIB = 2 ** 20


def test_quick_end_to_end(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--quick", "--layouts", "tsp,ulysses_zero1", "--tsp", "2", "--seq", "32", "64",
                                      "--steps", "1", "--out", str(out), *TINY])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert [(r["layout"], r["seq"]) for r in results] == [("tsp", 32), ("tsp", 64), ("ulysses_zero1", 32),
                                                         ("ulysses_zero1", 64)]
    for r in results:
        assert r["ok"] and r["error"] is None, r
        assert all(key in r for key in REQUIRED_KEYS), sorted(r)
        assert r["tsp"] == 2 and r["batch"] == 1
        assert 0 < r["peak_bytes_per_rank"] < 512 * MIB, r
        assert r["peak_bytes_per_rank"] >= max(r["peak_bytes_ranks"]) > 0
        assert sum(r["peak_breakdown"].values()) == pytest.approx(r["peak_bytes_per_rank"], rel=0.01)
        assert r["peak_breakdown"]["params"] > 0
        assert r["comm_bytes"] > 0 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["seq"] / r["step_s"])
        assert r["cpu_s_per_step"] > 0
        assert 2.0 < r["loss"] < 8.0  # ~ln(64) = 4.16 at init
    tsp = {r["seq"]: r for r in results if r["layout"] == "tsp"}
    for r in tsp.values():
        # TSP's own counter and the dispatcher-level counter see the same collectives
        assert r["comm_bytes"] == r["comm_bytes_c10d"], r
        assert 0.0 <= r["exposed_comm_fraction"] <= 1.0
        assert r["peak_breakdown"]["optimizer"] > 0 or r["state_breakdown"]["optimizer"] > 0
        # the exposed seconds per collective add up to the exposed total (one timed step: its median is its mean)
        waits = r["exposed_by_collective"]
        assert sum(w["mean_s"] for w in waits.values()) == pytest.approx(r["exposed_comm_s"], rel=1e-9, abs=1e-12)
        assert all(0 <= w["mean_s"] <= w["max_s"] for w in waits.values())
        assert not any(c.isdigit() for label in waits for c in label), list(waits)  # numbers written #
        assert {"broadcast: shard of block #", "ring: weight hop #/#", "ring: grad hop #/#"} <= set(waits), list(waits)
        assert [w["mean_s"] for w in waits.values()] == sorted((w["mean_s"] for w in waits.values()), reverse=True)
    # K/V gathers grow with S, weight traffic does not
    assert tsp[64]["comm_by_op"]["all_gather"] > tsp[32]["comm_by_op"]["all_gather"]
    assert tsp[64]["comm_by_op"]["ring"] == tsp[32]["comm_by_op"]["ring"]

    table = (out / "results.md").read_text()
    assert "| tsp | 64 |" in table and "| ulysses_zero1 | 32 |" in table
    waits = table.split("## Where TSP waits", 1)[1]
    assert "| tsp | 64 | 2 |" in waits and "ulysses_zero1" not in waits  # TSP's rows only
    if importlib.util.find_spec("matplotlib") is None:  # plots are optional (ds_tsp[bench]); the table says so
        assert "No plots: matplotlib is not installed" in table
    else:
        for name in PLOTS:
            assert (out / name).stat().st_size > 1000, name


def test_failing_layout_is_reported_not_raised():
    pytest.importorskip("transformers")
    shape = ModelShape(vocab_size=63, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=2)
    [result] = run_layout(BenchConfig(layout="dtensor_tp_sp", seqs=(32,), tsp=2, shape=shape, steps=1, warmup=0),
                          timeout_s=120)
    assert result["ok"] is False and result["layout"] == "dtensor_tp_sp" and result["seq"] == 32
    assert "divisible" in result["error"]
    assert result["peak_bytes_per_rank"] is None and result["tokens_per_s"] is None


def _count_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1000)  # 4000 bytes
    with CollectiveBytes() as counter:
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        dist.all_gather_into_tensor(torch.empty(world * 1000), x)
        dist.reduce_scatter_tensor(torch.empty(1000), torch.ones(world * 1000))
        dist.all_to_all_single(torch.empty(1000), torch.ones(1000))
        send = dist.isend(x, dst=(rank + 1) % world)
        dist.irecv(torch.empty(1000), src=(rank - 1) % world).wait()
        send.wait()
        torch.mm(x[None], x[:, None])  # compute is not counted
    return rank, counter.snapshot()


def test_collective_bytes_follow_the_logical_convention():
    for rank, snap in run_on_local_ranks(_count_collectives, 2, timeout_s=120):
        share = 4000 // 2  # (D-1)/D of 4000 bytes
        assert snap["bytes"]["all_reduce"] == 2 * share
        assert snap["bytes"]["broadcast"] == (0 if rank == 0 else 4000)  # received, not sent, by the root
        assert snap["bytes"]["all_gather"] == share * 2  # (D-1)/D of the 8000-byte output
        assert snap["bytes"]["reduce_scatter"] == share * 2  # (D-1)/D of the 8000-byte input
        assert snap["bytes"]["all_to_all"] == share
        assert snap["bytes"]["send"] == 4000 and snap["bytes"]["recv"] == 0
        assert sum(snap["calls"].values()) == 7


def test_report_writes_table_plots_and_failures(tmp_path):
    pytest.importorskip("matplotlib")
    breakdown = {"params": MIB, "grads": 0, "optimizer": 2 * MIB, "activations": 3 * MIB, "temporaries": 0,
                 "other": 0}
    results = [{"layout": layout, "title": layout, "ok": True, "seq": seq, "tsp": 4,
                "peak_bytes_per_rank": 6 * MIB * seq // 512, "peak_breakdown": breakdown, "comm_bytes": MIB,
                "step_s": 0.5, "tokens_per_s": seq / 0.5,
                "exposed_comm_fraction": 0.25 if layout == "tsp" else None}
               for layout in ("tsp", "ulysses_zero3") for seq in (512, 1024)]
    results.append({"layout": "autotp_zero1", "title": "AutoTP", "ok": False, "seq": 512, "tsp": 4,
                    "error": "Traceback ...\nValueError: boom", "peak_bytes_per_rank": None})
    paths = write_report(results, str(tmp_path), {"tsp": 4, "batch": 1, "shape": {}, "steps": 2, "warmup": 1})
    with open(paths["json"]) as f:
        assert json.load(f)[0]["layout"] == "tsp"
    with open(paths["md"]) as f:
        table = f.read()
    assert "| tsp | 1024 | 4 | 12.0 | 1.0 | 0.0 | 2.0 | 3.0 |" in table and "| 25% |" in table
    assert "autotp_zero1 S=512: FAILED: ValueError: boom" in table
    assert sorted(os.path.basename(p) for p in paths["plots"]) == sorted(PLOTS)
    assert "| tsp | 512 |" in markdown_table(results)


def test_report_of_several_degrees_labels_each_series(tmp_path):
    from ds_tsp.tools.bench.report import _series

    rows = [{"layout": "tsp", "title": "TSP", "ok": True, "seq": 64, "tsp": d, "peak_bytes_per_rank": MIB // d,
             "step_s": 1.0, "tokens_per_s": 64.0} for d in (2, 4)]
    assert list(_series(rows).values()) == ["TSP D=2", "TSP D=4"]
    assert list(_series(rows[:1]).values()) == ["TSP"]  # one degree: no D in the label
    table = markdown_table(rows)
    assert "| tsp | 64 | 2 | 0.5 |" in table and "| tsp | 64 | 4 | 0.2 |" in table


def test_report_without_matplotlib_still_writes_json_and_table(tmp_path, monkeypatch):
    from ds_tsp.tools.bench import report

    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "write_plots", no_matplotlib)
    paths = report.write_report([{"layout": "tsp", "ok": True, "seq": 64, "peak_bytes_per_rank": MIB}], str(tmp_path))
    assert paths["plots"] == [] and os.path.exists(paths["json"])
    with open(paths["md"]) as f:
        assert "pip install 'ds_tsp[bench]'" in f.read()


def test_flags_map_to_configs():
    from ds_tsp.tools.bench.cli import configs_from_args
    from ds_tsp.tools.bench.common import tsp_options

    quick = configs_from_args(build_parser().parse_args(["--quick"]))
    assert [c.layout for c in quick] == ["single", "tsp", "tsp_speed", "dtensor_tp_sp", "ulysses_zero3",
                                         "ulysses_zero1", "autotp_zero1"]
    assert {(c.seqs, c.steps, c.shape.num_layers, c.tsp) for c in quick} == {((512, 1024), 2, 2, 4)}
    peers = configs_from_args(build_parser().parse_args(["--activation-checkpointing", "--seq", "64,32"]))
    assert {c.layout: c.checkpointing() for c in peers}["tsp"] is False
    assert {c.layout: c.checkpointing() for c in peers}["ulysses_zero3"] is True
    assert peers[0].seqs == (32, 64) and peers[0].shape.num_layers == 4
    degrees = configs_from_args(build_parser().parse_args(["--tsp", "2", "4", "--layouts",
                                                           "single,tsp,ulysses_zero1"]))
    assert [(c.tsp, c.layout) for c in degrees] == [(2, "single"), (2, "tsp"), (2, "ulysses_zero1"), (4, "tsp"),
                                                     (4, "ulysses_zero1")]  # single device measured once
    every = configs_from_args(build_parser().parse_args(["--activation-checkpointing", "all", "--layouts", "tsp"]))
    assert every[0].checkpointing() is True
    assert tsp_options("speed", False).keep_gathered_kv and not tsp_options("memory", False).keep_gathered_kv
    # the schedule between them runs when named (never in "all"): projections kept, K/V re-gathered
    kept = tsp_options("projections", False)
    assert not kept.recompute_projections and not kept.keep_gathered_kv
    assert tsp_options("memory", False).recompute_projections
    with pytest.raises(ValueError, match="'speeed'.*'memory', 'projections', 'speed'"):
        tsp_options("speeed", False)  # a mode the bench does not know is no silent speed mode
    named = configs_from_args(build_parser().parse_args(["--layouts", "tsp,tsp_kept_projections", "--tsp", "2"]))
    assert [c.layout for c in named] == ["tsp", "tsp_kept_projections"]
    assert "tsp_kept_projections" not in {c.layout for c in configs_from_args(build_parser().parse_args([]))}


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "tsp,nope"], "unknown ['nope']"),
    (["--seq", "100", "--tsp", "4"], "multiple of 2*--tsp=8"),
    (["--seq", "12", "--tsp", "2", "4"], "multiple of 2*--tsp=8"),
    (["--heads", "6", "--tsp", "4"], "num_heads=6"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys, tmp_path):
    args = build_parser().parse_args([*argv, "--out", str(tmp_path)])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# --- mixture of experts (ds_tsp.tools.bench.moe_report) --------------------------------------------------------------
MOE_TINY = [*TINY, "--heads", "4", "--layers", "2", "--num-experts", "4", "--top-k", "2", "--moe-ffn", "16"]


def test_moe_flags_map_to_one_config_per_schedule():
    from ds_tsp.tools.bench.cli import configs_from_args

    configs = configs_from_args(build_parser().parse_args([*MOE_TINY, "--moe-dispatch", "ring,all_to_all",
                                                           "--tsp", "2", "4"]))
    assert [(c.tsp, c.layout, c.moe_dispatch) for c in configs] == [
        (2, "tsp", "ring"), (2, "tsp", "all_to_all"), (2, "tsp_speed", "ring"), (2, "tsp_speed", "all_to_all"),
        (4, "tsp", "ring"), (4, "tsp", "all_to_all"), (4, "tsp_speed", "ring"), (4, "tsp_speed", "all_to_all")]
    shape = configs[0].shape
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (4, 2, 16)
    assert all(shape.is_moe_layer(i) for i in range(2)) and configs[0].label == "tsp[ring]"


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "tsp,ulysses_zero1"], "TSP layouts only"),
    (["--moe-dispatch", "ring,nope"], "unknown ['nope']"),
    (["--num-experts", "3", "--tsp", "2"], "num_experts=3"),
])
def test_bad_moe_flags_exit_2(argv, message, capsys, tmp_path):
    args = build_parser().parse_args([*MOE_TINY, "--seq", "32", "--tsp", "2", *argv, "--out", str(tmp_path)])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_moe_flags_need_experts(capsys, tmp_path):
    args = build_parser().parse_args([*TINY, "--top-k", "2", "--out", str(tmp_path)])
    assert args.run(args) == 2 and "--top-k: only with --num-experts" in capsys.readouterr().err


def test_moe_cell_per_schedule_runs_and_reports_the_auto_choice(tmp_path, capsys):
    out = tmp_path / "moe"
    args = build_parser().parse_args([*MOE_TINY, "--layouts", "tsp", "--moe-dispatch", "ring,all_to_all", "--tsp",
                                      "2", "--seq", "32", "--steps", "1", "--warmup", "0", "--out", str(out),
                                      "--quiet", "--profile"])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    results = json.loads((out / "results.json").read_text())
    for r in results:  # --profile's work against the minimum (ds_tsp.tools.bench.work), the whole group's
        moe = r["profile"]["work"]["moe"]
        # expert GEMMs: forward + backward + the memory-optimal gate/up recompute (22/18), exactly
        assert moe["gemm_flops"] * 18 == moe["min_gemm_flops"] * 22 == 22 * 18 * 2 * 32 * 2 * 32 * 16
    # the ring moves exactly 3(D - 1) packed expert shards per layer and rank; all_to_all its real rows (the
    # minimum takes them at even routing)
    assert results[0]["profile"]["work"]["moe"]["bytes_over_min"] == 1.0
    assert 0.5 < results[1]["profile"]["work"]["moe"]["bytes_over_min"] < 1.5
    assert "work per layer type against the minimum" in (out / "results.md").read_text()
    assert [(r["label"], r["moe_dispatch"], r["ok"]) for r in results] == [("tsp[ring]", "ring", True),
                                                                           ("tsp[all_to_all]", "all_to_all", True)]
    assert results[0]["tsp_options"]["moe_dispatch"] == "ring"
    rows = json.loads((out / "moe.json").read_text())
    assert {r["schedule"] for r in rows} == {"ring", "all_to_all"}
    # 16 local tokens: all_to_all sends fewer bytes per layer, so the plan's auto picks it
    assert {r["plan_auto"] for r in rows} == {"all_to_all"}
    assert {r["measured_faster"] for r in rows} <= {"ring", "all_to_all"}
    assert all(isinstance(r[key], bool) for r in rows for key in ("auto_within_10pct", "auto_within_10pct_cpu"))
    ring = next(r for r in rows if r["schedule"] == "ring")
    # the ring's bytes are routing-free; the plan's are the busiest rank's per kind (every rank's on CUDA), and on
    # CPU tensors the causal K/V exchange sends less on every rank but one per kind (exact per rank:
    # tests/tools/test_plan_moe.py)
    assert 0.9 * ring["plan_comm_bytes_per_step"] < ring["comm_bytes_per_step"] <= ring["plan_comm_bytes_per_step"]
    assert "plan's auto" in (out / "results.md").read_text()


def test_hf_config_gives_the_shape_moe_included(tmp_path):
    """`--hf-config` (the flag `ds-tsp plan` has too) takes the whole shape from a config.json transformers wrote,
    MoE fields and dense/sparse layers included; --layers cuts it; an explicit shape flag beside it is refused."""
    import pytest
    from transformers import Qwen3MoeConfig

    from ds_tsp.tools.bench.cli import configs_from_args

    Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                   mlp_only_layers=[0]).save_pretrained(tmp_path)
    argv = ["--hf-config", str(tmp_path), "--layouts", "tsp", "--tsp", "2", "--seq", "64"]
    full, = configs_from_args(build_parser().parse_args(argv))
    assert (full.shape.num_layers, full.shape.num_experts, full.shape.num_experts_per_tok) == (4, 8, 2)
    assert [full.shape.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (full.shape.hidden_size, full.shape.vocab_size, full.shape.moe_intermediate_size) == (32, 128, 16)
    cut, = configs_from_args(build_parser().parse_args(argv + ["--layers", "2"]))
    assert cut.shape.num_layers == 2 and [cut.shape.is_moe_layer(i) for i in range(2)] == [False, True]
    with pytest.raises(ValueError, match="--hidden: the shape comes from --hf-config"):
        configs_from_args(build_parser().parse_args(argv + ["--hidden", "64"]))
