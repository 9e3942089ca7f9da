"""ds_tsp training checkpoints and the HF export under the cp axis: ds_tsp.initialize with {"size": 2, "cp_size": 2}
on 4 gloo ranks (D=2, C=2, data 1), a TSPForCausalLM loaded from a tiny HF checkpoint, fp32, ZeRO-1 (ZeRO-3: slow).

- save_training_checkpoint at step SAVE_AT, then a FRESH engine (no optimizer state yet: its zero step runs on
  cp-cut batches) resumes with load_training_checkpoint and trains to STEPS: every resumed loss is bit-identical
  to the uninterrupted run's, and so are the final weights (both runs exported and compared tensor by tensor);
- one writer per TSP shard: the cp groups hold the same shards, so only cp rank 0 (of data rank 0) opens shard
  files (global ranks 0 and 1), and the manifest records the layout with cp=2 and the samples per step (micro x
  accumulation x data, not DeepSpeed's data x cp count);
- save_pretrained under cp (engine.module) reloads in plain transformers with tensors identical (torch.equal) to
  the shards the engine trained (gathered over the TSP group from DeepSpeed's fp32 masters).
One 4-rank spawn (module fixture) for ZeRO-1, another for ZeRO-3 (marked slow).
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


def _ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
            "gradient_clipping": 0.5, "tsp": {"size": 2, "cp_size": 2}}


def _engine(model_dir: str, stage: int):
    from masked_patterns import MaskedPatterns

    import ds_tsp

    data = MaskedPatterns(vocab_size=256, seq_len=30, num_samples=64)  # 30 tokens: padded to 2 x C x D = 8's multiple
    engine, _, loader, _ = ds_tsp.initialize(model=model_dir, config=_ds_config(stage), training_data=data)
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


def _save_and_resume(model_dir: str, workdir: str, stages: tuple[int, ...]) -> dict:
    import torch.distributed as dist

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
            rest = _steps(engine, batches, STEPS - SAVE_AT)
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
                          "manifest": json.loads((path / "manifest.json").read_text())}
    finally:
        train_state.ShardFileWriter = original
    return out


def _spawn(workdir, stages: tuple[int, ...]):
    from ds_tsp.testing import save_tiny_llama

    model_dir = str(save_tiny_llama(workdir / "initial", seed=0))
    return run_on_local_ranks(_save_and_resume, 4, model_dir, str(workdir), stages, timeout_s=600, env=ENV), workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("cp_ckpt"), (1,))


def test_resume_at_tsp2_cp2_is_bit_identical(runs):
    _assert_bit_identical_resume(runs, 1)


def test_one_writer_per_shard_under_cp(runs):
    _assert_one_writer_per_shard(runs, 1)


def test_save_pretrained_under_cp_reloads_the_trained_tensors(runs):
    _assert_export_is_the_trained_tensors(runs, 1)


@pytest.mark.slow
def test_zero3_save_resume_and_export_under_cp(tmp_path):
    runs = _spawn(tmp_path, (3,))
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
