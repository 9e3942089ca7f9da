"""examples/finetune_hf.py under torchrun: loads a checkpoint by slices, trains (loss falls), saves HF layout that
plain transformers loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_finetune_hf_example_round_trip(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "finetune_hf.py"), "--output_dir", str(tmp_path / "out"), "--steps", "8",
           "--seq", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    losses = [line["loss"] for line in lines if "step" in line]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.num_parameters() == lines[-1]["params"]
