"""TRL's RewardTrainer on TSP: ds_tsp.hf.TSPRewardTrainer (`class R(TSPTrainer, RewardTrainer)`) at TSP=2 (ZeRO-2,
SGD, fp32) equals a plain RewardTrainer in one process with the same seed and preference data, per logged step
(1e-5 relative; the reward statistics relative to the step's largest |reward|): loss, grad_norm, TRL's min / mean /
max reward, accuracy, margin, and num_tokens (exact); evaluate() likewise, predict()'s rewards, the saved
weights after 3 steps, and the trained model's scores when it is called directly (outside DeepSpeed's engine).
The tiny Llama ...ForSequenceClassification (num_labels=1) is built with pad_token_id 2 while the tokenizer pads
with 0, so the run also checks that the TSP model pools where RewardTrainer's pad token (set on the config after
the model is built) says. One run covers a text dataset with an explicit prompt and margins,
center_rewards_coefficient, gradient accumulation 2, gradient checkpointing, and evaluate() on a pre-tokenized
dataset (chosen_ids / rejected_ids). The composition users write is checked by its class; options TSP cannot honour
are refused by name.
Slow (opt-in): TSP=2 x data 2 with ZeRO-2 (4 processes, no checkpointing) equals a plain 2-process RewardTrainer
(the data axis is TRL's process axis: its gathered rewards and token counts); TSP=2 under ZeRO-3 with nothing kept
whole (test_grpo.py's zero(3)) equals the one-process RewardTrainer with the same assertions (total_flos included:
the parameter count reads a partitioned parameter's whole shape).

Run as a script, this file is the worker: `python tests/integrations/test_reward_trainer.py OUT.json MODEL TOKENIZER
[DS_CONFIG]` (one launch runs every case; the reference and TSP=2 launches run at the same time).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
WORDS = [f"w{i}" for i in range(40)]
MODEL_PAD = 2  # "<unk>": the tokenizer's pad is "<pad>" (0), which RewardTrainer writes onto the config
BATCH, ACCUMULATION, STEPS = 2, 2, 3
METRICS = ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")
REWARDS = ("min_reward", "mean_reward", "max_reward", "margin")  # relative to the step's largest |reward|


# --- the worker ----------------------------------------------------------------------------------------------
def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over WORDS, trained locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(directory)


def save_reward_model(directory: Path, family: str = "llama") -> None:
    """A tiny ...ForSequenceClassification of `family`, one label, vocab 43 (a padded vocab shard at D=2)."""
    import transformers
    from hf_tiny import init_tiny_weights_, tiny_config

    config = tiny_config(family, num_labels=1, pad_token_id=MODEL_PAD, vocab_size=len(WORDS) + 3)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    init_tiny_weights_(model.to(torch.float64)).to(torch.float32).save_pretrained(directory)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def rows(kind: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    if kind == "text":  # explicit prompt, margins: TRL tokenizes, appends EOS, and passes the margins along
        return [{"prompt": _words(rng, 2, 6), "chosen": " " + _words(rng, 1, 8), "rejected": " " + _words(rng, 1, 8),
                 "margin": round(rng.uniform(0.0, 0.5), 3)} for _ in range(n)]
    return [{"chosen_ids": [rng.randrange(3, 3 + len(WORDS)) for _ in range(rng.randint(3, 15))],
             "rejected_ids": [rng.randrange(3, 3 + len(WORDS)) for _ in range(rng.randint(3, 15))]}
            for _ in range(n)]


def main(out: str, model_dir: str, tokenizer_dir: str, ds_config: str | None = None) -> None:
    import transformers
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    out_dir = str(Path(out).with_suffix(""))
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // (2 if ds_config else 1)  # TSP=2 in the DeepSpeed config
    # loaded before the config: under a ZeRO-3 config transformers would load it partitioned (zero.Init)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    args = RewardConfig(output_dir=out_dir, max_steps=STEPS, optim="sgd", learning_rate=0.5,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1,
                        report_to=[], save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True,
                        use_cpu=not torch.cuda.is_available(), bf16=False, max_grad_norm=1.0,
                        dataloader_drop_last=True, per_device_train_batch_size=BATCH, per_device_eval_batch_size=2,
                        gradient_accumulation_steps=ACCUMULATION, center_rewards_coefficient=0.01,
                        gradient_checkpointing=replicas == 1, deepspeed=ds_config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if ds_config is None:
        trainer_class = RewardTrainer
    else:
        from ds_tsp.hf import TSPRewardTrainer as trainer_class
    train = rows("text", STEPS * BATCH * ACCUMULATION * replicas, seed=1)
    trainer = trainer_class(model=model, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(train),
                            eval_dataset=Dataset.from_list(rows("ids", 4, seed=2)))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    trainer.evaluate()
    rewards = trainer.predict(trainer.eval_dataset).predictions  # [chosen; rejected] of each batch, gathered
    trainer.save_model(f"{out_dir}/final")
    chosen = [row["chosen_ids"] for row in rows("ids", 4, seed=2)]
    width = max(map(len, chosen))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in chosen], device=args.device)
    with torch.no_grad():  # the trained model called directly, not through DeepSpeed's engine (a user scoring)
        direct = trainer.model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"log": trainer.state.log_history, "predictions": rewards.tolist(),
                                         "direct": direct.tolist()}))


# --- the tests -------------------------------------------------------------------------------------------------
def _launch(out: Path, model: Path, tokenizer: Path, ds_config: Path | None = None,
            nproc: int = 1, trace: Path | None = None) -> subprocess.Popen:
    """trace: record every rank's collectives there (tests/helpers/traced_run.py) for the NCCL-rules replay."""
    from warm_python import python_command

    # plain python, or torchrun's ranks (warm_python.py); a traced run starts fresh interpreters (python_command)
    launch = python_command(0 if nproc == 1 else nproc, fresh=trace is not None)
    argv = [str(out), str(model), str(tokenizer)] + ([str(ds_config)] if ds_config else [])
    traced = [str(ROOT / "tests" / "helpers" / "traced_run.py"), str(trace)] if trace is not None else []
    return subprocess.Popen([*launch, *traced, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def _close(a, b, tol=1e-5, scale=0.0):
    return abs(a - b) <= tol * max(abs(b), scale, 1e-8)


def _reward_scale(line: dict, prefix: str = "") -> float:
    """The size of the step's rewards: a mean or margin of rewards of both signs is compared relative to it (fp32
    sums in another order differ by a few 1e-8 of the rewards, not of their near-cancelling mean)."""
    return max(abs(line[f"{prefix}min_reward"]), abs(line[f"{prefix}max_reward"]))


def _runs(tmp: Path, data_replicas: int, stage: int = 2, family: str = "llama") -> dict:
    """The plain RewardTrainer on `data_replicas` processes and TSP=2 on 2 x data_replicas under ZeRO `stage`,
    launched together, on a tiny `family` reward model."""
    from test_grpo import zero
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")
    save_reward_model(tmp / "model", family)
    save_tokenizer(tmp / "tokenizer")
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": zero(stage),
        "zero_allow_untested_optimizer": True, "tsp": {"size": 2}}))
    # both at once: the plain reference (one process) and TSP=2 share the two cores while each starts up
    reference = _launch(tmp / "ref.json", tmp / "model", tmp / "tokenizer", nproc=data_replicas)
    tsp = _launch(tmp / "tsp.json", tmp / "model", tmp / "tokenizer", tmp / "ds.json", nproc=2 * data_replicas,
                  trace=tmp / "trace" if data_replicas == 1 else None)
    return {"runs": (_finish(reference, tmp / "ref.json"), _finish(tsp, tmp / "tsp.json")),
            "final": (tmp / "ref", tmp / "tsp")}


