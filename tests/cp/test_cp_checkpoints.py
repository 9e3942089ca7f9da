"""ds_tsp training checkpoints and the HF export under the cp axis: ds_tsp.initialize with {"size": 2, "cp_size": 2}
on 4 gloo ranks (D=2, C=2, data 1), a TSPForCausalLM loaded from a tiny HF checkpoint, fp32, ZeRO-1 and ZeRO-3.

- save_training_checkpoint at step SAVE_AT, then a FRESH engine (no optimizer state yet: its zero step runs on
  cp-cut batches) resumes with load_training_checkpoint and trains to STEPS: every resumed loss is bit-identical
  to the uninterrupted run's, and so are the final weights (both runs exported and compared tensor by tensor);
- one writer per TSP shard: the cp groups hold the same shards, so only cp rank 0 (of data rank 0) opens shard
  files (global ranks 0 and 1), and the manifest records the layout with cp=2 and the samples per step (micro x
  accumulation x data, not DeepSpeed's data x cp count);
- save_pretrained under cp (engine.module) reloads in plain transformers with tensors identical (torch.equal) to
  the shards the engine trained (gathered over the TSP group from DeepSpeed's fp32 masters);
- resume at another cp degree, on the same 4 ranks and global batch (2 samples per step): that checkpoint resumed
  at (tsp 2, cp 1, data 2), (1, 2, 2) and (1, 4, 1), and one saved at (2, 1, 2) resumed at (2, 2, 1). The full
  weights and Adam moments after the load equal the saved ones bit for bit; the resumed losses are within
  LAYOUT_TOLERANCE (1e-6 relative) of BOTH uninterrupted runs, the saving layout's and the new layout's (the same
  fp32 sums in another order; measured 0 to 9e-8); DeepSpeed's global_steps / global_samples, the lr and the
  optimizer step equal the new layout's uninterrupted run's. A resume on another global batch is refused naming
  both layouts.
One 4-rank spawn (module fixture) for ZeRO-1, ZeRO-3 and the cp-degree resumes.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from local_ranks import run_on_local_ranks  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
STEPS, SAVE_AT = 4, 2
LAYOUT_TOLERANCE = 1e-6  # fp32 losses of two layouts: the same sums in another order (measured: see the test)


def _ds_config(stage: int, tsp: int = 2, cp: int = 2, micro: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
            "gradient_clipping": 0.5, "tsp": {"size": tsp, "cp_size": cp}}


def _engine(model_dir: str, stage: int, config: dict | None = None):
    from masked_patterns import MaskedPatterns

    import ds_tsp

    data = MaskedPatterns(vocab_size=256, seq_len=30, num_samples=64)  # 30 tokens: padded to 2 x C x D = 8's multiple
    engine, _, loader, _ = ds_tsp.initialize(model=model_dir, config=config or _ds_config(stage), training_data=data)
    return engine, loader


def _steps(engine, batches, count: int) -> list[float]:
    losses = []
    for _ in range(count):
        loss = engine(**next(batches)).loss  # the global loss (HF face)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _trained_weights(engine) -> dict[str, torch.Tensor] | None:
    """HF-named full fp32 weights from the engine's shards (collective); on global rank 0, else None."""
    import torch.distributed as dist
    from test_training_checkpoint import _full_state

    full = {name.removesuffix("::None"): t for name, t in _full_state(engine).items() if name.endswith("::None")}
    return full if dist.get_rank() == 0 else None


def _save_and_resume(model_dir: str, workdir: str, stages: tuple[int, ...], keep_saved: bool = False) -> dict:
    """keep_saved: also return the ZeRO-1 run's full weights and moments at the save (for the cp-degree resumes)."""
    import torch.distributed as dist
    from test_training_checkpoint import _full_state

    import ds_tsp
    import ds_tsp.checkpoint.training.train_state as train_state

    writers: list[int] = []
    original = train_state.ShardFileWriter

    class RecordingWriter(original):  # which global ranks open shard files
        def __init__(self, *args, **kwargs):
            writers.append(dist.get_rank())
            super().__init__(*args, **kwargs)

    train_state.ShardFileWriter = RecordingWriter
    out = {}
    try:
        for stage in stages:
            where = f"{workdir}/ckpt{stage}"
            engine, loader = _engine(model_dir, stage)
            batches = iter(loader)
            first = _steps(engine, batches, SAVE_AT)
            writers.clear()
            path = ds_tsp.save_training_checkpoint(engine, where, SAVE_AT, loader=loader)
            saved_by = list(writers)
            saved_state = _full_state(engine) if keep_saved and stage == 1 else None
            rest = _steps(engine, batches, STEPS - SAVE_AT)
            state = _run_state(engine)
            engine.module.save_pretrained(f"{workdir}/export{stage}")
            trained = _trained_weights(engine)
            engine.destroy()

            engine, loader = _engine(model_dir, stage)
            step = ds_tsp.load_training_checkpoint(engine, where, loader=loader)
            resumed = _steps(engine, iter(loader), STEPS - step)
            engine.module.save_pretrained(f"{workdir}/resumed{stage}")
            engine.destroy()
            out[stage] = {"uninterrupted": first + rest, "resumed": resumed, "step": step, "saved_by": saved_by,
                          "files": sorted(p.name for p in path.iterdir()), "trained": trained,
                          "manifest": json.loads((path / "manifest.json").read_text()), "saved_state": saved_state,
                          "state": state}
    finally:
        train_state.ShardFileWriter = original
    return out


