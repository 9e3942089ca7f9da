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
