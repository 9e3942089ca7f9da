"""TRL's DPOTrainer on TSP: ds_tsp.hf.TSPDPOTrainer (`class D(TSPTrainer, DPOTrainer)`) at TSP=2 (ZeRO-2, SGD, fp32)
equals a plain DPOTrainer in one process with the same seed and preference data, per logged step over 3 steps:
loss, grad_norm and every metric TRL logs (rewards/chosen, rejected, accuracies, margins, logps/*, logits/*,
entropy, mean_token_accuracy: 1e-5 relative; the rewards, differences of policy and reference log-probs, relative
to beta x the step's |logps/chosen|), num_tokens exactly.
Prompts, chosen and rejected completions have different lengths (3 to 19 tokens a row, so every row's zigzag cut
falls inside it, chosen and rejected cut at different places); the tiny Llama's vocabulary (43) leaves a padded
vocab shard at D=2, which logits/* must not count.
One launch runs several trainers (one process start for all):
- "sigmoid": loss_type sigmoid, gradient accumulation 2, gradient checkpointing, sync_ref_model (the reference
  mixed with the policy every step), WPO weighting (use_weighting: log sum p^2 from the vocab shards), evaluate(),
  the saved weights, predict() refused by name (it would rebuild full logits);
- "combined": every pairwise loss type TRL ships but aot (hinge, ipo, exo_pair, nca_pair, robust, bco_pair,
  sppo_hard, apo_zero, apo_down, discopop, sft, sigmoid_norm, sigmoid) as one weighted combination, with ld_alpha
  and an explicit ref_model (TRL's sft term cannot take WPO weights: it multiplies an expanded tensor in place);
- "aot": aot + aot_unpaired (they sort the batch), precompute_ref_log_probs, padding_free=True (which TRL 1.16
  turns off itself: both runs pad);
- "peft": peft_config=LoraConfig (every projection), ref_model=None, WPO weighting, gradient checkpointing: the
  reference is the policy's own pass with the adapter off; the saved adapter equals the plain run's, and plain
  peft reloads it with its scores; the plain run's rewards are far from those of a reference that kept the
  adapter (all zero).
examples/dpo.py runs at TSP=2 (step 1's loss is log 2: the reference is the policy's copy; then it trains).
Slow (opt-in): TSP=2 x data 2 with ZeRO-2 (4 processes) equals a plain 2-process DPOTrainer (sigmoid, combined and
peft cases); "peft_model" (a PEFT model with a nonzero adapter, sigmoid + ipo, ld_alpha, precompute_ref_log_probs:
the reference is the adapter before training, TRL's "ref" copy) at TSP=2; TSP=2 under ZeRO-3 (the combined case,
the policy given as its checkpoint directory, and both LoRA cases) equals the plain run; examples/dpo.py at TSP=2
logs the plain one-process run's steps.

Run as a script, this file is the worker: `python tests/integrations/test_dpo_trainer.py OUT.json MODEL TOKENIZER
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
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "helpers"),
                                      os.environ.get("PYTHONPATH", "")])}
WORDS = [f"w{i}" for i in range(40)]
BATCH, STEPS, BETA = 2, 3, 0.5
PAIRWISE = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
            "apo_down", "discopop", "sft", "sigmoid_norm"]
CASES = {
    "sigmoid": {"loss_type": ["sigmoid"], "gradient_accumulation_steps": 2, "gradient_checkpointing": True,
                "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5, "use_weighting": True},
    "combined": {"loss_type": PAIRWISE, "loss_weights": [1.0 + 0.1 * i for i in range(len(PAIRWISE))],
                 "label_smoothing": 0.1, "ld_alpha": 0.7, "ref_model": True},
    "aot": {"loss_type": ["aot", "aot_unpaired"], "loss_weights": [1.0, 0.5], "precompute_ref_log_probs": True,
            "padding_free": True},
    "peft": {"loss_type": ["sigmoid"], "peft": "config", "use_weighting": True, "gradient_checkpointing": True},
}
SLOW_CASES = {  # run by the slow tests only
    "peft_model": {"loss_type": ["sigmoid", "ipo"], "peft": "model", "precompute_ref_log_probs": True,
                   "ld_alpha": 0.7},
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METRICS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "entropy", "mean_token_accuracy",
           "rewards/accuracies")
LOGITS = ("logits/chosen", "logits/rejected")  # relative to the run's largest |mean logit|
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")


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


def save_causal_lm(directory: Path) -> None:
    """A tiny Llama causal LM, vocab 43 (a padded vocab shard at D=2)."""
    import transformers
    from hf_tiny import init_tiny_weights_, tiny_config

    config = tiny_config("llama", vocab_size=len(WORDS) + 3, pad_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    init_tiny_weights_(model.to(torch.float64)).to(torch.float32).save_pretrained(directory)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _words(rng, 2, 9), "chosen": " " + _words(rng, 1, 9), "rejected": " " + _words(rng, 1, 9)}
            for _ in range(n)]


def run_case(name: str, model_dir: str, tokenizer_dir: str, out_dir: str, ds_config: str | None) -> dict:
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    options = dict({**CASES, **SLOW_CASES}[name])
    accumulation = options.pop("gradient_accumulation_steps", 1)
    given_ref = options.pop("ref_model", False)
    adapter = options.pop("peft", None)
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // (2 if ds_config else 1)  # TSP=2 in the DeepSpeed config
    # loaded before the DPOConfig: under a live ZeRO-3 config an HF model's weights would be partitioned (the
    # previous case's, still alive in this process, is forgotten first)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=f"{out_dir}/{name}", max_steps=STEPS, optim="sgd", learning_rate=0.5,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1,
                     report_to=[], save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True,
                     use_cpu=not torch.cuda.is_available(), bf16=False, max_grad_norm=1.0, beta=BETA,
                     dataloader_drop_last=True, per_device_train_batch_size=BATCH, per_device_eval_batch_size=2,
                     gradient_accumulation_steps=accumulation, deepspeed=ds_config, **options)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if ds_config is None:
        trainer_class = DPOTrainer
    else:
        from ds_tsp.hf import TSPDPOTrainer as trainer_class
    train = Dataset.from_list(rows(STEPS * BATCH * accumulation * replicas, seed=1))
    if options.get("precompute_ref_log_probs"):  # TRL caches the reference log-probs beside the dataset's files
        from datasets import load_from_disk

        train = load_from_disk(str(Path(out_dir).parent / "data" / f"{name}-{'tsp' if ds_config else 'ref'}"))
    evaluate = name == "sigmoid"
    # under ZeRO-3 TSP reads the checkpoint by slices (a LoRA case: the model loaded before the DPOConfig)
    zero3 = ds_config is not None and json.loads(Path(ds_config).read_text())["zero_optimization"]["stage"] == 3
    model = model_dir if zero3 and adapter is None else model
    ref_model = None
    if given_ref:  # an explicit reference (the same weights): TSP converts it as its own frozen model
        ref_model = model_dir if zero3 else transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                                               dtype=torch.float32)
    more = {}
    if adapter is not None:  # LoRA, ref_model=None: the reference is the adapter-disabled base (peft_config=) or,
        import peft  # for a PEFT model, its adapter as it was before training (here a nonzero one)
        from hf_tiny import randomize_lora_

        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
        torch.manual_seed(0)  # PEFT draws lora_A from the global generator: the same in both runs
        if adapter == "config":
            more["peft_config"] = lora
        else:
            model = randomize_lora_(peft.get_peft_model(model, lora))
    trainer = trainer_class(model=model, ref_model=ref_model, args=args, processing_class=tokenizer,
                            train_dataset=train,
                            eval_dataset=Dataset.from_list(rows(4, seed=2)) if evaluate else None, **more)
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    log = trainer.state.log_history
    if adapter is not None:
        trainer.save_model(f"{out_dir}/{name}/final")
    if evaluate:
        trainer.evaluate()
        trainer.save_model(f"{out_dir}/{name}/final")
        if ds_config is not None:  # predict() would rebuild full logits: refused on every rank before any collective
            from ds_tsp.core.errors import TSPConfigError

            try:
                trainer.predict(trainer.eval_dataset)
            except TSPConfigError as err:
                log = [*log, {"predict": "refused" if "TSPDPOTrainer.predict" in str(err) else str(err)}]
    return log


def main(out: str, model_dir: str, tokenizer_dir: str, ds_config: str | None = None, cases: str = "") -> None:
    out_dir, ds_config = str(Path(out).with_suffix("")), ds_config or None
    logs = {name: run_case(name, model_dir, tokenizer_dir, out_dir, ds_config)
            for name in (cases.split(",") if cases else CASES)}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(logs))


# --- the tests -------------------------------------------------------------------------------------------------
def _launch(out: Path, model: Path, tokenizer: Path, ds_config: Path | None, nproc: int,
            cases: str) -> subprocess.Popen:
    from warm_python import python_command

    launch = python_command(0 if nproc == 1 else nproc)  # plain python, or torchrun's ranks (warm_python.py)
    argv = [str(out), str(model), str(tokenizer), str(ds_config) if ds_config else "", cases]
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def _close(a, b, tol=1e-5, scale=0.0):
    return abs(a - b) <= tol * max(abs(b), scale, 1e-8)


def _runs(tmp: Path, data_replicas: int, cases: str = "", zero_stage: int = 2) -> dict:
    """The plain DPOTrainer on `data_replicas` processes and TSP=2 on 2 x data_replicas, launched together."""
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")
    save_causal_lm(tmp / "model")
    save_tokenizer(tmp / "tokenizer")
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True, "tsp": {"size": 2}}))
    from datasets import Dataset

    for name, options in {**CASES, **SLOW_CASES}.items():  # on disk, one copy per run: TRL's precompute cache
        if options.get("precompute_ref_log_probs"):
            n = STEPS * BATCH * options.get("gradient_accumulation_steps", 1) * data_replicas
            for run in ("ref", "tsp"):
                Dataset.from_list(rows(n, seed=1)).save_to_disk(str(tmp / "data" / f"{name}-{run}"))
    reference = _launch(tmp / "ref.json", tmp / "model", tmp / "tokenizer", None, data_replicas, cases)
    tsp = _launch(tmp / "tsp.json", tmp / "model", tmp / "tokenizer", tmp / "ds.json", 2 * data_replicas, cases)
    return {"runs": (_finish(reference, tmp / "ref.json"), _finish(tsp, tmp / "tsp.json")), "root": tmp}


def test_tsp_dpo_trainer_equals_plain_dpo_trainer(tmp_path):
    _assert_same_runs(_runs(tmp_path, 1))


@pytest.mark.slow
def test_tsp2_x_data2_zero2_equals_plain_two_process_dpo_trainer(tmp_path):
    _assert_same_runs(_runs(tmp_path, 2, cases="sigmoid,combined,peft"))


@pytest.mark.slow
def test_tsp_dpo_trainer_with_a_peft_model_equals_plain_dpo_trainer(tmp_path):
    """A PEFT model (nonzero initial adapter), ref_model=None, precompute_ref_log_probs: the reference is the adapter
    as it was before training, as DPOTrainer's "ref" copy of it."""
    _assert_same_runs(_runs(tmp_path, 1, cases="peft_model"))


