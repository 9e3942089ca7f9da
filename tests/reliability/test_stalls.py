"""A dead (SIGKILL) or stalled (SIGSTOP) rank ends every other rank within timeout_s + 30 s, with ONE message.

The ranks are plain processes started with the standard torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), as on separate nodes: no local launcher tears the job down, and the process group keeps
gloo's default 1800 s timeout, so only TSPComm(timeout_s=...) can bound the stall (or, given PG_TIMEOUT_S, the TSP
group is a new group with that timeout, as ds_tsp.initialize builds it). This file is also the rank script:
`python tests/reliability/test_stalls.py rank STEPS TIMEOUT_S [PG_TIMEOUT_S]`. benchmarks/stall_trials.py repeats the stall.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rank_procs import Ranks

from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX, Blocked, TSPCommError, describe
from ds_tsp.core.reliability.watchdog import EXIT_CODE, watched_wait

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5
KINDS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce", "ring", "gather", "loss all_reduce")
LAYER = r"layer: (ShardedCausalLM|model\.[\w.]+|lm_head|step \d+ loss logging)( forward| backward| recompute)?"


# --- the rank script ------------------------------------------------------------------------------------------
def _rank_main(steps: int, timeout_s: float | None, pg_timeout_s: float | None = None) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.parallel.launch import init_from_env
    from ds_tsp.core.reliability.watchdog import label_modules, stats
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    torch.set_num_threads(1)
    rank, world = init_from_env(backend="gloo")  # process-group timeout: the 1800 s default
    group = dist.group.WORLD
    if pg_timeout_s is not None:  # a short timeout only once every rank is up
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=pg_timeout_s))
    comm = TSPComm(group, timeout_s=timeout_s)
    shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    model = label_modules(ShardedCausalLM(shape, comm).init_weights_(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=world, rank=rank)
    start = time.perf_counter()
    for step in range(steps):
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        with comm.guard("loss all_reduce", context=f"step {step} loss logging"):
            dist.all_reduce(logged, group=comm.group)
        print(f"step {step} loss {float(logged):.4f}", flush=True)
    with comm.guard("final barrier"):
        dist.barrier()
    print("DONE " + json.dumps({**stats(), "seconds": time.perf_counter() - start}), flush=True)
    # Leave without tearing gloo down: torch 2.13's teardown itself aborts now and then ("terminate called without
    # an active exception", rc 134, also with the watchdog off). test_watchdog_thread_never_blocks_exit covers a
    # normal interpreter exit with the watchdog thread alive.
    sys.stderr.flush()
    os._exit(0)


# --- the tests ------------------------------------------------------------------------------------------------
class _Ranks(Ranks):
    def __init__(self, tmp_path: Path, world: int, steps: int, timeout_s: float | None,
                 pg_timeout_s: float | None = None):
        extra = [] if pg_timeout_s is None else [str(pg_timeout_s)]
        super().__init__(tmp_path, world, [__file__, "rank", str(steps), str(timeout_s), *extra])

    def wait_for_step(self, step: int, deadline_s: float = 60) -> None:
        self.wait_for(f"step {step} ", deadline_s=deadline_s)


def _messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(MESSAGE_PREFIX)]


@pytest.mark.parametrize("how,victim", [("kill", 1), ("stop", 0)])
def test_dead_or_stalled_rank_ends_the_others(tmp_path, how, victim):
    world = 2
    ranks = _Ranks(tmp_path, world, steps=100_000, timeout_s=TIMEOUT_S)
    try:
        ranks.wait_for_step(2)
        os.kill(ranks.procs[victim].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        for r in range(world):
            if r == victim:
                continue
            took = ranks.wait_exit(r, TIMEOUT_S + 30)
            err = ranks.err(r)
            assert took is not None, f"rank {r} still running {TIMEOUT_S + 30} s after the {how}:\n{err[-2000:]}"
            done = "killed" if how == "kill" else "stopped"
            print(f"{how}: rank {r} exited {took:.1f} s after rank {victim} was {done}\n{err}")
            assert ranks.procs[r].returncode == EXIT_CODE, err
            messages = _messages(err)
            assert len(messages) == 1, err
            message = messages[0]
            assert ("failed" if how == "kill" else "timed out") in message
            assert any(f"{MESSAGE_PREFIX} {kind}" in message for kind in KINDS), message
            assert re.search(LAYER, message), message
            assert re.search(rf"waiting for rank {victim}\b", message), message
            if how == "stop":
                assert f"timeout_s={TIMEOUT_S}" in message
                assert took >= TIMEOUT_S - 1, "a stalled peer must be given timeout_s before the rank gives up"
    finally:
        ranks.cleanup()
    assert all(p.returncode is not None for p in ranks.procs)


def test_process_group_timeout_first_reads_as_the_watchdogs(tmp_path):
    """The TSP group's own timeout shorter than timeout_s, so gloo's fires first (with the two equal, as
    ds_tsp.initialize makes them, gloo's timer starts when an op is posted and won 9 of 20 by-hand trials): gloo's
    error reaches the waiting rank, which ends with the same ONE "timed out" line, not gloo's raw text."""
    world, victim, pg_timeout_s, timeout_s = 2, 1, 4, 60
    ranks = _Ranks(tmp_path, world, steps=100_000, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    try:
        ranks.wait_for_step(2)
        os.kill(ranks.procs[victim].pid, signal.SIGSTOP)
        took = ranks.wait_exit(0, pg_timeout_s + 30)
        err = ranks.err(0)
        assert took is not None, f"rank 0 still running {pg_timeout_s + 30} s after the stop:\n{err[-2000:]}"
        print(f"rank 0 exited {took:.1f} s after rank {victim} was stopped\n{err}")
        assert ranks.procs[0].returncode == EXIT_CODE, err
        messages = _messages(err)
        assert len(messages) == 1 and len(err.strip().splitlines()) == 1, err  # nothing but the one line
        message = messages[0]
        assert any(f"{MESSAGE_PREFIX} {kind}" in message for kind in KINDS), message
        assert " timed out on rank 0 " in message, message
        assert re.search(LAYER, message) and re.search(rf"waiting for rank {victim}\b", message), message
        assert f"timeout_s={timeout_s}" in message, message
        assert re.search(r"timed out|timeout", message.split("waiting for", 1)[1], re.I), message  # gloo's words
        assert took < timeout_s / 2, "gloo's timeout, not the watchdog's, ended the rank"
    finally:
        ranks.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["runtime", "world"])
def test_stall_trials(tmp_path, setup):
    """benchmarks/stall_trials.py, a few trials (the full measurement is 20): ranks started by hand, one SIGSTOPped
    at a random point of a step, then once right before the loss logging, then once right before the non-finite
    check (its job-wide all-reduce); every survivor ends within timeout_s + 30 s with ONE message
    naming collective, layer and peer. setup runtime: the groups' own timeout is timeout_s."""
    for stop_at, trials, extra in (("random", 3, []), ("optimizer", 1, []), ("optimizer", 1, ["--nonfinite"])):
        out = tmp_path / f"{stop_at}{len(extra)}.json"
        done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stall_trials.py"), "--trials", str(trials),
                               "--timeout-s", "5", "--setup", setup, "--stop-at", stop_at, "--seed", "1", *extra,
                               "--keep", str(tmp_path / f"{stop_at}{len(extra)}"), "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
        print(done.stdout)
        assert done.returncode == 0, done.stderr
        summary = json.loads(out.read_text())["summary"]
        assert summary["trial_errors"] == 0 and summary["ok"] == summary["survivors"] == trials, done.stdout
        if extra:
            assert summary["collectives"] == ["non-finite check all_reduce"], summary


def test_healthy_run_is_not_disturbed(tmp_path):
    """With the watchdog armed, a run ends normally; the watchdog thread wakes a few times in total, not per
    collective (it sleeps until the earliest deadline)."""
    world, steps = 2, 12
    ranks = _Ranks(tmp_path, world, steps=steps, timeout_s=TIMEOUT_S)
    try:
        for r in range(world):
            assert ranks.wait_exit(r, 90) is not None
        for r in range(world):
            assert ranks.procs[r].returncode == 0, ranks.err(r)
            assert not _messages(ranks.err(r)), ranks.err(r)
            done = json.loads(ranks.out(r).split("DONE ", 1)[1])
            print(f"rank {r}: {done}")
            assert done["arms"] >= steps * 20  # every wait of every step was armed ...
            assert done["wakeups"] <= 3 + 2 * done["seconds"] / TIMEOUT_S  # ... the thread woke ~2x per timeout_s
    finally:
        ranks.cleanup()


def test_watchdog_thread_never_blocks_exit():
    """The watchdog thread is a daemon: an interpreter with it started (and a wait armed and done) exits at once."""
    code = ("from ds_tsp.core.reliability.watchdog import WATCHDOG, Blocked, stats\n"
            "WATCHDOG.disarm(WATCHDOG.arm(Blocked(None, 'probe', ('group',)), 600.0))\n"
            "assert stats()['thread'], stats()\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30


# --- in-process: cost of arming, failure without a watchdog, message format -----------------------------------
class _Done:
    def wait(self):
        return True


class _Broken:
    def wait(self):
        raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. "
                           "This is typically caused by a remote worker crashing.")


def _fake_comm(rank=0, size=2, ranks=None, context="model.layers.1.mlp backward"):
    return SimpleNamespace(rank=rank, size=size, _ranks=ranks or list(range(size)), context=context)


def test_arming_costs_microseconds():
    works, blocked, n = [_Done()], Blocked(_fake_comm(), "broadcast", ("src", 1)), 20_000

    def per_wait(timeout_s):
        start = time.perf_counter()
        for _ in range(n):
            watched_wait(works, blocked, timeout_s)
        return (time.perf_counter() - start) / n

    bare = min(per_wait(None) for _ in range(3))
    armed = min(per_wait(30.0) for _ in range(3))
    print(f"per wait: {bare * 1e6:.2f} us unarmed, {armed * 1e6:.2f} us armed")
    assert armed - bare < 20e-6  # a gloo collective costs >= tens of us; arming is ~1 us


def test_failure_without_watchdog_raises_one_clear_error():
    blocked = Blocked(_fake_comm(rank=0, size=3), "ring", ("ring", 2, 1), "weight hop 1/2")
    with pytest.raises(TSPCommError) as info:
        watched_wait([_Broken()], blocked, None)
    text = str(info.value)
    assert text.startswith(f"{MESSAGE_PREFIX} ring (weight hop 1/2) failed on rank 0 (TSP rank 0 of 3)")
    assert "waiting for rank 2 (ring receive) or rank 1 (ring send)" in text
    assert "Connection closed by peer [127.0.0.1]:4242" in text and "pair.cc" not in text
    assert "layer: model.layers.1.mlp backward" in text
    assert "test_stalls.py" in text  # the call site


def test_backend_timeout_reads_as_timed_out():
    """gloo's own timeout (the group's, fired before the watchdog's deadline) is reported like the watchdog's."""
    class TimedOut:
        def wait(self):
            raise RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv "
                               "operation to complete")

    blocked = Blocked(_fake_comm(rank=1, size=2), "all_gather", ("group",), "sequence gather")
    with pytest.raises(TSPCommError) as info:
        watched_wait([TimedOut()], blocked, None)
    text = str(info.value)
    assert text.startswith(f"{MESSAGE_PREFIX} all_gather (sequence gather) timed out on rank 0 (TSP rank 1 of 2)")
    assert "waiting for rank 0 (the rest of the TSP group): Timed out waiting 10000ms for recv operation" in text
    assert "unbound_buffer.cc" not in text and "layer: model.layers.1.mlp backward" in text
    with pytest.raises(TSPCommError, match="broadcast failed on rank 0"):  # a closed connection still "failed"
        watched_wait([_Broken()], Blocked(_fake_comm(), "broadcast", ("src", 1)), None)


