"""TRL's SFTTrainer on TSP: `class SFTWithTSP(TSPTrainer, SFTTrainer)` and ds_tsp.hf.TSPSFTTrainer at TSP=2 equal
plain SFTTrainer in one process on the same global batch, per logged step (fp32, 1e-5 relative): loss, TRL's
mean_token_accuracy / entropy / num_tokens metrics, for
- packing=True (the "bfd" strategy: padding-free rows whose documents TRL marks with seq_lengths / cu_seq_lens),
- padding_free=True (a flattened row, position_ids + cu_seq_lens_q/k + seq_idx),
- completion-only loss (a prompt-completion dataset, padded rows with an attention mask) plus evaluate() with a
  compute_metrics (full logits and labels, as the plain SFTTrainer gives them),
- assistant-only loss (a chat template with {% generation %} markers) with loss_type="dft" (per-token weights);
and TSPSFTTrainer at TSP=2 x data 2 (ZeRO-2) equals a plain 2-process (DDP) SFTTrainer, packing=True.
TRL's fused-LM-head call is answered by TSP's streaming head: per-token log-probs / entropy / top-1 and the
gradient of a per-token-weighted loss equal transformers' (float64, 1e-10). The packed-document keys are honoured
or refused by name; other TRL trainers and SFTTrainer-before-TSPTrainer are refused by name.

Run as a script, this file is the worker: `python tests/integrations/test_trl.py OUT.json MODEL TOKENIZER [DS_CONFIG FUSED]`
(one launch runs every case; the reference, TSP=2 and the data-axis launches run at the same time).
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
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos>"
                 "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}")
# name: (SFTConfig options, dataset kind, evaluate too)
CASES = {
    "packing": ({"packing": True, "packing_strategy": "bfd", "max_length": 40, "per_device_train_batch_size": 2},
                "text", 0),
    "padding_free": ({"padding_free": True, "max_length": None, "per_device_train_batch_size": 3}, "text", 0),
    "completion_only": ({"completion_only_loss": True, "max_length": 64, "per_device_train_batch_size": 3},
                        "prompt", 1),
    "assistant_only": ({"assistant_only_loss": True, "loss_type": "dft", "per_device_train_batch_size": 3},
                       "chat", 0),
}
STEPS = 3
METRICS = ("loss", "mean_token_accuracy", "entropy")


# --- the worker ----------------------------------------------------------------------------------------------
def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over WORDS, trained locally (no download), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS[:20] if rng.random() < 0.5 else WORDS) for _ in range(rng.randint(lo, hi)))


def rows(kind: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    if kind == "text":
        return [{"text": _words(rng, 4, 22)} for _ in range(n)]
    if kind == "prompt":
        return [{"prompt": _words(rng, 3, 12), "completion": " " + _words(rng, 2, 10)} for _ in range(n)]
    return [{"messages": [{"role": "user", "content": _words(rng, 2, 8)},
                          {"role": "assistant", "content": _words(rng, 2, 8)},
                          {"role": "user", "content": _words(rng, 2, 6)},
                          {"role": "assistant", "content": _words(rng, 1, 6)}]} for _ in range(n)]


def token_accuracy(prediction) -> dict:
    """compute_metrics: top-1 accuracy and mean log-prob of the next-token labels, from full logits and labels."""
    logits, labels = (torch.as_tensor(x) for x in (prediction.predictions, prediction.label_ids))
    targets, valid = labels[:, 1:], labels[:, 1:] != -100
    log_probs = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return {"accuracy": float((logits[:, :-1].argmax(-1) == targets)[valid].float().mean()),
            "label_log_prob": float(log_probs[valid].mean()), "labels_sum": int(labels.sum())}


def run_case(name: str, model_dir: str, tokenizer_dir: str, ds_config: str | None, out_dir: str) -> list[dict]:
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    options, kind, evaluate = CASES[name]
    args = SFTConfig(output_dir=f"{out_dir}/{name}", max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1, report_to=[], save_strategy="no",
                     train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                     bf16=False, gradient_checkpointing=False, dataloader_drop_last=True, max_grad_norm=1.0,
                     average_tokens_across_devices=True, per_device_eval_batch_size=2, deepspeed=ds_config,
                     **options)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if ds_config is None:
        trainer_class = SFTTrainer
    elif name == "packing":  # the ready-made class
        from ds_tsp.hf import TSPSFTTrainer as trainer_class
    else:  # the composition users write
        from ds_tsp.hf import TSPTrainer

        class SFTWithTSP(TSPTrainer, SFTTrainer):
            pass

        trainer_class = SFTWithTSP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data_replicas = world // (json.loads(Path(ds_config).read_text())["tsp"]["size"] if ds_config else 1)
    n = STEPS * options["per_device_train_batch_size"] * (3 if options.get("packing") else 1) * data_replicas
    trainer = trainer_class(model=model, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(rows(kind, n, seed=1)),
                            eval_dataset=Dataset.from_list(rows(kind, 4, seed=2)) if evaluate else None,
                            compute_metrics=token_accuracy if evaluate else None)  # predictions: full logits
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    if evaluate:
        trainer.evaluate()
    return trainer.state.log_history


def main(out: str, model_dir: str, tokenizer_dir: str, ds_config: str | None = None, fused_dir: str | None = None,
         cases: str | None = None):
    names = cases.split(",") if cases else list(CASES)
    results = {name: run_case(name, model_dir, tokenizer_dir, ds_config or None, str(Path(out).parent))
               for name in names}
    fused = fused_call(fused_dir) if fused_dir else None  # on the TSP ranks the trainers set up
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))
        if fused is not None:
            torch.save(fused, f"{out}.fused.pt")


def fused_batch(vocab: int) -> tuple[dict, torch.Tensor]:
    from hf_tiny import packed_batch

    data = packed_batch(vocab, [[9, 14, 7], [20, 10]], seed=4)
    weights = torch.rand(data["input_ids"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return data, weights


def fused_call(directory: str) -> dict:
    """TRL's fused-LM-head call on a float64 TSP model over the whole world, with a per-token-weighted loss (as
    loss_type="dft" has): its fields and the full gradient."""
    import torch.distributed as dist

    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    assert model.tsp.comm.size == dist.get_world_size() == 2
    data, weights = fused_batch(model.config.vocab_size)
    model.fused_lm_head_outputs = ("log_probs", "mean_logits", "log_sum_sq_probs")  # as DPOTrainer asks for them
    out = model(input_ids=data["input_ids"], labels=data["labels"], position_ids=data["position_ids"],
                fused_lm_head=True)
    (-(out.log_probs * weights).sum()).backward()
    fields = {k: getattr(out, k).detach() for k in ("loss", "log_probs", "entropy", "is_top1", "label_mask",
                                                    "mean_logits", "log_sum_sq_probs")}
    everyone = [None] * 2
    dist.all_gather_object(everyone, fields)
    return {"ranks": everyone, "grads": model.tsp.full_state_dict(grads=True)}


# --- the tests -------------------------------------------------------------------------------------------------
def _launch(out: Path, model: Path, tokenizer: Path, ds_config: Path | None = None,
            fused: Path | None = None, processes: int | None = None, cases: str = "") -> subprocess.Popen:
    from warm_python import python_command

    processes = processes or (1 if ds_config is None else 2)
    launch = python_command(0 if processes == 1 else processes)  # plain python, or torchrun's ranks
    argv = [str(out), str(model), str(tokenizer)] + ([str(ds_config or ""), str(fused or "")] if ds_config or cases
                                                     else [])
    argv += [cases] if cases else []
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def _close(a, b, tol=1e-5):
    return abs(a - b) <= tol * max(abs(b), 1e-8)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")
    from hf_tiny import save_tiny_checkpoint

    from ds_tsp.tools.synthetic import save_tiny_llama

    tmp = tmp_path_factory.mktemp("trl")
    save_tiny_llama(tmp / "model", seed=0)
    save_tiny_checkpoint(tmp / "fused", "llama_linear")  # vocab 67: a padded vocab shard at D=2
    save_tokenizer(tmp / "tokenizer")
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": {"stage": 2},
        "tsp": {"size": 2}}))
    # all at once: the plain references (one process; two for the data axis), TSP=2 and TSP=2 x data 2 share the
    # two cores while each starts up
    reference = _launch(tmp / "ref.json", tmp / "model", tmp / "tokenizer")
    tsp = _launch(tmp / "tsp.json", tmp / "model", tmp / "tokenizer", tmp / "ds.json", tmp / "fused")
    reference_dp = _launch(tmp / "ref_dp.json", tmp / "model", tmp / "tokenizer", processes=2, cases="packing")
    tsp_dp = _launch(tmp / "tsp_dp.json", tmp / "model", tmp / "tokenizer", tmp / "ds.json", processes=4,
                     cases="packing")
    runs = _finish(reference, tmp / "ref.json"), _finish(tsp, tmp / "tsp.json")
    data_runs = _finish(reference_dp, tmp / "ref_dp.json"), _finish(tsp_dp, tmp / "tsp_dp.json")
    return {"sft": runs, "sft_data2": data_runs, "fused": torch.load(tmp / "tsp.json.fused.pt"),
            "fused_dir": tmp / "fused"}


@pytest.mark.parametrize("case", list(CASES))
def test_sft_with_tsp_equals_plain_sft_trainer(sft_runs, case):
    reference, tsp = (runs[case] for runs in sft_runs["sft"])
    _assert_same_steps(reference, tsp, case)


def test_tsp_sft_trainer_tsp2_x_data2_equals_plain_two_process_sft(sft_runs):
    """TSPSFTTrainer on TSP=2 x data 2 (4 processes, ZeRO-2 over the data axis) equals a plain SFTTrainer on 2
    processes (DDP), packing=True: the data axis is the Trainer's process axis (its sampler's shards, num_tokens
    gathered over replicas, the loss weighted by the tokens of both replicas)."""
    runs = sft_runs["sft_data2"]
    _assert_same_steps(runs[0]["packing"], runs[1]["packing"], "packing")
    assert runs[0]["packing"][0]["num_tokens"] > sft_runs["sft"][0]["packing"][0]["num_tokens"], \
        "two replicas count the tokens of both"


def _assert_same_steps(reference: list[dict], tsp: list[dict], case: str) -> None:
    """Every logged step: the loss and TRL's metrics 1e-5, num_tokens equal, the grad norm 1e-4 (fp32); evaluate()'s
    metrics where the case evaluates."""
    want = [line for line in reference if "loss" in line and "train_runtime" not in line]
    got = [line for line in tsp if "loss" in line and "train_runtime" not in line]
    assert len(want) == STEPS and [g["step"] for g in got] == [w["step"] for w in want], (got, want)
    for g, w in zip(got, want):
        for key in METRICS:
            assert _close(g[key], w[key]), (case, key, g, w)
        assert g["num_tokens"] == w["num_tokens"], (case, g, w)
        assert _close(g["grad_norm"], w["grad_norm"], 1e-4), (case, g, w)
    if CASES[case][2]:
        evals = [[line for line in runs if "eval_loss" in line] for runs in (tsp, reference)]
        assert len(evals[0]) == len(evals[1]) == 1
        for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy", "eval_label_log_prob"):
            assert _close(evals[0][0][key], evals[1][0][key]), (key, evals)
        for key in ("eval_accuracy", "eval_labels_sum"):
            assert evals[0][0][key] == evals[1][0][key], (key, evals)


def test_fused_lm_head_call_equals_transformers(sft_runs):
    """TRL's fused call (model(..., fused_lm_head=True)) through the streaming head at TSP=2: values on every rank
    (with DPOTrainer's mean_logits and log_sum_sq_probs) and the gradient of a per-token-weighted loss equal
    transformers' logits path (float64; vocab 67: padded)."""
    from hf_tiny import shift

    from ds_tsp.tools.hf_reference import load_hf_reference

    got = sft_runs["fused"]
    ref = load_hf_reference(sft_runs["fused_dir"], torch.float64)
    data, weights = fused_batch(ref.config.vocab_size)
    logits = ref(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits
    targets = shift(data["labels"])
    valid = targets != -100
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * valid
    (-(log_probs * weights).sum()).backward()
    want = {"log_probs": log_probs, "entropy": -(log_softmax.exp() * log_softmax).sum(-1) * valid,
            "is_top1": (logits.argmax(-1) == targets) & valid, "label_mask": valid,
            "loss": -log_probs.sum() / valid.sum(), "mean_logits": logits.mean(-1) * valid,  # the real vocab only
            "log_sum_sq_probs": torch.logsumexp(2 * log_softmax, -1) * valid}
    for rank in got["ranks"]:
        for key in ("log_probs", "entropy", "loss", "mean_logits", "log_sum_sq_probs"):
            assert (rank[key] - want[key]).abs().max() < 1e-10, key
        for key in ("is_top1", "label_mask"):
            assert torch.equal(rank[key], want[key]), key
    for name, param in ref.named_parameters(remove_duplicate=False):
        assert (got["grads"][name] - param.grad).norm() <= 1e-10 * param.grad.norm(), name


def test_packed_document_keys_become_position_ids_or_are_refused():
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.integrations.accelerate.dataloaders import packed_document_positions

    ids = torch.arange(9)[None]
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    for batch in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 4, "max_length_k": 4},
                  {"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]], dtype=torch.int32)},
                  {"seq_lengths": [[3, 2], [4]]}):  # two examples' lists, flattened into one row
        out = packed_document_positions({"input_ids": ids, **batch})
        assert set(out) == {"input_ids", "position_ids"} and torch.equal(out["position_ids"], want), batch
    trl_like = {"input_ids": ids, "position_ids": want, "cu_seq_lens_q": cu, "seq_idx": torch.zeros(1, 9)}
    with pytest.raises(TSPConfigError, match="seq_idx and position_ids mark different"):
        packed_document_positions(trl_like)
    with pytest.raises(TSPConfigError, match="cu_seq_lens_q=.*ONE flattened row"):
        packed_document_positions({"input_ids": torch.zeros(2, 9, dtype=torch.long), "cu_seq_lens_q": cu})
    with pytest.raises(TSPConfigError, match="seq_lengths="):
        packed_document_positions({"input_ids": ids, "seq_lengths": [[5, 6]]})


def test_other_trl_trainers_and_the_wrong_order_are_refused_by_name():
    trl = pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPTrainer

    for name in ("KTOTrainer",):  # GRPO, RLOO, Reward, DPO: test_grpo.py, test_rloo.py, test_*_trainer.py
        with pytest.raises(TSPConfigError, match=f"TSPTrainer with TRL's {name} is not supported"):
            type("Composed", (TSPTrainer, getattr(trl, name)), {})
    with pytest.raises(TSPConfigError, match=r"list TSPTrainer first, class Wrong\(TSPTrainer, SFTTrainer\)"):
        type("Wrong", (trl.SFTTrainer, TSPTrainer), {})
    from ds_tsp.hf import TSPSFTTrainer

    assert TSPSFTTrainer.__mro__[1:3] == (TSPTrainer, trl.SFTTrainer) and TSPSFTTrainer._tsp_with_sft


def test_sft_options_that_need_full_logits_are_refused_by_name():
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPSFTTrainer

    plain = {"label_smoothing_factor": 0.0, "chat_template_path": None, "gradient_checkpointing_kwargs": None,
             "router_aux_loss_coef": None}
    refused = [({"peft_config": object()}, {}, "peft_config="), ({"compute_loss_func": len}, {}, "compute_loss_func="),
               ({}, {"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
               ({}, {"chat_template_path": "Qwen/Qwen3-0.6B"}, "chat_template_path="),
               ({}, {"gradient_checkpointing_kwargs": {"selective": True}}, "selective")]
    for kwargs, options, match in refused:  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=match):
            TSPSFTTrainer(model=None, args=SimpleNamespace(**{**plain, **options}), **kwargs)


def test_bare_sft_trainer_on_a_tsp_model_names_tsp_sft_trainer(tmp_path):
    """SFTTrainer(model=TSPForCausalLM) without TSPTrainer: one TSPConfigError naming TSPSFTTrainer (it was a bare
    AttributeError: generation_config); hasattr / getattr with a default still answer as before."""
    from datasets import Dataset
    from hf_tiny import tiny_config
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPForCausalLM

    save_tokenizer(tmp_path / "tok")
    model = TSPForCausalLM(tiny_config("llama", vocab_size=len(WORDS) + 3))
    assert not hasattr(model, "generation_config") and getattr(model, "generation_config", None) is None
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(TSPConfigError, match=r"ds_tsp\.hf\.TSPSFTTrainer"):
        SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows("text", 4, 0)),
                   processing_class=AutoTokenizer.from_pretrained(tmp_path / "tok"))


def test_tsp_sft_trainer_without_trl_says_how_to_install(monkeypatch):
    import ds_tsp.hf
    from ds_tsp.integrations.trl import composed as trl_composed

    trl_composed.composed_trainer_class.cache_clear()
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    try:
        with pytest.raises(ImportError, match=r"pip install 'ds_tsp\[trl\]'"):
            _ = ds_tsp.hf.TSPSFTTrainer
    finally:
        trl_composed.composed_trainer_class.cache_clear()


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
