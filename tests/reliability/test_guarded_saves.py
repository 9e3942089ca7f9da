"""The collectives a run posts outside the layers are guarded too: a peer that stalls (sleeps) or dies inside a
training-checkpoint save, save_pretrained, or TSPTrainer's token count ends the other rank within timeout_s plus a
margin, with the watchdog's ONE line naming the collective and the peer (exit code EXIT_CODE), instead of waiting on
gloo's 1800 s default; a save interrupted this way leaves the previous checkpoint untouched and loadable.

Two ranks started by hand (tests/helpers/rank_procs.py) on gloo with the default group's 1800 s timeout, TSP 2,
TSPComm(timeout_s=TIMEOUT_S). This file is also the rank script: `python test_guarded_saves.py rank CASE DIR`.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_S = 2.0
MARGIN_S = 20.0  # interpreter start-up and the 2-core CI box; the stall itself is 60 s


# --- the rank script ------------------------------------------------------------------------------------------
def _stall(rank: int, case: str) -> None:
    if rank == 1:
        print("STALLING", flush=True)
        if case.endswith("dies"):
            os._exit(3)
        time.sleep(60)


def _rank_main(case: str, directory: str) -> None:
    import torch

    from ds_tsp.checkpoint.training.access import OptimizerAccess
    from ds_tsp.checkpoint.training.store import CheckpointStore
    from ds_tsp.checkpoint.training.train_state import save_train_state
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.parallel.launch import init_from_env
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.model.causal_lm import ShardedCausalLM

    torch.set_num_threads(1)
    rank, world = init_from_env(backend="gloo")  # the default group keeps gloo's 1800 s: only the guard bounds it
    groups = ProcessGroups.build(ParallelLayout.from_world_size(world, tsp=world))
    comm = TSPComm(groups.tsp_group, timeout_s=TIMEOUT_S)
    shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    model = ShardedCausalLM(shape, comm).init_weights_(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    if case.startswith("train_save"):
        store = CheckpointStore(directory, keep_last=3)
        access = OptimizerAccess(optimizer, global_batch_size=2)
        save_train_state(access, model, groups, store, 1)
        print("SAVED 1", flush=True)
        real_weight = access.weight
        seen = []

        def weight(param):  # rank 1 stalls half-way through the parameters of the second save
            seen.append(param)
            if len(seen) == 3:
                _stall(rank, case)
            return real_weight(param)

        access.weight = weight
        save_train_state(access, model, groups, store, 2)
    elif case == "save_pretrained":
        import ds_tsp.checkpoint.hf.save as hf_save

        real_agree = hf_save.agree_on_outcome

        def agree(*args, **kwargs):  # rank 1 stalls after its last gather, before the outcome broadcast
            _stall(rank, case)
            return real_agree(*args, **kwargs)

        hf_save.agree_on_outcome = agree
        hf_save.save_streaming(model, Path(directory) / "hf", "{}")
    elif case == "token_count":
        from types import SimpleNamespace

        from ds_tsp.integrations.hf_trainer import TSPTrainer

        trainer = SimpleNamespace(tsp_groups=groups, tsp_comm=comm, _tsp_vlm=False,
                                  args=SimpleNamespace(average_tokens_across_devices=True))
        labels = torch.tensor([[1, 2, -100, 3]])
        _stall(rank, case)
        TSPTrainer._get_num_items_in_batch(trainer, [{"shift_labels": labels}], torch.device("cpu"))
    print("NOT STALLED", flush=True)
    sys.stderr.flush()
    os._exit(0)


# --- the tests ------------------------------------------------------------------------------------------------
def _run(tmp_path: Path, case: str):
    from rank_procs import Ranks, survivor_reports_the_stall

    ranks = Ranks(tmp_path, 2, [__file__, "rank", case, str(tmp_path / "ckpt")])
    return survivor_reports_the_stall(ranks, TIMEOUT_S + MARGIN_S)


def test_a_stall_inside_a_training_checkpoint_save_ends_the_peer_and_keeps_the_previous_one(tmp_path):
    from ds_tsp.checkpoint.training import verify_checkpoint

    message, took = _run(tmp_path, "train_save")
    assert " timed out on rank 0 " in message and f"timeout_s={TIMEOUT_S:g}" in message, message
    assert re.search(r"training checkpoint save: .* waiting for rank 1\b", message), message
    assert took >= TIMEOUT_S - 0.5  # the peer got its timeout_s
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000001"], steps  # the interrupted save committed nothing
    verify_checkpoint(tmp_path / "ckpt" / "step-00000001")


@pytest.mark.slow  # in-process on the fake group: tests/reliability/test_guarded_collectives.py
def test_a_stall_in_the_trainers_token_count_ends_the_peer(tmp_path):
    message, _ = _run(tmp_path, "token_count")
    assert re.search(r"token count all_reduce timed out on rank 0 .* waiting for rank 1\b", message), message


@pytest.mark.slow
def test_a_stall_before_save_pretrained_agrees_ends_the_peer(tmp_path):
    message, _ = _run(tmp_path, "save_pretrained")
    assert re.search(r"save_pretrained: broadcast of the outcome timed out on rank 0 .* waiting for rank 1\b",
                     message), message
    # the writer had every tensor before the outcome broadcast: its checkpoint is complete
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "ckpt" / "hf").iterdir())


@pytest.mark.slow
def test_a_peer_that_dies_inside_a_save_ends_the_other_at_once(tmp_path):
    message, took = _run(tmp_path, "train_save_dies")
    assert re.search(r"training checkpoint save: .* failed on rank 0 .* waiting for rank 1\b", message), message
    assert took < TIMEOUT_S + MARGIN_S


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank":
    _rank_main(sys.argv[2], sys.argv[3])
