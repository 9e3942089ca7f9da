"""The suite's ranks fork from one pre-imported server instead of each starting a fresh interpreter.

ds_tsp.run_on_local_ranks starts every rank with the "spawn" method, so each rank of each call imports torch, and
most of the suite's rank functions also import transformers and DeepSpeed: 2-5 s of CPU per rank before the first
line of the test runs, paid again on every call (~80 calls of 2-4 ranks in the default suite, plus the ranks that
`ds-tsp verify` and `ds-tsp bench` start when their tests call them in-process). Under `forked_ranks()` the
package's own launcher runs unchanged (same `_child` body, same failure, timeout and result handling) except for
the start method: multiprocessing's "forkserver", whose ONE server process per pytest session imports PRELOAD once;
each rank is a fresh fork of it. A rank is still a new process with its own gloo group, RNG and memory, as under
"spawn": the server never starts a process group, an OpenMP pool (OMP_NUM_THREADS=1, conftest.py) or CUDA.
DeepSpeed's own suite reuses warm rank processes for the same reason (tests/unit/common.py, reuse_dist_env).

What "spawn" gave and a fork of a long-lived server would not, restored per rank: the environment. A forked rank
inherits the server's environment (the caller's when the server started), so the caller's os.environ at the call
is sent along and installed before the rank body runs (monkeypatch.setenv reaches the ranks as before; the call's
`env` is applied on top by the launcher, as always).

Tests of the launcher itself (test_launch.py, test_gpu_launch.py), of the public name (test_public_surface.py,
test_readme.py) and the soak's resident-memory curve keep the package's spawn launcher. DS_TSP_SUITE_SPAWN=1 in
the environment turns forked_ranks() into a no-op: every rank spawned as by the package (to rule the forkserver out
when a rank misbehaves, and to time the difference). A helper module, not a test file.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.multiprocessing as torch_mp

from ds_tsp.core.parallel import launch

# Imported once, in the server: a module a rank imports that is already here costs the rank nothing. A module that
# is not installed is skipped (multiprocessing's preload ignores ImportError).
PRELOAD = ["torch", "torch.distributed", "pytest", "numpy", "ds_tsp", "ds_tsp.hf", "ds_tsp.testing",
           "ds_tsp.model.causal_lm", "deepspeed", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.mixtral.modeling_mixtral", "safetensors.torch",
           "transformers.trainer", "accelerate", "peft"]  # the rank functions that build a Trainer or a PEFT model


def _in_caller_environ(caller_environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """Runs first in the forked rank: the caller's environment as it was at the call (what a spawned rank starts
    with), then the launcher's rank body (which sets MASTER_*, RANK, WORLD_SIZE and the call's env on top)."""
    os.environ.clear()
    os.environ.update(caller_environ)
    return target(*args)


class _ForkedContext:
    """The part of a multiprocessing context launch.py uses (Process, Queue), on the forkserver context, with each
    Process's target run inside _in_caller_environ."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def Queue(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return self._context.Queue(*args, **kwargs)

    def Process(self, *, target: Callable[..., Any], args: tuple = (), **kwargs: Any) -> Any:  # noqa: N802
        return self._context.Process(target=_in_caller_environ, args=(dict(os.environ), target, *args), **kwargs)


class _ForkedMP:
    """Stands in for torch.multiprocessing inside ds_tsp.core.parallel.launch: asked for the "spawn" context, it answers with
    the forked one."""

    def __init__(self) -> None:
        context = torch_mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call), once per session
        self._context = _ForkedContext(context)

    def get_context(self, method: str) -> Any:
        assert method == "spawn", method  # the only context launch.py asks for; anything else: re-read launch.py
        return self._context


_FORKED_MP = _ForkedMP()


@contextlib.contextmanager
def forked_ranks() -> Iterator[None]:
    """Inside: every rank ds_tsp.core.parallel.launch.run_on_local_ranks starts (directly, or through `ds-tsp verify` or
    `ds-tsp bench` called in-process) forks from the session's server (see the module docstring)."""
    if os.environ.get("DS_TSP_SUITE_SPAWN") == "1":
        yield
        return
    saved = launch.mp
    launch.mp = _FORKED_MP
    try:
        yield
    finally:
        launch.mp = saved


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
                       env: Mapping[str, str] | None = None) -> list:
    """ds_tsp.run_on_local_ranks with forked ranks; same arguments, same results."""
    with forked_ranks():
        return launch.run_on_local_ranks(fn, world_size, *args, timeout_s=timeout_s, env=env)
