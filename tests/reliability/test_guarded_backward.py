"""DeepSpeed's gradient reduction inside `engine.backward`, the evaluation loop's size gather, the loader's batch
fetch and the Trainer's flos broadcast are guarded: a peer that stalls (sleeps) inside them ends the other rank
within timeout_s plus a margin with the watchdog's ONE line naming the block and the peer (exit code EXIT_CODE),
instead of gloo's 1800 s default (or, where the group has timeout_s, gloo's own traceback). Guards nest (the layers'
waits inside a guarded backward keep the outer deadline), and an error of the computation inside a guarded backward
propagates as it is.

Two ranks started by hand (tests/helpers/rank_procs.py) on gloo. This file is also the rank script:
`python test_guarded_backward.py rank CASE`. In-process cases use the fake process group (world 2).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

TIMEOUT_S = 2
MARGIN_S = 20.0  # interpreter start-up and the 2-core CI box; the stall itself is 60 s
GLOO_TIMEOUT = "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"


# --- the rank script ------------------------------------------------------------------------------------------
def _stall(rank: int) -> None:
    if rank == 1:
        print("STALLING", flush=True)
        time.sleep(60)


def _rank_main(case: str) -> None:
    torch.set_num_threads(1)
    if case == "hooks":  # TSP 2 on the world: the layers' own waits nest in the guard; a DeepSpeed-like hook
        from ds_tsp.core.comm.communicator import TSPComm
        from ds_tsp.core.parallel.launch import init_from_env
        from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
        from ds_tsp.core.shape.model_shape import ModelShape
        from ds_tsp.integrations.deepspeed.engine import _guard_backward
        from ds_tsp.model.causal_lm import ShardedCausalLM

        rank, world = init_from_env(backend="gloo")  # the default group keeps gloo's 1800 s: only the guard bounds it
        groups = ProcessGroups.build(ParallelLayout.from_world_size(world, tsp=world))
        comm = TSPComm(groups.tsp_group, timeout_s=TIMEOUT_S)
        shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2)
        model = ShardedCausalLM(shape, comm).init_weights_(0)
        params = [p for p in model.parameters() if p.requires_grad]

        def reduce(param):  # what DeepSpeed's reduce hooks do: an all-reduce over the world as each grad is ready
            if param is params[len(params) // 2]:
                _stall(rank)
            dist.all_reduce(param.grad)

        for p in params:
            p.register_post_accumulate_grad_hook(reduce)
        engine = SimpleNamespace(backward=lambda loss: loss.backward(), device=torch.device("cpu"))
        _guard_backward(engine, comm)
        ids = torch.arange(8)[None] + 8 * rank  # this rank's shard of a 16-token sequence (the values do not matter)
        loss = model(ids, (ids + 1) % 64, ids)
        engine.backward(loss)
    elif case == "deepspeed":  # data 2 x TSP 1, ZeRO-2: rank 0 waits in DeepSpeed's gradient reduction
        import ds_tsp
        from ds_tsp.core.shape.model_shape import ModelShape

        shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
                  "tsp": {"size": 1, "timeout_s": TIMEOUT_S}}
        data = [{"input_ids": torch.arange(i, i + 8) % 64} for i in range(4)]
        engine, _, loader, _ = ds_tsp.initialize(model=shape, config=config, training_data=data)
        batch = next(iter(loader))
        loss = engine(**batch)
        rank = dist.get_rank()
        # the stall lands inside backward, before this rank's reduction: rank 0 waits in DeepSpeed's
        next(p for p in engine.module.parameters() if p.requires_grad).register_hook(
            lambda grad: _stall(rank) or grad)
        engine.backward(loss)
    elif case == "eval_pad":  # the evaluation loop's pad_across_processes (a size gather over every process)
        from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

        accelerator = TSPAccelerator(tsp_size=2)
        accelerator.tsp_comm.timeout_s = TIMEOUT_S
        _stall(accelerator.process_index)
        accelerator.pad_across_processes(torch.zeros(1, 4), dim=1)
    print("NOT STALLED", flush=True)
    sys.stderr.flush()
    os._exit(0)


def _run(tmp_path: Path, case: str):
    from rank_procs import Ranks, survivor_reports_the_stall

    return survivor_reports_the_stall(Ranks(tmp_path, 2, [__file__, "rank", case]), TIMEOUT_S + MARGIN_S)


# --- two ranks ------------------------------------------------------------------------------------------------
def test_a_stall_inside_a_guarded_backward_ends_the_peer(tmp_path):
    """The engine's backward guard with TSP 2's own collectives inside and DeepSpeed-like reduce hooks: rank 1
    stalls in a hook, rank 0 waits in the next hook's all-reduce (the real engine: the slow test below)."""
    message, took = _run(tmp_path, "hooks")
    assert re.search(r"DeepSpeed backward \(gradient reduction: .*\) timed out on rank 0 .* waiting for rank 1\b",
                     message), message
    assert took >= TIMEOUT_S - 0.5


