"""benchmarks/gpu/tsp_memory_7b.py cannot run here at full size (no GPU); its --tiny CPU self-test keeps it working."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_self_test_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "tsp_memory_7b.py"), "--device", "cpu",
                          "--tiny", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    layouts = {r.get("layout") for r in results}
    assert {"tsp", "tsp_checkpointed", "tp_sp", "ulysses_zero3"} <= layouts
    assert all("error" not in r for r in results)
    assert any(r.get("backend") == "cpu_flash" for r in results)