@pytest.mark.slow
def test_tsp2_zero3_equals_plain_dpo_trainer(tmp_path):
    _assert_same_runs(_runs(tmp_path, 1, cases="combined,peft,peft_model", zero_stage=3))


def _assert_same_line(got: dict, want: dict, logits_scale: float, prefix: str = "") -> None:
    for key in METRICS:
        key = prefix + key
        if key in want:
            assert _close(got[key], want[key]), (key, got, want)
    for key in LOGITS:
        assert _close(got[prefix + key], want[prefix + key], scale=logits_scale), (key, got, want)
    scale = BETA * abs(want[f"{prefix}logps/chosen"])
    for key in REWARDS:
        assert _close(got[prefix + key], want[prefix + key], scale=scale), (key, got, want)
    assert got[f"{prefix}num_tokens"] == want[f"{prefix}num_tokens"], (got, want)


def _assert_same_runs(dpo_runs: dict) -> None:
    from safetensors.torch import load_file

    reference, tsp = dpo_runs["runs"]
    assert set(tsp) == set(reference)
    for case in reference:
        want = [line for line in reference[case] if "loss" in line and "train_runtime" not in line]
        got = [line for line in tsp[case] if "loss" in line and "train_runtime" not in line]
        assert len(want) == STEPS and [g["step"] for g in got] == [w["step"] for w in want], (case, got, want)
        assert len({w["loss"] for w in want}) == STEPS, (case, want)  # the model trains: every step's loss differs
        assert want[-1]["rewards/margins"] != 0.0 and want[0]["logits/chosen"] != 0.0, (case, want)
        # a mean logit over the vocabulary nearly cancels (logits of both signs): fp32 sums in another order differ
        # by a few 1e-8 of the logits, not of their mean
        logits_scale = max(abs(w[key]) for w in want for key in LOGITS)
        for g, w in zip(got, want):
            assert set(g) == set(w), (case, sorted(set(g) ^ set(w)))
            _assert_same_line(g, w, logits_scale)
        totals = [[line for line in runs[case] if "train_runtime" in line][0] for runs in (tsp, reference)]
        assert totals[0]["total_flos"] == totals[1]["total_flos"] > 0, (case, totals)
        assert _close(totals[0]["train_loss"], totals[1]["train_loss"]), (case, totals)
        if case.startswith("peft"):
            _assert_same_adapters(dpo_runs["root"], case, want)
    if "sigmoid" not in reference:  # evaluate(), predict() and the saved weights: the sigmoid case's
        return
    assert {"predict": "refused"} in tsp["sigmoid"], tsp["sigmoid"][-2:]
    evals = [[line for line in runs["sigmoid"] if "eval_loss" in line] for runs in (tsp, reference)]
    assert len(evals[0]) == len(evals[1]) == 1, evals
    assert _close(evals[0][0]["eval_loss"], evals[1][0]["eval_loss"]), evals
    _assert_same_line(evals[0][0], evals[1][0], max(abs(evals[1][0][f"eval_{key}"]) for key in LOGITS), "eval_")
    root = dpo_runs["root"]
    want_w = load_file(root / "ref" / "sigmoid" / "final" / "model.safetensors")
    got_w = load_file(root / "tsp" / "sigmoid" / "final" / "model.safetensors")
    initial = load_file(root / "model" / "model.safetensors")
    assert set(got_w) == set(want_w) == set(initial)
    for name, tensor in want_w.items():
        assert (got_w[name] - tensor).norm() <= 1e-5 * tensor.norm() + 1e-7, name
    moved = (want_w["lm_head.weight"] - initial["lm_head.weight"]).norm() / initial["lm_head.weight"].norm()
    assert moved > 1e-4, moved  # the comparison is of trained weights


