"""examples/train.py under torchrun with a shipped config: trains, logs JSON per step, reports memory, exports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_train_with_shipped_config(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train.py"), "--ds_config", str(ROOT / "ds_configs" / "tsp.json"),
           "--max_steps", "4", "--seq_len", "64", "--export", str(tmp_path / "export")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["layout"] == {"pipe": 1, "data": 1, "tsp": 2}
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert len(lines[-1]["peak_memory_mib_per_rank"]) == 2
    assert (tmp_path / "export" / "model.safetensors").is_file()
