"""TSPTrainer with a vision-language model: a transformers Qwen3_5ForConditionalGeneration (the tiny hybrid Qwen3.5
VLM of tests/helpers/vlm_tiny.py) handed to ds_tsp.hf.TSPTrainer at TSP=2 (ZeRO-2, SGD, fp32, gradient
accumulation 2, gradient checkpointing: the language model's layers and the tower's blocks) equals the plain
transformers Trainer in one process with the same seed and image dataset, per
logged step (loss 1e-5, grad norm 1e-4 relative), in evaluate()'s eval_loss and in the saved weights (the
Qwen3_5ForConditionalGeneration layout plain transformers reloads), after 3 steps.
The collator is what a VLM fine-tuning script writes: each example is text around one image (or none) whose
placeholder span (vision start, n image tokens, vision end) is built from its grid, right padding, pixel_values
concatenated in batch order, image_grid_thw, mm_token_type_ids, and labels with -100 on the image tokens and the
padding (as transformers' Qwen-VL recipes mask them).
A VLM under TRL's trainers is refused by name (what to use instead in the message).
Under --runslow: TSP=2 x data 2 (ZeRO-2) against the plain Trainer on 2 processes; DeepSpeed ZeRO-3 with every
weight partitioned (the tower's gathered by ZeRO-3's hooks) at TSP=2 x data 2 against the plain Trainer under the
same ZeRO-3; TSPAccelerator.prepare on the VLM in a hand-written loop against the same loop on one process; and the
same loop under the FSDP2 config at TSP=2 x data 2 (the tower kept whole) against one process taking both replicas'
batches per step.

Run as a script, this file is the worker: `python tests/integrations/test_vlm_trainer.py OUT.json MODEL [DS_CONFIG]`
(the reference and TSP=2 launches run at the same time).
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
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers"), os.environ.get("PYTHONPATH", "")])}
BATCH, ACCUMULATION, STEPS = 2, 2, 3
PAD = 0


# --- the worker ----------------------------------------------------------------------------------------------
def examples(n: int, seed: int) -> list[dict]:
    """Text before and after one image of a few grids (every third example has none), random pixels."""
    from vlm_tiny import IMAGE, PATCH_PIXELS

    g = torch.Generator().manual_seed(seed)
    grids = [(1, 4, 4), (1, 2, 4), None, (1, 4, 6)]
    out = []
    for i in range(n):
        before, after = (int(torch.randint(1, 6, (), generator=g)) for _ in range(2))
        grid = grids[i % len(grids)]
        row = {"before": torch.randint(1, IMAGE, (before,), generator=g).tolist(),
               "after": torch.randint(1, IMAGE, (after,), generator=g).tolist(), "grid": grid}
        if grid is not None:
            row["pixels"] = torch.randn(grid[0] * grid[1] * grid[2], PATCH_PIXELS, generator=g)
        out.append(row)
    return out


def collate(rows: list[dict]) -> dict:
    """input_ids with the image placeholder spans, right padding, pixel_values / image_grid_thw in batch order,
    mm_token_type_ids, labels masking the image tokens and the padding."""
    from vlm_tiny import END, IMAGE, START

    seqs = []
    for row in rows:
        span = [] if row["grid"] is None else [START, *[IMAGE] * (row["grid"][1] * row["grid"][2] // 4), END]
        seqs.append(row["before"] + span + row["after"])
    length = max(len(s) for s in seqs)
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)], mask[b, :len(seq)] = torch.tensor(seq), 1
    batch = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE).int(),
             "labels": ids.masked_fill((ids == IMAGE) | (mask == 0), -100)}
    images = [row for row in rows if row["grid"] is not None]
    if images:
        batch["pixel_values"] = torch.cat([row["pixels"] for row in images])
        batch["image_grid_thw"] = torch.tensor([row["grid"] for row in images])
    return batch


def main(out: str, model_dir: str, ds_config: str | None = None, trainer: str = "tsp") -> None:
    import transformers

    out_dir = str(Path(out).with_suffix(""))
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1, report_to=[], save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=not torch.cuda.is_available(), bf16=False,
        max_grad_norm=1.0, dataloader_drop_last=True, per_device_train_batch_size=BATCH, per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION, remove_unused_columns=False, gradient_checkpointing=True,
        deepspeed=ds_config)
    tsp = ds_config is not None and trainer == "tsp"
    zero3 = ds_config is not None and json.loads(Path(ds_config).read_text())["zero_optimization"]["stage"] == 3
    # under a live ZeRO-3 config from_pretrained partitions the weights (zero.Init): TSPTrainer reads the directory
    model = model_dir if tsp and zero3 else transformers.AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if not tsp:
        trainer_class = transformers.Trainer
    else:
        from ds_tsp.hf import TSPTrainer as trainer_class
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // (2 if tsp else 1)  # TSP=2 in the DeepSpeed config
    trainer = trainer_class(model=model, args=args,
                            train_dataset=examples(STEPS * BATCH * ACCUMULATION * replicas, seed=1),
                            eval_dataset=examples(4, seed=2), data_collator=collate)
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    checkpointed = getattr(trainer.model, "visual", None) or trainer.model.model.visual
    assert checkpointed.is_activation_checkpointing, "the tower is checkpointed, as in the plain run"
    trainer.evaluate()
    trainer.save_model(f"{out_dir}/final")
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"log": trainer.state.log_history}))


def loop_main(out: str, model_dir: str, mode: str) -> None:
    """A hand-written training loop (SGD, fp32, STEPS batches of BATCH, grad clipping): mode "loop" on one process
    with the plain transformers model, "accelerate" under TSPAccelerator(tsp_size=WORLD_SIZE) (prepare converts the
    model, rebinds the optimizer and keeps the loader's batches whole). Two data replicas: "loop-data2" on one
    process takes 2 batches per step and averages their mean losses (what DDP computes), "accelerate-fsdp2" under
    the FSDP2 config TSP=2 x data 2 (the environment `accelerate launch` exports; the tower kept whole) logs the
    replicas' mean. Writes the losses, the clipped norms and, on rank 0, the final weights (save_model /
    save_pretrained)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    replicas = 2 if mode in ("loop-data2", "accelerate-fsdp2") else 1
    loader = torch.utils.data.DataLoader(examples(STEPS * BATCH * replicas, seed=1), batch_size=BATCH,
                                         collate_fn=collate)
    accelerator = None
    if mode.startswith("accelerate"):
        from ds_tsp.accelerate import TSPAccelerator

        accelerator = TSPAccelerator(tsp_size=None if replicas > 1 else int(os.environ.get("WORLD_SIZE", "1")))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    log = []
    for batch in batches:
        if accelerator is None:
            loss = sum(model(**b).loss for b in [batch, *(next(batches) for _ in range(replicas - 1))]) / replicas
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            loss = accelerator.gather(loss.detach()).mean()
        optimizer.step()
        optimizer.zero_grad()
        log.append({"step": len(log) + 1, "loss": float(loss), "grad_norm": float(norm)})
    final = str(Path(out).with_suffix("")) + "/final"
    if accelerator is None:
        model.save_pretrained(final)
    else:
        accelerator.save_model(model, final)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"log": log}))


