"""Accelerate with TSP: examples/train_accelerate.py launched by a plain `accelerate launch --config_file ...`
(DeepSpeed TSP=2, DeepSpeed TSP=2 x DP=2 with ZeRO-2, FSDP2 TSP=2 x DP=2) matches its single-process run per step:
loss and the grad norm clip_grad_norm_ returns, within 1e-5 relative (fp32). The single-process run itself matches
a plain transformers training loop. gather_for_metrics returns every held-out sample once; save_state at step 2
+ load_state resumes with identical losses; the model saved by save_pretrained loads in plain transformers.
Config conflicts are one clear error each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from warm_python import python_command, python_exec  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.integrations.accelerate.launch_config import resolve_setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [str(ROOT / "examples" / "train_accelerate.py"), "--max_steps", "4", "--eval_samples", "6"]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(launch: list[str], out: Path, *extra: str) -> list[dict]:
    cmd = [*launch, *SCRIPT, "--output_dir", str(out), *extra]
    # the Accelerate launcher runs as itself; its workers (and the references) fork from the warm interpreter
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**ENV, **python_exec()}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _accelerate(config: str, processes: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "ds_configs" / config)]
    return cmd + (["--num_processes", str(processes)] if processes else [])


def _steps(lines):
    return [line for line in lines if "step" in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc") / "reference"
    return out, _run(python_command(0), out, "--checkpoint_at", "2")


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * abs(b)


def _assert_same_steps(got, want, what):
    assert [s["step"] for s in got] == [1, 2, 3, 4], (what, got)
    for g, w in zip(got, want):
        assert _close(g["loss"], w["loss"]) and _close(g["grad_norm"], w["grad_norm"], 1e-4), (what, g, w)


def test_single_process_run_equals_a_plain_transformers_loop(reference):
    out, lines = reference
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "initial", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5, total_iters=4)
    from ds_tsp.tools.synthetic import RepeatingPatterns

    data = RepeatingPatterns(vocab_size=model.config.vocab_size, seq_len=64, num_samples=22, seed=0)
    for step, line in enumerate(_steps(lines)):
        ids = torch.stack([data[4 * step + i]["input_ids"] for i in range(4)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        assert _close(line["loss"], loss.item()) and _close(line["grad_norm"], norm.item(), 1e-4), (line, loss, norm)
    evaluation = [line for line in lines if "eval_loss" in line][0]
    assert evaluation["eval_indices"] == list(range(16, 22))


@pytest.mark.parametrize("config, processes", [("accelerate_tsp.yaml", 2), ("accelerate_tsp.yaml", 4),
                                               ("accelerate_tsp_fsdp2.yaml", None)],
                         ids=["deepspeed-tsp2", "deepspeed-zero2-tsp2xdp2", "fsdp2-tsp2xdp2"])
def test_accelerate_launch_matches_single_process(reference, tmp_path, config, processes):
    out = tmp_path / "run"
    lines = _run(_accelerate(config, processes), out, "--checkpoint_at", "2")
    _assert_same_steps(_steps(lines), _steps(reference[1]), config)
    evaluation = [line for line in lines if "eval_loss" in line][0]
    assert sorted(evaluation["eval_indices"]) == list(range(16, 22)), "each held-out sample once, none duplicated"
    saved = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref_saved = transformers.AutoModelForCausalLM.from_pretrained(reference[0])
    for name, value in ref_saved.state_dict().items():  # norm-wise: Adam magnifies fp32 noise in tiny entries
        assert (saved.state_dict()[name] - value).norm() <= 1e-4 * value.norm(), name
    assert (out / "initial" / "config.json").is_file() and (out / "state").is_dir(), "save kept the other entries"
    if config.endswith("fsdp2.yaml"):  # resume from save_state at step 2: identical losses
        resumed = _run(_accelerate(config, processes), out, "--resume")
        assert [s["loss"] for s in _steps(resumed)] == [s["loss"] for s in _steps(lines)[2:]]


def test_frozen_layers_with_an_optimizer_on_the_trainable_parameters(tmp_path):
    """requires_grad set on the HF model carries to the TSP shards; the optimizer built on the trainable parameters
    only is accepted; exactly the unfrozen tensors move, as in the single-process run (DeepSpeed ZeRO-2, TSP=2)."""
    extra = ["--max_steps", "3", "--trainable", "model.layers.1.,model.norm."]  # its embedding and head are tied
    reference = _run(python_command(0), tmp_path / "ref", *extra)
    lines = _run(_accelerate("accelerate_tsp.yaml", 2), tmp_path / "tsp", *extra)
    for g, w in zip(_steps(lines), _steps(reference), strict=True):
        assert _close(g["loss"], w["loss"]) and _close(g["grad_norm"], w["grad_norm"], 1e-4), (g, w)
    start, want, got = (transformers.AutoModelForCausalLM.from_pretrained(p).state_dict()
                        for p in (tmp_path / "ref" / "initial", tmp_path / "ref", tmp_path / "tsp"))
    for name, value in start.items():
        if name.startswith(("model.layers.1.", "model.norm.")):
            assert not torch.equal(got[name], value), name
            assert (got[name] - want[name]).norm() <= 1e-4 * want[name].norm(), name
        else:
            assert torch.equal(got[name], value), f"{name} is frozen and moved"


# --- one clear error per conflicting setting (the environment `accelerate launch` exports) ------------------------

def _ds_env(tmp_path, **extra):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "tsp": {"size": 2}}))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config), "WORLD_SIZE": "4",
            **extra}


def _fsdp_env(**extra):
    return {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "WORLD_SIZE": "4", **extra}


@pytest.mark.parametrize("key", ["TP_SIZE", "CP_SIZE", "SP_SIZE"])
def test_deepspeed_config_with_accelerate_tp_cp_sp(tmp_path, key):
    env = _ds_env(tmp_path, ACCELERATE_USE_PARALLELISM_CONFIG="true", **{f"PARALLELISM_CONFIG_{key}": "2"})
    with pytest.raises(TSPConfigError, match=f"parallelism_config_{key.lower()}=2 together with the DeepSpeed"):
        resolve_setup(env)


@pytest.mark.parametrize("key", ["SP_SIZE", "DP_REPLICATE_SIZE"])  # CP_SIZE is tsp.cp_size: tests/cp/test_cp_fsdp.py
def test_fsdp2_config_with_sp_replicate(key):
    with pytest.raises(TSPConfigError, match=f"parallelism_config_{key.lower()}=2"):
        resolve_setup(_fsdp_env(**{f"PARALLELISM_CONFIG_{key}": "2"}))


def test_fsdp_config_errors():
    with pytest.raises(TSPConfigError, match="fsdp_version=1"):
        resolve_setup(_fsdp_env(FSDP_VERSION="1"))
    with pytest.raises(TSPConfigError, match="no TSP degree"):
        resolve_setup(_fsdp_env(ACCELERATE_USE_PARALLELISM_CONFIG="false"))
    with pytest.raises(TSPConfigError, match="--num_processes 4"):
        resolve_setup(_fsdp_env(WORLD_SIZE="6"))
    with pytest.raises(TSPConfigError, match="fsdp_offload_params"):
        resolve_setup(_fsdp_env(FSDP_OFFLOAD_PARAMS="true"))
    env = _fsdp_env()
    setup = resolve_setup(env)
    assert setup.mode == "fsdp2" and setup.tsp.size == 2
    assert env["ACCELERATE_USE_FSDP"] == "false", "Accelerate's own FSDP must not wrap the model again"


def test_bad_tsp_block_is_named(tmp_path):
    env = _ds_env(tmp_path)
    Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).write_text(json.dumps({"tsp": {"size": 2, "sise": 4}}))
    with pytest.raises(TSPConfigError, match="tsp.sise: unknown key"):
        resolve_setup(env)


def test_non_llama_family_model_is_refused():
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.model.convert import to_tsp_model

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TSPConfigError, match="model_type='gpt2'"):
        to_tsp_model(gpt2, TSPComm.single())
    with pytest.raises(TSPConfigError, match="model=Linear"):
        to_tsp_model(torch.nn.Linear(2, 2), TSPComm.single())