# --- resume at another cp degree (ZeRO-1, same 4 ranks, same global batch of 2 samples) --------------------------
# (tsp, cp) -> data = 4 / (tsp x cp), micro batch = 2 / data
OTHER_LAYOUTS = [(2, 1), (1, 2), (1, 4)]


def _layout_config(tsp: int, cp: int, micro: int | None = None) -> dict:
    return _ds_config(1, tsp=tsp, cp=cp, micro=2 // (4 // (tsp * cp)) if micro is None else micro)


def _run_state(engine) -> dict:
    """What must continue across a resume besides the losses: DeepSpeed's counters, the lr, the optimizer step."""
    from ds_tsp.checkpoint.training.deepspeed_access import DeepSpeedAccess

    return {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
            "lr": float(engine.get_lr()[0]), "optimizer_step": DeepSpeedAccess(engine).step_count()}


def _moved_exactly(saved: dict, loaded: dict) -> bool:
    return sorted(saved) == sorted(loaded) and all(torch.equal(saved[n], loaded[n]) for n in saved)


def _resume(model_dir: str, where: str, config: dict, saved_state: dict) -> dict:
    from test_training_checkpoint import _full_state

    import ds_tsp

    engine, loader = _engine(model_dir, 1, config)
    step = ds_tsp.load_training_checkpoint(engine, where, loader=loader)
    moved = _moved_exactly(saved_state, _full_state(engine))
    losses = _steps(engine, iter(loader), STEPS - step)
    out = {"step": step, "moved_exactly": moved, "losses": losses, "state": _run_state(engine)}
    engine.destroy()
    return out


def _cp_degree_changes(model_dir: str, workdir: str, saved_at_cp2: dict) -> dict:
    """The checkpoint of (tsp 2, cp 2, data 1) resumed at each other layout; every other layout trained
    uninterrupted; (tsp 2, cp 1, data 2) also saves, and (tsp 2, cp 2) resumes that one; a resume that does not
    keep the global batch is refused."""
    from test_training_checkpoint import _full_state

    import ds_tsp

    ckpt_cp2 = f"{workdir}/ckpt1"
    out = {"resumed": {}, "uninterrupted": {}}
    saved_at_cp1 = None
    for tsp, cp in OTHER_LAYOUTS:
        engine, loader = _engine(model_dir, 1, _layout_config(tsp, cp))
        batches = iter(loader)
        losses = _steps(engine, batches, SAVE_AT)
        if (tsp, cp) == (2, 1):
            ds_tsp.save_training_checkpoint(engine, f"{workdir}/ckpt_cp1", SAVE_AT, loader=loader)
            saved_at_cp1 = _full_state(engine)
        losses += _steps(engine, batches, STEPS - SAVE_AT)
        out["uninterrupted"][(tsp, cp)] = {"losses": losses, "state": _run_state(engine)}
        engine.destroy()
        out["resumed"][(tsp, cp)] = _resume(model_dir, ckpt_cp2, _layout_config(tsp, cp), saved_at_cp2)
    out["resumed_cp1_at_cp2"] = _resume(model_dir, f"{workdir}/ckpt_cp1", _layout_config(2, 2), saved_at_cp1)
    engine, loader = _engine(model_dir, 1, _layout_config(2, 1, micro=2))  # data 2 x micro 2: 4 samples per step
    try:
        ds_tsp.load_training_checkpoint(engine, ckpt_cp2, loader=loader)
        out["batch_error"] = "no error"
    except ds_tsp.TSPConfigError as err:
        out["batch_error"] = str(err)
    engine.destroy()
    return out


def _ranks(model_dir: str, workdir: str, stages: tuple[int, ...], cp_changes: bool) -> dict:
    out = _save_and_resume(model_dir, workdir, stages, keep_saved=cp_changes)
    if cp_changes:
        out["cp_changes"] = _cp_degree_changes(model_dir, workdir, out[1]["saved_state"])
    for stage in stages:
        out[stage].pop("saved_state")
    return out


def _spawn(workdir, stages: tuple[int, ...], cp_changes: bool = False):
    from ds_tsp.testing import save_tiny_llama

    model_dir = str(save_tiny_llama(workdir / "initial", seed=0))
    return run_on_local_ranks(_ranks, 4, model_dir, str(workdir), stages, cp_changes, timeout_s=600,
                              env=ENV), workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("cp_ckpt"), (1, 3), cp_changes=True)


def test_resume_at_tsp2_cp2_is_bit_identical(runs):
    _assert_bit_identical_resume(runs, 1)


def test_one_writer_per_shard_under_cp(runs):
    _assert_one_writer_per_shard(runs, 1)


