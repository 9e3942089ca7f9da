"""kill -9 during a save never costs a checkpoint, and examples/train.py --resume after a kill continues bit for bit.

Ranks are separate processes started with the standard torch.distributed variables (tests/helpers/rank_procs.py), running
examples/train.py. To kill at a chosen moment of a save, this file is also the rank program
(`python tests/checkpoint/test_checkpoint_kill.py rank PHASE ARGS...`): it stops the save of step 3 at PHASE (halfway through
writing a shard file, with every file written but before the rename, or while pruning the oldest checkpoint) and
prints PAUSED, then the test SIGKILLs every rank.
"""
from __future__ import annotations

import json
import random
import runpy
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from rank_procs import REPO, Ranks  # noqa: E402

TRAIN = str(REPO / "examples" / "train.py")
CONFIG = str(REPO / "ds_configs" / "tsp.json")  # no ZeRO: the torch-optimizer path (ZeRO: test_training_checkpoint)
PAUSE_STEP = 3


# --- the rank program -------------------------------------------------------------------------------------------
def _pause(phase: str) -> None:
    from ds_tsp.tools.json_stdout import json_stream

    # train.py's stdout is kept for its records (print() goes to stderr there): the marker is written beside them
    print(f"PAUSED {phase}", file=json_stream(), flush=True)
    while True:
        time.sleep(60)


def _install_pause(phase: str) -> None:
    from ds_tsp.checkpoint.training import shard_files, store

    if phase == "shard":
        write = shard_files.write_file

        def half_then_pause(path, data):
            if f"step-{PAUSE_STEP:08d}" in path.parent.name:
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                _pause(phase)
            write(path, data)

        shard_files.write_file = half_then_pause
    elif phase == "rename":
        commit = store.CheckpointStore.commit

        def pause_before_rename(self, tmp, step):
            if step == PAUSE_STEP:
                _pause(phase)  # manifest and every file are written; the directory still has its temporary name
            return commit(self, tmp, step)

        store.CheckpointStore.commit = pause_before_rename
    elif phase == "prune":
        discard = store.CheckpointStore._discard

        def pause_while_pruning(self, path):
            import os

            os.rename(path, self.root / ".trash-test-0")  # renamed away, its files not yet deleted
            _pause(phase)
            discard(self, path)

        store.CheckpointStore._discard = pause_while_pruning


def _rank_main(phase: str, argv: list[str]) -> None:
    if phase != "none":
        _install_pause(phase)
    sys.argv = [TRAIN, *argv]
    runpy.run_path(TRAIN, run_name="__main__")


# --- helpers ----------------------------------------------------------------------------------------------------
def _train_argv(save_dir: Path, max_steps: int, *extra: str) -> list[str]:
    return ["--ds_config", CONFIG, "--max_steps", str(max_steps), "--seq_len", "32", "--save_dir", str(save_dir),
            *extra]


def _losses(ranks: Ranks) -> dict[int, float]:
    out = {}
    for line in ranks.out(0).splitlines():
        if line.startswith("{") and '"step"' in line:
            record = json.loads(line)
            out[record["step"]] = record["loss"]
    return out


def _check_loadable(save_dir: Path) -> int:
    """The newest complete checkpoint passes every checksum; returns its step."""
    from ds_tsp.checkpoint.training import CheckpointStore, verify_checkpoint

    latest = CheckpointStore(save_dir).latest()
    assert latest is not None, list(save_dir.iterdir())
    return verify_checkpoint(latest).step


def _run(tmp_path: Path, tag: str, argv: list[str], phase: str = "none") -> Ranks:
    return Ranks(tmp_path, 2, [__file__, "rank", phase, *argv], tag=tag)


# --- the tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase,survivor", [("shard", PAUSE_STEP - 1), ("rename", PAUSE_STEP - 1),
                                            ("prune", PAUSE_STEP)])
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, phase, survivor):
    save_dir = tmp_path / "ckpt"
    ranks = _run(tmp_path, "kill", _train_argv(save_dir, 6, "--save_every", "1", "--keep_last", "2"), phase)
    try:
        ranks.wait_for(f"PAUSED {phase}", ranks=[0])
        ranks.kill_all()
        ranks.wait_all(30)
    finally:
        ranks.cleanup()
    assert _check_loadable(save_dir) == survivor
    leftovers = [p.name for p in save_dir.iterdir() if p.name.startswith(".")]
    assert leftovers, "the kill should have left a temporary or trash directory behind"
    if phase != "rename":  # one resume is enough to show the leftovers go (the resume itself: the test below)
        return
    # resuming works and the next successful save removes what the kill left
    again = _run(tmp_path, "resume", _train_argv(save_dir, survivor + 1, "--resume", "--keep_last", "2"))
    try:
        assert again.wait_all(180) == [0, 0], again.err(0)[-3000:]
    finally:
        again.cleanup()
    assert f'"resumed_from_step": {survivor}' in again.out(0)
    assert _check_loadable(save_dir) == survivor + 1
    assert not [p.name for p in save_dir.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_kill_at_random_moments_of_frequent_saves(tmp_path):
    """Saves every step (most of the step time is spent saving): killed at a random moment three times, the
    newest complete checkpoint always passes its checksums and the run resumes from it."""
    save_dir = tmp_path / "ckpt"
    rng = random.Random(0)
    done = 0
    for attempt in range(3):
        extra = ["--save_every", "1", "--keep_last", "2"] + (["--resume"] if attempt else [])
        ranks = _run(tmp_path, f"random{attempt}", _train_argv(save_dir, 1000, *extra))
        try:
            ranks.wait_for(f'"step": {done + 2},', ranks=[0])
            time.sleep(rng.uniform(0.0, 0.5))
            ranks.kill_all()
            ranks.wait_all(30)
        finally:
            ranks.cleanup()
        step = _check_loadable(save_dir)
        assert step >= done + 1
        if attempt:
            assert f'"resumed_from_step": {done}' in ranks.out(0)
        done = step


def test_train_example_resumes_bit_identically_after_a_kill(tmp_path):
    """examples/train.py --save_dir --save_every 2: killed after step 5, --resume restarts from step 4 and prints
    the same losses, bit for bit, as a run that was never interrupted."""
    whole = _run(tmp_path, "whole", _train_argv(tmp_path / "whole", 8))
    try:
        assert whole.wait_all(180) == [0, 0], whole.err(0)[-3000:]
    finally:
        whole.cleanup()
    want = _losses(whole)
    assert sorted(want) == list(range(1, 9))

    save_dir = tmp_path / "ckpt"
    killed = _run(tmp_path, "killed", _train_argv(save_dir, 8, "--save_every", "2"))
    try:
        killed.wait_for('"step": 5,', ranks=[0])
        killed.kill_all()
        killed.wait_all(30)
    finally:
        killed.cleanup()
    resumed = _run(tmp_path, "resumed", _train_argv(save_dir, 8, "--save_every", "2", "--resume"))
    try:
        assert resumed.wait_all(180) == [0, 0], resumed.err(0)[-3000:]
    finally:
        resumed.cleanup()
    assert '"resumed_from_step": 4' in resumed.out(0)
    got = _losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert {s: want[s] for s in got} == got  # exact float equality
    assert {s: _losses(killed)[s] for s in range(1, 5)} == {s: want[s] for s in range(1, 5)}


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "rank":
    _rank_main(sys.argv[2], sys.argv[3:])