def test_message_names_global_ranks():
    comm = _fake_comm(rank=1, size=2, ranks=[4, 6], context="model.layers.0.self_attn forward")
    text = describe(Blocked(comm, "broadcast", ("src", 0), "shard of block 0"), "timed out", 5.01, 5)
    assert "waiting for rank 4 (TSP rank 0) (the broadcast source)" in text and "timeout_s=5" in text
    text = describe(Blocked(comm, "reduce", ("dst", 1)), "timed out", 5.0, 5)
    assert "waiting for rank 4 (the reduce contributors; this rank is the destination)" in text
    text = describe(Blocked(comm, "all_gather", ("group",)), "timed out", 5.0, 5)
    assert "waiting for rank 4 (the rest of the TSP group)" in text


def test_label_modules_names_forward_backward_and_resets():
    from torch import nn

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import label_modules

    comm = TSPComm.single()
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(comm.context)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(comm.context)
            return g * 2

    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.comm = comm

        def forward(self, x):
            return Probe.apply(x)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.comm, self.blocks = comm, nn.ModuleList([Leaf(), Leaf()])

        def forward(self, x):
            seen.append(comm.context)
            return self.blocks[1](self.blocks[0](x)).sum()

    model = label_modules(label_modules(Root()))  # idempotent
    model(torch.ones(3, requires_grad=True)).backward()
    assert seen == ["Root forward", "blocks.0 forward", "blocks.1 forward", "blocks.1 backward", "blocks.0 backward"]
    assert comm.context == ""  # reset when the backward pass ended


if __name__ == "__main__" and len(sys.argv) in (4, 5) and sys.argv[1] == "rank":
    _rank_main(int(sys.argv[2]), None if sys.argv[3] == "None" else float(sys.argv[3]),
               float(sys.argv[4]) if len(sys.argv) == 5 else None)
