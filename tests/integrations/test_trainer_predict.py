"""evaluate / predict / compute_metrics under TSP see what the plain Trainer gives them: TSPTrainer at TSP=2 against
the plain single-process Trainer on the same padded eval batches (right padding, some labels -100):
- compute_metrics gets predictions = the full logits [B, S, V] (gathered from the vocab shards per eval batch) and
  label_ids = the batch's labels, full length, original (unsharded, unshifted) order: a token-accuracy metric and
  a labels checksum are equal;
- trainer.predict: predictions and label_ids equal (1e-5), metrics too; with preprocess_logits_for_metrics the
  hook's output on the full logits (argmax) is equal. Logits are compared at real tokens: at in-batch padding
  (attention_mask 0) they are an artefact of the mask in both and differ (see the test);
- include_for_metrics=["inputs"]: the full input ids, as the plain Trainer gives them;
- prediction_loss_only: no predictions, no labels, and no logits built (no logits all-reduce), the loss equal.

Run as a script, this file is the worker: `python tests/integrations/test_trainer_predict.py OUT.pt MODEL [DS_CONFIG]`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
VOCAB, SAMPLES, MAX_LEN = 64, 6, 38  # rows of 17 .. 38 tokens: the longest eval row has 38


# --- the worker ----------------------------------------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    """Rows of 17 .. MAX_LEN tokens, mostly a few frequent ids (a short training run makes the argmax right at
    times); about a quarter of the labels -100."""

    def __init__(self, offset: int = 0, samples: int = SAMPLES):
        self.offset, self.samples = offset, samples

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + self.offset + i)
        n = 17 + (i * 7) % (MAX_LEN - 16)
        frequent = torch.tensor([3, 3, 3, 3, 5, 5, 7, 11])[torch.randint(0, 8, (n,), generator=g)]
        ids = torch.where(torch.rand(n, generator=g) < 0.8, frequent, torch.randint(0, VOCAB, (n,), generator=g))
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=g) < 0.25] = -100
        return {"input_ids": ids, "labels": labels}


def pad(rows: list[dict]) -> dict:
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
           "labels": torch.full((len(rows), width), -100), "attention_mask": torch.zeros(len(rows), width,
                                                                                           dtype=torch.long)}
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][b, :n], out["labels"][b, :n], out["attention_mask"][b, :n] = r["input_ids"], r["labels"], 1
    return out


def token_accuracy(prediction) -> dict:
    logits, labels = (torch.as_tensor(x) for x in (prediction.predictions, prediction.label_ids))
    targets, guesses = labels[:, 1:], logits[:, :-1].argmax(-1)
    valid = targets != -100
    log_probs = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    inputs = {} if prediction.inputs is None else {"inputs": torch.as_tensor(prediction.inputs).tolist()}
    return {"accuracy": float((guesses == targets)[valid].float().mean()), "labels_sum": int(labels.sum()),
            "label_log_prob": float(log_probs[valid].mean()), "shape": list(logits.shape), **inputs}


def argmax_logits(logits, labels):
    return logits.argmax(-1)


def main(out: str, model_dir: str, ds_config: str | None = None) -> None:
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(Path(out).parent / "run"), per_device_eval_batch_size=3, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), deepspeed=ds_config, per_device_train_batch_size=2, max_steps=4,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, save_strategy="no",
        train_sampling_strategy="sequential", dataloader_drop_last=True, average_tokens_across_devices=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if ds_config is None:
        trainer_class = transformers.Trainer
    else:
        from ds_tsp.hf import TSPTrainer as trainer_class
    trainer = trainer_class(model=model, args=args, train_dataset=Rows(offset=1000, samples=8), eval_dataset=Rows(),
                            data_collator=pad, compute_metrics=token_accuracy)
    trainer.train()  # (DeepSpeed evaluates before training only under ZeRO-3, with or without TSP)
    counter = trainer.model.tsp.comm.counter.calls if ds_config else {}

    def logits_built(run):  # all-reduces of the rows whose logits are built (the logits_to_keep path)
        before = counter.get("logits_rows", 0)
        return run(), counter.get("logits_rows", 0) - before

    results = {"evaluate": trainer.evaluate()}
    trainer.args.include_for_metrics = ["inputs"]  # compute_metrics gets the input ids too
    predicted, built = logits_built(lambda: trainer.predict(Rows()))
    trainer.args.include_for_metrics = []
    results["predict"] = (torch.as_tensor(predicted.predictions), torch.as_tensor(predicted.label_ids),
                          predicted.metrics, built)
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = None, argmax_logits
    results["argmax"] = torch.as_tensor(trainer.predict(Rows()).predictions)
    trainer.preprocess_logits_for_metrics, trainer.args.prediction_loss_only = None, True
    loss_only, built = logits_built(lambda: trainer.predict(Rows()))
    results["loss_only"] = {"predictions": loss_only.predictions, "label_ids": loss_only.label_ids,
                            "loss": loss_only.metrics["test_loss"], "logits_built": built}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out)


# --- the test ----------------------------------------------------------------------------------------------------
def _launch(out: Path, model: Path, ds_config: Path | None = None) -> subprocess.Popen:
    from warm_python import python_command

    launch = python_command(0 if ds_config is None else 2)  # plain python, or torchrun's ranks (warm_python.py)
    argv = [str(out), str(model)] + ([str(ds_config)] if ds_config else [])
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return torch.load(out, weights_only=False)


def test_predict_and_compute_metrics_see_what_the_plain_trainer_gives(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    from ds_tsp.tools.synthetic import save_tiny_llama

    save_tiny_llama(tmp_path / "model", seed=0, vocab_size=VOCAB)
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 1000000,
        "zero_optimization": {"stage": 0}, "tsp": {"size": 2}}))
    reference = _launch(tmp_path / "ref.pt", tmp_path / "model")
    tsp = _launch(tmp_path / "tsp.pt", tmp_path / "model", tmp_path / "ds.json")
    want, got = _finish(reference, tmp_path / "ref.pt"), _finish(tsp, tmp_path / "tsp.pt")

    assert want["evaluate"]["eval_shape"] == [SAMPLES, MAX_LEN, VOCAB]  # the plain Trainer's: full logits
    assert want["evaluate"]["eval_accuracy"] > 0.2, "the metric is not trivially zero"
    for key in ("eval_shape", "eval_labels_sum", "eval_accuracy"):
        assert got["evaluate"][key] == want["evaluate"][key], (key, got["evaluate"], want["evaluate"])
    for key in ("eval_loss", "eval_label_log_prob"):
        assert abs(got["evaluate"][key] - want["evaluate"][key]) <= 1e-5 * abs(want["evaluate"][key]), key

    (predictions, label_ids, metrics, built), (ref_predictions, ref_label_ids, ref_metrics, _) = got["predict"], \
        want["predict"]
    assert predictions.shape == ref_predictions.shape == (SAMPLES, MAX_LEN, VOCAB)
    # Real tokens: equal. In-batch padding (attention_mask 0): neither is meaningful, and they differ (transformers
    # lets a padded query see the real tokens, TSP keeps padding apart); padding across batches is -100 in both.
    real = torch.zeros(SAMPLES, MAX_LEN, dtype=torch.bool)
    for i in range(SAMPLES):
        real[i, :len(Rows()[i]["input_ids"])] = True
    batch_width = torch.tensor([max(len(Rows()[j]["input_ids"]) for j in range(i - i % 3, i - i % 3 + 3))
                                for i in range(SAMPLES)])
    across = torch.arange(MAX_LEN)[None] >= batch_width[:, None]
    assert (predictions - ref_predictions)[real].abs().max() <= 1e-5 * ref_predictions[real].abs().max()
    assert bool((predictions[across] == -100).all()) and bool((ref_predictions[across] == -100).all())
    assert torch.equal(label_ids, ref_label_ids), "labels: full length, original order, unshifted"
    assert metrics["test_accuracy"] == ref_metrics["test_accuracy"] > 0.2
    assert metrics["test_inputs"] == ref_metrics["test_inputs"], "include_for_metrics=['inputs']: the full ids"
    assert abs(metrics["test_label_log_prob"] - ref_metrics["test_label_log_prob"]) <= 1e-5 * 3
    assert torch.equal(got["argmax"][real], want["argmax"][real]), "preprocess_logits_for_metrics: full logits"
    assert built > 0, "the probe sees logits being built"

    assert got["loss_only"]["predictions"] is None and got["loss_only"]["label_ids"] is None
    assert got["loss_only"]["logits_built"] == 0, "prediction_loss_only builds no logits"
    assert abs(got["loss_only"]["loss"] - want["loss_only"]["loss"]) <= 1e-5 * want["loss_only"]["loss"]


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