# --- the tests -------------------------------------------------------------------------------------------------
def _assert_same_weights(want_w: dict, got_w: dict, initial: dict) -> None:
    """Every saved weight within 1e-5 (fp32 over a few SGD steps), the same names as the checkpoint's, and the vision
    tower moved from its initial weights (so the comparison covers a trained tower)."""
    assert set(got_w) == set(want_w) == set(initial)
    for name, tensor in want_w.items():
        assert (got_w[name] - tensor).norm() <= 1e-5 * tensor.norm() + 1e-7, name
    tower = "model.visual.merger.linear_fc2.weight"
    assert (want_w[tower] - initial[tower].float()).norm() > 1e-4 * initial[tower].norm(), "the tower trains"


def _launch(out: Path, model: Path, ds_config: Path | None = None, nproc: int = 1,
            trainer: str = "tsp") -> subprocess.Popen:
    from warm_python import python_command

    # plain python, or torchrun's ranks (warm_python.py); a DeepSpeed run starts under torchrun even on one rank
    launch = python_command(0 if nproc == 1 and ds_config is None else nproc)
    argv = [str(out), str(model)] + ([str(ds_config), trainer] if ds_config else [])
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> list[dict]:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())["log"]


def _close(a, b, tol=1e-5):
    return abs(a - b) <= tol * abs(b)