@pytest.mark.slow  # DeepSpeed's start-up: ~50 s on the 2-core box
def test_a_stall_inside_deepspeeds_gradient_reduction_ends_the_peer(tmp_path):
    pytest.importorskip("deepspeed")
    message, took = _run(tmp_path, "deepspeed")
    assert re.search(r"DeepSpeed backward \(gradient reduction: .*\) timed out on rank 0 .* waiting for rank 1\b",
                     message), message
    assert "layer: backward" in message
    assert took >= TIMEOUT_S - 0.5  # the peer got its timeout_s


@pytest.mark.slow
def test_a_stall_in_the_evaluation_loops_size_gather_ends_the_peer(tmp_path):
    message, _ = _run(tmp_path, "eval_pad")
    assert re.search(r"pad_across_processes size gather timed out on rank 0 .* waiting for rank 1\b", message), message


# --- in process, on the fake group ----------------------------------------------------------------------------


@pytest.fixture
def reports(monkeypatch):
    from ds_tsp.core.reliability.watchdog import WATCHDOG

    got = []
    monkeypatch.setattr(WATCHDOG, "report_and_exit", lambda message: got.append(message))
    return got


def _raise(error):
    raise error


def test_deepspeed_backward_reports_a_collectives_failure_and_lets_other_errors_through(fake_pair_of_ranks, reports):
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX
    from ds_tsp.integrations.deepspeed.engine import _guard_backward

    comm = TSPComm(dist.group.WORLD, timeout_s=20)
    for error in (RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"),
                  torch.OutOfMemoryError("CUDA out of memory"), ValueError("bad")):
        engine = SimpleNamespace(backward=lambda loss, e=error: _raise(e), device=torch.device("cpu"))
        _guard_backward(engine, comm)
        with pytest.raises(type(error)):
            engine.backward(None)
    assert reports == []
    engine = SimpleNamespace(backward=lambda loss: _raise(RuntimeError(GLOO_TIMEOUT)), device=torch.device("cpu"))
    _guard_backward(engine, comm)
    with pytest.raises(RuntimeError):
        engine.backward(None)
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} DeepSpeed backward (gradient reduction: ZeRO reduce / all_reduce "
                              "hooks) timed out on rank 0"), message
    assert "waiting for rank 1" in message and "layer: backward" in message


