"""The one-time setup, the Trainer's resume load and the TRL trainers' loaders are guarded: a peer that stalls
(sleeps) inside them ends the other rank within timeout_s plus a margin with the watchdog's ONE line naming the
block and the peer (exit code EXIT_CODE), instead of gloo's 1800 s default.

- setup: build_runtime's node-placement all_gather_object and group creation (real), DeepSpeed's initialize under
  ds_tsp.initialize (real, slow), TSPAccelerator.prepare (Accelerate's prepare posting a world collective);
- resume: TSPTrainer's setup-and-resume block (_prepare_for_training) and its _load_from_checkpoint, with the
  Trainer's method posting a world collective as DeepSpeed's checkpoint load does;
- the loaders of GRPO / RLOO / reward / DPO (trl.grpo.unsharded: whole batches): a real TSPAccelerator-prepared
  loader whose fetch broadcasts the sampler's RNG state over the world.

Two ranks started by hand (tests/helpers/rank_procs.py) on gloo. This file is also the rank script:
`python test_guarded_setup.py rank CASE`. In-process checks use the fake process group (world 2).
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


# --- the rank script ------------------------------------------------------------------------------------------
def _stall(rank: int, stalling: int = 1) -> None:
    if rank == stalling:
        print("STALLING", flush=True)
        time.sleep(60)


def _world_collective_after_a_stall() -> None:
    """What DeepSpeed's / Accelerate's code does inside the guarded block: a collective over the world (rank 1
    stalls first)."""
    _stall(dist.get_rank())
    dist.all_reduce(torch.zeros(1))


def _rank_main(case: str) -> None:
    torch.set_num_threads(1)
    if case == "groups":  # build_runtime: the placement all_gather_object and new_group, no TSPComm yet
        from ds_tsp.core.config import parse_tsp_config
        from ds_tsp.core.parallel.launch import init_from_env
        from ds_tsp.core.parallel.runtime import build_runtime

        rank, _ = init_from_env(backend="gloo")  # the default group keeps gloo's 1800 s: only the guard bounds it
        _stall(rank)
        build_runtime(parse_tsp_config({"size": 2, "timeout_s": TIMEOUT_S}))
    elif case == "deepspeed_setup":  # data 2 x TSP 1, ZeRO-2: rank 1 stalls inside deepspeed.initialize
        import deepspeed

        import ds_tsp
        from ds_tsp.core.shape.model_shape import ModelShape

        original = deepspeed.initialize

        def initialize(*args, **kwargs):
            _stall(dist.get_rank())
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 2}, "tsp": {"size": 1, "timeout_s": TIMEOUT_S}}
        ds_tsp.initialize(model=shape, config=config)
    elif case == "prepare":  # TSPAccelerator.prepare: Accelerate's prepare posts a world collective
        import accelerate

        from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

        accelerator = TSPAccelerator(tsp_size=2)
        accelerator.tsp_comm.timeout_s = TIMEOUT_S
        accelerate.Accelerator.prepare = lambda self, *objects: _world_collective_after_a_stall() or objects
        accelerator.prepare(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    elif case in ("resume", "resume_model"):  # TSPTrainer's resume: the Trainer's load posts a world collective
        import transformers

        from ds_tsp.core.comm.communicator import TSPComm
        from ds_tsp.core.parallel.launch import init_from_env
        from ds_tsp.integrations.hf_trainer import TSPTrainer

        init_from_env(backend="gloo")
        trainer = object.__new__(TSPTrainer)
        trainer.__dict__.update(tsp_comm=TSPComm(dist.group.WORLD, timeout_s=TIMEOUT_S),
                                state=SimpleNamespace(global_step=0))
        if case == "resume":
            transformers.Trainer._prepare_for_training = lambda self, *a: _world_collective_after_a_stall()
            trainer._prepare_for_training(4, None, "out/checkpoint-2")
        else:
            transformers.Trainer._load_from_checkpoint = lambda self, *a: _world_collective_after_a_stall()
            trainer._load_from_checkpoint("out/checkpoint-2")
    elif case == "trl_loader":  # GRPO's train loader: whole prompt rows, the sampler's RNG broadcast at each epoch
        from accelerate.data_loader import prepare_data_loader

        from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator
        from ds_tsp.integrations.accelerate.dataloaders import TSPShardedLoader
        from ds_tsp.integrations.trl.grpo import unsharded

        accelerator = TSPAccelerator(tsp_size=2)  # the process group and Accelerate's state (MULTI_CPU)
        accelerator.tsp_comm.timeout_s = TIMEOUT_S
        # what TSPAccelerator._prepare_tsp_loader builds on a data axis of 2 (DeepSpeed / FSDP2 launches) with
        # use_seedable_sampler=False: Accelerate broadcasts the sampler's generator from rank 0 at each epoch start
        prompts = [{"prompt": f"p{i}"} for i in range(8)]
        prepared = prepare_data_loader(torch.utils.data.DataLoader(prompts, batch_size=2, shuffle=True,
                                                                   collate_fn=lambda rows: rows),
                                       num_processes=2, process_index=accelerator.process_index,
                                       rng_types=["generator"], use_seedable_sampler=False)
        loader = unsharded(TSPShardedLoader(prepared, accelerator.tsp_comm))
        _stall(accelerator.process_index, stalling=0)  # the broadcast's root: only its peer waits
        next(iter(loader))
    print("NOT STALLED", flush=True)
    sys.stderr.flush()
    os._exit(0)


# --- two ranks ------------------------------------------------------------------------------------------------
# case: (what the survivor's line names, run by default, the rank that stalls)
CASES = {
    "trl_loader": (r"the data loader's batch fetch \(Accelerate's RNG-state / batch broadcast\)", True, 0),
    "groups": (r"setup: node-placement all_gather_object", False, 1),
    "deepspeed_setup": (r"deepspeed.initialize \(the model's broadcast, .*\)", False, 1),
    "prepare": (r"Accelerate prepare \(deepspeed.initialize: .*\)", False, 1),
    "resume": (r"the Trainer's setup \(accelerator.prepare, deepspeed.initialize\) and resume load \(.*\)", False, 1),
    "resume_model": (r"the Trainer's resume load \(the model's checkpoint\)", False, 1),
}


@pytest.mark.parametrize("case", [c if default else pytest.param(c, marks=pytest.mark.slow)
                                  for c, (_, default, _) in CASES.items()])
def test_a_stall_in_setup_resume_or_a_trl_loader_ends_the_peer(tmp_path, case):
    """One rank stalls inside the block, the other waits in its collective: out within timeout_s + margin, one line
    naming the block and the stalled rank (the default run: the TRL loader; the others are slow, ~10-50 s each)."""
    if case == "deepspeed_setup":
        pytest.importorskip("deepspeed")
    from rank_procs import Ranks, survivor_reports_the_stall

    pattern, _, stalling = CASES[case]
    message, took = survivor_reports_the_stall(Ranks(tmp_path, 2, [__file__, "rank", case]), TIMEOUT_S + MARGIN_S,
                                               stalling=stalling)
    assert re.search(pattern + rf" (timed out|failed) on rank {1 - stalling} .* waiting for rank {stalling}\b",
                     message), message
    if case not in ("groups", "deepspeed_setup"):  # there the groups have timeout_s: gloo's timer may fire first
        assert " timed out " in message and took >= TIMEOUT_S - 0.5, message


# --- in process, on the fake group (tests/conftest.py) ---------------------------------------------------------
def test_the_setup_and_resume_blocks_are_armed_and_let_their_own_errors_through(fake_pair_of_ranks, monkeypatch):
    """While Accelerate's prepare, the Trainer's setup / resume load
    and a whole-batch loader's fetch run, this thread's wait is armed; a bad checkpoint file's error (not a
    collective's) propagates as it is; after each block nothing is armed."""
    import accelerate
    import transformers

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import WATCHDOG, guarded
    from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator
    from ds_tsp.integrations.accelerate.dataloaders import TSPShardedLoader, WholeBatchLoader
    from ds_tsp.integrations.hf_trainer import TSPTrainer
    from ds_tsp.integrations.trl.grpo import unsharded

    comm, me = TSPComm(dist.group.WORLD, timeout_s=20), threading.get_ident()
    armed = []

    def seen(*_a, **_k):
        armed.append(WATCHDOG._armed[me][3].kind if me in WATCHDOG._armed else None)
        return _a[1:] if _a else None

    monkeypatch.setattr(accelerate.Accelerator, "prepare", seen)
    accelerator = object.__new__(TSPAccelerator)
    accelerator.__dict__.update(tsp_comm=comm, tsp_setup=SimpleNamespace(mode="plain"))
    accelerator.prepare(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    monkeypatch.setattr(transformers.Trainer, "_prepare_for_training", seen)
    monkeypatch.setattr(transformers.Trainer, "_load_from_checkpoint", seen)
    trainer = object.__new__(TSPTrainer)
    trainer.__dict__.update(tsp_comm=comm, state=SimpleNamespace(global_step=2))
    trainer._prepare_for_training(4, None, None)
    trainer._prepare_for_training(4, None, "checkpoint-2")
    trainer._load_from_checkpoint("checkpoint-2")
    loader = unsharded(TSPShardedLoader(iter([[{"prompt": "p"}]]), comm))
    assert isinstance(loader, WholeBatchLoader) and unsharded(loader) is loader
    def prompts():  # what the prepared loader yields, seen while the fetch runs
        seen()
        yield [{"prompt": "p"}]

    loader.loader = prompts()
    assert list(loader) == [[{"prompt": "p"}]]
    with guarded(None, "setup: process groups' creation (new_group)", context="setup", timeout_s=5):
        seen()
    assert armed == ["Accelerate prepare (deepspeed.initialize: the model's broadcast, ZeRO's partitioning, barriers)",
                     "the Trainer's setup (accelerator.prepare, deepspeed.initialize)",
                     "the Trainer's setup (accelerator.prepare, deepspeed.initialize) and resume load (DeepSpeed's "
                     "checkpoint load, the optimizer's)",
                     "the Trainer's resume load (the model's checkpoint)",
                     "the data loader's batch fetch (Accelerate's RNG-state / batch broadcast)",
                     "setup: process groups' creation (new_group)"], armed
    assert me not in WATCHDOG._armed

    def bad_file(*_a, **_k):
        raise RuntimeError("Error(s) in loading state_dict for TSPForCausalLM: size mismatch for lm_head")

    monkeypatch.setattr(transformers.Trainer, "_load_from_checkpoint", bad_file)
    with pytest.raises(RuntimeError, match="size mismatch"):  # a file's error, not reported as a stall
        trainer._load_from_checkpoint("checkpoint-2")
    assert me not in WATCHDOG._armed


def test_the_pipeline_engines_train_batch_and_eval_batch_are_bounded(fake_pair_of_ranks, monkeypatch):
    """Under tsp.pipeline_stages > 1 the stages' sends / receives run inside DeepSpeed's train_batch / eval_batch:
    each call is one guarded block (armed while it runs); a collective's failure is reported with the one line, an
    error of the computation propagates as it is."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import WATCHDOG
    from ds_tsp.integrations.deepspeed.engine import _guard_pipeline

    comm, me = TSPComm(dist.group.WORLD, timeout_s=20), threading.get_ident()
    reports = []
    monkeypatch.setattr(WATCHDOG, "report_and_exit", lambda message: reports.append(message))

    def train_batch(error=None):
        if error is not None:
            raise error
        return WATCHDOG._armed[me][3].kind

    engine = SimpleNamespace(train_batch=train_batch, eval_batch=train_batch)
    _guard_pipeline(engine, comm)
    assert engine.train_batch().startswith("DeepSpeed pipeline train_batch")
    assert engine.eval_batch().startswith("DeepSpeed pipeline eval_batch") and me not in WATCHDOG._armed
    with pytest.raises(ValueError):
        engine.train_batch(ValueError("bad batch"))
    assert reports == []
    with pytest.raises(RuntimeError):
        engine.train_batch(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    (message,) = reports
    assert "DeepSpeed pipeline train_batch" in message and "waiting for rank 1" in message, message


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    _rank_main(sys.argv[2])