def test_tsp2_trainer_with_a_vlm_equals_plain_trainer(tmp_path):
    _assert_same_run(tmp_path, 1)


@pytest.mark.slow
def test_tsp2_x_data2_zero2_vlm_equals_plain_two_process_trainer(tmp_path):
    """The data axis: TSP=2 x data 2 (4 processes) against the plain Trainer on 2 processes (DDP)."""
    _assert_same_run(tmp_path, 2)


@pytest.mark.slow
def test_tsp2_x_data2_zero3_vlm_equals_plain_zero3_trainer(tmp_path):
    """DeepSpeed ZeRO-3 on the data axis with the tower partitioned over it (persistence threshold 0: every
    weight, the tower's included, gathered by ZeRO-3's hooks): TSP=2 x data 2 against the plain Trainer under the
    same ZeRO-3 config on 2 processes."""
    _assert_same_run(tmp_path, 2, stage=3)


@pytest.mark.slow
def test_tsp2_accelerate_loop_with_a_vlm_equals_single_process_loop(tmp_path):
    """TSPAccelerator.prepare on the VLM (plain launch, TSP=2): a hand-written loop over pixel_values batches (one
    batch with one image, so one rank encodes nothing) equals the same loop on one process with the plain model:
    loss and clipped grad norm per step, and the saved weights (the tower trained)."""
    _assert_same_loop(tmp_path, ("loop", 1, {}), ("accelerate", 2, {}))


@pytest.mark.slow
def test_tsp2_x_data2_fsdp2_accelerate_loop_with_a_vlm_equals_single_process_loop(tmp_path):
    """TSPAccelerator under the FSDP2 config at TSP=2 x data 2 (the language model fully_shard'ed over the data
    axis, the vision tower whole: its grads summed over TSP and averaged over data in its backward): the loop's
    losses, clipped grad norms (the tower's grads counted once) and saved weights equal one process taking both
    replicas' batches per step."""
    _assert_same_loop(tmp_path, ("loop-data2", 1, {}), ("accelerate-fsdp2", 4, _FSDP2_ENV))


_FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
              "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
              "FSDP_RESHARD_AFTER_FORWARD": "true", "ACCELERATE_MIXED_PRECISION": "no"}


def _assert_same_loop(tmp_path, reference: tuple, tsp: tuple) -> None:
    from safetensors.torch import load_file
    from vlm_tiny import save_vlm_checkpoint

    model_dir = tmp_path / "model"
    save_vlm_checkpoint(model_dir)

    def launch(out, mode, nproc, env):
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc_per_node", str(nproc)]
        return subprocess.Popen([*launch, __file__, str(out), str(model_dir), mode], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**ENV, **env}, cwd=ROOT)

    procs = launch(tmp_path / "loop.json", *reference), launch(tmp_path / "acc.json", *tsp)
    want, got = _finish(procs[0], tmp_path / "loop.json"), _finish(procs[1], tmp_path / "acc.json")
    assert [s["step"] for s in got] == [s["step"] for s in want] == list(range(1, STEPS + 1))
    assert len({s["loss"] for s in want}) == STEPS
    for w, g in zip(want, got):
        assert _close(g["loss"], w["loss"]) and _close(g["grad_norm"], w["grad_norm"], 1e-4), (g, w)
    want_w = load_file(tmp_path / "loop" / "final" / "model.safetensors")
    got_w = {k: v for f in (tmp_path / "acc" / "final").glob("*.safetensors") for k, v in load_file(f).items()}
    _assert_same_weights(want_w, got_w, load_file(model_dir / "model.safetensors"))


