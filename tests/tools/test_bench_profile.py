"""`ds-tsp bench --profile`: every event's self time is charged to one (layer type, phase) cell; a tiny D=2 run of
TSP and a peer carries profiles whose cells are non-negative, fit the step, and agree with TSP's own wait counter."""
import json
from types import SimpleNamespace

import pytest
from local_ranks import forked_ranks

from ds_tsp.tools.bench.cli import main
from ds_tsp.tools.bench.profile import KEYS, attribute, layer_of, nest, op_seconds_by_layer, phase_of, top_ops_table


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


def test_op_seconds_by_layer_names_each_layer_types_ops_by_self_time():
    events = [
        _event("_TSPAttentionBackward", 0, 100),
        _event("aten::mm", 10, 50),
        _event("aten::mul", 50, 60),
        _event("aten::copy_", 52, 56),  # inside the mul: the mul's self time is 6, the copy's 4
        _event("aten::mm", 70, 80),
        _event("_TSPGatedMLP", 110, 135),
        _event("aten::mul", 112, 132),
        _event("aten::add", 140, 143),  # outside every layer: rest
    ]
    by_layer = op_seconds_by_layer(nest(events))
    assert by_layer["attention"] == pytest.approx({"aten::mm": 50e-6, "aten::mul": 6e-6, "aten::copy_": 4e-6})
    assert by_layer["mlp"] == pytest.approx({"aten::mul": 20e-6})
    assert by_layer["rest"] == pytest.approx({"aten::add": 3e-6})
    row = {"layout": "tsp", "seq": 64, "tsp": 2, "profile": {"top_ops_by_layer": {
        "attention": [["aten::mm", 1.25], ["aten::mul", 0.5]]}}}
    assert "| tsp | 64 | 2 | attention | mm 1.250, mul 0.500 |" in top_ops_table([row])
    assert top_ops_table([{"layout": "tsp", "seq": 64}]) == ""


def _profiled_tiny_run(out) -> dict:
    rc = main(["--profile", "--layouts", "tsp,dtensor_tp_sp", "--tsp", "2", "--seq", "64", "--layers", "1",
               "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256", "--steps", "1", "--warmup", "1",
               "--quiet", "--out", str(out)])
    assert rc == 0
    row = json.loads((out / "results.json").read_text())
    rows = row["results"] if isinstance(row, dict) else row
    return {r["layout"]: r for r in rows}


def _counter_within_the_profiled_waits(tsp: dict) -> bool:
    """The counter times each wait from outside its profiler range (+ entering/leaving it): the same waits, a bit
    more."""
    return tsp["blocked_s"] <= tsp["counter_wait_s"] * 1.01 + 1e-3 and \
        tsp["counter_wait_s"] <= tsp["blocked_s"] * 1.1 + 2e-3


def test_bench_profile_tiny(tmp_path):
    by_layout = _profiled_tiny_run(tmp_path)
    for r in by_layout.values():
        prof = r["profile"]
        assert all(prof[k] >= 0 for k in KEYS)
        assert prof["gemm_s"] > 0 and prof["attention_s"] > 0
        assert sum(prof[k] for k in KEYS) == pytest.approx(prof["wall_s"], rel=0.02, abs=1e-3)
    tsp = by_layout["tsp"]["profile"]
    layers = tsp["by_layer"]
    assert layers["attention"]["attention_s"] > 0 and layers["mlp"]["gemm_s"] > 0 and layers["vocab"]["gemm_s"] > 0
    assert layers["mlp"]["attention_s"] == 0 and layers["attention"]["comm_wait_s"] > 0
    # comm_wait also counts posting the collectives
    assert tsp["comm_wait_s"] >= tsp["blocked_s"] * 0.99
    assert "step_s" in by_layout["tsp"] and "comm_bytes" in by_layout["tsp"]  # existing keys kept
    md = (tmp_path / "results.md").read_text()
    assert "| layer type |" in md and "| ops by self seconds |" in md
    for layer, ops in tsp["top_ops_by_layer"].items():  # the layer's busiest aten ops, within its seconds
        seconds = [s for _, s in ops]
        assert ops and all(name.startswith("aten::") for name, _ in ops) and seconds == sorted(seconds, reverse=True)
        assert sum(seconds) <= sum(layers[layer].values()) * 1.01 + 1e-4, layer
    # A time cross-check: one loaded full-suite run measured the counter 5.8 ms over the bound (22.8 ms against
    # 17.0 ms profiled). A wait missing from the profile shows in every run: a run over the bound is profiled once
    # more, and the test fails only if that run is over it too.
    if not _counter_within_the_profiled_waits(tsp):
        (tmp_path / "again").mkdir()
        tsp = _profiled_tiny_run(tmp_path / "again")["tsp"]["profile"]
    assert _counter_within_the_profiled_waits(tsp), (tsp["blocked_s"], tsp["counter_wait_s"])


