"""The README's DeepSpeed loop on a GPU: the loader's batches arrive on the engine's device.

DeepSpeed's engine does not move inputs, and under a launcher the TSP groups are NCCL-only: a CPU batch would fail
the model's input check (a collective) on every rank. Checked without a GPU: the meta device stands in for it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_tsp.core.tokens.loader import TSPDataLoader

META = torch.device("meta")


def _groups(tsp_size: int = 2, tsp_rank: int = 1):
    return SimpleNamespace(data_size=1, data_rank=0, tsp_size=tsp_size, tsp_rank=tsp_rank, data_group=None)


def _samples(n: int = 4, seq: int = 8):
    return [{"input_ids": torch.arange(seq) + i, "labels": torch.arange(seq) + i,
             "position_ids": torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])} for i in range(n)]


@pytest.mark.parametrize("device", ["meta", META])
def test_loader_puts_every_tensor_on_its_device(device):
    data = _samples()
    on_cpu = list(TSPDataLoader(data, _groups(), micro_batch_size=2, shuffle=False))
    moved = list(TSPDataLoader(data, _groups(), micro_batch_size=2, shuffle=False, device=device))
    assert len(moved) == len(on_cpu) == 2
    for got, want in zip(moved, on_cpu):
        assert got.keys() == want.keys() and got["tsp_shard"] == (1, 2) and got["seq_len"] == want["seq_len"]
        tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
        assert set(tensors) == {"input_ids", "shift_labels", "position_ids"}
        for k in tensors:
            assert got[k].device == META and got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k


def test_loader_without_device_stays_on_the_cpu():
    batch = next(iter(TSPDataLoader(_samples(), _groups(), micro_batch_size=2, shuffle=False)))
    assert all(v.device.type == "cpu" for v in batch.values() if isinstance(v, torch.Tensor))


def test_initialize_gives_the_loader_the_engine_device(monkeypatch):
    """ds_tsp.initialize's loader yields batches on engine.device, so `engine(**batch)` needs no .to()."""
    from ds_tsp.integrations.deepspeed import engine as ds_engine

    class FakeEngine:
        device = META

        @staticmethod
        def train_micro_batch_size_per_gpu():
            return 2

        def backward(self, loss):  # initialize bounds both with the watchdog
            pass

        def step(self):
            pass

    class FakeDeepSpeed:
        @staticmethod
        def init_distributed(**kwargs):
            pass

        @staticmethod
        def initialize(**kwargs):
            return FakeEngine(), None, None, None

    runtime = SimpleNamespace(groups=_groups(tsp_size=1, tsp_rank=0), comm=None, options=None)
    monkeypatch.setattr(ds_engine, "import_deepspeed", lambda: FakeDeepSpeed)
    monkeypatch.setattr(ds_engine, "local_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(ds_engine, "_launched", lambda: True)
    monkeypatch.setattr(ds_engine, "build_runtime", lambda tsp, **kw: SimpleNamespace(config=tsp, **vars(runtime)))
    monkeypatch.setattr(ds_engine, "to_tsp_model", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(ds_engine, "_register_zero3_fetches", lambda *a: None)
    monkeypatch.setattr(ds_engine, "NonFiniteGuard", lambda *a, **k: None)
    engine, _, loader, _ = ds_engine.initialize(model=object(), config={"train_batch_size": 2, "tsp": {"size": 1}},
                                                training_data=_samples())
    assert loader.device == META
    batch = next(iter(loader))
    assert batch["input_ids"].device == META and batch["shift_labels"].device == META
