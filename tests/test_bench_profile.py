"""`ds-tsp bench --profile`: one TSP row at D=2 carries a per-phase profile that is non-negative and fits the step."""
import json

from ds_tsp.bench.cli import main
from ds_tsp.bench.profile import KEYS, phase_of


def test_phase_of_names():
    assert phase_of("aten::mm") == "gemm"
    assert phase_of("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert phase_of("aten::copy_") == "copy"
    assert phase_of("_TSPAttentionBackward") is None  # autograd Function bookkeeping is "other"


def test_bench_profile_tiny(tmp_path):
    rc = main(["--profile", "--layouts", "tsp", "--tsp", "2", "--seq", "64", "--layers", "1", "--hidden", "64",
               "--heads", "4", "--ffn", "128", "--vocab", "256", "--steps", "1", "--warmup", "1", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 0
    row = json.loads((tmp_path / "results.json").read_text())
    rows = row["results"] if isinstance(row, dict) else row
    prof = rows[0]["profile"]
    assert all(prof[k] >= 0 for k in KEYS)
    assert prof["gemm_s"] > 0 and prof["attention_s"] > 0
    assert sum(prof[k] for k in KEYS) <= prof["wall_s"] * 1.05 + 1e-3
    assert "step_s" in rows[0] and "comm_bytes" in rows[0]  # existing keys kept
