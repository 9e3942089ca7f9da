"""examples/demo_train.py: the loss goes down and every rank reports its peak-memory breakdown."""
from __future__ import annotations

import json

from demo_run import DEMO_TSP2, readme_command_output


def test_demo_trains_and_reports_memory():
    # The README's command as written (30 steps), run once for this test and tests/meta/test_doc_figures.py; a non-zero
    # exit raises with the demo's stderr.
    records = [json.loads(line) for line in readme_command_output(DEMO_TSP2)]

    config = next(r for r in records if "config" in r)
    tsp = config["config"]["tsp"]
    assert tsp == 2 and config["params_per_rank"] < 0.51 * config["params_full"]  # 1/D of the weights (+ norms)

    losses = [r["loss"] for r in records if "step" in r]
    assert len(losses) == config["config"]["steps"] == 30
    summary = next(r["summary"] for r in records if "summary" in r)
    assert summary["decreased"] is True and losses[-1] < losses[0]
    assert summary["loss_first"] == losses[0] and summary["loss_last"] == losses[-1]

    memory = [r["memory"] for r in records if "memory" in r]
    assert [m["rank"] for m in memory] == list(range(tsp))
    param_mib = config["params_per_rank"] * 4 / 2 ** 20  # float32
    for m in memory:
        peak = m["peak_mib"]
        assert set(peak) >= {"PARAM", "GRAD", "OPT", "ACT", "TEMP", "total"}
        assert abs(peak["PARAM"] - param_mib) < 0.01, peak
        assert peak["ACT"] > 0 and peak["total"] >= peak["PARAM"] + peak["ACT"]
