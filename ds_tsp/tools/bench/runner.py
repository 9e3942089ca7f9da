"""Run layouts: one spawned process group per layout, so a failing peer is reported and the others still run.

`rank_main` is what every rank of a group executes: build the layout once, then measure each sequence length
in ascending order (ds_tsp.tools.bench.measure). The driver (`run_layouts`) aggregates the ranks into one result
object per (layout, seq). When a group fails and it covered several sequence lengths, each length is retried
in its own group, so one that runs out of memory or time does not hide the ones that work.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from ds_tsp.tools.bench.config import INSTALL_HINT, LAYOUTS, BenchConfig

SETUP_FAILED = "layout setup failed"  # marks errors raised before any sequence length ran: no per-S retry
# Environment for every rank: DeepSpeed on CPU without accelerator detection noise; never download anything.
RANK_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def build_session(cfg: BenchConfig):
    """(layout module, its built session) on this rank; a failure is reported as SETUP_FAILED."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    spec = cfg.spec
    try:
        layout_module = importlib.import_module(f"ds_tsp.tools.bench.{spec.module}")
        return layout_module, layout_module.build(cfg, spec.option_dict)
    except Exception as exc:
        raise RuntimeError(f"{SETUP_FAILED}: {type(exc).__name__}: {exc}") from exc


def rank_main(cfg: BenchConfig, progress_queue=None) -> list[dict]:
    """Body of one rank: returns one measurement dict per sequence length (see measure.measure_workload)."""
    import torch

    from ds_tsp.tools.bench.measure import measure_workload
    from ds_tsp.tools.bench.progress import Step

    spec = cfg.spec
    layout_module, session = build_session(cfg)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out = []
    for seq in cfg.seqs:
        def progress(phase, i, n, seconds, seq=seq):
            if progress_queue is not None and rank == 0:
                progress_queue.put(Step(cfg.label, seq, phase, i, n, seconds))

        workload = session.workload(seq)
        result = measure_workload(workload, steps=cfg.steps, warmup=cfg.warmup, progress=progress)
        if cfg.profile:  # after the timed steps, so their timings are undisturbed
            from ds_tsp.tools.bench.profile import profile_step
            result["profile"] = profile_step(workload)
        setup = getattr(session, "SETUP", None) or getattr(layout_module, "SETUP", "")  # a VLM session's own
        result["setup"] = setup.format(stage=spec.option_dict.get("zero_stage"))
        out.append(result)
        del workload
    return out


def missing_requirements(layout: str) -> list[str]:
    return [pkg for pkg in LAYOUTS[layout].requires if importlib.util.find_spec(pkg) is None]


def _summed_median(ranks: list[dict], key: str, n: int) -> float | None:
    """Median over steps of a per-step figure summed over ranks; None when the ranks did not record it."""
    if key not in ranks[0]:
        return None
    return statistics.median(sum(r[key][i] for r in ranks) for i in range(n))