def test_tsp_reward_trainer_equals_plain_reward_trainer(tmp_path):
    """...and the TSP run (training, evaluate, predict: whole-batch loaders), recorded, obeys NCCL's rules."""
    from traced_run import assert_obeys_nccl_rules

    _assert_same_run(_runs(tmp_path, 1))
    assert_obeys_nccl_rules(tmp_path / "trace", kinds={"all_reduce", "all_gather", "broadcast"})


@pytest.mark.slow
def test_tsp_reward_trainer_under_zero3_equals_plain_reward_trainer(tmp_path):
    """ZeRO-3 partitions every parameter again as soon as the module that fetched it is done (tests/integrations/
    test_grpo.py's zero(3)): what a layer reads outside its children's hooks (Qwen3's q/k norms) and the score head,
    read by the classifier's pooling outside its core's forward, are whole in the forward and in the backward
    (gradient checkpointing's recompute included)."""
    _assert_same_run(_runs(tmp_path, 1, stage=3, family="qwen3"))


@pytest.mark.slow
def test_tsp2_x_data2_zero2_equals_plain_two_process_reward_trainer(tmp_path):
    _assert_same_run(_runs(tmp_path, 2))


def _assert_same_run(reward_runs: dict) -> None:
    from safetensors.torch import load_file

    (reference, tsp), predictions = ([run["log"] for run in reward_runs["runs"]],
                                     [torch.tensor(run["predictions"]) for run in reward_runs["runs"]])
    assert predictions[0].shape == predictions[1].shape == (8, 1), predictions
    assert (predictions[1] - predictions[0]).abs().max() <= 1e-5 * predictions[0].abs().max(), predictions
    direct = [torch.tensor(run["direct"]) for run in reward_runs["runs"]]
    assert direct[0].shape == direct[1].shape == (4, 1), direct
    assert (direct[1] - direct[0]).abs().max() <= 1e-5 * direct[0].abs().max(), direct
    want = [line for line in reference if "loss" in line and "train_runtime" not in line]
    got = [line for line in tsp if "loss" in line and "train_runtime" not in line]
    assert len(want) == STEPS and [g["step"] for g in got] == [w["step"] for w in want], (got, want)
    assert len({w["loss"] for w in want}) == STEPS, want  # the model trains: every step's loss differs
    for g, w in zip(got, want):
        for key in METRICS:
            assert _close(g[key], w[key], scale=_reward_scale(w) if key in REWARDS else 0.0), (key, g, w)
        assert g["num_tokens"] == w["num_tokens"] > 0, (g, w)
    totals = [[line for line in runs if "train_runtime" in line] for runs in (tsp, reference)]
    assert totals[0][0]["total_flos"] == totals[1][0]["total_flos"] > 0, totals
    assert _close(totals[0][0]["train_loss"], totals[1][0]["train_loss"]), totals
    evals = [[line for line in runs if "eval_loss" in line] for runs in (tsp, reference)]
    assert len(evals[0]) == len(evals[1]) == 1
    got_eval, want_eval = evals[0][0], evals[1][0]
    assert got_eval["eval_num_tokens"] == want_eval["eval_num_tokens"]
    for key in ("loss", "accuracy", *REWARDS):
        scale = _reward_scale(want_eval, "eval_") if key in REWARDS else 0.0
        assert _close(got_eval[f"eval_{key}"], want_eval[f"eval_{key}"], scale=scale), (key, evals)
    ref_dir, tsp_dir = (root / "final" for root in reward_runs["final"])
    want_w, got_w = load_file(ref_dir / "model.safetensors"), load_file(tsp_dir / "model.safetensors")
    initial = load_file(Path(reward_runs["final"][0]).parent / "model" / "model.safetensors")
    assert set(got_w) == set(want_w) == set(initial)
    for name, tensor in want_w.items():
        assert (got_w[name] - tensor).norm() <= 1e-5 * tensor.norm() + 1e-7, name
    moved = [(want_w[n] - initial[n]).norm() / initial[n].norm() for n in ("score.weight", "model.embed_tokens.weight")]
    assert min(moved) > 1e-4, moved  # the comparison is of trained weights


