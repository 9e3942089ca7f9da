"""run_on_local_ranks: results come back in rank order, and a failing rank raises fast instead of hanging."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ds_tsp.core.parallel.launch import run_on_local_ranks


def _rank_info(scale: int) -> dict:
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"rank": rank, "world": dist.get_world_size(), "sum": float(total),
            "tensor": torch.full((2,), rank * scale), "threads": torch.get_num_threads()}


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from the test")
    dist.barrier()  # the other ranks wait here for a rank that never comes


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_results_in_rank_order():
    results = run_on_local_ranks(_rank_info, 3, 10, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["world"] == 3 and r["sum"] == 3.0 and r["threads"] == 1
        assert torch.equal(r["tensor"], torch.full((2,), rank * 10))


def test_failing_rank_raises_without_hanging():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_on_local_ranks(_fail_on_rank_one, 2, timeout_s=120)
    assert time.monotonic() - start < 60
    assert "rank 1" in str(info.value) and "boom from the test" in str(info.value)
    assert "ValueError" in str(info.value)


def test_overall_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        run_on_local_ranks(_sleep, 1, 60.0, timeout_s=4)
    assert time.monotonic() - start < 30


def _bad_input_on_rank_zero() -> None:
    from ds_tsp.core.errors import TSPConfigError

    if dist.get_rank() == 0:
        try:
            raise OSError("header too large")
        except OSError:  # wrapped, as a library may raise it
            raise RuntimeError("loading failed") from TSPConfigError(
                "cannot read the safetensors header of model.safetensors: re-save or re-download it")
    dist.barrier()


def test_an_input_error_in_a_rank_is_its_one_line():
    """A TSPConfigError in a spawned rank reaches the caller as that one line (no relayed traceback), still a
    RuntimeError for callers that catch a rank's failure; ds-tsp verify prints it as its one error line."""
    from ds_tsp.core.errors import TSPConfigError

    with pytest.raises(TSPConfigError) as info:
        run_on_local_ranks(_bad_input_on_rank_zero, 1, timeout_s=120)  # one rank: what a rank returns is the same
    assert str(info.value) == "cannot read the safetensors header of model.safetensors: re-save or re-download it"
    assert isinstance(info.value, RuntimeError) and info.value.rank == 0