def _assert_same_run(tmp_path, replicas: int, stage: int = 2) -> None:
    pytest.importorskip("deepspeed")
    import transformers
    from safetensors.torch import load_file
    from vlm_tiny import save_vlm_checkpoint

    model_dir = tmp_path / "model"
    save_vlm_checkpoint(model_dir)  # float64 on disk: both runs load it as float32
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True}
    (tmp_path / "ds.json").write_text(json.dumps({**config, "tsp": {"size": 2}}))
    if stage == 3:  # the reference: the plain Trainer under the same ZeRO-3
        # (the plain Trainer saves a ZeRO-3 model's weights whole only when asked to gather them)
        plain = {**config, "zero_optimization": {**zero, "stage3_gather_16bit_weights_on_model_save": True}}
        (tmp_path / "ds_plain.json").write_text(json.dumps(plain))
        reference = _launch(tmp_path / "ref.json", model_dir, tmp_path / "ds_plain.json", nproc=replicas,
                            trainer="plain")
    else:
        reference = _launch(tmp_path / "ref.json", model_dir, nproc=replicas)
    tsp = _launch(tmp_path / "tsp.json", model_dir, tmp_path / "ds.json", nproc=2 * replicas)
    want, got = _finish(reference, tmp_path / "ref.json"), _finish(tsp, tmp_path / "tsp.json")
    steps = [[line for line in log if "grad_norm" in line] for log in (want, got)]
    assert len(steps[0]) == STEPS and [s["step"] for s in steps[1]] == [s["step"] for s in steps[0]], steps
    assert len({s["loss"] for s in steps[0]}) == STEPS, steps  # the model trains: every step's loss differs
    for w, g in zip(*steps):
        assert _close(g["loss"], w["loss"]) and _close(g["grad_norm"], w["grad_norm"], 1e-4), (g, w)
    evals = [[line["eval_loss"] for line in log if "eval_loss" in line] for log in (want, got)]
    assert len(evals[1]) == 1 and _close(evals[1][0], evals[0][0]), evals
    saved = json.loads((tmp_path / "tsp" / "final" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"], saved["architectures"]
    want_w, got_w = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("ref", "tsp"))
    # the plain Trainer's ZeRO-3 save (transformers 5.25, weights gathered on save) writes the language model
    # under a doubled prefix; the tensors are the same
    doubled = "model.language_model.model.language_model."
    want_w = {k.replace(doubled, "model.language_model."): v for k, v in want_w.items()}
    _assert_same_weights(want_w, got_w, load_file(model_dir / "model.safetensors"))
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "tsp" / "final")
    assert type(reloaded).__name__ == "Qwen3_5ForConditionalGeneration"


def test_vlm_under_trl_trainers_and_full_logit_options_are_refused_by_name():
    pytest.importorskip("trl")
    from types import SimpleNamespace

    import transformers
    from vlm_tiny import vlm_config

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPDPOTrainer, TSPGRPOTrainer, TSPRewardTrainer, TSPRLOOTrainer, TSPSFTTrainer, TSPTrainer
    from ds_tsp.integrations.multimodal import is_vision_language

    model = transformers.AutoModelForImageTextToText.from_config(vlm_config())
    assert is_vision_language(model)
    assert not is_vision_language(transformers.AutoModelForCausalLM.from_config(vlm_config().text_config))
    args = SimpleNamespace(chat_template_path=None, label_smoothing_factor=0.0)
    for trainer, extra in ((TSPSFTTrainer, {}), (TSPGRPOTrainer, {"reward_funcs": []}),
                           (TSPRLOOTrainer, {"reward_funcs": []}), (TSPDPOTrainer, {}),
                           (TSPRewardTrainer, {})):  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=rf"Qwen3_5ForConditionalGeneration \(a vision-language model\) "
                                                 rf"with {trainer.__name__}.*use ds_tsp.hf.TSPTrainer with a collator"):
            trainer(model=model, args=args, **extra)
    with pytest.raises(TSPConfigError, match="compute_loss_func= with a vision-language model"):
        TSPTrainer(model=model, args=args, compute_loss_func=lambda *a, **k: None)
    with pytest.raises(TSPConfigError, match="label_smoothing_factor=0.1 with a vision-language model"):
        TSPTrainer(model=model, args=SimpleNamespace(label_smoothing_factor=0.1))
    pytest.importorskip("accelerate")
    from ds_tsp.integrations.accelerate.accelerator import _vlm_names

    assert _vlm_names({0: "model.visual.merger.norm.weight", 1: "model.language_model.norm.weight"}) == \
        {0: "visual.merger.norm.weight", 1: "model.norm.weight"}


if __name__ == "__main__":
    from ds_tsp.core.parallel.launch import exit_rank

    if sys.argv[3:] and sys.argv[3] in ("loop", "accelerate", "loop-data2", "accelerate-fsdp2"):
        loop_main(*sys.argv[1:4])
    else:
        main(*sys.argv[1:])
    exit_rank()  # a torchrun worker: skip interpreter finalization, where gloo can abort