def test_nested_guards_keep_the_outer_deadline(fake_pair_of_ranks):
    """A layer's wait inside a guarded backward arms its own deadline and restores the backward's when it ends:
    the backward stays bounded from its own start; after it nothing is armed."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import WATCHDOG

    comm, me = TSPComm(dist.group.WORLD, timeout_s=20), threading.get_ident()
    with comm.guard("backward", comm_errors_only=True):
        outer = WATCHDOG._armed[me]
        with comm.guard("layer all_gather"):
            assert WATCHDOG._armed[me] is not outer and WATCHDOG._armed[me][0] >= outer[0]
        assert WATCHDOG._armed[me] is outer
    assert me not in WATCHDOG._armed


def test_accelerator_backward_and_the_evaluation_size_gather_are_guarded(fake_pair_of_ranks, reports, monkeypatch):
    """TSPAccelerator.backward (under DeepSpeed: Accelerate's engine.backward + engine.step) and
    pad_across_processes (the evaluation loop's size gather over every process); Accelerate's methods mocked."""
    import accelerate

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX
    from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

    armed = []
    monkeypatch.setattr(accelerate.Accelerator, "backward", lambda self, loss, **kw: armed.append(
        threading.get_ident() in self._armed_view) or _raise(RuntimeError(GLOO_TIMEOUT)))
    monkeypatch.setattr(accelerate.Accelerator, "pad_across_processes", lambda self, t, **kw: _raise(
        RuntimeError(GLOO_TIMEOUT)))
    from ds_tsp.core.reliability.watchdog import WATCHDOG

    accelerator = object.__new__(TSPAccelerator)
    accelerator.__dict__.update(tsp_comm=TSPComm(dist.group.WORLD, timeout_s=20),
                                tsp_setup=SimpleNamespace(mode="deepspeed"), _armed_view=WATCHDOG._armed)
    with pytest.raises(RuntimeError):
        accelerator.backward(torch.zeros(()))
    with pytest.raises(RuntimeError):
        accelerator.pad_across_processes(torch.zeros(1, 4), dim=1)
    assert armed == [True]
    first, second = reports
    assert first.startswith(f"{MESSAGE_PREFIX} DeepSpeed backward and step (gradient reduction, grad-norm all_reduce, "
                            "ZeRO collectives) timed out on rank 0"), first
    assert second.startswith(f"{MESSAGE_PREFIX} pad_across_processes size gather timed out on rank 0"), second


def test_on_a_device_the_backward_guards_watch_an_event_and_do_not_sync(fake_pair_of_ranks, monkeypatch):
    """NCCL: the reduction in a backward does not block the host, so after the block the guard hands an event on
    the engine's (the loss's) device to the watchdog thread; nothing waits on the host. Watchdog.watch mocked."""
    import accelerate

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import WATCHDOG
    from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator
    from ds_tsp.integrations.deepspeed.engine import _guard_backward

    watched = []
    monkeypatch.setattr(WATCHDOG, "watch", lambda device, blocked, start, timeout_s, frame: watched.append(
        (device, blocked.kind.split(" (")[0], timeout_s)))
    comm = TSPComm(dist.group.WORLD, timeout_s=20)
    for device in (torch.device("cuda", 1), torch.device("cpu")):
        engine = SimpleNamespace(backward=lambda loss: None, device=device)
        _guard_backward(engine, comm)
        engine.backward(None)
    monkeypatch.setattr(accelerate.Accelerator, "backward", lambda self, loss, **kw: None)
    accelerator = object.__new__(TSPAccelerator)
    accelerator.__dict__.update(tsp_comm=comm, tsp_setup=SimpleNamespace(mode="fsdp2"))
    accelerator.backward(SimpleNamespace(device=torch.device("cuda", 0)))  # a CUDA loss
    assert watched == [(torch.device("cuda", 1), "DeepSpeed backward", 20),
                       (torch.device("cuda", 0), "fsdp2 backward", 20)], watched


def test_the_loaders_batch_fetch_and_the_flos_broadcast_are_guarded(fake_pair_of_ranks, reports, monkeypatch):
    """Accelerate's loader posts world collectives when a batch is fetched (the generator's RNG broadcast at an
    epoch's start, the dispatcher's batch broadcast): each fetch is guarded, errors of the data pipeline propagate,
    a complete or abandoned iteration leaves nothing armed. The Trainer's flos broadcast is guarded too."""
    import transformers

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX
    from ds_tsp.core.reliability.watchdog import WATCHDOG
    from ds_tsp.integrations.accelerate.dataloaders import guarded_batches
    from ds_tsp.integrations.hf_trainer import TSPTrainer

    comm, me = TSPComm(dist.group.WORLD, timeout_s=20), threading.get_ident()

    def loader(error=None):
        yield me in WATCHDOG._armed
        if error is not None:
            raise error
        yield me in WATCHDOG._armed

    assert list(guarded_batches(loader(), comm)) == [True, True] and me not in WATCHDOG._armed
    for batch in guarded_batches(loader(), comm):
        break
    assert me not in WATCHDOG._armed
    with pytest.raises(RuntimeError, match="stack expects"):
        list(guarded_batches(loader(RuntimeError("stack expects each tensor to be equal size")), comm))
    assert reports == []
    with pytest.raises(RuntimeError):
        list(guarded_batches(loader(RuntimeError(GLOO_TIMEOUT)), comm))
    (message,) = reports
    assert message.startswith(f"{MESSAGE_PREFIX} the data loader's batch fetch (Accelerate's RNG-state / batch "
                              "broadcast) timed out on rank 0"), message
    assert "waiting for rank 1" in message and "layer: data loading" in message

    armed = []
    monkeypatch.setattr(transformers.Trainer, "store_flos", lambda self: armed.append(me in WATCHDOG._armed))
    trainer = object.__new__(TSPTrainer)
    trainer.__dict__.update(tsp_comm=comm, state=SimpleNamespace(global_step=3))
    trainer.store_flos()
    assert armed == [True] and me not in WATCHDOG._armed


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank":
    _rank_main(sys.argv[2])