def aggregate(cfg: BenchConfig, seq: int, ranks: list[dict]) -> dict:
    """Per-rank measurements of one (layout, seq) -> the result object written to results.json."""
    spec = cfg.spec
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    step_s = statistics.median(per_step)
    cpu_s = _summed_median(ranks, "cpu_s", len(per_step))
    main_cpu_s = _summed_median(ranks, "main_thread_cpu_s", len(per_step))
    peak_rank = max(ranks, key=lambda r: r["peak_bytes"])
    c10d_bytes = max(r["c10d"]["total_bytes"] for r in ranks)
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    loss = (sum(losses) if ranks[0]["loss_reduce"] == "sum" else statistics.mean(losses)) if losses else None
    result = {
        "layout": cfg.layout, "title": spec.title, "ok": True, "error": None,
        "seq": seq, "tsp": cfg.world // cfg.cp, "cp": cfg.cp, "world": cfg.world, "batch": cfg.batch,
        "peak_bytes_per_rank": peak_rank["peak_bytes"],
        "peak_breakdown": peak_rank["peak_breakdown"],
        "peak_bytes_ranks": [r["peak_bytes"] for r in ranks],
        "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
        "state_breakdown": peak_rank["state_breakdown"],
        "comm_bytes": c10d_bytes, "comm_source": "c10d dispatch counter (ds_tsp.tools.bench.comm_count)",
        "comm_by_op": peak_rank["c10d"]["bytes"], "comm_calls": peak_rank["c10d"]["calls"],
        "comm_bytes_c10d": c10d_bytes,
        # seconds inside collective calls in the tracked step (max over ranks): synchronous calls block, async
        # ones return at once, so this is a lower bound of exposed communication for the peers
        "comm_call_s_tracked": max(r["c10d"]["blocking_s"] for r in ranks),
        "step_s": step_s, "step_s_per_step": per_step,
        # the group's tokens per step: B*S, or D*B*S for a data-parallel layout (hf_zero3_dp, hf_fsdp2_dp: a
        # sequence per rank)
        "tokens_per_step": ranks[0].get("tokens_per_step", cfg.batch * seq),
        "tokens_per_s": ranks[0].get("tokens_per_step", cfg.batch * seq) / step_s,
        # CPU seconds of all ranks together per step (median over steps): the work a step costs, which other
        # load on the machine disturbs much less than wall time
        "cpu_s_per_step": cpu_s,
        "tokens_per_cpu_s": ranks[0].get("tokens_per_step", cfg.batch * seq) / cpu_s if cpu_s else None,
        # of which the threads that run the steps (the rest: gloo's and other helper threads)
        "main_thread_cpu_s_per_step": main_cpu_s,
        "exposed_comm_s": None, "exposed_comm_fraction": None,
        "loss": loss,
        "activation_checkpointing": cfg.checkpointing(),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
        "steps": cfg.steps, "warmup": cfg.warmup,
        "shape": cfg.shape.to_dict(), "setup": ranks[0].get("setup", ""),
        **ranks[0].get("info", {}), **_moe_fields(cfg), **_cp_comm_fields(cfg),
    }
    if "vision_tower" in peak_rank:  # the peak rank's, and every rank's (the ranks encode different items)
        result["vision_tower"] = peak_rank["vision_tower"]
        result["vision_tower_ranks"] = [r["vision_tower"] for r in ranks]
    if "profile" in ranks[0]:  # the slowest rank's profile: a step takes as long as its slowest rank
        result["profile"] = dict(max((r["profile"] for r in ranks), key=lambda p: p["wall_s"]))
        if "work" in ranks[0]["profile"]:  # the whole group's counted work (the rows an owner runs vary by rank)
            from ds_tsp.tools.bench.work import group_work

            result["profile"]["work"] = group_work(cfg, seq, [r["profile"]["work"] for r in ranks],
                                                   result.get("tsp_options") or {})
    if "tsp_comm_bytes" in ranks[0]:
        # TSP's own counter: the same logical convention, counted on every timed step (deterministic per step).
        result["comm_bytes"] = max(r["tsp_comm_bytes"][-1] for r in ranks)
        # the causal K/V gather and dK/dV scatter send different amounts per rank (ds_tsp.core.comm.kv_gather)
        result["comm_bytes_mean"] = statistics.mean(r["tsp_comm_bytes"][-1] for r in ranks)
        result["comm_source"] = "ds_tsp CommCounter (per timed step)"
        result["comm_by_op"] = ranks[0]["tsp_comm_by_kind"]
        fractions = [statistics.median(w / s for w, s in zip(r["tsp_wait_s"], r["step_s"])) for r in ranks]
        result["exposed_comm_fraction"] = statistics.mean(fractions)
        result["exposed_comm_s"] = statistics.mean(statistics.median(r["tsp_wait_s"]) for r in ranks)
        result["exposed_by_collective"] = waits_by_collective([r["tsp_wait_by"] for r in ranks])
    return result


def waits_by_collective(ranks: list[list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """label -> {"mean_s", "max_s"}: seconds per timed step blocked on that collective (CommCounter's
    wait_by_collective), averaged over the steps, then over the ranks (mean) or the rank that waited most (max);
    largest mean first."""
    per_rank = []
    for steps in ranks:
        labels = {label for step in steps for label in step}
        per_rank.append({label: sum(step.get(label, 0.0) for step in steps) / max(len(steps), 1)
                         for label in labels})
    labels = {label for rank in per_rank for label in rank}
    out = {label: {"mean_s": statistics.mean(rank.get(label, 0.0) for rank in per_rank),
                   "max_s": max(rank.get(label, 0.0) for rank in per_rank)} for label in labels}
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["mean_s"], kv[0])))


