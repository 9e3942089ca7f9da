"""Run a launched script with this rank's collectives recorded for the NCCL-rules replay (tests/helpers/nccl_rules.py):
every TSPComm the run creates records into one CommRecorder, and every torch.distributed call made elsewhere (the
Trainer's, Accelerate's, DeepSpeed's, ds_tsp's own reductions: tests/helpers/dist_trace.py) joins the same list in
post order. A helper module, used as the launched program:

    torchrun --nproc_per_node 2 tests/helpers/traced_run.py OUT_DIR SCRIPT ARGS...

runs SCRIPT as __main__ with ARGS and writes OUT_DIR/rank{RANK}.pkl (the op dicts) when it returns, raises, or
ends through os._exit (ds_tsp's exit_rank, the watchdog). Metadata only: the calls run unchanged, so the run's
numbers are the untraced run's. `recorded(OUT_DIR, world)` reads them back.
"""
from __future__ import annotations

import os
import pickle
import runpy
import sys
from pathlib import Path


def recorded(out_dir: str | Path, world: int) -> list[list[dict]]:
    """Every rank's ops, indexed by global rank (the files this module wrote: test data, never a user's)."""
    ops = []
    for rank in range(world):
        with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
            ops.append(pickle.load(f))
    return ops


def assert_obeys_nccl_rules(trace: str | Path, kinds: set[str], world: int = 2) -> None:
    """The NCCL-rules replay (tests/helpers/nccl_rules.py) of a traced run: every rank's collectives (the layers'
    through TSPComm; the Trainer's, Accelerate's and DeepSpeed's, ds_tsp's token counts and saves through
    torch.distributed) in post order meet their peers' in the same order, with the same shapes, and the replay
    finishes (gloo's threads hide orders that hang NCCL). kinds: op kinds rank 0 must have posted."""
    from nccl_rules import check

    ops = recorded(trace, world)
    assert kinds <= {o["kind"] for o in ops[0]}, {o["kind"] for o in ops[0]}
    assert any(o.get("source") == "outside" for o in ops[0])  # the collectives outside TSPComm were recorded
    report = check(ops)
    assert report.ok and report.completed == report.total, report


def _main(out_dir: str, script: str, argv: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dist_trace import traced

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.comm.recorder import CommRecorder

    rec = CommRecorder()
    post_init = TSPComm.__post_init__

    def recording_post_init(self):
        post_init(self)
        self.recorder = rec
        if self.cp is not None:
            self.cp.recorder = rec

    TSPComm.__post_init__ = recording_post_init
    written = []

    def write() -> None:
        if written:
            return
        written.append(True)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.pkl", "wb") as f:
            pickle.dump(list(rec.ops), f)

    real_exit = os._exit

    def exit_after_writing(code):
        write()
        real_exit(code)

    os._exit = exit_after_writing
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with traced(rec.ops):
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            write()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3:])
