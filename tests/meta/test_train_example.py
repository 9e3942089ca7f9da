"""examples/train.py under torchrun with a shipped config: trains, logs JSON per step, reports memory, exports.
Stdout carries the JSON lines only (`| jq` works: DeepSpeed's warnings, its op-build message and the progress bar go
to stderr), and a bad config is one line on stderr, printed once for both ranks, exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]


def _torchrun(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train.py"), *args]
    # DS_ACCELERATOR unset, as a newcomer runs it: DeepSpeed then warns about its accelerator choice (on stdout);
    # TMPDIR: where the ranks agree on who prints an error (ds_tsp.tools.entry_point), kept out of /tmp
    env = {**{k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}, "TMPDIR": str(tmp)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_torchrun_train_with_shipped_config(tmp_path):
    out = _torchrun("--ds_config", str(ROOT / "ds_configs" / "tsp.json"), "--max_steps", "4", "--seq_len", "64",
                    "--export", str(tmp_path / "export"), tmp=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]  # every line: stdout is JSON only
    assert lines[0]["layout"] == {"pipe": 1, "data": 1, "tsp": 2}
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert len(lines[-1]["peak_memory_mib_per_rank"]) == 2
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert "Setting accelerator to CPU" in out.stderr  # DeepSpeed's own messages still reach the user, on stderr


def test_torchrun_bad_config_is_one_line_once_exit_2(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "tsp.json").read_text())
    config["tsp"]["sise"] = 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    out = _torchrun("--ds_config", str(path), "--max_steps", "2", "--seq_len", "64", tmp=tmp_path)
    ours = [line for line in out.stderr.splitlines() if line.startswith("train.py: error:")]
    from ds_tsp.core.config import TSPConfig

    assert ours == ["train.py: error: tsp.sise: unknown key (did you mean 'size'?); allowed keys are "
                    + ", ".join(TSPConfig.keys())], out.stderr
    # no rank's traceback: no frame of the package (its own path: a clone may itself be named ds_tsp)
    assert "TSPConfigError" not in out.stderr and f"{ROOT / 'ds_tsp'}/" not in out.stderr, out.stderr
    assert out.stdout == ""
    # torchrun adds its own report: the first failed rank's "exitcode  : 2" as the root cause (the other rank exited
    # 2 too, or was stopped by torchrun first), and it exits 1 itself
    root_cause = out.stderr.split("Root Cause")[1]
    assert "exitcode  : 2" in root_cause and out.returncode == 1, out.stderr