def _assert_same_adapters(root: Path, case: str, want: list[dict]) -> None:
    """A LoRA case: the reference really is the adapter-off base (peft_config=) / the initial adapter (a PEFT model):
    the plain run's rewards are far from those of a reference that kept the trained adapter (0: the policy itself)
    or dropped the initial one; the TSP run's saved adapter equals the plain run's, trained, and plain peft
    reloads it onto the base model with the plain adapter's scores."""
    import peft
    import transformers
    from safetensors.torch import load_file

    rewards = max(abs(w[key]) / (BETA * abs(w["logps/chosen"])) for w in want for key in REWARDS)
    assert rewards > 1e-4, want  # 10x the comparison's tolerance
    if case == "peft_model":  # step 1: the policy is its initial adapter, exactly the reference (not the base)
        assert want[0]["rewards/chosen"] == want[0]["rewards/margins"] == 0.0, want[0]
    got_dir, want_dir = root / "tsp" / case / "final", root / "ref" / case / "final"
    got, plain = load_file(got_dir / "adapter_model.safetensors"), load_file(want_dir / "adapter_model.safetensors")
    assert set(got) == set(plain) and len(plain) == 2 * len(LORA_TARGETS) * 2, sorted(set(got) ^ set(plain))
    for name, tensor in plain.items():
        assert (got[name] - tensor).norm() <= 1e-5 * tensor.norm() + 1e-7, name
    b = [name for name in plain if name.endswith("down_proj.lora_B.weight")][0]
    assert plain[b].norm() > 1e-3, b  # trained (peft_config= starts B at zero)
    probe = torch.randint(0, len(WORDS) + 3, (2, 11), generator=torch.Generator().manual_seed(3))
    scores = []
    for directory in (got_dir, want_dir):
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
        with torch.no_grad():
            scores.append(peft.PeftModel.from_pretrained(base, directory)(input_ids=probe).logits)
    assert (scores[0] - scores[1]).norm() <= 1e-5 * scores[1].norm()


