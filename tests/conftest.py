"""Shared pytest setup: the suite's environment (below), `slow` tests are opt-in (pytest --runslow, or RUN_SLOW=1
in the environment); `soak` tests run only when selected (pytest -m soak).

The tests live in one folder per concept (core/, model/, moe/, hybrid/, cp/, checkpoint/, integrations/,
reliability/, tools/, meta/); what they share (multi-rank launchers, tiny checkpoints, references, the sync and
NCCL-rule checkers) is in helpers/. Every one of these folders is put on sys.path and PYTHONPATH here, so a test
imports a helper (or another test's fixtures) by its module name, and so do the ranks and scripts it starts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The suite's environment, set here so that `python -m pytest -q tests` alone is CI's run (.ci/run exports nothing).
# pytest imports this file before any test module, so before torch or deepspeed: OMP_NUM_THREADS is read when torch
# loads its OpenMP runtime, DS_ACCELERATOR when deepspeed picks its accelerator. Subprocesses the tests start
# (torchrun, mp.spawn) inherit os.environ. Set, not defaulted: the suite is a CPU suite (gloo, DeepSpeed's CPU
# accelerator even where a GPU is visible), never downloads (tiny models are built from configs), and its timings
# and thread-dependent checks assume one OpenMP thread per process, whatever the calling shell exports.
SUITE_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
os.environ.update(SUITE_ENV)

_TESTS = Path(__file__).resolve().parent
SUITE_PATHS = [str(_TESTS / "helpers"), *sorted(str(d) for d in _TESTS.iterdir()
                                                 if d.is_dir() and d.name not in ("helpers", "fixtures", "__pycache__"))]
sys.path[:0] = [p for p in SUITE_PATHS if p not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join([*SUITE_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
if "torch" in sys.modules:  # imported before us (a plugin): its thread pool already read the environment
    sys.modules["torch"].set_num_threads(int(SUITE_ENV["OMP_NUM_THREADS"]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def _run_slow(config: pytest.Config) -> bool:
    return config.getoption("--runslow") or os.environ.get("RUN_SLOW", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" not in (config.getoption("-m") or ""):
        skip_soak = pytest.mark.skip(reason="soak: run with pytest -m soak")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(skip_soak)
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_pair_of_ranks():
    """A default process group of 2 ranks on torch's fake backend (this process is rank 0): collectives return at
    once, so a test can drive the code that arms the guards around them without a second process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
