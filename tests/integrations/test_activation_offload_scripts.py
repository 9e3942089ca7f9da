"""Offload of checkpointed activations through the user-facing scripts: the same losses bit for bit.

- examples/train.py under torchrun, TSP=2: `"tsp": {"activation_checkpointing": true, "offload_activations": true}`
  against `"activation_checkpointing": true` alone, every step's loss (the full float the script logs) equal;
- examples/hf_trainer.py (TSPTrainer) under torchrun, TSP=2: DeepSpeed's `"activation_checkpointing":
  {"cpu_checkpointing": true}` (read as offload_activations) against checkpointing alone, every logged field of
  every step (loss, grad_norm) equal.
Each launches torchrun twice (about a minute of CPU each on 2 cores): opt-in, `--runslow`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _config(tmp: Path, name: str, tsp: dict, **top) -> str:
    config = json.loads((ROOT / "ds_configs" / "tsp.json").read_text())
    config["tsp"].update(tsp)
    config.update(top)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _torchrun(script: str, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_train_example_losses_bit_for_bit(tmp_path):
    runs = {}
    for name, tsp in (("kept", {"activation_checkpointing": True}),
                      ("offloaded", {"activation_checkpointing": True, "offload_activations": True})):
        lines = _torchrun("train.py", "--ds_config", _config(tmp_path, name, tsp), "--max_steps", "4", "--seq_len",
                          "64")
        runs[name] = [(line["step"], line["loss"]) for line in lines if "step" in line and "loss" in line]
        assert lines[0]["offload_activations"] is (name == "offloaded") and lines[0]["activation_checkpointing"]
    assert len(runs["kept"]) == 4 and runs["offloaded"] == runs["kept"], runs


@pytest.mark.slow
def test_tsp_trainer_deepspeed_cpu_checkpointing_bit_for_bit(tmp_path):
    runs = {}
    for name, top in (("kept", {}), ("cpu_checkpointing", {"activation_checkpointing": {"cpu_checkpointing": True}})):
        config = _config(tmp_path, name, {"activation_checkpointing": True}, **top)
        lines = _torchrun("hf_trainer.py", "--ds_config", config, "--output_dir", str(tmp_path / name),
                          "--max_steps", "3", "--global_batch", "2")
        runs[name] = [{k: v for k, v in line.items() if k in ("step", "loss", "grad_norm")} for line in lines
                      if "step" in line and "loss" in line]
        (options,) = [line for line in lines if "offload_activations" in line]
        assert options == {"activation_checkpointing": True, "offload_activations": name == "cpu_checkpointing"}
    assert len(runs["kept"]) == 3 and runs["cpu_checkpointing"] == runs["kept"], runs