def _run_example(tmp: Path, steps: int, plain: bool) -> list[list[dict]]:
    """examples/dpo.py at TSP=2 (ds_configs/tsp.json: AdamW, lr 3e-3) and, with plain, as a one-process DPOTrainer
    (--lr 3e-3) launched beside it: each run's JSON lines."""
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")
    example, common = str(ROOT / "examples" / "dpo.py"), ["--max_steps", str(steps), "--beta", "0.1"]
    commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", example,
                 "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), "--output_dir", str(tmp / "tsp"), *common]]
    if plain:
        commands.append([sys.executable, example, "--lr", "3e-3", "--output_dir", str(tmp / "plain"), *common])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for cmd in commands]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        lines.append([json.loads(line) for line in out.splitlines()])
    assert all([line["step"] for line in run] == list(range(1, steps + 1)) for run in lines), lines
    return lines


def test_dpo_example_trains_under_tsp(tmp_path):
    """examples/dpo.py at TSP=2: step 1 scores the policy against itself (the reference is its copy), so the sigmoid
    loss is exactly -log sigmoid(0) = log 2 and the margin 0; then it trains (the chosen completions win), and the
    saved model is one transformers loads. Its equality with a plain run: the slow test below."""
    import math

    import transformers

    (got,) = _run_example(tmp_path, steps=2, plain=False)
    assert _close(got[0]["loss"], math.log(2), tol=1e-6) and got[0]["margin"] == 0.0, got
    assert got[1]["margin"] > 0 and got[1]["accuracy"] > 0 and got[1]["loss"] < got[0]["loss"], got
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tsp").num_parameters() > 0


