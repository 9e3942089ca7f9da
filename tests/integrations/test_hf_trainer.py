"""HF Trainer with TSP: examples/hf_trainer.py under torchrun with `TSPTrainer` equals the plain single-process
`Trainer` (the same script with one process) per logged step (fp32: loss 1e-5, grad norm 1e-4 relative) and in its
final weights (1e-4 norm-wise):
- TSP=2 with tsp.json; eval_loss under TSP equals the single-process one; the HF-layout save loads in plain
  transformers with the same weights; resume_from_checkpoint continues with identical losses; that run (steps,
  evaluation, checkpoint saves) recorded and replayed under NCCL's rules;
- TSP=2 x DP=2, ZeRO-2, gradient_accumulation_steps=2, replicas holding different numbers of labelled tokens
  (the token-weighted mean over the whole global batch, as num_items_in_batch intends);
- packed batches (DataCollatorWithFlattening), TSP=2;
- a PEFT LoRA model (base frozen, adapter trained and saved as PEFT's), TSP=2.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from ds_tsp.core.errors import TSPConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "hf_trainer.py")
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(out: Path, *args: str, processes: int = 1, trace: Path | None = None) -> list[dict]:
    """trace: record every rank's collectives there (tests/helpers/traced_run.py) for the NCCL-rules replay."""
    from warm_python import python_command

    # python, or torchrun's ranks (warm_python.py); a traced run starts fresh interpreters (see python_command)
    launch = python_command(0 if processes == 1 else processes, fresh=trace is not None)
    traced = [str(ROOT / "tests" / "helpers" / "traced_run.py"), str(trace)] if trace is not None else []
    proc = subprocess.run([*launch, *traced, SCRIPT, "--output_dir", str(out), *args], capture_output=True,
                          text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))  # only JSON lines: the script prints nothing else
    return lines


def _steps(lines):
    return [line for line in lines if "step" in line]


def _close(a, b, tol=1e-5):
    return abs(a - b) <= tol * abs(b)


def _assert_steps_match(got, want):
    """Every logged step: the loss (1e-5) and the grad norm before clipping (1e-4: fp32 sums reordered over shards
    and replicas, ~1e-7 seen). A loss alone misses a uniform 2x gradient error (it moved the losses by 7.5e-6), the
    norm shows it at once."""
    assert [s["step"] for s in got] == [s["step"] for s in want] and got, (got, want)
    for g, w in zip(got, want):
        assert _close(g["loss"], w["loss"]), (g, w)
        assert _close(g["grad_norm"], w["grad_norm"], 1e-4), (g, w)


def _assert_saved_weights_match(got_dir: Path, want_dir: Path) -> None:
    """The TSP run's final save equals the plain run's, norm-wise per tensor (1e-4: Adam's early steps magnify fp32
    noise in single tiny entries)."""
    saved = transformers.AutoModelForCausalLM.from_pretrained(got_dir).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(want_dir).state_dict()
    assert set(saved) == set(want)
    for name, value in want.items():
        assert (saved[name] - value).norm() <= 1e-4 * value.norm(), name


def test_tsp2_equals_plain_trainer_with_eval_save_and_resume(tmp_path):
    common = ["--max_steps", "4", "--global_batch", "2", "--lr", "3e-3", "--eval_samples", "4", "--save_steps", "2"]
    reference = _run(tmp_path / "ref", *common)
    tsp = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common, processes=2,
               trace=tmp_path / "trace")
    _assert_steps_match(_steps(tsp), _steps(reference))  # recorded: the traced run's numbers are the plain run's
    from traced_run import assert_obeys_nccl_rules

    assert_obeys_nccl_rules(tmp_path / "trace", kinds={"all_reduce", "all_gather", "broadcast", "gather"})
    eval_ref = [line["eval_loss"] for line in reference if "eval_loss" in line]
    eval_tsp = [line["eval_loss"] for line in tsp if "eval_loss" in line]
    assert len(eval_tsp) == 1 and _close(eval_tsp[0], eval_ref[0]), (eval_tsp, eval_ref)
    _assert_saved_weights_match(tmp_path / "tsp", tmp_path / "ref")
    probe = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the TSP save, in plain transformers, scores like the plain Trainer's model
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tsp")(input_ids=probe).logits
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref")(input_ids=probe).logits
    assert (got - ref).norm() <= 1e-4 * ref.norm()
    assert (tmp_path / "tsp" / "checkpoint-2" / "config.json").is_file(), "checkpoints are in HF layout"
    assert (tmp_path / "tsp" / "checkpoint-4").is_dir(), "the final save_model kept the checkpoints"

    resumed = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common,
                   "--resume_from_checkpoint", str(tmp_path / "tsp" / "checkpoint-2"), processes=2)
    assert [s["loss"] for s in _steps(resumed)] == [s["loss"] for s in _steps(tsp)[2:]]


def test_tsp2_x_dp2_zero2_gradient_accumulation_uneven_labels(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "tsp_zero2.json").read_text())
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    common = ["--max_steps", "3", "--global_batch", "4", "--lr", "3e-3"]
    reference = _run(tmp_path / "ref", *common, "--gradient_accumulation_steps", "2")
    tsp = _run(tmp_path / "tsp", "--ds_config", str(tmp_path / "ds.json"), *common, processes=4)
    _assert_steps_match(_steps(tsp), _steps(reference))
    _assert_saved_weights_match(tmp_path / "tsp", tmp_path / "ref")


def test_packed_batches_tsp2(tmp_path):
    common = ["--max_steps", "3", "--global_batch", "2", "--lr", "3e-3", "--packed"]
    reference = _run(tmp_path / "ref", *common)
    tsp = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common, processes=2)
    _assert_steps_match(_steps(tsp), _steps(reference))
    _assert_saved_weights_match(tmp_path / "tsp", tmp_path / "ref")


def test_peft_lora_tsp2_equals_plain_peft_trainer(tmp_path):
    """A PEFT LoRA model handed to TSPTrainer: the Trainer's optimizer (on the trainable parameters) holds the adapter
    only, the losses are the plain Trainer's, and save_model writes an adapter plain peft loads."""
    peft = pytest.importorskip("peft")
    common = ["--max_steps", "3", "--global_batch", "2", "--lr", "3e-3", "--lora", "4"]
    reference = _run(tmp_path / "ref", *common)
    tsp = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common, processes=2)
    _assert_steps_match(_steps(tsp), _steps(reference))
    from safetensors.torch import load_file

    got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("tsp", "ref"))
    assert set(got) == set(want) and len(want) == 2 * 7 * 2
    for name, value in want.items():
        assert (got[name] - value).norm() <= 1e-4 * value.norm(), name
    probe = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = []
    for run in ("tsp", "ref"):
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run / "initial")
        with torch.no_grad():
            logits.append(peft.PeftModel.from_pretrained(base, tmp_path / run)(input_ids=probe).logits)
    assert (logits[0] - logits[1]).norm() <= 1e-5 * logits[1].norm()


def test_parallelism_config_sp_cp_with_tsp_is_an_error():
    from types import SimpleNamespace

    from ds_tsp.integrations.hf_trainer import _check_parallelism_config

    for key in ("sp_size", "cp_size", "tp_size"):
        args = SimpleNamespace(parallelism_config=SimpleNamespace(**{"sp_size": 1, "cp_size": 1, "tp_size": 1,
                                                                     key: 2}))
        with pytest.raises(TSPConfigError, match=f"parallelism_config={key}=2"):
            _check_parallelism_config(args, 2)