def failure(cfg: BenchConfig, seq: int, error: str) -> dict:
    return {"layout": cfg.layout, "title": cfg.spec.title, "ok": False, "error": error, "seq": seq,
            "tsp": cfg.world // cfg.cp, "cp": cfg.cp, "world": cfg.world, "batch": cfg.batch,
            "peak_bytes_per_rank": None, "comm_bytes": None, "step_s": None, "tokens_per_s": None,
            "exposed_comm_fraction": None,
            "activation_checkpointing": cfg.checkpointing(),
            "shape": cfg.shape.to_dict(), **_moe_fields(cfg), **_cp_comm_fields(cfg)}


def _moe_fields(cfg: BenchConfig) -> dict:
    """An MoE run's schedule, and its label and title naming it (one layout measured under several schedules)."""
    if not cfg.runs_moe_dispatch:
        return {}
    return {"moe_dispatch": cfg.moe_dispatch, "label": cfg.label, "title": f"{cfg.spec.title} ({cfg.moe_dispatch})"}


def _cp_comm_fields(cfg: BenchConfig) -> dict:
    """Layout tsp_cp's cp schedule (tsp.cp_comm), and its label where one run measures both."""
    if cfg.cp == 1:
        return {}
    return {"cp_comm": cfg.cp_comm, "label": cfg.label}


def _short(error: str, limit: int = 4000) -> str:
    """The informative tail of a rank's traceback."""
    return error if len(error) <= limit else "..." + error[-limit:]


def run_layout(cfg: BenchConfig, *, timeout_s: float, progress_queue=None) -> list[dict]:
    """All of cfg.seqs for one layout -> result objects (ok or not), never raises for a failing layout."""
    from ds_tsp.core.parallel.launch import run_on_local_ranks

    missing = missing_requirements(cfg.layout)
    if missing:
        hint = "; ".join(INSTALL_HINT.get(m, f"pip install {m}") for m in missing)
        return [failure(cfg, seq, f"missing {', '.join(missing)}: {hint}") for seq in cfg.seqs]
    env = dict(RANK_ENV)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    if not env["TORCH_EXTENSIONS_DIR"]:
        del env["TORCH_EXTENSIONS_DIR"]
    try:
        per_rank = run_on_local_ranks(rank_main, cfg.world, cfg, progress_queue, timeout_s=timeout_s, env=env)
    except Exception as exc:  # noqa: BLE001 - a failing peer becomes an "ok": false object
        if len(cfg.seqs) > 1 and SETUP_FAILED not in str(exc):
            out = []
            for seq in cfg.seqs:
                out.extend(run_layout(replace(cfg, seqs=(seq,)), timeout_s=timeout_s, progress_queue=progress_queue))
            return out
        return [failure(cfg, cfg.seqs[0], _short(str(exc)))]
    return [aggregate(cfg, seq, [rank[i] for rank in per_rank]) for i, seq in enumerate(cfg.seqs)]


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_layouts(configs: list[BenchConfig], *, timeout_s: float,
                on_event: Callable[[object], None] | None = None, rounds: int = 1) -> list[dict]:
    """Run each layout's group in turn, `rounds` times over (ds_tsp.tools.bench.rounds merges them). on_event
    receives ds_tsp.tools.bench.progress's events: GroupStart before a group starts, Step from its rank 0 as it
    runs, RunDone per result."""
    from ds_tsp.tools.bench.progress import GroupStart, RunDone
    from ds_tsp.tools.bench.rounds import merge_rounds

    per_round = []
    with progress_pump(on_event) as queue:
        for _ in range(rounds):
            results = []
            for index, cfg in enumerate(configs):
                start, load_before = time.monotonic(), _loadavg()
                if on_event is not None:
                    on_event(GroupStart(cfg.label, tuple(cfg.seqs), cfg.world))
                for result in run_layout(cfg, timeout_s=timeout_s, progress_queue=queue):
                    result["group_wall_s"] = round(time.monotonic() - start, 1)
                    # other processes on the machine skew step times: record the 1-minute load around the group
                    result["loadavg_before_after"] = [load_before, _loadavg()]
                    result["config_index"] = index
                    results.append(result)
                    if on_event is not None:
                        on_event(RunDone(result))
            per_round.append(results)
    return merge_rounds(per_round)


@contextlib.contextmanager
def progress_pump(handler):
    """A queue the ranks' progress events go into, drained by a thread calling handler(event); None: no queue."""
    if handler is None:
        yield None
        return
    import queue as queue_mod
    import threading

    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            try:
                handler(queue.get(timeout=0.1))
            except queue_mod.Empty:
                continue
            except (EOFError, OSError):
                return

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield queue
    finally:
        stop.set()
        thread.join(timeout=1)
