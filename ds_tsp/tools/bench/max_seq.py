"""`ds-tsp bench --max-seq --budget-mib N`: the longest sequence whose MEASURED per-rank peak fits a budget.

Per (layout, activation checkpointing off / on) one process group builds the layout once and probes lengths in
it: start at a small multiple of 2*D (TSP's zigzag needs 2*D chunks; Ulysses and sequence parallel need D),
double until the peak exceeds the budget (or, when the start already does, halve until a length fits), then
bisect until the gap between the longest fitting and the shortest failing length is within 5% (or one unit).
Building once matters: spawning a group and importing torch / transformers / DeepSpeed costs far more than a
short probe step on 2 CPU cores.

A probe = `warmup` untimed steps (at least 1 on the first probe, so the optimizer state exists as in any later
step) + ONE step under MemTracker (measure.tracked_step), whose peak, max over ranks (all-reduced so every rank
takes the same branch), is compared with the budget. Its wall time is the row's step_s (MemTracker adds
overhead: the times are indicative only). The row of the longest fitting length is the usual results.json
object (runner.aggregate) plus "max_seq", "budget_bytes", "probes", "next_probe_seq", "next_probe_peak_bytes".
"""
from __future__ import annotations

import dataclasses
import gc
import resource
import time

from ds_tsp.tools.bench.config import BenchConfig

START_TOKENS = 256  # first probe: the smallest multiple of the unit >= this
LIMIT_TOKENS = 2 ** 21  # stop doubling here even if it still fits (no real OOM on CPU: keep runs finite)
TOLERANCE = 0.05
# checkpointing variants: BenchConfig.activation_checkpointing values. "all" turns it on for TSP and the peers.
VARIANTS = ("none", "all")


def unit(cfg: BenchConfig) -> int:
    """Every probed length is a multiple of this: 2*D for all multi-rank layouts (they get the same tokens); 2*D*C
    for tsp_cp (its peers run on C*D ranks: the same unit)."""
    return 2 * cfg.tsp * cfg.cp


