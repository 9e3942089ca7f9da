"""A stalled rank, measured: N trials of a tiny TSP training run whose ranks are started BY HAND, one SIGSTOPped.

    python benchmarks/stall_trials.py --trials 20 --world 2 --timeout-s 10 --out /tmp/stalls.json

Each trial starts `--world` plain `python` processes with the standard torch.distributed variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; env://, no launcher that could tear the job down), which train a
tiny ShardedCausalLM in a loop. After `--warm-steps` steps, at a random point inside a step, one rank (random, or
`--victim`) gets SIGSTOP. For every surviving rank the trial records whether it exits, how long after the SIGSTOP,
its exit code, and its stderr: the ds_tsp stall messages (lines starting with ds_tsp.core.reliability.watchdog.MESSAGE_PREFIX),
whether the one message names the collective, the layer and the peer, and any other text (gloo's own "Timed out
waiting 10000ms for recv operation", a Python traceback). A survivor is `ok` when it exits within timeout_s + 30 s
with ds_tsp's exit code and exactly ONE such message (timed out, naming collective, layer and peer) and nothing
else on stderr. A survivor still running `--observe-s` after the SIGSTOP is `hung`: its Python stacks are dumped
(faulthandler, SIGUSR1) into its stderr file before it is killed, to show where it waits.

--setup runtime (default): init_process_group(timeout=timeout_s) + ds_tsp.core.parallel.runtime.build_runtime with a "tsp"
block of that timeout_s, the path of ds_tsp.initialize (DeepSpeed) where gloo's own timeout equals timeout_s;
--setup world: the process group keeps gloo's 1800 s default, TSPComm(WORLD, timeout_s) (tests/reliability/test_stalls.py).
--log guard: the per-step loss all-reduce runs inside comm.guard(...); --log model: through
ShardedCausalLM.loss_for_logging (what TSPForCausalLM's forward does for its loss); --log none: no logging.
--stop-at optimizer: instead of a SIGSTOP at a random time, the victim stops itself (SIGSTOP to itself) after
the last TSP collective of a step, so every survivor's next wait is the loss logging (or, with --nonfinite, the
non-finite check): the one wait a random stop rarely lands in.
--nonfinite: every step runs ds_tsp.core.reliability.nonfinite.NonFiniteGuard.check after backward (its job-wide all-reduce),
as the README's DeepSpeed loop does (`engine.tsp_guard.check`); earlier trials saw gloo's raw timeout there.

    python benchmarks/stall_trials.py --trials 20 --timeout-s 20 --nonfinite --out /tmp/stalls.json

This file is also the rank script (`python benchmarks/stall_trials.py rank ...`, argv from the controller).
Prints one table row per survivor and a summary; --out writes the whole record as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GRACE_S = 30  # the requirement: every survivor ends within timeout_s + 30 s
RAW_MARKERS = ("Timed out waiting", "Traceback (most recent call last)", "terminate called", "Connection closed",
               "gloo", "Gloo", "RuntimeError", "DistBackendError")


# --- the rank script ------------------------------------------------------------------------------------------
def _rank_main(argv: list[str]) -> None:
    import faulthandler

    p = argparse.ArgumentParser()
    p.add_argument("--timeout-s", type=int, required=True)
    p.add_argument("--setup", choices=("runtime", "world"), required=True)
    p.add_argument("--log", choices=("guard", "model", "none"), required=True)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--self-stop", default=None, help="RANK:STEP: that rank stops itself before that step's "
                                                     "optimizer step")
    p.add_argument("--nonfinite", action="store_true", help="NonFiniteGuard.check after every backward")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the controller asks a hung rank where it waits

    import torch
    import torch.distributed as dist

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPConfig
    from ds_tsp.core.parallel.launch import init_from_env
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.reliability.nonfinite import NonFiniteGuard
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    torch.set_num_threads(1)
    if args.setup == "runtime":
        rank, world = init_from_env(timeout_s=args.timeout_s, backend="gloo")
        comm = build_runtime(TSPConfig(size=world, timeout_s=args.timeout_s)).comm
    else:
        rank, world = init_from_env(backend="gloo")  # gloo's timeout: the 1800 s default
        comm = TSPComm(dist.group.WORLD, timeout_s=args.timeout_s)
    shape = ModelShape(vocab_size=64, hidden_size=16 * world, intermediate_size=32 * world, num_layers=2,
                       num_heads=2 * world, num_kv_heads=world)
    model = label_modules(ShardedCausalLM(shape, comm).init_weights_(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    nonfinite = NonFiniteGuard(model) if args.nonfinite else None  # its all-reduce spans the job (world group)
    ids = torch.randint(0, shape.vocab_size, (2, 16 * world), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=world, rank=comm.rank)
    last = time.perf_counter()
    stop_rank, stop_step = map(int, args.self_stop.split(":")) if args.self_stop else (-1, -1)
    for step in range(args.steps):
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
        if comm.rank == stop_rank and step == stop_step:  # every collective of this step is done: the others
            print(f"SELF-STOP {time.time():.6f}", flush=True)  # wait next in the loss logging (or the next step)
            os.kill(os.getpid(), signal.SIGSTOP)
        if nonfinite is not None:
            nonfinite.check(loss, step)  # raises TSPNonFiniteError on a NaN/inf (none here)
        opt.step()
        opt.zero_grad()
        if args.log == "guard":
            logged = loss.detach().clone()
            with comm.guard("loss all_reduce", context=f"step {step} loss logging"):
                dist.all_reduce(logged, group=comm.group)
        elif args.log == "model":
            logged = model.loss_for_logging(loss)
        else:
            logged = loss.detach()
        now = time.perf_counter()
        print(f"step {step} loss {float(logged):.4f} step_s {now - last:.4f}", flush=True)
        last = now
    sys.stderr.flush()
    os._exit(0)  # no gloo teardown (see tests/reliability/test_stalls.py)


# --- one trial ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    from ds_tsp.core.parallel.launch import free_port

    return free_port()


def _start(tmp: Path, world: int, rank_args: list[str]) -> tuple[list[subprocess.Popen], list]:
    port, procs, files = _free_port(), [], []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        out, err = open(tmp / f"rank{r}.out", "w"), open(tmp / f"rank{r}.err", "w")
        files += [out, err]
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", *rank_args], env=env, stdout=out,
                                      stderr=err, cwd=REPO, start_new_session=True))
    return procs, files


def _steps(tmp: Path, r: int) -> list[float]:
    text = (tmp / f"rank{r}.out").read_text()
    return [float(s) for s in re.findall(r"step_s ([\d.]+)", text)]


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


def analyse(stderr: str, victim: int) -> dict:
    """What a survivor's stderr says: its ds_tsp messages, and whether the one message names collective, layer
    and peer; `other` keeps the first lines that are not a ds_tsp message (gloo's raw text, a traceback)."""
    from ds_tsp.core.reliability.watchdog import MESSAGE_PREFIX

    lines = [line for line in stderr.splitlines() if line.strip()]
    messages = [line for line in lines if line.startswith(MESSAGE_PREFIX)]
    other = [line for line in lines if not line.startswith(MESSAGE_PREFIX)]
    out = {"n_messages": len(messages), "message": messages[0] if messages else None, "other": other[:6],
           "raw_gloo": any(m in line for line in other for m in RAW_MARKERS), "collective": None, "outcome": None,
           "layer": None, "peer": None, "names_victim": False}
    if messages:
        m = messages[0]
        head = re.match(rf"{re.escape(MESSAGE_PREFIX)} (.+?) (timed out|failed) on rank \d+", m)
        if head:
            out["collective"], out["outcome"] = head.group(1), head.group(2)
        layer = re.search(r"; layer: (.+?); at ", m)
        if layer and not layer.group(1).startswith("not labelled"):
            out["layer"] = layer.group(1)
        waited = m.split("waiting for ", 1)[1].split("; layer: ", 1)[0].split("): ", 1)[0] if "waiting for " in m else ""
        peers = [int(r) for group in re.findall(r"\branks? (\d+(?:, \d+)*)", waited) for r in group.split(", ")]
        out["peer"] = peers or None  # global ranks named as waited for ("rank 2 (ring receive) or rank 0 (ring send)")
        out["names_victim"] = victim in peers
    return out


def run_trial(i: int, args, rng: random.Random, keep_dir: Path) -> dict:
    from ds_tsp.core.reliability.watchdog import EXIT_CODE

    tmp = Path(tempfile.mkdtemp(prefix=f"stall{i}_", dir=keep_dir))
    victim = rng.randrange(args.world) if args.victim < 0 else args.victim
    rank_args = ["--timeout-s", str(args.timeout_s), "--setup", args.setup, "--log", args.log]
    if args.nonfinite:
        rank_args.append("--nonfinite")
    if args.stop_at == "optimizer":
        rank_args += ["--self-stop", f"{victim}:{args.warm_steps + 1}"]
    procs, files = _start(tmp, args.world, rank_args)
    record: dict = {"trial": i, "dir": str(tmp)}
    try:
        deadline = time.monotonic() + args.start_s
        while not all(len(_steps(tmp, r)) > args.warm_steps for r in range(args.world)):
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                record["error"] = (f"rank {dead[0]} exited early (rc {procs[dead[0]].returncode})" if dead else
                                   f"no step {args.warm_steps} within {args.start_s} s")
                return record
            time.sleep(0.02)
        step_s = statistics.median(_steps(tmp, 0)[1:] or _steps(tmp, 0))
        delay = rng.uniform(0, 1.5 * step_s)  # land anywhere in a step: forward, backward, optimizer, logging
        if args.stop_at == "optimizer":  # the victim stops itself; it says when (wall clock) just before
            while "SELF-STOP" not in (tmp / f"rank{victim}.out").read_text():
                if procs[victim].poll() is not None or time.monotonic() > deadline:
                    record["error"] = f"rank {victim} did not stop itself"
                    return record
                time.sleep(0.01)
            stopped = float((tmp / f"rank{victim}.out").read_text().split("SELF-STOP ", 1)[1].split()[0])
            delay = None
        else:
            time.sleep(delay)
            stopped = time.time()
            os.kill(procs[victim].pid, signal.SIGSTOP)
        record.update(victim=victim, step_s=round(step_s, 4), delay_s=delay and round(delay, 4), survivors=[])
        survivors = [r for r in range(args.world) if r != victim]
        exited: dict[int, float] = {}
        while len(exited) < len(survivors) and time.time() - stopped < args.observe_s:
            for r in survivors:
                if r not in exited and procs[r].poll() is not None:
                    exited[r] = time.time() - stopped
            time.sleep(0.02)
        for r in survivors:
            if r not in exited:  # hung: where does it wait?
                _signal(procs[r], signal.SIGUSR1)
        time.sleep(1.0 if len(exited) < len(survivors) else 0)
        for r in survivors:
            err = (tmp / f"rank{r}.err").read_text(errors="replace")
            took = exited.get(r)
            s = {"rank": r, "exited": took is not None, "seconds": None if took is None else round(took, 2),
                 "rc": procs[r].returncode if took is not None else None, **analyse(err, victim)}
            s["within_limit"] = took is not None and took <= args.timeout_s + GRACE_S
            s["ok"] = (s["within_limit"] and s["rc"] == EXIT_CODE and s["n_messages"] == 1
                       and s["outcome"] == "timed out" and bool(s["collective"]) and bool(s["layer"])
                       and bool(s["peer"]) and not s["other"])
            if took is None:
                s["stacks"] = err[-6000:]
            record["survivors"].append(s)
        return record
    finally:
        for p in procs:
            if p.poll() is None:
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for f in files:
            f.close()


def summarise(trials: list[dict], args) -> dict:
    rows = [s for t in trials for s in t.get("survivors", [])]
    times = sorted(s["seconds"] for s in rows if s["exited"])
    q = (lambda f: times[min(len(times) - 1, int(f * len(times)))]) if times else (lambda f: None)
    return {"trials": len(trials), "trial_errors": sum("error" in t for t in trials), "survivors": len(rows),
            "ok": sum(s["ok"] for s in rows), "exited": sum(s["exited"] for s in rows),
            "within_limit": sum(s["within_limit"] for s in rows), "hung": sum(not s["exited"] for s in rows),
            "rc": {str(rc): sum(s["rc"] == rc for s in rows) for rc in sorted({s["rc"] for s in rows}, key=str)},
            "one_message": sum(s["n_messages"] == 1 for s in rows),
            "timed_out": sum(s["outcome"] == "timed out" for s in rows),
            "names_collective_layer_peer": sum(bool(s["collective"] and s["layer"] and s["peer"]) for s in rows),
            "names_victim": sum(s["names_victim"] for s in rows),
            "raw_gloo_or_traceback": sum(s["raw_gloo"] for s in rows),
            "seconds": {"min": times[0] if times else None, "median": statistics.median(times) if times else None,
                        "p90": q(0.9), "max": times[-1] if times else None},
            "limit_s": args.timeout_s + GRACE_S,
            "collectives": sorted({s["collective"] for s in rows if s["collective"]}),
            "config": {k: getattr(args, k) for k in ("world", "timeout_s", "setup", "log", "stop_at", "warm_steps",
                                                      "victim", "observe_s", "seed", "nonfinite")}}


def _row(t: dict, s: dict) -> str:
    took = f"{s['seconds']:.1f}" if s["exited"] else "HUNG"
    what = (s["message"] or (s["other"][0] if s["other"] else ""))[len("ds_tsp: TSP collective "):][:70]
    return (f"{t['trial']:>3} {t['victim']:>6} {s['rank']:>4} {took:>6} {str(s['rc']):>4} {s['n_messages']:>4} "
            f"{'yes' if s['ok'] else 'NO':>3}  {what}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--world", type=int, default=2, help="ranks (2 or 3 keeps a 2-core box usable)")
    p.add_argument("--timeout-s", type=int, default=10, help="the tsp block's timeout_s")
    p.add_argument("--setup", choices=("runtime", "world"), default="runtime")
    p.add_argument("--log", choices=("guard", "model", "none"), default="guard")
    p.add_argument("--warm-steps", type=int, default=2, help="steps every rank completes before the SIGSTOP")
    p.add_argument("--stop-at", choices=("random", "optimizer"), default="random",
                   help="random: SIGSTOP at a random point of a step; optimizer: the victim stops itself after the "
                        "step's last TSP collective, so the others wait next in the loss logging")
    p.add_argument("--nonfinite", action="store_true", help="every step runs NonFiniteGuard.check (a job-wide "
                                                              "all-reduce) after backward")
    p.add_argument("--victim", type=int, default=-1, help="rank to stop (default: a random one per trial)")
    p.add_argument("--observe-s", type=float, default=None, help="give up on a survivor after this long "
                                                                 "(default timeout_s + 60)")
    p.add_argument("--start-s", type=float, default=240, help="limit for the ranks to reach --warm-steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", default=None, help="folder for the rank logs (default: a temporary one)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    args.observe_s = args.observe_s if args.observe_s is not None else args.timeout_s + 60
    keep = Path(args.keep or tempfile.mkdtemp(prefix="stall_trials_"))
    keep.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    print(f"rank logs under {keep}", flush=True)
    print("trial victim rank   secs   rc msgs ok   message", flush=True)
    trials = []
    for i in range(args.trials):
        t = run_trial(i, args, rng, keep)
        trials.append(t)
        if "error" in t:
            print(f"{i:>3} trial error: {t['error']} ({t['dir']})", flush=True)
        for s in t.get("survivors", []):
            print(_row(t, s), flush=True)
    summary = summarise(trials, args)
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "trials": trials}, indent=1))
    return summary


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        _rank_main(sys.argv[2:])
    else:
        main()
