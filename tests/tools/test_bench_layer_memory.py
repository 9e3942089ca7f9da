"""`ds-tsp bench --layer-memory`: the saved-tensor ledger, real vs fake agreement, and saved bytes vs the design.

Expectations:
- test_ledger_*: the instrument's accounting itself (dedupe by storage, names, owners): holds on any code.
- test_fake_matches_real_at_a_tiny_shape: the --fake run (FakeTensorMode + fake process group, used for the 7B
  layer) sees exactly the saved bytes of a real gloo run; holds on any code.
- test_saved_bytes_are_the_design_minimum / _match_the_plan: the AFTER target. Before the fused RMSNorm (HF-style
  RMSNorm under autograd: fp32 copy of the input + normalised output) the layer kept 1.80x the minimum in bf16
  (288.5 MiB vs 160.5 MiB for the 7B layer at S=8192, D=2) and these failed; with the fused RMSNorm Function
  (input + rstd) they pass.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from local_ranks import forked_ranks, run_on_local_ranks

from ds_tsp.tools.bench.layer_memory import LayerMemoryConfig, SavedLedger, measure_rank, minimum_saved, plan_layer


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    """`ds-tsp bench --layer-memory`, called in-process below, starts its ranks with the package's launcher: they fork
    from the session's pre-imported server instead of each importing torch afresh (tests/helpers/local_ranks.py)."""
    with forked_ranks():
        yield


# h=64, 4 heads (d=16), SwiGLU 96: a few seconds per run on 2 cores
TINY = dict(hidden=64, heads=4, ffn=96, seq=64)


def test_ledger_counts_views_of_one_storage_once_and_names_savers():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8))
    with SavedLedger() as ledger:
        e = x.exp()  # saves its result
        y = (e.view(2, 16) * 2).sum() + (e[1:] * e[1:]).sum()  # e[1:]: a view of e's storage, saved by mul
        z = x @ w  # saves x and w
    ledger.mark("parameter", [w])
    ledger.mark("input", [x])
    ledger.name_savers(y, z)
    by_size = {(tuple(map(tuple, en["shapes"])), en["owner"]): en for en in ledger.entries}
    exp_entry = [en for en in ledger.entries if [4, 8] in en["shapes"] and en["owner"] is None]
    assert len(exp_entry) == 1 and exp_entry[0]["bytes"] == 4 * 8 * 4, ledger.entries
    assert "ExpBackward0" in exp_entry[0]["savers"] and "MulBackward0" in exp_entry[0]["savers"]
    owners = sorted(en["owner"] for en in ledger.entries if en["owner"])
    assert owners == ["input", "parameter"], by_size
    assert sum(en["bytes"] for en in ledger.entries) == 4 * 8 * 4 * 2 + 8 * 8 * 4  # e, x, w: each once


def _fake_in_fresh_process(configs: list[LayerMemoryConfig]) -> list[list[dict]]:
    """run_fake needs a process with no process group: a test before may have left one up."""
    code = ("import json, sys; from ds_tsp.tools.bench.layer_memory import LayerMemoryConfig, run_fake; "
            "print(json.dumps([run_fake(LayerMemoryConfig(**c)) for c in json.loads(sys.argv[1])]))")
    arg = json.dumps([{**c.__dict__, "fake": True} for c in configs])
    out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fake_runs() -> dict:
    configs = {(D, dtype): LayerMemoryConfig(**TINY, tsp=D, dtype=dtype) for D in (1, 2) for dtype in ("bf16", "fp32")}
    return dict(zip(configs, _fake_in_fresh_process(list(configs.values()))))


def _peak_mismatches(real: list[dict], fake: list[dict]) -> list[tuple]:
    """(rank, module, key, real, fake) of every module peak where the two differ by more than 256 B."""
    out = []
    for r_real, r_fake in zip(real, fake):
        for module, peaks in r_real["peaks"].items():
            assert peaks.keys() == r_fake["peaks"][module].keys(), module
            out += [(r_real["rank"], module, key, value, r_fake["peaks"][module][key]) for key, value in peaks.items()
                    if abs(value - r_fake["peaks"][module][key]) > 256]
    return out


def test_fake_matches_real_at_a_tiny_shape(fake_runs):
    cfg = LayerMemoryConfig(**TINY, tsp=2, dtype="bf16")
    fake = fake_runs[(2, "bf16")]
    real = run_on_local_ranks(measure_rank, 2, cfg, timeout_s=240)
    for r_real, r_fake in zip(real, fake):
        assert r_real["saved_bytes"] == r_fake["saved_bytes"] > 0
        assert sorted(e["bytes"] for e in r_real["saved"]) == sorted(e["bytes"] for e in r_fake["saved"])
    # Peaks to 256 B. Alone the two are equal; two loaded full-suite runs each measured ONE real module peak off
    # by one small tensor (the attention's forward 128 B below the fake, the layer's backward 4,096 B above: one
    # [L, h] bf16 tensor freed later), the cause not found. A modelling difference shows in every run: a peak that
    # differs is measured once more, and the test fails only if it differs again.
    if _peak_mismatches(real, fake):
        real = run_on_local_ranks(measure_rank, 2, cfg, timeout_s=240)
    assert not _peak_mismatches(real, fake)


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_saved_bytes_are_the_design_minimum(fake_runs, D, dtype):
    """AFTER target (fails with the unfused HF-style norm; see the module docstring): within 10% of the minimum."""
    cfg = LayerMemoryConfig(**TINY, tsp=D, dtype=dtype)
    minimum = sum(b for _, b in minimum_saved(cfg))
    for rank in fake_runs[(D, dtype)]:
        assert abs(rank["saved_bytes"] - minimum) <= 0.10 * minimum, (rank["saved_bytes"], minimum, rank["saved"])


@pytest.mark.parametrize("D", [1, 2])
def test_saved_bytes_match_the_plan(fake_runs, D):
    """ds-tsp plan's per-layer figure is what the layer keeps (kept in step with the code)."""
    cfg = LayerMemoryConfig(**TINY, tsp=D, dtype="bf16")
    planned = plan_layer(cfg)["saved_bytes"]
    for rank in fake_runs[(D, "bf16")]:
        assert abs(rank["saved_bytes"] - planned) <= 0.10 * planned, (rank["saved_bytes"], planned)


def test_cli_writes_json_and_markdown(tmp_path):
    from ds_tsp.tools.bench.cli import build_parser, layer_memory_config

    args = build_parser().parse_args(["--layer-memory"])
    assert layer_memory_config(args) == LayerMemoryConfig()  # the 7B layer at S=8192, D=2, bf16
    bad = build_parser().parse_args(["--layer-memory", "--seq", "100", "--tsp", "4"])
    with pytest.raises(ValueError, match="--seq"):
        layer_memory_config(bad)
    out = subprocess.run([sys.executable, "-m", "ds_tsp.tools.bench", "--layer-memory", "--fake", "--hidden", "64",
                          "--heads", "4", "--ffn", "96", "--seq", "64", "--tsp", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads((tmp_path / "layer_memory.json").read_text())
    assert result["source"].startswith("fake") and len(result["ranks"]) == 2
    assert result["saved_over_minimum"] == result["saved_bytes"] / result["minimum_bytes"]
    assert "What the backward keeps" in (tmp_path / "layer_memory.md").read_text()