def test_counted_work_charges_gemm_flops_and_the_counters_marks_to_layer_types():
    """GEMM FLOPs from the recorded shapes (FlopCounterMode's formulas, in-place addmm_ too) and the counters'
    zero-length marks (bytes of the TSP group and of the cp axis, cp waits), each to its enclosing layer type."""
    from ds_tsp.tools.bench.profile import counted_work

    def op(name, start, end, shapes=None):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), input_shapes=shapes)

    events = [op("MoERingBackward", 0, 100), op("aten::mm", 10, 20, [[4, 8], [8, 16]]),
              op("ds_tsp::counted_bytes[tsp]=1000", 30, 30), op("ds_tsp::counted_wait[tsp]=0.5", 31, 31),
              op("_TSPAttention", 100, 200), op("aten::addmm_", 110, 120, [[4, 16], [4, 8], [8, 16]]),
              op("ds_tsp::counted_bytes[cp]=24", 130, 130), op("ds_tsp::counted_wait[cp]=0.25", 131, 131),
              op("aten::linear", 140, 160, [[4, 8], [16, 8], []]), op("aten::mm", 141, 159, [[4, 8], [8, 16]])]
    work = counted_work(nest(events))
    assert work["moe"] == {"gemm_flops": 2 * 4 * 8 * 16, "comm_bytes": 1000, "cp_bytes": 0, "cp_wait_s": 0.0}
    assert work["attention"] == {"gemm_flops": 2 * 2 * 4 * 8 * 16, "comm_bytes": 0, "cp_bytes": 24,
                                 "cp_wait_s": 0.25}  # the linear is counted once, at its mm


def test_marked_counters_count_as_before_and_mark_inside_the_open_layer():
    """_marked_counters leaves the counters' own figures unchanged and restores their class; in between every add
    and wait shows as a mark nested in the range open at the time (a cp counter's under its own axis)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from ds_tsp.core.comm.communicator import CommCounter
    from ds_tsp.core.reliability.stall_message import Blocked
    from ds_tsp.tools.bench.profile import _marked_counters, counted_work

    counters = SimpleNamespace(tsp=CommCounter(), cp=CommCounter())
    with _marked_counters(counters), profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("MoEAllToAll"):
            counters.tsp.add("all_to_all", 4096)
            counters.tsp.add_wait(0.125, Blocked(None, "all_to_all", ("group",), "rows of step 3"))
        with record_function("_TSPGatedDeltaNet"):
            counters.cp.add("all_gather", 512)
            counters.cp.add_wait(0.25, None)
    assert type(counters.tsp) is type(counters.cp) is CommCounter
    assert counters.tsp.snapshot() == {"bytes": {"all_to_all": 4096}, "calls": {"all_to_all": 1},
                                       "total_bytes": 4096, "wait_s": 0.125,
                                       "wait_by": {"all_to_all: rows of step #": 0.125}}
    assert counters.cp.total_bytes == 512 and counters.cp.wait_s == 0.25
    work = counted_work(nest(prof.events()))
    assert (work["moe"]["comm_bytes"], work["moe"]["cp_wait_s"]) == (4096, 0.0)
    assert (work["gdn"]["cp_bytes"], work["gdn"]["cp_wait_s"]) == (512, 0.25)
