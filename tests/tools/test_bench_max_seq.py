"""`ds-tsp bench --max-seq`: the search itself (pure) and one tiny end-to-end run whose answer is checked against
its own measurements: max_seq fits the budget, the next probe does not."""
from __future__ import annotations

import json

import pytest
from local_ranks import forked_ranks

from ds_tsp.tools.bench.cli import build_parser
from ds_tsp.tools.bench.max_seq import search


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    """`ds-tsp bench --max-seq`, called in-process below, starts its ranks with the package's launcher: they fork
    from the session's pre-imported server instead of each importing torch afresh (tests/helpers/local_ranks.py)."""
    with forked_ranks():
        yield


TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--vocab", "64"]
REQUIRED_KEYS = ("layout", "seq", "tsp", "peak_bytes_per_rank", "comm_bytes", "step_s", "tokens_per_s")


def test_search_doubles_then_bisects_to_tolerance():
    probed = []

    def fits(seq):
        probed.append(seq)
        return seq <= 1000

    best, first_fail = search(fits, start=64, step=8)
    assert probed[:5] == [64, 128, 256, 512, 1024]
    assert best <= 1000 < first_fail and first_fail - best <= max(8, 0.05 * best)
    assert all(s % 8 == 0 for s in probed)
    assert search(lambda s: False, start=64, step=8) == (None, 8)  # halved down to one step, none fit
    probed.clear()
    best, first_fail = search(fits, start=4096, step=8)  # the start is over: halve, then bisect
    assert probed[:3] == [4096, 2048, 1024] and best <= 1000 < first_fail <= best * 1.05 + 8
    assert search(lambda s: True, start=64, step=8, limit=256) == (256, None)


def test_max_seq_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    budget_mib = 1
    args = build_parser().parse_args(["--max-seq", "--budget-mib", str(budget_mib), "--layouts", "tsp", "--tsp", "1",
                                      "2", "--timeout", "120", "--quiet", "--out", str(out), *TINY])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [(r["layout"], r["tsp"], r["activation_checkpointing"]) for r in rows] == [
        ("tsp", 1, False), ("tsp", 1, True), ("tsp", 2, False), ("tsp", 2, True)]
    budget = budget_mib * 2 ** 20
    for r in rows:
        assert r["ok"] and all(key in r for key in REQUIRED_KEYS), r
        assert r["budget_bytes"] == budget and r["seq"] == r["max_seq"] and r["max_seq"] % (2 * r["tsp"]) == 0
        assert r["peak_bytes_per_rank"] <= budget
        assert r["next_probe_seq"] > r["max_seq"] and r["next_probe_peak_bytes"] > budget
        assert r["next_probe_seq"] - r["max_seq"] <= max(2 * r["tsp"], 0.05 * r["max_seq"])
    by_degree = {(r["tsp"], r["activation_checkpointing"]): r["max_seq"] for r in rows}
    assert by_degree[2, False] > by_degree[1, False] and by_degree[2, True] > by_degree[1, True]  # 1/D per rank
    assert (out / "max_seq_vs_d.png").exists()
    assert "max S" in (out / "results.md").read_text()


def test_max_seq_needs_budget(capsys):
    args = build_parser().parse_args(["--max-seq", "--layouts", "tsp", *TINY])
    assert args.run(args) == 2
    assert "--budget-mib" in capsys.readouterr().err
