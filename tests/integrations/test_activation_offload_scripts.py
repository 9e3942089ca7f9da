"""Offload of checkpointed activations through the user-facing scripts: the same losses bit for bit.

- examples/train.py under torchrun, TSP=2: `"tsp": {"activation_checkpointing": true, "offload_activations": true}`
  against `"activation_checkpointing": true` alone, every step's loss (the full float the script logs) equal;
- examples/hf_trainer.py (TSPTrainer) under torchrun, TSP=2: DeepSpeed's `"activation_checkpointing":
  {"cpu_checkpointing": true}` (read as offload_activations) against checkpointing alone, every logged field of
  every step (loss, grad_norm) equal.
Each launches torchrun twice (about a minute of CPU each on 2 cores): opt-in, `--runslow`. The default run has their
tiny forms, all four TSP=2 launches at once: 2 steps at sequence 32, the same equalities.
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


def _steps(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k in ("step", "loss", "grad_norm")} for line in lines
            if "step" in line and "loss" in line]


def test_offload_through_both_scripts_tiny(tmp_path):
    """The two tests below at 2 steps, sequence 32, their four TSP=2 launches started together (forked from the
    suite's warm interpreter, tests/helpers/warm_python.py): examples/train.py with offload_activations and
    examples/hf_trainer.py with DeepSpeed's cpu_checkpointing log their checkpointing-only runs' losses (and the
    Trainer's grad norms) bit for bit, and each says which of the two it ran."""
    from warm_python import python_command

    train = {"kept": {"activation_checkpointing": True},
             "offloaded": {"activation_checkpointing": True, "offload_activations": True}}
    trainer = {"kept": {}, "cpu_checkpointing": {"activation_checkpointing": {"cpu_checkpointing": True}}}
    commands = {("train", name): ["train.py", "--ds_config", _config(tmp_path, f"train_{name}", tsp), "--max_steps",
                                  "2", "--seq_len", "32"] for name, tsp in train.items()}
    commands.update({("trainer", name): ["hf_trainer.py", "--ds_config", _config(
        tmp_path, f"trainer_{name}", {"activation_checkpointing": True}, **top), "--output_dir",
        str(tmp_path / name), "--max_steps", "2", "--global_batch", "2", "--seq_len", "32"]
        for name, top in trainer.items()})
    procs = {key: subprocess.Popen([*python_command(2), str(ROOT / "examples" / argv[0]), *argv[1:]],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for key, argv in commands.items()}
    lines = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (key, err[-4000:])
        lines[key] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for name in train:
        assert lines["train", name][0]["offload_activations"] is (name == "offloaded")
        assert lines["train", name][0]["activation_checkpointing"]
    for name in trainer:
        (options,) = [line for line in lines["trainer", name] if "offload_activations" in line]
        assert options == {"activation_checkpointing": True, "offload_activations": name == "cpu_checkpointing"}
    kept, offloaded = _steps(lines["train", "kept"]), _steps(lines["train", "offloaded"])
    assert len(kept) == 2 and offloaded == kept, (kept, offloaded)
    kept, offloaded = _steps(lines["trainer", "kept"]), _steps(lines["trainer", "cpu_checkpointing"])
    assert len(kept) == 2 and offloaded == kept, (kept, offloaded)


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
