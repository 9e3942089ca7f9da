"""The cp axis in TSPTrainer and TSPAccelerator: {"tsp": {"size": 2, "cp_size": 2}} on 4 gloo ranks (D=2, C=2,
data 1), fp32, trains like the plain single-process run on the same batches.

- TSPTrainer (DeepSpeed ZeRO-1 over data x cp, gradient accumulation 2, samples with different shares of labels
  -100, seq 30 padded to 32 = 2*D*C): every logged loss and grad norm equals the plain transformers Trainer's
  (1e-5 / 1e-4 relative), with average_tokens_across_devices on and off (the token count of each sample is counted
  once over tsp x cp); eval_loss too; predict (logits under cp) is refused, naming cp_size;
- TSPTrainer on the tiny Qwen3-MoE (tests/helpers/hf_tiny.py: output_router_logits, so router_aux_loss_coef x the
  load-balancing loss is in every loss; its counts all-reduced over TSP then cp): the same equalities (the aux term is
  ~2.5% of the loss, so an aux counted per cp group or twice under accumulation would fail them);
- TSPAccelerator's loop (examples/train_accelerate.py, DeepSpeed ZeRO-1 via the launcher's environment): every
  loss and grad norm equals the same script on one process; gather_for_metrics returns each held-out sample once.
- gather / gather_for_metrics on (data 2, cp 2, tsp 1) groups: one copy per data replica.
One 4-rank launch runs the above (module fixture), one more the average_tokens_across_devices=False run (the MoE
model's: behind the slow marker); the references run on one rank. ~35 s on 2 cores.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, SEQ = 3, 30
ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer_ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 1_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "tsp": {"size": 2, "cp_size": 2}}


def _train_with_trainer(model_dir: str, out: str, ds_config: dict | None, average_tokens: bool) -> dict:
    """STEPS optimizer steps of (TSP)Trainer, micro-batch 1 x accumulation 2; the logged losses, eval_loss and what
    predict says under cp."""
    import torch

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPTrainer

    example = _example("hf_trainer")  # its SyntheticLM: a sample-dependent share of labels -100
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    data = dict(vocab_size=model.config.vocab_size, seq_len=SEQ, seed=0, packed=False)
    train = example.SyntheticLM(num_samples=STEPS * 2, **data)
    held_out = example.SyntheticLM(num_samples=2, offset=STEPS * 2, **data)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, seed=0, logging_steps=1, report_to=[], save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, deepspeed=ds_config, use_cpu=True,
        dataloader_drop_last=True, average_tokens_across_devices=average_tokens)
    trainer_class = transformers.Trainer if ds_config is None else TSPTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                            data_collator=example._stack)
    trainer.train()
    steps = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    result = {"steps": steps, "eval_loss": trainer.evaluate()["eval_loss"]}
    if ds_config is not None:
        try:
            trainer.predict(held_out)
            result["predict"] = "ran"
        except TSPConfigError as err:
            result["predict"] = str(err)
    _reset_hf_state()
    return result


def _reset_hf_state() -> None:
    """The next run in this process builds its own Accelerator / DeepSpeed config (both are process singletons)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_loop(model_dir: str, out: str) -> list[dict]:
    """examples/train_accelerate.py in this process: its per-step log and its eval line (printed: captured)."""
    import contextlib
    import io
    from unittest import mock

    from accelerate.state import PartialState

    example = _example("train_accelerate")
    printed = io.StringIO()
    # its end_training would destroy the launcher's process group, which the launcher destroys itself
    with contextlib.redirect_stdout(printed), mock.patch.object(PartialState, "destroy_process_group",
                                                                lambda self, group=None: None):
        log = example.main(["--model_name_or_path", model_dir, "--output_dir", out, "--max_steps", str(STEPS),
                            "--seq_len", str(SEQ), "--global_batch", "2", "--eval_samples", "3"])
    evals = [json.loads(line) for line in printed.getvalue().splitlines() if '"eval_loss"' in line]
    _reset_hf_state()
    return log + evals