@pytest.mark.slow
def test_dpo_example_under_tsp_logs_the_plain_runs_steps(tmp_path):
    """examples/dpo.py at TSP=2 and as a plain DPOTrainer: the same JSON line per step (AdamW: 1e-4 relative; the
    margin relative to beta x |chosen_logps|)."""
    got, want = _run_example(tmp_path, steps=3, plain=True)
    assert want[1]["margin"] > 0 and want[0]["loss"] != want[1]["loss"], want  # it trains
    for g, w in zip(got, want):
        assert g["accuracy"] == w["accuracy"], (g, w)
        for key in ("loss", "chosen_logps", "rejected_logps"):
            assert _close(g[key], w[key], tol=1e-4), (key, g, w)
        assert _close(g["margin"], w["margin"], tol=1e-4, scale=0.1 * abs(w["chosen_logps"])), (g, w)


def test_fused_head_logit_stats_read_nothing_on_the_host():
    """DPOTrainer's fused-head call (log-probs with the mean logit and log sum p^2) and its backward: no host sync
    (counted by what runs, tests/helpers/sync_counter.py), on a soft-capped head with a padded vocab row."""
    from sync_counter import SyncCounter

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.model.fused_lm_head import FusedLMHeadCall

    shape = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, final_logit_softcapping=5.0)
    model = ShardedCausalLM(shape, TSPComm.single(), dtype=torch.float64).init_weights_(0)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(12) < 4, -100)
    b = shard_batch(tsp=1, rank=0, input_ids=ids, labels=labels)
    h, _ = model.final_hidden(b["input_ids"], b["position_ids"], None, b["shift_labels"], None)
    batch = {"shift_labels": b["shift_labels"], "attention_mask": None}
    with SyncCounter() as syncs:
        out = FusedLMHeadCall(logit_stats=True)._stats(model, h, batch, b["seq_len"], None)
        (out.log_probs.sum() + out.mean_logits.sum() + out.log_sum_sq_probs.sum()).backward()
    assert not syncs.events, syncs.events
    assert out.mean_logits.abs().sum() > 0 and out.log_sum_sq_probs.abs().sum() > 0