def _round_down(value: int, step: int) -> int:
    return max(step, value // step * step)


def search(fits, *, start: int, step: int, limit: int = LIMIT_TOKENS, tolerance: float = TOLERANCE):
    """Doubling then bisection over multiples of `step`; fits(seq) -> bool. Returns (best or None, first_fail or
    None): best = longest length that fit, first_fail = shortest that did not (None if the limit was reached).
    When `start` already does not fit, halve (down to `step`) until one fits, then bisect the same way."""
    lo, hi, seq = None, None, start
    while seq <= limit:
        if not fits(seq):
            hi = seq
            break
        lo, seq = seq, seq * 2
    while lo is None and hi is not None and hi > step:
        seq = _round_down(hi // 2, step)
        if fits(seq):
            lo = seq
        else:
            hi = seq
    if lo is None or hi is None:
        return lo, hi
    while hi - lo > max(step, tolerance * lo):
        mid = _round_down((lo + hi) // 2, step)
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def probe(workload, warmup: int) -> dict:
    """One rank's measurement at one length, with the keys runner.aggregate reads."""
    from ds_tsp.tools.bench.measure import tracked_step

    for _ in range(warmup):
        workload.step()
    timing = {}

    def timed():
        start, cpu = time.perf_counter(), time.process_time()
        loss = workload.step()
        timing.update(step_s=[time.perf_counter() - start], cpu_s=[time.process_time() - cpu], loss=loss)
        return loss

    counter = workload.tsp_counter
    if counter is not None:
        counter.reset()
    tracked = tracked_step(dataclasses.replace(workload, step=timed))
    out = {"tokens_per_step": workload.tokens_per_step, "loss_reduce": workload.loss_reduce, "info": workload.info,
           "step_s": timing["step_s"], "cpu_s": timing["cpu_s"],
           "loss": None if timing["loss"] is None else float(timing["loss"]), **tracked,
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if counter is not None:
        snap = counter.snapshot()
        out.update(tsp_comm_bytes=[int(snap["total_bytes"])], tsp_wait_s=[float(snap["wait_s"])],
                   tsp_comm_by_kind=dict(snap["bytes"]), tsp_wait_by=[dict(snap["wait_by"])])
    return out


def _group_max(value: int) -> int:
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def rank_max_seq(cfg: BenchConfig, budget_bytes: int, progress_queue=None) -> dict:
    """Body of one rank: build the layout once, search; returns this rank's measurement at the best length."""
    import torch.distributed as dist

    from ds_tsp.tools.bench.progress import Probe
    from ds_tsp.tools.bench.runner import build_session

    module, session = build_session(cfg)
    spec = cfg.spec
    rank = dist.get_rank() if dist.is_initialized() else 0
    probes, measured = [], {}

    def fits(seq: int) -> bool:
        workload = session.workload(seq)
        result = probe(workload, max(cfg.warmup, 0 if probes else 1))
        del workload
        gc.collect()
        peak = _group_max(result["peak_bytes"])
        probes.append({"seq": seq, "peak_bytes_per_rank": peak, "fits": peak <= budget_bytes})
        measured[seq] = result
        if progress_queue is not None and rank == 0:
            progress_queue.put(Probe(cfg.layout, cfg.activation_checkpointing, seq, peak, budget_bytes))
        return peak <= budget_bytes

    best, first_fail = search(fits, start=cfg.seqs[0], step=unit(cfg))
    fail_peak = next((p["peak_bytes_per_rank"] for p in probes if p["seq"] == first_fail), None)
    return {"best": measured.get(best), "max_seq": best, "probes": probes, "next_probe_seq": first_fail,
            "next_probe_peak_bytes": fail_peak, "setup": getattr(module, "SETUP", "").format(
                stage=spec.option_dict.get("zero_stage"))}


def start_seq(cfg: BenchConfig) -> int:
    step = unit(cfg)
    return -(-START_TOKENS // step) * step


def run_one(cfg: BenchConfig, budget_bytes: int, *, timeout_s: float, progress_queue=None) -> dict:
    """One (layout, checkpointing) search in its own process group -> one results.json row (never raises)."""
    from ds_tsp.core.parallel.launch import run_on_local_ranks
    from ds_tsp.tools.bench.config import INSTALL_HINT
    from ds_tsp.tools.bench.runner import RANK_ENV, _short, aggregate, failure, missing_requirements

    cfg = dataclasses.replace(cfg, seqs=(start_seq(cfg),))
    extra = {"max_seq": None, "budget_bytes": budget_bytes}
    missing = missing_requirements(cfg.layout)
    if missing:
        hint = "; ".join(INSTALL_HINT.get(m, f"pip install {m}") for m in missing)
        return {**failure(cfg, cfg.seqs[0], f"missing {', '.join(missing)}: {hint}"), **extra}
    try:
        ranks = run_on_local_ranks(rank_max_seq, cfg.world, cfg, budget_bytes, progress_queue,
                                   timeout_s=timeout_s, env=dict(RANK_ENV))
    except Exception as exc:  # noqa: BLE001 - a failing layout becomes an "ok": false row
        return {**failure(cfg, cfg.seqs[0], _short(str(exc))), **extra}
    head = ranks[0]
    extra.update(probes=head["probes"], next_probe_seq=head["next_probe_seq"],
                 next_probe_peak_bytes=head["next_probe_peak_bytes"])
    if head["max_seq"] is None:  # a layout that fits nothing at this budget is a result, not a failure
        smallest = min(head["probes"], key=lambda p: p["seq"])
        return {**failure(cfg, smallest["seq"], None), **extra, "ok": True, "fits": "none",
                "note": f"nothing fits: even S={smallest['seq']} needs {smallest['peak_bytes_per_rank']} > "
                        f"{budget_bytes} bytes per rank"}
    per_rank = [dict(r["best"], setup=r["setup"]) for r in ranks]
    row = aggregate(dataclasses.replace(cfg, steps=1), head["max_seq"], per_rank)
    return {**row, **extra, "max_seq": head["max_seq"]}


def run_max_seq(configs: list[BenchConfig], budget_bytes: int, *, timeout_s: float, on_event=None,
                variants: tuple[str, ...] = VARIANTS) -> list[dict]:
    """Every layout x checkpointing variant in turn. on_event receives ds_tsp.tools.bench.progress's events:
    SearchStart and SearchDone per search, Probe per probed length (from the group's rank 0)."""
    from ds_tsp.tools.bench.progress import SearchDone, SearchStart
    from ds_tsp.tools.bench.runner import progress_pump

    results = []
    with progress_pump(on_event) as queue:
        for cfg in configs:
            for variant in variants:
                run_cfg = dataclasses.replace(cfg, activation_checkpointing=variant)
                start = time.monotonic()
                if on_event is not None:
                    on_event(SearchStart(cfg.layout, variant, budget_bytes))
                row = run_one(run_cfg, budget_bytes, timeout_s=timeout_s, progress_queue=queue)
                row["group_wall_s"] = round(time.monotonic() - start, 1)
                results.append(row)
                if on_event is not None:
                    on_event(SearchDone(cfg.layout, variant, row))
    return results