def _cp_ranks(model_dir: str, moe_dir: str, workdir: str) -> dict:
    import os

    import torch.distributed as dist

    result = {"trainer": _train_with_trainer(model_dir, f"{workdir}/t1", _trainer_ds_config(), True),
              "moe_trainer": _train_with_trainer(moe_dir, f"{workdir}/m1", _trainer_ds_config(), True)}
    config = Path(workdir) / "accelerate_ds.json"
    if dist.get_rank() == 0:
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                      "gradient_clipping": "auto", "steps_per_print": 1_000_000,
                                      "zero_optimization": {"stage": 1}, "tsp": {"size": 2, "cp_size": 2}}))
    dist.barrier()
    os.environ.update({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config),
                       "ACCELERATE_MIXED_PRECISION": "no"})
    result["accelerate"] = _accelerate_loop(model_dir, f"{workdir}/a")
    result.update(_gathers_at_data2_cp2())
    return result


def _gathers_at_data2_cp2() -> dict:
    """TSPAccelerator.gather / gather_for_metrics on the groups of (data 2, cp 2, tsp 1): the data group spans
    data x cp, the cp ranks of a replica hold the same values, one copy per replica comes back."""
    from types import SimpleNamespace

    import torch

    from ds_tsp.accelerate import TSPAccelerator
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups

    groups = ProcessGroups.build(ParallelLayout.from_world_size(4, tsp=1, cp=2))
    accelerator = SimpleNamespace(data_size=groups.data_size, _cp_size=groups.cp_size, _data_group=groups.data_group,
                                  gradient_state=SimpleNamespace(end_of_dataloader=False, remainder=0))
    accelerator.gather = lambda t: TSPAccelerator.gather(accelerator, t)
    sample = groups.data_rank * 10 + 1  # the sample of this rank's replica
    return {"gather": TSPAccelerator.gather_for_metrics(accelerator, torch.tensor([sample])).tolist(),
            "gather_objects": TSPAccelerator.gather_for_metrics(accelerator, [f"s{sample}"], use_gather_object=True)}


def _reference(model_dir: str, moe_dir: str, workdir: str) -> dict:
    return {"trainer": _train_with_trainer(model_dir, f"{workdir}/r1", None, True),
            "moe_trainer": _train_with_trainer(moe_dir, f"{workdir}/rm1", None, True),
            "moe_aux": _aux_term_of_first_sample(moe_dir),
            "accelerate": _accelerate_loop(model_dir, f"{workdir}/ra")}


def _aux_term_of_first_sample(model_dir: str) -> tuple[float, float]:
    """transformers' (loss, router_aux_loss_coef x aux_loss) on the first training sample: the aux term's weight in
    the losses the MoE comparison checks."""
    import torch

    example = _example("hf_trainer")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sample = example._stack([example.SyntheticLM(vocab_size=model.config.vocab_size, seq_len=SEQ, num_samples=1,
                                                 seed=0, packed=False)[0]])
    with torch.no_grad():
        out = model(**sample, use_cache=False)
    return float(out.loss), float(model.config.router_aux_loss_coef * out.aux_loss)


