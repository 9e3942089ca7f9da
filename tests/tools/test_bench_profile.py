"""`ds-tsp bench --profile`: every event's self time is charged to one (layer type, phase) cell; a tiny D=2 run of
TSP and a peer carries profiles whose cells are non-negative, fit the step, and agree with TSP's own wait counter."""
import json
from types import SimpleNamespace

import pytest
from local_ranks import forked_ranks

from ds_tsp.tools.bench.cli import main
from ds_tsp.tools.bench.profile import KEYS, attribute, layer_of, nest, phase_of


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    """`ds-tsp bench --profile`, called in-process below, starts its ranks with the package's launcher: they fork
    from the session's pre-imported server instead of each importing torch afresh (tests/helpers/local_ranks.py)."""
    with forked_ranks():
        yield


def test_phase_of_names():
    assert phase_of("aten::mm") == "gemm"
    assert phase_of("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert phase_of("aten::copy_") == "copy"
    assert phase_of("aten::mul") == "elementwise"
    assert phase_of("ds_tsp::comm_wait") == "comm_wait"
    assert phase_of("c10d::allreduce_") == "comm_wait"
    assert phase_of("_TSPAttentionBackward") is None  # autograd Function bookkeeping is "other"


def _event(name, start_us, end_us):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_attribute_charges_each_self_time_once():
    events = [
        _event("autograd::engine::evaluate_function: _TSPAttentionBackward", 0, 100),
        _event("_TSPAttentionBackward", 10, 100),
        _event("aten::mm", 20, 60),
        _event("gloo:all_gather", 55, 150),  # an async collective's span: overlaps, charged nowhere
        _event("ds_tsp::comm_wait", 60, 90),
        _event("_TSPGatedMLP", 110, 135),
        _event("aten::mul", 112, 132),
        _event("Optimizer.step#AdamW.step", 140, 190),
    ]
    totals, cells = attribute(nest(events), wall_s=200e-6)
    assert cells["attention"]["gemm_s"] == pytest.approx(40e-6)
    assert cells["attention"]["comm_wait_s"] == pytest.approx(30e-6)
    assert cells["attention"]["other_s"] == pytest.approx(30e-6)  # 10 + 20 of the two ranges' own time
    assert cells["mlp"]["elementwise_s"] == pytest.approx(20e-6)
    assert cells["mlp"]["other_s"] == pytest.approx(5e-6)
    assert cells["optimizer"]["other_s"] == pytest.approx(50e-6)
    assert cells["rest"]["other_s"] == pytest.approx(25e-6)  # wall outside every top-level range
    assert sum(totals.values()) == pytest.approx(200e-6)
    assert layer_of(None) == "rest"
    gdn = nest([_event("_TSPGatedDeltaNet_autocast_cpu_bfloat16", 0, 10), _event("aten::mm", 1, 2)])
    assert layer_of(gdn[-1]) == layer_of(nest([_event("_TSPGatedDeltaNetBackward", 0, 1)])[0]) == "gdn"


def test_bench_profile_tiny(tmp_path):
    rc = main(["--profile", "--layouts", "tsp,dtensor_tp_sp", "--tsp", "2", "--seq", "64", "--layers", "1",
               "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256", "--steps", "1", "--warmup", "1",
               "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    row = json.loads((tmp_path / "results.json").read_text())
    rows = row["results"] if isinstance(row, dict) else row
    by_layout = {r["layout"]: r for r in rows}
    for r in by_layout.values():
        prof = r["profile"]
        assert all(prof[k] >= 0 for k in KEYS)
        assert prof["gemm_s"] > 0 and prof["attention_s"] > 0
        assert sum(prof[k] for k in KEYS) == pytest.approx(prof["wall_s"], rel=0.02, abs=1e-3)
    tsp = by_layout["tsp"]["profile"]
    layers = tsp["by_layer"]
    assert layers["attention"]["attention_s"] > 0 and layers["mlp"]["gemm_s"] > 0 and layers["vocab"]["gemm_s"] > 0
    assert layers["mlp"]["attention_s"] == 0 and layers["attention"]["comm_wait_s"] > 0
    # the counter times each wait from outside its profiler range (+ entering/leaving it): same waits, a bit more
    assert tsp["blocked_s"] <= tsp["counter_wait_s"] * 1.01 + 1e-3
    assert tsp["counter_wait_s"] <= tsp["blocked_s"] * 1.1 + 2e-3
    # comm_wait also counts posting the collectives
    assert tsp["comm_wait_s"] >= tsp["blocked_s"] * 0.99
    assert "step_s" in by_layout["tsp"] and "comm_bytes" in by_layout["tsp"]  # existing keys kept
    assert "| layer type |" in (tmp_path / "results.md").read_text()