def test_dpo_trainer_composes_and_refuses_what_tsp_cannot_honour_by_name():
    trl = pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPDPOTrainer, TSPTrainer

    assert TSPDPOTrainer.__mro__[1:3] == (TSPTrainer, trl.DPOTrainer) and TSPDPOTrainer._tsp_with_dpo
    assert type("DPOWithTSP", (TSPTrainer, trl.DPOTrainer), {})._tsp_with_dpo  # the class users write
    with pytest.raises(TSPConfigError, match=r"list TSPTrainer first, class Wrong\(TSPTrainer, DPOTrainer\)"):
        type("Wrong", (trl.DPOTrainer, TSPTrainer), {})
    with pytest.raises(TSPConfigError, match="dpo and sft trainers together"):
        type("Both", (TSPTrainer, trl.DPOTrainer, trl.SFTTrainer), {})
    plain = {"chat_template_path": None}
    zero3 = SimpleNamespace(zero_stage=3)
    peft_model = SimpleNamespace(peft_config={})
    refused = [({"model": peft_model, "peft_config": object()}, {}, "peft_config= with a PEFT model"),
               ({"model": "a/checkpoint", "peft_config": object()}, {}, "peft_config= with model='a/checkpoint'"),
               ({"model": peft_model}, {"sync_ref_model": True}, "sync_ref_model=True with a PEFT adapter"),
               ({"quantization_config": object()}, {}, "quantization_config="),
               ({"processing_class": object()}, {}, "processing_class=object.*text-only"),
               ({"compute_metrics": len}, {}, "compute_metrics="),
               ({}, {"use_liger_kernel": True}, "use_liger_kernel=True"),
               ({}, {"activation_offloading": True}, "activation_offloading=True.*offload_activations"),
               ({}, {"router_aux_loss_coef": 0.01}, "router_aux_loss_coef"),
               ({}, {"chat_template_path": "Qwen/Qwen3-0.6B"}, "chat_template_path="),
               ({}, {"sync_ref_model": True, "deepspeed_plugin": zero3}, "sync_ref_model=True under ZeRO-3")]
    for kwargs, options, match in refused:  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=match):
            TSPDPOTrainer(**{"model": None, **kwargs}, args=SimpleNamespace(**{**plain, **options}))
    cp = SimpleNamespace(**plain, device="cpu", parallelism_config=None,
                         hf_deepspeed_config=SimpleNamespace(config={"tsp": {"size": 2, "cp_size": 2}}))
    with pytest.raises(TSPConfigError, match="tsp.cp_size=2 with TSPDPOTrainer"):
        TSPDPOTrainer(model=None, args=cp)
    with pytest.raises(TSPConfigError, match="pass them by keyword"):  # DPOTrainer's (model, ref_model, args) order
        TSPDPOTrainer(None, None, SimpleNamespace(**plain), None, None, None, None, None, None, None, None, None, None)
    import transformers
    from hf_tiny import tiny_config

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.integrations.trl.dpo import reference_model
    from ds_tsp.model.convert import to_tsp_model

    tsp_model = object()
    runtime = SimpleNamespace(comm=None, options=None, data_group=None)
    with pytest.raises(TSPConfigError, match="model= is a TSPForCausalLM and no ref_model= was given"):
        reference_model(tsp_model, {}, SimpleNamespace(), runtime, lambda source, *a, **k: source)
    partitioned = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    next(partitioned.parameters()).ds_id = 0  # what zero.Init leaves on a model loaded under a live ZeRO-3 config
    with pytest.raises(TSPConfigError, match="partitioned by DeepSpeed ZeRO-3.*pass the checkpoint directory"):
        to_tsp_model(partitioned, TSPComm.single(), hf_face=True)


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
