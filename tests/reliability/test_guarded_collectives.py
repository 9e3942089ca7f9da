"""Every collective ds_tsp posts outside TSPComm is guarded: the non-finite check's job-wide
all-reduce and the grad-norm all-reduces end a rank with the watchdog's ONE line naming collective and peer, never
gloo's raw "Timed out waiting 20000ms" traceback. In-process on the fake process group (world 2); the backend's
timeout is simulated by an all_reduce that raises gloo's words."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX, TSPCommError
from ds_tsp.core.reliability.watchdog import WATCHDOG

GLOO_TIMEOUT = "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"


@pytest.fixture
def fake_world(monkeypatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def timed_out(*args, **kwargs):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(dist, "all_reduce", timed_out)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def reports(monkeypatch):
    got = []
    monkeypatch.setattr(WATCHDOG, "report_and_exit", lambda message: got.append(message))
    return got


class _Tiny(nn.Module):
    def __init__(self, comm):
        super().__init__()
        self.comm, self.w = comm, nn.Parameter(torch.ones(3))


def test_nonfinite_check_reports_one_line(fake_world, reports):
    from ds_tsp.core.reliability.nonfinite import NonFiniteGuard

    model = _Tiny(TSPComm(dist.group.WORLD, timeout_s=20))  # the guard takes timeout_s from the model's comm
    guard = NonFiniteGuard(model)
    with pytest.raises(RuntimeError):  # the real report_and_exit never returns; the captured one lets it rise
        guard.check(torch.tensor(1.0), step=7)
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} non-finite check all_reduce timed out on rank 0"), message
    assert "timeout_s=20" in message and "waiting for rank 1 (the rest of its group)" in message, message
    assert "Timed out waiting 20000ms" in message and "unbound_buffer.cc" not in message  # gloo's words, trimmed
    assert "layer: step 7 non-finite check" in message


def test_nonfinite_check_without_timeout_raises_tsp_comm_error(fake_world):
    from ds_tsp.core.reliability.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard(_Tiny(TSPComm(dist.group.WORLD, timeout_s=None)))
    with pytest.raises(TSPCommError, match=r"non-finite check all_reduce timed out .* waiting for rank 1"):
        guard.check(torch.tensor(1.0), step=1)


def test_grad_norm_reports_one_line(fake_world, reports):
    from ds_tsp.core.grads.clip import clip_grad_norm_, mark_sharded

    groups = SimpleNamespace(layout=SimpleNamespace(tsp_enabled=True), tsp_group=dist.group.WORLD, rank=0, tsp_rank=0)
    model = _Tiny(TSPComm(dist.group.WORLD, timeout_s=20))
    mark_sharded(model.w)
    model.w.grad = torch.ones(3)
    with pytest.raises(RuntimeError):  # the real report_and_exit never returns
        clip_grad_norm_(model, 1.0, groups)
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} grad norm all_reduce timed out on rank 0"), message
    assert "waiting for rank 1 (the rest of its group)" in message and "layer: clip_grad_norm_" in message


# --- the collectives of the trainers, the accelerator and GRPO (the saves: tests/reliability/test_guarded_saves.py)
def _groups():
    return SimpleNamespace(layout=SimpleNamespace(tsp_enabled=True, data_enabled=True, cp_enabled=False),
                           tsp_group=dist.group.WORLD, data_group=dist.group.WORLD, cp_group=None, data_size=2,
                           cp_size=1)


def test_trainer_token_count_reports_one_line(fake_world, reports):
    from ds_tsp.integrations.hf_trainer import TSPTrainer

    trainer = SimpleNamespace(tsp_groups=_groups(), tsp_comm=TSPComm(dist.group.WORLD, timeout_s=20), _tsp_vlm=False,
                              args=SimpleNamespace(average_tokens_across_devices=True))
    with pytest.raises(RuntimeError):
        TSPTrainer._get_num_items_in_batch(trainer, [{"shift_labels": torch.tensor([[1, -100]])}], torch.device("cpu"))
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} token count all_reduce timed out on rank 0"), message
    assert "waiting for rank 1" in message


def test_accelerator_gathers_report_one_line(fake_world, reports):
    from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

    accelerator = SimpleNamespace(data_size=2, _cp_size=1, _data_group=dist.group.WORLD,
                                  tsp_comm=TSPComm(dist.group.WORLD, timeout_s=20))

    def timed_out(*args, **kwargs):
        raise RuntimeError(GLOO_TIMEOUT)

    dist_all_gather, dist.all_gather = dist.all_gather, timed_out
    try:
        with pytest.raises(RuntimeError):
            TSPAccelerator.gather(accelerator, torch.ones(2))
    finally:
        dist.all_gather = dist_all_gather
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} gather over data timed out on rank 0"), message


def test_grpo_leader_broadcast_reports_one_line(fake_world, reports, monkeypatch):
    from ds_tsp.integrations.trl import grpo

    comm = TSPComm(dist.group.WORLD, timeout_s=20)
    monkeypatch.setattr(grpo, "tsp_model", lambda trainer: SimpleNamespace(tsp=SimpleNamespace(comm=comm)))

    def timed_out(*args, **kwargs):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(dist, "broadcast_object_list", timed_out)
    with pytest.raises(RuntimeError):
        grpo._broadcast_from_leader(SimpleNamespace(), ["completions"])
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} GRPO completions broadcast from TSP rank 0 timed out"), message
    assert "layer: generation" in message


def test_a_guard_on_device_tensors_watches_their_event(monkeypatch):
    """NCCL: a collective in a guarded block returns at once; the guard then hands an event on the tensors' device
    to the watchdog (as a TSPComm wait does), so a stall still ends the rank. Watchdog.watch mocked."""
    from ds_tsp.core.reliability.watchdog import guard

    watched = []
    monkeypatch.setattr(WATCHDOG, "watch", lambda device, blocked, start, timeout_s, frame: watched.append(
        (device, blocked.kind, timeout_s)))
    with guard("token count all_reduce", timeout_s=7, poll=torch.device("cuda", 1)):
        pass
    with guard("on the host", timeout_s=7, poll=torch.device("cpu")):
        pass
    with guard("unbounded", timeout_s=None, poll=torch.device("cuda", 1)):
        pass
    assert watched == [(torch.device("cuda", 1), "token count all_reduce", 7)]


@pytest.mark.parametrize("evaluate", [False, True])
def test_trainer_logging_and_saving_are_guarded_evaluation_is_not(monkeypatch, evaluate):
    """TSPTrainer bounds the Trainer's own collectives (the loss-logging gather, the flos broadcast, a checkpoint
    save) by timeout_s; an evaluation may outlast timeout_s, so a step that evaluates logs first under the guard,
    then evaluates and saves outside it (the save then guarded by _save_checkpoint). The Trainer's method mocked."""
    import threading

    import transformers

    from ds_tsp.integrations.hf_trainer import TSPTrainer

    calls = []

    def trainer_step(self, *args, **kwargs):
        calls.append((self.control.should_evaluate, self.control.should_save,
                      threading.get_ident() in WATCHDOG._armed))

    monkeypatch.setattr(transformers.Trainer, "_maybe_log_save_evaluate", trainer_step)
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", lambda self, model, trial: calls.append(
        ("save", threading.get_ident() in WATCHDOG._armed)))
    trainer = object.__new__(TSPTrainer)
    trainer.__dict__.update(control=SimpleNamespace(should_evaluate=evaluate, should_save=True),
                            tsp_comm=TSPComm(None, timeout_s=20), state=SimpleNamespace(global_step=3))
    trainer._maybe_log_save_evaluate(torch.zeros(()), None, None, None, 0.0, None, 0.0)
    trainer._save_checkpoint(None, None)
    if evaluate:
        assert calls == [(False, False, True), (True, True, False), ("save", True)], calls
    else:
        assert calls == [(False, True, True), ("save", True)], calls
    assert trainer.control.should_evaluate is evaluate and trainer.control.should_save


def test_deepspeed_step_reports_one_line_and_oom_propagates(fake_world, reports):
    """engine.step() posts DeepSpeed's own collectives (its grad-norm all-reduce over the TSP group when clipping):
    ds_tsp.initialize guards it, so gloo's timeout there is the one line, not its traceback; an out-of-memory error
    inside a guard is the device's and propagates as it is."""
    from ds_tsp.integrations.deepspeed.engine import _guard_step

    def step(error):
        raise error

    engine = SimpleNamespace(step=lambda: step(RuntimeError(GLOO_TIMEOUT)))
    _guard_step(engine, TSPComm(dist.group.WORLD, timeout_s=20))
    with pytest.raises(RuntimeError):
        engine.step()
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} DeepSpeed optimizer step (grad-norm all_reduce, ZeRO collectives) "
                              "timed out on rank 0"), message
    assert "layer: optimizer step" in message
    engine = SimpleNamespace(step=lambda: step(torch.OutOfMemoryError("CUDA out of memory")))
    _guard_step(engine, TSPComm(dist.group.WORLD, timeout_s=20))
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    assert len(reports) == 1