def _local_tokens(model_dir: str, workdir: str, ds_config: dict | None) -> dict:
    return _train_with_trainer(model_dir, f"{workdir}/{'cp' if ds_config else 'ref'}", ds_config, False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ds_tsp.testing import save_tiny_llama

    workdir = tmp_path_factory.mktemp("cp_trainers")
    model_dir = str(save_tiny_llama(workdir / "initial", seed=0))
    moe_dir = str(save_tiny_checkpoint(workdir / "moe", "qwen3_moe"))
    reference = run_on_local_ranks(_reference, 1, model_dir, moe_dir, str(workdir), timeout_s=300, env=ENV)[0]
    cp = run_on_local_ranks(_cp_ranks, 4, model_dir, moe_dir, str(workdir), timeout_s=300, env=ENV)
    return reference, cp


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * abs(b)


def _assert_trainer_matches(want: dict, cp: list[dict]) -> None:
    assert len(want["steps"]) == STEPS and want["steps"][-1][0] < want["steps"][0][0], want  # it learns
    for rank, got in enumerate(cp):
        assert len(got["steps"]) == STEPS, (rank, got)
        for (loss, norm), (ref_loss, ref_norm) in zip(got["steps"], want["steps"]):
            assert _close(loss, ref_loss, 1e-5) and _close(norm, ref_norm, 1e-4), (rank, got, want)
        assert _close(got["eval_loss"], want["eval_loss"], 1e-5), (rank, got["eval_loss"], want["eval_loss"])
        assert "tsp.cp_size=2" in got["predict"] and "prediction_loss_only=True" in got["predict"], got["predict"]


def test_tsp_trainer_at_tsp2_cp2_logs_the_plain_trainers_losses(runs):
    """average_tokens_across_devices=True (the default): tokens counted over data x cp x tsp, loss scale data x cp."""
    reference, cp = runs
    _assert_trainer_matches(reference["trainer"], [result["trainer"] for result in cp])


def test_tsp_trainer_moe_at_tsp2_cp2_logs_the_plain_trainers_losses(runs):
    """Qwen3-MoE with output_router_logits: each micro-batch's loss carries router_aux_loss_coef x the aux loss of
    the whole sequence (counts over TSP then cp; the Trainer's loss scale data x cp undone by DeepSpeed's mean over
    data x cp, so each cp group adds its share once)."""
    reference, cp = runs
    loss, aux_term = reference["moe_aux"]
    assert aux_term > 1e-2 * loss, (loss, aux_term)  # the aux term weighs 1000x the loss tolerance
    _assert_trainer_matches(reference["moe_trainer"], [result["moe_trainer"] for result in cp])


@pytest.mark.parametrize("model", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_tsp_trainer_at_tsp2_cp2_without_average_tokens_across_devices(tmp_path, model):
    """average_tokens_across_devices=False: each replica's tokens counted over tsp x cp, the loss scaled by cp (for
    the MoE model its aux term too, which num_items_in_batch leaves unscaled: counted once per sequence)."""
    from ds_tsp.testing import save_tiny_llama

    model_dir = str(save_tiny_llama(tmp_path / "initial", seed=0) if model == "llama"
                    else save_tiny_checkpoint(tmp_path / "initial", model))
    want = run_on_local_ranks(_local_tokens, 1, model_dir, str(tmp_path), None, timeout_s=300, env=ENV)[0]
    cp = run_on_local_ranks(_local_tokens, 4, model_dir, str(tmp_path), _trainer_ds_config(), timeout_s=300, env=ENV)
    _assert_trainer_matches(want, cp)


def test_tsp_accelerator_at_tsp2_cp2_matches_one_process(runs):
    reference, cp = runs
    want = reference["accelerate"]
    steps = [line for line in want if "step" in line]
    assert len(steps) == STEPS and steps[-1]["loss"] < steps[0]["loss"], want
    got = cp[0]["accelerate"]  # rank 0 logs (every rank computes the same global values)
    for g, w in zip([line for line in got if "step" in line], steps, strict=True):
        assert g["step"] == w["step"] and _close(g["loss"], w["loss"], 1e-5), (g, w)
        assert _close(g["grad_norm"], w["grad_norm"], 1e-4), (g, w)
    evaluation, ref_eval = got[-1], want[-1]
    assert _close(evaluation["eval_loss"], ref_eval["eval_loss"], 1e-5), (evaluation, ref_eval)
    assert sorted(evaluation["eval_indices"]) == ref_eval["eval_indices"], "each held-out sample once"


def test_gather_for_metrics_keeps_one_cp_copy_per_replica(runs):
    for rank, result in enumerate(runs[1]):
        assert result["gather"] == [1, 11] and result["gather_objects"] == ["s1", "s11"], (rank, result)
