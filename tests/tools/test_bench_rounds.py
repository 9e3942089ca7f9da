"""`ds-tsp bench --rounds N`: the layouts run in turn N times and the rounds fold into one result per (layout, seq)
(ds_tsp.tools.bench.rounds). Synthetic results, no process groups: the merge's figures, the round-by-round ratios,
failures, the run order, and the flag's refusal with --max-seq."""
from __future__ import annotations

import statistics

import pytest

from ds_tsp.tools.bench import runner
from ds_tsp.tools.bench.cli import build_parser
from ds_tsp.tools.bench.rounds import merge_rounds, rounds_table


def _result(index, layout, seq, steps, cpu, tokens=1024, ok=True):
    out = {"layout": layout, "seq": seq, "tsp": 2, "ok": ok, "config_index": index, "tokens_per_step": tokens,
           "step_s_per_step": steps, "step_s": statistics.median(steps),
           "tokens_per_s": tokens / statistics.median(steps),
           "cpu_s_per_step": cpu, "peak_bytes_per_rank": 100 + index, "loadavg_before_after": [1.0, 1.5],
           "group_wall_s": 3.0}
    return out if ok else {**out, "error": "boom"}


ROUND_1 = [_result(0, "tsp", 512, [1.0, 1.2, 1.1], 2.0), _result(1, "ulysses_zero1", 512, [2.0, 2.2, 2.4], 4.0)]
ROUND_2 = [_result(0, "tsp", 512, [1.5, 1.6, 1.7], 3.0), _result(1, "ulysses_zero1", 512, [1.5, 1.5, 1.6], 3.5)]


def test_rounds_fold_into_one_result_per_layout_and_length():
    tsp, peer = merge_rounds([ROUND_1, ROUND_2])
    assert tsp["step_s_per_step"] == [1.0, 1.2, 1.1, 1.5, 1.6, 1.7]
    assert tsp["step_s"] == pytest.approx(statistics.median([1.0, 1.2, 1.1, 1.5, 1.6, 1.7]))  # 1.35
    assert tsp["tokens_per_s"] == pytest.approx(1024 / 1.35)
    assert tsp["cpu_s_per_step"] == 2.5 and tsp["tokens_per_cpu_s"] == pytest.approx(1024 / 2.5)
    assert [r["step_s"] for r in tsp["rounds"]] == [1.1, 1.6]
    assert tsp["peak_bytes_per_rank"] == 100 and peer["peak_bytes_per_rank"] == 101  # memory: the first round's
    assert peer["step_s"] == pytest.approx(1.8)
    assert merge_rounds([ROUND_1]) == ROUND_1  # one round: unchanged


def test_rounds_table_gives_the_first_layouts_ratio_round_by_round():
    table = rounds_table(merge_rounds([ROUND_1, ROUND_2]))
    peer_row = next(line for line in table.splitlines() if line.startswith("| ulysses_zero1"))
    # round 1: (1024 / 1.1) / (1024 / 2.2) = 2.00; round 2: 1.5 / 1.6 = 0.94; median of two: 1.47
    assert "| 1.47x (0.94 - 2.00) |" in peer_row, peer_row
    assert f"{1024 / 2.2:.0f}, {1024 / 1.5:.0f}" in peer_row
    tsp_row = next(line for line in table.splitlines() if line.startswith("| tsp "))
    assert tsp_row.endswith("| tsp | - |")
    assert rounds_table(ROUND_1) == ""


def test_a_failure_in_any_round_is_the_result():
    failed = [ROUND_2[0], _result(1, "ulysses_zero1", 512, [9.0], 9.0, ok=False)]
    tsp, peer = merge_rounds([ROUND_1, failed])
    assert tsp["ok"] and len(tsp["rounds"]) == 2
    assert not peer["ok"] and peer["error"] == "boom"
    missing = merge_rounds([ROUND_1, ROUND_2[:1]])[1]  # the group failed before this length in round 2
    assert not missing["ok"] and "missing in a round" in missing["error"]


def test_layouts_run_in_turn_each_round(monkeypatch):
    calls = []

    def fake_run_layout(cfg, *, timeout_s, progress_queue=None):
        calls.append(cfg.layout)
        steps = [1.0] if cfg.layout == "tsp" else [2.0]
        return [_result(0, cfg.layout, 512, steps, 1.0)]

    monkeypatch.setattr(runner, "run_layout", fake_run_layout)
    args = build_parser().parse_args(["--layouts", "tsp,ulysses_zero1", "--seq", "512", "--tsp", "2",
                                      "--layers", "1"])
    from ds_tsp.tools.bench.cli import _model_defaults, configs_from_args

    _model_defaults(args)
    results = runner.run_layouts(configs_from_args(args), timeout_s=10, rounds=3)
    assert calls == ["tsp", "ulysses_zero1"] * 3
    assert [r["layout"] for r in results] == ["tsp", "ulysses_zero1"]
    assert [len(r["rounds"]) for r in results] == [3, 3]


@pytest.mark.parametrize("flags", [["--max-seq", "--budget-mib", "64", "--layouts", "tsp"], ["--layer-memory"]])
def test_rounds_are_refused_where_nothing_is_timed(capsys, flags):
    args = build_parser().parse_args([*flags, "--rounds", "2"])
    assert args.run(args) == 2
    assert "--rounds" in capsys.readouterr().err
