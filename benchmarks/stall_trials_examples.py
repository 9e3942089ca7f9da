"""A stalled rank inside a saving run, measured on the examples: N trials of `examples/train.py --save_dir D
--save_every 1` or `examples/hf_trainer.py --save_steps 1`, ranks started BY HAND, one SIGSTOPped at a random moment.

    python benchmarks/stall_trials_examples.py --example train --trials 20 --timeout-s 20 --out /tmp/train.json
    python benchmarks/stall_trials_examples.py --example hf_trainer --trials 20 --timeout-s 20 --out /tmp/hf.json

Each trial starts `--world` plain `python` processes with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
(no launcher that could tear the job down), the DeepSpeed config's "tsp" block carrying timeout_s (TSP `--world`).
Once every rank logged `--warm-steps` steps, after a random delay of up to `--max-delay-s` (a step and its save take
well under a second here, so the stop lands anywhere in a step or a save), a random rank gets SIGSTOP. A survivor
is `ok` when it exits within timeout_s + 30 s with ds_tsp's exit code and exactly ONE stall line naming the
collective and the peer ("waiting for rank V"). After the trial the newest complete checkpoint must load:
train: the newest step directory of the ds_tsp store passes verify_checkpoint (checksums, manifest); hf_trainer:
the newest checkpoint-N with trainer_state.json (what the Trainer writes last) loads in plain transformers.
Prints one row per survivor and a summary; --out writes the record as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GRACE_S = 30  # the requirement: every survivor ends within timeout_s + 30 s


def _command(example: str, out: Path, config: Path) -> list[str]:
    if example == "train":
        return [str(REPO / "examples" / "train.py"), "--ds_config", str(config), "--max_steps", "100000",
                "--seq_len", "64", "--save_dir", str(out / "ckpt"), "--save_every", "1", "--keep_last", "2"]
    return [str(REPO / "examples" / "hf_trainer.py"), "--ds_config", str(config), "--output_dir", str(out / "hf"),
            "--max_steps", "100000", "--global_batch", "2", "--save_steps", "1"]


def _steps_logged(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith("{") and '"step"' in line and '"loss"' in line)


def _newest_loads(example: str, out: Path) -> str:
    """'ok' when the newest complete checkpoint loads, else why not."""
    if example == "train":
        from ds_tsp.checkpoint.training import CheckpointStore, verify_checkpoint

        latest = CheckpointStore(out / "ckpt").latest()
        if latest is None:
            return "no complete checkpoint"
        try:
            verify_checkpoint(latest)
        except Exception as err:  # noqa: BLE001 - recorded
            return f"{latest.name}: {type(err).__name__}: {err}"
        return "ok"
    import transformers

    done = [p for p in (out / "hf").glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    if not done:
        return "no complete checkpoint"
    newest = max(done, key=lambda p: int(p.name.split("-")[1]))
    try:
        transformers.AutoModelForCausalLM.from_pretrained(newest)
    except Exception as err:  # noqa: BLE001 - recorded
        return f"{newest.name}: {type(err).__name__}: {err}"
    return "ok"


def trial(example: str, world: int, timeout_s: int, warm_steps: int, max_delay_s: float, rng: random.Random,
          keep: Path | None) -> list[dict]:
    from ds_tsp.core.parallel.launch import free_port
    from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX
    from ds_tsp.core.reliability.watchdog import EXIT_CODE

    out = Path(tempfile.mkdtemp(prefix=f"stall_{example}_", dir=keep))
    config = json.loads((REPO / "ds_configs" / "tsp.json").read_text())
    config["tsp"] = {**config["tsp"], "size": world, "timeout_s": timeout_s}
    (out / "ds.json").write_text(json.dumps(config))
    port, procs, files = free_port(), [], []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE":
               str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        o, e = open(out / f"rank{r}.out", "w"), open(out / f"rank{r}.err", "w")
        files += [o, e]
        procs.append(subprocess.Popen([sys.executable, *_command(example, out, out / "ds.json")], env=env, stdout=o,
                                      stderr=e, cwd=REPO, start_new_session=True))
    rows = []
    try:
        deadline = time.monotonic() + 300
        # hf_trainer logs on rank 0 only: wait for its steps, and for every rank to be alive
        while _steps_logged((out / "rank0.out").read_text()) < warm_steps:
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                return [{"trial_error": f"rank {dead[0] if dead else '?'} ended before the stop",
                         "stderr": (out / f"rank{dead[0] if dead else 0}.err").read_text()[-2000:]}]
            time.sleep(0.05)
        time.sleep(rng.uniform(0, max_delay_s))
        victim = rng.randrange(world)
        os.kill(procs[victim].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for r in range(world):
            if r == victim:
                continue
            while procs[r].poll() is None and time.monotonic() - stopped < timeout_s + GRACE_S:
                time.sleep(0.05)
            took = time.monotonic() - stopped if procs[r].poll() is not None else None
            err = (out / f"rank{r}.err").read_text()
            # a progress bar (tqdm's \r, no newline) may precede the line on rank 0's stderr
            messages = [line[line.index(MESSAGE_PREFIX):] for line in err.splitlines() if MESSAGE_PREFIX in line]
            names_peer = len(messages) == 1 and re.search(rf"waiting for .*\brank {victim}\b", messages[0]) is not None
            rows.append({"survivor": r, "victim": victim, "exit_s": None if took is None else round(took, 2),
                         "code": procs[r].returncode, "message": messages[0] if len(messages) == 1 else messages,
                         "ok": took is not None and procs[r].returncode == EXIT_CODE and names_peer})
    finally:
        for p in procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in procs:
            p.wait(timeout=60)
        for f in files:
            f.close()
    loads = _newest_loads(example, out)
    for row in rows:
        row["newest_checkpoint"] = loads
        row["ok"] = row["ok"] and loads == "ok"
    return rows


def _collective(message: str) -> str:
    """What the stall line names as the collective ("ds_tsp: TSP collective <what> timed out on rank ...")."""
    return re.sub(r" (timed out|failed) on rank.*", "", message).split("collective ", 1)[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--example", choices=("train", "hf_trainer"), required=True)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout-s", type=int, default=20)
    p.add_argument("--warm-steps", type=int, default=2)
    p.add_argument("--max-delay-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, default=None, help="keep each trial's directory under here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in range(args.trials):
        for row in trial(args.example, args.world, args.timeout_s, args.warm_steps, args.max_delay_s, rng, args.keep):
            row["trial"] = t
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stderr"}), flush=True)
    survivors = [r for r in rows if "survivor" in r]
    summary = {"example": args.example, "timeout_s": args.timeout_s, "trials": args.trials,
               "survivors": len(survivors), "ok": sum(r["ok"] for r in survivors),
               "trial_errors": sum("trial_error" in r for r in rows),
               "max_exit_s": max((r["exit_s"] for r in survivors if r["exit_s"] is not None), default=None),
               "collectives": sorted({_collective(r["message"]) for r in survivors if isinstance(r["message"], str)})}
    print(json.dumps({"summary": summary}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0 if summary["ok"] == summary["survivors"] == args.trials * (args.world - 1) else 1


if __name__ == "__main__":
    sys.exit(main())
