"""Exit codes of launched scripts, measured: N runs under `torchrun --standalone --nproc_per_node 2`, counting aborts.

    python benchmarks/exit_trials.py --runs 50 --what minimal --out /tmp/exit_minimal.json
    python benchmarks/exit_trials.py --runs 20 --what demo
    python benchmarks/exit_trials.py --runs 20 --what verify
    python benchmarks/exit_trials.py --runs 20 --what script --script my_script.py

--what minimal: benchmarks/exit_user_script.py, a user's own script (load a tiny local checkpoint, 2 steps,
save_pretrained, return normally: no exit_rank, no destroy_process_group, no os._exit); the checkpoint is built
once per measurement. demo / verify: the README's commands (`examples/demo_train.py`, `-m ds_tsp verify --tsp 2
--dtype float64`; both end through ds_tsp.tools.entry_point). script: any script (e.g. the Python API block of docs/python_api.md
saved to a file), run as `torchrun ... SCRIPT`. A run is an abort when torchrun exits non-zero or any stderr line says "terminate called" (the
signature of a gloo worker thread ended during interpreter finalization; see ds_tsp.core.reliability.clean_exit).
Prints one line per run and a JSON summary; --keep keeps every run's stdout/stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABORT_MARKERS = ("terminate called", "SIGABRT", "Signal 6")


def tiny_checkpoint(directory: Path) -> Path:
    """The tiny Llama-3-style checkpoint examples/finetune_hf.py builds (no download)."""
    sys.path.insert(0, str(REPO / "examples"))
    from finetune_hf import tiny_llama3

    tiny_llama3(str(directory))
    return directory


def command(what: str, work: Path, run: int, script: str | None = None) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if what == "minimal":
        return torchrun + [str(REPO / "benchmarks" / "exit_user_script.py"), str(work / "model"),
                           str(work / f"out{run}")]
    if what == "demo":
        return torchrun + [str(REPO / "examples" / "demo_train.py")]
    if what == "verify":
        return torchrun + ["-m", "ds_tsp", "verify", "--tsp", "2", "--dtype", "float64"]
    if what == "script":
        return torchrun + [str(Path(script).resolve())]
    raise ValueError(what)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--what", choices=("minimal", "demo", "verify", "script"), default="minimal")
    p.add_argument("--script", default=None, help="with --what script: the script to launch")
    p.add_argument("--timeout-s", type=float, default=600, help="per run")
    p.add_argument("--keep", default=None, help="folder for every run's stdout/stderr (default: a temporary one)")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    args = p.parse_args(argv)
    if (args.what == "script") != (args.script is not None):
        p.error("--script goes with --what script (and --what script needs --script)")
    work = Path(args.keep or tempfile.mkdtemp(prefix=f"exit_{args.what}_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.what == "minimal":
        tiny_checkpoint(work / "model")
    runs = []
    for i in range(args.runs):
        start = time.monotonic()
        try:
            done = subprocess.run(command(args.what, work, i, args.script), cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=args.timeout_s, check=False)
            rc, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = "timeout", exc.stdout or "", exc.stderr or ""
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
        (work / f"run{i}.out").write_text(out)
        (work / f"run{i}.err").write_text(err)
        markers = [m for m in ABORT_MARKERS if m in err]
        run = {"run": i, "rc": rc, "seconds": round(time.monotonic() - start, 1), "abort": rc != 0 or bool(markers),
               "markers": markers}
        runs.append(run)
        print(f"{i:>3} rc {rc} {run['seconds']:>6.1f} s {'ABORT ' + ','.join(markers) if run['abort'] else 'ok'}",
              flush=True)
    summary = {"what": args.what, "runs": len(runs), "aborts": sum(r["abort"] for r in runs),
               "nonzero_rc": sum(r["rc"] != 0 for r in runs),
               "terminate_called": sum("terminate called" in r["markers"] for r in runs), "logs": str(work),
               "command": " ".join(command(args.what, work, 0, args.script))}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return summary


if __name__ == "__main__":
    main()