def test_save_pretrained_under_cp_reloads_the_trained_tensors(runs):
    _assert_export_is_the_trained_tensors(runs, 1)


def test_zero3_save_resume_and_export_under_cp(runs):
    _assert_bit_identical_resume(runs, 3)
    _assert_one_writer_per_shard(runs, 3)
    _assert_export_is_the_trained_tensors(runs, 3)


def _assert_bit_identical_resume(runs, stage: int) -> None:
    results, workdir = runs
    for rank, result in enumerate(results):
        run = result[stage]
        assert run["step"] == SAVE_AT and len(run["uninterrupted"]) == STEPS, (rank, run)
        assert run["resumed"] == run["uninterrupted"][SAVE_AT:], (rank, stage, run)  # exact float equality
        assert run["uninterrupted"][-1] < run["uninterrupted"][0], run
    final = transformers.AutoModelForCausalLM.from_pretrained(workdir / f"export{stage}").state_dict()
    resumed = transformers.AutoModelForCausalLM.from_pretrained(workdir / f"resumed{stage}").state_dict()
    start = transformers.AutoModelForCausalLM.from_pretrained(workdir / "initial").state_dict()
    assert sorted(final) == sorted(resumed)
    for name, value in final.items():
        assert not torch.equal(value, start[name]), f"{name} did not move"
        assert torch.equal(resumed[name], value), (stage, name)


def _assert_one_writer_per_shard(runs, stage: int) -> None:
    results, _ = runs
    writers = sorted(r for result in results for r in result[stage]["saved_by"])
    assert writers == [0, 1], writers  # cp rank 0 of data rank 0, TSP ranks 0 and 1; cp rank 1 (ranks 2, 3) writes none
    run = results[0][stage]
    shard_files = [f for f in run["files"] if f.startswith("tsp")]
    assert sorted({f.split("-")[0] for f in shard_files}) == ["tsp00", "tsp01"], run["files"]
    manifest = run["manifest"]
    assert manifest["layout"] == {"tsp": 2, "data": 1, "pipe": 1, "cp": 2}, manifest["layout"]
    assert manifest["global_batch_size"] == 2, manifest["global_batch_size"]  # micro 2 x accumulation 1 x data 1


def _assert_export_is_the_trained_tensors(runs, stage: int) -> None:
    results, workdir = runs
    trained = results[0][stage]["trained"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(workdir / f"export{stage}", dtype=torch.float32)
    state = saved.state_dict()
    covered = [name for name in state if name in trained]
    # every tensor but the tied LM head (it IS the embedding) comes from the shards
    assert sorted(set(state) - set(covered)) == (["lm_head.weight"] if saved.config.tie_word_embeddings else []), \
        sorted(set(state) - set(covered))
    for name in covered:
        assert torch.equal(state[name], trained[name]), (stage, name)


def test_resume_at_another_cp_degree_continues_the_run(runs):
    results, _ = runs
    for rank, result in enumerate(results):
        changes, at_cp2 = result["cp_changes"], result[1]
        print(f"rank {rank}: " + "; ".join(f"{k}: {v['losses']}" for k, v in changes["uninterrupted"].items()))
        for (tsp, cp), resumed in changes["resumed"].items():
            _assert_continues(resumed, at_cp2["uninterrupted"], changes["uninterrupted"][(tsp, cp)], (rank, tsp, cp))
        _assert_continues(changes["resumed_cp1_at_cp2"], changes["uninterrupted"][(2, 1)]["losses"],
                          {"losses": at_cp2["uninterrupted"], "state": at_cp2["state"]}, (rank, "cp1 -> cp2"))


def test_resume_at_another_cp_degree_needs_the_same_global_batch(runs):
    for result in runs[0]:
        message = result["cp_changes"]["batch_error"]
        assert "global batch of 2 samples per step, this run has 4" in message, message
        assert "train_batch_size" in message and "keep 2" in message and "cp does not count" in message, message
        assert "saved at tsp=2 x cp=2 x data=1, this run is tsp=2 x cp=1 x data=2" in message, message


def _relative(got: list[float], want: list[float]) -> float:
    got_t, want_t = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return float(((got_t - want_t).abs() / want_t.abs()).max())


def _assert_continues(resumed: dict, saving_layout: list[float], new_layout: dict, what) -> None:
    """The resumed run starts from the saved state bit for bit and continues like both uninterrupted runs."""
    assert resumed["step"] == SAVE_AT and resumed["moved_exactly"], (what, resumed)
    assert len(resumed["losses"]) == STEPS - SAVE_AT, (what, resumed)
    to_saving, to_new = _relative(resumed["losses"], saving_layout[SAVE_AT:]), \
        _relative(resumed["losses"], new_layout["losses"][SAVE_AT:])
    print(f"{what}: resumed vs the saving layout's run {to_saving:.2e}, vs the new layout's run {to_new:.2e}")
    assert to_saving < LAYOUT_TOLERANCE and to_new < LAYOUT_TOLERANCE, (what, resumed["losses"], saving_layout,
                                                                        new_layout["losses"])
    assert resumed["state"] == new_layout["state"], (what, resumed["state"], new_layout["state"])
