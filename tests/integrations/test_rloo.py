"""TRL's RLOOTrainer on TSP: ds_tsp.hf.TSPRLOOTrainer at TSP=2 (ZeRO-3, SGD, fp32) equals a plain RLOOTrainer in one
process with the same seed, prompts and a deterministic reward, over 3 optimizer steps: every logged value within
1e-5 relative (the loss relative to its advantages' unit scale, the KL to the log-probs it is a difference of, values
below 1e-3 within 1e-8; step_time, a wall-clock time, is not compared), and the saved weights after the 3 steps
(1e-5 of each tensor's norm). Measured: loss 8e-7, grad_norm 3e-7, KL 2e-5 of itself (2e-8 of the entropy), weights
8e-8. The run covers beta > 0 (a reference model: RLOO's KL is a reward penalty, zero on the first generation and
not on the second), gradient accumulation 2 with steps_per_generation 4 (a generation batch of 4 prompt groups
serves two optimizer steps: a step's micro-batches hold parts of groups, so the leave-one-out advantages do not
cancel in its loss, and the second step's importance ratios are off-policy, some of them clipped),
normalize_advantages, reward_clip_range, sampling at temperature 0.7, and evaluate() after training (every eval
metric, as above); without gradient checkpointing, so ZeRO-3's backward reads the parameters the layers saved (the
q/k norm weights among them, whole only while the layer they are registered with is in its backward; the GRPO test
covers the checkpointed recompute under ZeRO-3). The composition users write is checked by its class; options TSP
cannot honour are refused by name.
Slow (opt-in): TSP=2 x data 2 with ZeRO-2 and with ZeRO-3 (4 processes, `class R(TSPTrainer, RLOOTrainer)`)
equals a plain 2-process RLOOTrainer (the data axis is TRL's process axis: seeds, reward / KL gathering, advantage
slices).

Run as a script, this file is the worker: `python tests/integrations/test_rloo.py OUT.json MODEL TOKENIZER
[DS_CONFIG]`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_grpo import ENV, ROOT, good_words, prompts, save_tokenizer, zero

STEPS, BATCH, ACCUMULATION = 3, 4, 2
# generation batch 16 = 4 prompts x 4 completions, consumed over 2 optimizer steps of 2 micro-batches: a step holds
# half of the (shuffled) groups, so its loss does not cancel, and the second step's ratios are off-policy
OPTIONS = {"beta": 0.05, "steps_per_generation": 4, "temperature": 0.7, "normalize_advantages": True,
           "reward_clip_range": (0.0, 0.5), "num_generations": 4, "max_completion_length": 6,
           "gradient_checkpointing": False}
NOT_COMPARED = {"step_time"}  # wall-clock seconds


# --- the worker ----------------------------------------------------------------------------------------------
def main(out: str, model_dir: str, tokenizer_dir: str, ds_config: str | None = None) -> None:
    import transformers
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    out_dir = str(Path(out).with_suffix(""))
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // (2 if ds_config else 1)  # TSP=2 in the DeepSpeed config
    # loaded before the config: under a ZeRO-3 config transformers would load it partitioned (zero.Init)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, padding_side="left")
    args = RLOOConfig(output_dir=out_dir, max_steps=STEPS, optim="sgd", learning_rate=0.1,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1,
                      report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                      bf16=False, max_grad_norm=1.0, per_device_train_batch_size=BATCH,
                      gradient_accumulation_steps=ACCUMULATION, per_device_eval_batch_size=8, deepspeed=ds_config,
                      **OPTIONS)
    if ds_config is None:
        trainer_class = RLOOTrainer
    elif replicas == 1:  # the ready-made class
        from ds_tsp.hf import TSPRLOOTrainer as trainer_class
    else:  # the composition users write
        from ds_tsp.hf import TSPTrainer

        class RLOOWithTSP(TSPTrainer, RLOOTrainer):
            pass

        trainer_class = RLOOWithTSP
    trainer = trainer_class(model=model, reward_funcs=good_words, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(prompts(4 * STEPS * replicas, seed=1)),
                            eval_dataset=Dataset.from_list(prompts(2 * replicas, seed=2)))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    trainer.evaluate()
    trainer.save_model(f"{out_dir}/final")
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(trainer.state.log_history))


# --- the tests -------------------------------------------------------------------------------------------------
def _launch(out: Path, tmp: Path, nproc: int, ds_config: Path | None = None) -> subprocess.Popen:
    from warm_python import python_command

    launch = python_command(0 if nproc == 1 else nproc)  # plain python, or torchrun's ranks (warm_python.py)
    argv = [str(out), str(tmp / "model"), str(tmp / "tokenizer")] + ([str(ds_config)] if ds_config else [])
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> list[dict]:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-6000:]
    return json.loads(out.read_text())


def _runs(tmp: Path, data_replicas: int, zero_stage: int) -> tuple[list[dict], list[dict]]:
    """The plain RLOOTrainer on `data_replicas` processes and TSP=2 on 2 x data_replicas under ZeRO `zero_stage`,
    launched together."""
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")
    from hf_tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp / "model", "qwen3")  # q/k norms, tied embeddings, GQA, vocab 98
    save_tokenizer(tmp / "tokenizer")
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": zero(zero_stage),
        "zero_allow_untested_optimizer": True, "tsp": {"size": 2}}))
    # both at once: they share the two cores while each starts up
    reference = _launch(tmp / "ref.json", tmp, data_replicas)
    tsp = _launch(tmp / "tsp.json", tmp, 2 * data_replicas, tmp / "ds.json")
    return _finish(reference, tmp / "ref.json"), _finish(tsp, tmp / "tsp.json")


def _close(got: float, want: float, scale: float = 1e-3) -> bool:
    return abs(got - want) <= 1e-5 * max(abs(want), scale)


def _scale(key: str, line: dict) -> float:
    """What a value is relative to: the loss is a mean of ratio x advantage (advantages normalised to unit std), the
    KL the mean of per-token log-prob differences (log-probs of the order of the entropy), so both are compared
    relative to their terms; any other value relative to itself (below 1e-3: within 1e-8)."""
    return {"loss": 1.0, "train_loss": 1.0, "kl": line.get("entropy", 1.0)}.get(key, 1e-3)


def _assert_same_run(reference: list[dict], tsp: list[dict], tmp: Path) -> None:
    from safetensors.torch import load_file

    want = [line for line in reference if "loss" in line and "train_runtime" not in line]
    got = [line for line in tsp if "loss" in line and "train_runtime" not in line]
    assert len(want) == STEPS and [g["step"] for g in got] == [w["step"] for w in want], (got, want)
    for g, w in zip(got, want):
        assert set(g) == set(w), sorted(set(g) ^ set(w))
        for key in sorted(set(w) - NOT_COMPARED):
            assert (g[key] is None and w[key] is None) or _close(g[key], w[key], _scale(key, w)), (key, g, w)
    # what makes the comparison able to fail: the loss moves, the KL penalty is zero on the first generation (policy
    # = reference) and not on the second (step 2 reuses step 1's completions: no generation, no KL)
    assert len({w["loss"] for w in want}) == STEPS and min(abs(w["loss"]) for w in want) > 1e-3, want
    assert want[0]["kl"] == 0.0 and abs(want[2]["kl"]) > 1e-6 and "kl" not in want[1], want
    evals = [[line for line in runs if "eval_loss" in line] for runs in (tsp, reference)]
    assert len(evals[0]) == len(evals[1]) == 1 and set(evals[0][0]) == set(evals[1][0]), evals
    for key in sorted(set(evals[1][0]) - {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}):
        assert _close(evals[0][0][key], evals[1][0][key], _scale(key.removeprefix("eval_"), evals[1][0])), (key, evals)
    totals = [[line for line in runs if "train_runtime" in line][0] for runs in (tsp, reference)]
    assert _close(totals[0]["train_loss"], totals[1]["train_loss"], 1.0), totals
    want_w, got_w = (load_file(tmp / name / "final" / "model.safetensors") for name in ("ref", "tsp"))
    initial = load_file(tmp / "model" / "model.safetensors")
    assert set(got_w) == set(want_w) == set(initial)
    for name, tensor in want_w.items():
        assert (got_w[name] - tensor).norm() <= 1e-5 * tensor.norm() + 1e-7, name
    moved = max((want_w[n] - initial[n]).norm() / initial[n].norm() for n in initial)
    assert moved > 1e-3, moved  # the comparison is of trained weights


def test_tsp_rloo_trainer_zero3_equals_plain_rloo_trainer(tmp_path):
    reference, tsp = _runs(tmp_path, 1, zero_stage=3)
    _assert_same_run(reference, tsp, tmp_path)
    assert reference[1]["clip_ratio/region_mean"] > 0, reference  # the second step's ratios are off-policy


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_rloo_tsp2_x_data2_zero_equals_plain_two_process_rloo(tmp_path, stage):
    _assert_same_run(*_runs(tmp_path, 2, zero_stage=stage), tmp_path)


# --- composition and refusals (in-process, nothing built) ----------------------------------------------------
def test_rloo_composition_and_wrong_order():
    trl = pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPRLOOTrainer, TSPTrainer

    assert TSPRLOOTrainer.__mro__[1:3] == (TSPTrainer, trl.RLOOTrainer)
    assert TSPRLOOTrainer._tsp_with_rloo and TSPRLOOTrainer._tsp_online_rl == "rloo"
    composed = type("R", (TSPTrainer, trl.RLOOTrainer), {})  # the class users write
    assert composed._tsp_with_rloo and not composed._tsp_with_grpo and composed._tsp_online_rl == "rloo"
    with pytest.raises(TSPConfigError, match=r"list TSPTrainer first, class Wrong\(TSPTrainer, RLOOTrainer\)"):
        type("Wrong", (trl.RLOOTrainer, TSPTrainer), {})
    with pytest.raises(TSPConfigError, match="grpo and rloo trainers together"):
        type("Both", (TSPTrainer, trl.RLOOTrainer, trl.GRPOTrainer), {})


def test_rloo_options_tsp_cannot_honour_are_refused_by_name():
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPRLOOTrainer

    name = r"with TSP \(TSPRLOOTrainer\)"
    refused = [({"peft_config": object()}, {}, "peft_config=.*" + name),
               ({}, {"use_vllm": True, "vllm_mode": "colocate"}, "vllm_mode='colocate' " + name),
               ({}, {"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching"),
               ({}, {"use_liger_kernel": True}, "use_liger_kernel=True " + name),
               ({}, {"router_aux_loss_coef": 0.01}, "router_aux_loss_coef " + name),
               ({}, {"sync_ref_model": True, "deepspeed_plugin": SimpleNamespace(zero_stage=3)},
                "sync_ref_model=True under ZeRO-3 " + name),
               ({"processing_class": object()}, {}, "processing_class=object " + name),
               ({"model": "Qwen/Qwen3-0.6B"}, {}, r"model='Qwen/Qwen3-0.6B' \(a name\) " + name),
               ({"quantization_config": object()}, {}, "quantization_config= " + name)]
    for kwargs, options, match in refused:  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=match):
            TSPRLOOTrainer(**{"model": None, **kwargs}, args=SimpleNamespace(**options))
    with pytest.raises(TSPConfigError, match="TSPRLOOTrainer arguments: .*pass them by keyword"):
        TSPRLOOTrainer(None, None, None, None, None, None, None, None, None, None, None, None, None)
    cp = SimpleNamespace(device="cpu", parallelism_config=None,
                         hf_deepspeed_config=SimpleNamespace(config={"tsp": {"size": 2, "cp_size": 2}}))
    with pytest.raises(TSPConfigError, match="tsp.cp_size=2 with TSPRLOOTrainer"):
        TSPRLOOTrainer(model=None, args=cp)


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    torch.set_num_threads(1)
    main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