def test_reward_trainer_composes_and_refuses_what_tsp_cannot_honour_by_name():
    trl = pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    import transformers
    from hf_tiny import tiny_config

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPRewardTrainer, TSPTrainer
    from ds_tsp.integrations.trl.reward import to_reward_model

    assert TSPRewardTrainer.__mro__[1:3] == (TSPTrainer, trl.RewardTrainer) and TSPRewardTrainer._tsp_with_reward
    assert type("RewardWithTSP", (TSPTrainer, trl.RewardTrainer), {})._tsp_with_reward  # the class users write
    with pytest.raises(TSPConfigError, match=r"list TSPTrainer first, class Wrong\(TSPTrainer, RewardTrainer\)"):
        type("Wrong", (trl.RewardTrainer, TSPTrainer), {})
    with pytest.raises(TSPConfigError, match="reward and sft trainers together"):
        type("Both", (TSPTrainer, trl.RewardTrainer, trl.SFTTrainer), {})
    plain = {"chat_template_path": None}
    as_string = r"model='Qwen/Qwen3-0.6B' \(a string\).*AutoModelForSequenceClassification\.from_pretrained"
    refused = [({"model": "Qwen/Qwen3-0.6B"}, {}, as_string),
               ({"peft_config": object()}, {}, "peft_config="),
               ({"quantization_config": object()}, {}, "quantization_config="),
               ({}, {"chat_template_path": "Qwen/Qwen3-0.6B"}, "chat_template_path=")]
    for kwargs, options, match in refused:  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=match):
            TSPRewardTrainer(**{"model": None, **kwargs}, args=SimpleNamespace(**{**plain, **options}))
    cp = SimpleNamespace(**plain, device="cpu", parallelism_config=None,
                         hf_deepspeed_config=SimpleNamespace(config={"tsp": {"size": 2, "cp_size": 2}}))
    with pytest.raises(TSPConfigError, match="tsp.cp_size=2 with TSPRewardTrainer"):
        TSPRewardTrainer(model=None, args=cp)
    causal_lm = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    with pytest.raises(TSPConfigError, match=r"model=LlamaForCausalLM with TSPRewardTrainer.*SequenceClassification"):
        to_reward_model(causal_lm, runtime=None)


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
