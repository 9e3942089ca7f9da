"""Memory over many steps. Opt-in soak (`pytest -m soak`): 1000 TSP training steps on CPU with a training checkpoint
every 100, resident memory sampled every 10 steps on every rank. After warm-up the RSS must stay flat: a leak of
handles, comm buffers, watchdog entries or hooks grows it step by step. The measured curve is printed (-s) and written
to $DS_TSP_SOAK_OUT (default: the test's tmp dir) as JSON. In the default run, the same loop for 24 steps (a
checkpoint every 8): the live tensors (count and bytes, by storage) identical after warm-up on every rank, the RSS
within FLAT_MIB.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_tsp.core.parallel.launch import run_on_local_ranks  # noqa: E402

STEPS, SAVE_EVERY, SAMPLE_EVERY, WARMUP = 1000, 100, 10, 200
FLAT_MIB = 8.0  # allowed RSS growth from the end of warm-up to the last step


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _live_tensors() -> tuple[int, int]:
    """(count, bytes) of the tensor storages Python can reach: a tensor kept per step (a handle's buffer, a saved
    activation, a watchdog entry's payload) adds to both."""
    import gc

    import torch

    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return len(storages), sum(storages.values())


def _soak(save_dir: str, steps: int = STEPS, save_every: int = SAVE_EVERY, sample_every: int = SAMPLE_EVERY,
          tensors: bool = False) -> list[tuple]:
    """(step, RSS MiB[, live tensor count, bytes]) every sample_every steps."""
    import gc

    import ds_tsp
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.synthetic import RepeatingPatterns

    shape = ModelShape(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "tsp": {"size": 2, "timeout_s": 60}}
    data = RepeatingPatterns(vocab_size=shape.vocab_size, seq_len=64, num_samples=10**6, seed=0)
    engine, _, loader, _ = ds_tsp.initialize(model=shape, config=config, training_data=data)
    batches = iter(loader)
    curve = []
    for step in range(1, steps + 1):
        b = next(batches)
        loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
        engine.backward(loss)
        if engine.tsp_guard.check(loss, step):
            engine.step()
        if step % save_every == 0:
            ds_tsp.save_training_checkpoint(engine, save_dir, step, loader=loader, keep_last=2)
        if step % sample_every == 0:
            gc.collect()
            curve.append((step, round(_rss_mib(), 2), *(_live_tensors() if tensors else ())))
    return curve


def test_memory_stays_flat_over_two_dozen_steps(tmp_path):
    """24 steps at D=2 with a checkpoint every 8: from step 8 on, every rank holds the same live tensors (count and
    bytes) at each sample, and its RSS grows by less than FLAT_MIB (0.1 MiB seen). One tensor kept per step (a
    list of the losses) fails the first check."""
    curves = run_on_local_ranks(_soak, 2, str(tmp_path / "ckpt"), 24, 8, 4, True, timeout_s=600,
                                env={"DS_ACCELERATOR": "cpu"})
    for rank, curve in enumerate(curves):
        warm = [c for c in curve if c[0] >= 8]
        assert len(warm) == 5 and all(c[2:] == warm[0][2:] for c in warm), (rank, curve)
        assert warm[-1][1] - warm[0][1] < FLAT_MIB, (rank, curve)


@pytest.mark.soak
def test_soak_resident_memory_stays_flat(tmp_path):
    curves = run_on_local_ranks(_soak, 2, str(tmp_path / "ckpt"), timeout_s=3600, env={"DS_ACCELERATOR": "cpu"})
    out = Path(os.environ.get("DS_TSP_SOAK_OUT", tmp_path / "soak_rss.json"))
    out.write_text(json.dumps({"rss_mib_per_rank": curves}, indent=1))
    for rank, curve in enumerate(curves):
        rss = dict(curve)
        print(f"rank {rank} RSS MiB: " + ", ".join(f"{s}:{m}" for s, m in curve if s % 100 == 0))
        growth = rss[STEPS] - rss[WARMUP]
        assert growth < FLAT_MIB, f"rank {rank}: RSS grew {growth:.1f} MiB from step {WARMUP} to {STEPS}: {curve}"
