"""ds_tsp training checkpoints under DeepSpeed: bit-identical resume (ZeRO 0/1/3, bf16 ZeRO-2), resharded resume
TSP=2 x DP=2 -> TSP=4 (weights and Adam moments moved exactly; losses within fp32 noise), and clear errors.
Without ZeRO (the torch optimizer's own state) and through examples/train.py: tests/checkpoint/test_checkpoint_kill.py.

Tolerances. Same layout: losses bit-identical (the restored state is the saved one bit for bit, and the data
order, schedule and optimizer step continue). Another layout: the resharded full weights and moments are
bit-identical to the saved ones (pure data movement); the losses then differ only by the reordered fp32 sums of
the new layout: the first two resumed steps within 1e-5 relative, and every later one within 4x the distance
between two UNINTERRUPTED runs on the two layouts, measured in the same test (training amplifies that noise step
by step: measured ~1e-6 after one step, ~5e-5 after six).
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")

from local_ranks import run_on_local_ranks  # noqa: E402
from masked_patterns import MaskedPatterns  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_  # noqa: E402

SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
ENV = {"DS_ACCELERATOR": "cpu"}
STEPS, SAVE_AT = 6, 3


def ds_config(tsp: int, stage: int, micro_batch: int = 2, bf16: bool = False, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
           "gradient_clipping": 0.5, "tsp": {"size": tsp}, **extra}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(cfg: dict):
    import ds_tsp

    ref = ReferenceCausalLM(SHAPE)
    init_weights_(ref, 0)
    data = MaskedPatterns(vocab_size=SHAPE.vocab_size, seq_len=32, num_samples=64)
    engine, _, loader, _ = ds_tsp.initialize(model=SHAPE, config=cfg, training_data=data, state_dict=full_state_dict(ref))
    return engine, loader


def _steps(engine, batches, first: int, last: int) -> list[float]:
    losses = []
    for _ in range(first, last + 1):
        b = next(batches)
        loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.tsp_model.loss_for_logging(loss)))
    return losses


def _full_state(engine) -> dict[str, torch.Tensor]:
    """HF-named full fp32 weights and Adam moments (collective): what a reshard must move exactly."""
    from ds_tsp.checkpoint.training.deepspeed_access import DeepSpeedAccess

    access, model = DeepSpeedAccess(engine), engine.tsp_model
    comm, out = model.comm, {}
    for prefix, module, param in model.sharded_modules():
        for key in (None, "exp_avg", "exp_avg_sq"):
            local = access.weight(param) if key is None else access.state(param, key)
            local = local.detach().float().contiguous()
            gathered = torch.empty((comm.size, *local.shape))
            comm.all_gather(gathered, local).wait()
            for name, t in module.unshard(list(gathered.unbind(0))).items():
                out[f"{prefix}{name}::{key}"] = t.clone()
    for name, param in model.replicated_params().items():
        out[f"{name}::None"] = access.weight(param).float().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}::{key}"] = access.state(param, key).float().clone()
    return out


def _save_and_resume(directory: str, configs: list[tuple[dict, dict]]) -> list[dict]:
    """For each (save config, resume config): train STEPS uninterrupted, saving at SAVE_AT; then a fresh engine on
    the resume config loads SAVE_AT and trains to STEPS; also train the resume config uninterrupted."""
    import ds_tsp

    out = []
    for k, (save_cfg, resume_cfg) in enumerate(configs):
        where = f"{directory}/run{k}"
        engine, loader = _engine(save_cfg)
        batches = iter(loader)
        first = _steps(engine, batches, 1, SAVE_AT)
        ds_tsp.save_training_checkpoint(engine, where, SAVE_AT, loader=loader)
        saved = _full_state(engine)
        rest = _steps(engine, batches, SAVE_AT + 1, STEPS)
        engine.destroy()

        engine, loader = _engine(resume_cfg)
        step = ds_tsp.load_training_checkpoint(engine, where, loader=loader)
        loaded = _full_state(engine)
        moved_exactly = sorted(saved) == sorted(loaded) and all(torch.equal(saved[n], loaded[n]) for n in saved)
        resumed = _steps(engine, iter(loader), step + 1, STEPS)
        engine.destroy()
        other = None
        if resume_cfg["tsp"] != save_cfg["tsp"]:
            engine, loader = _engine(resume_cfg)
            other = _steps(engine, iter(loader), 1, STEPS)
            engine.destroy()
        out.append({"uninterrupted": first + rest, "resumed": resumed, "step": step, "moved_exactly": moved_exactly,
                    "other_layout": other})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    configs = [(ds_config(2, 1), ds_config(2, 1)),
               (ds_config(2, 3), ds_config(2, 3)),
               (ds_config(2, 2, bf16=True), ds_config(2, 2, bf16=True)),
               # TSP=2 x DP=2 -> TSP=4 x DP=1 (its kv heads shared by 2 ranks), same global batch, clipping active
               (ds_config(2, 2), ds_config(4, 2, micro_batch=4))]
    return run_on_local_ranks(_save_and_resume, 4, directory, configs, timeout_s=600, env=ENV)[0]


@pytest.mark.parametrize("index,what", [(0, "ZeRO-1"), (1, "ZeRO-3"), (2, "bf16 ZeRO-2")])
def test_resume_on_the_same_layout_is_bit_identical(runs, index, what):
    run = runs[index]
    assert run["step"] == SAVE_AT
    assert run["moved_exactly"], what
    assert run["resumed"] == run["uninterrupted"][SAVE_AT:], (what, run)  # exact float equality
    assert run["uninterrupted"][-1] < run["uninterrupted"][0]


def test_resume_on_another_layout_reshards_weights_and_moments(runs):
    run = runs[3]
    assert run["moved_exactly"]  # TSP=2 x DP=2 shards re-cut for TSP=4 (kv heads now replicated), bit for bit
    want = torch.tensor(run["uninterrupted"][SAVE_AT:], dtype=torch.float64)
    got = torch.tensor(run["resumed"], dtype=torch.float64)
    rel = ((got - want).abs() / want.abs()).tolist()
    layout_noise = ((torch.tensor(run["other_layout"], dtype=torch.float64)[SAVE_AT:] - want).abs()
                    / want.abs()).tolist()
    print(f"resumed vs uninterrupted (relative): {rel}; two uninterrupted layouts: {layout_noise}")
    assert max(rel[:2]) < 1e-5, rel
    assert all(r <= max(4 * n, 1e-5) for r, n in zip(rel, layout_noise)), (rel, layout_noise)


# --- failures: one clear error, on every rank -------------------------------------------------------------------
def _resume_expecting_errors(directory: str, cases: list[tuple]) -> list[str]:
    """For each (save config, resume config, damage, manifest model override): save step 1, damage, resume."""
    import os

    import torch.distributed as dist

    import ds_tsp

    messages = []
    for k, (save_cfg, resume_cfg, damage, shape) in enumerate(cases):
        where = f"{directory}/case{k}"
        engine, loader = _engine(save_cfg)
        _steps(engine, iter(loader), 1, 1)
        path = ds_tsp.save_training_checkpoint(engine, where, 1, loader=loader)
        engine.destroy()
        dist.barrier()
        if dist.get_rank() == 0 and damage is not None:
            victim = path / "tsp01-00001.safetensors"
            data = bytearray(victim.read_bytes())
            if damage == "flip":
                data[len(data) // 2] ^= 0xFF
            else:
                data = data[: len(data) - 100]
            victim.write_bytes(bytes(data))
            os.sync()
        if dist.get_rank() == 0 and shape is not None:
            manifest = json.loads((path / "manifest.json").read_text())
            manifest["model"].update(shape)
            (path / "manifest.json").write_text(json.dumps(manifest))
        dist.barrier()
        engine, loader = _engine(resume_cfg)
        try:
            ds_tsp.load_training_checkpoint(engine, where, loader=loader)
            messages.append("no error")
        except TSPConfigError as err:
            messages.append(str(err))
        engine.destroy()
    return messages


ERROR_CASES = {
    "flip": r"tsp01-00001\.safetensors: sha256 does not match the manifest \(corrupted\)",
    "truncate": r"tsp01-00001\.safetensors has \d+ bytes, the manifest says \d+ \(truncated\?\)",
    "batch": r"global batch of 4 samples per step, this run has 8 .*keep 4",
    "shape": r"the checkpoint's model has hidden_size=48, this model hidden_size=32",
}


def test_damaged_or_foreign_checkpoint_fails_clearly_on_every_rank(tmp_path):
    import re

    cases = [(ds_config(2, 1), ds_config(2, 1, micro_batch=4) if case == "batch" else ds_config(2, 1),
              case if case in ("flip", "truncate") else None, {"hidden_size": 48} if case == "shape" else None)
             for case in ERROR_CASES]
    per_rank = run_on_local_ranks(_resume_expecting_errors, 4, str(tmp_path), cases, timeout_s=300, env=ENV)
    for rank, messages in enumerate(per_rank):
        for (case, pattern), message in zip(ERROR_CASES.items(), messages):
            assert re.search(pattern, message), (case, rank, message)
