"""`--profile`: where one TSP step's wall time goes, by phase (one extra step after the timed ones).

Phases are disjoint by construction: op phases sum torch.profiler SELF CPU time (no parent/child double count),
communication is the CommCounter's blocked wait time (Python-side, while no op runs), and "other" (Python,
autograd bookkeeping, launch overhead, c10d calls themselves) is the wall time minus the rest.
"""
from __future__ import annotations

import time

# op-name substrings per phase; first match wins, so the order matters (attention before the generic copies)
PHASES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("flash_attention", "scaled_dot_product", "_masked_attention", "aten::_softmax"),
    "copy": ("aten::copy_", "aten::cat", "aten::stack", "aten::index", "aten::narrow_copy", "aten::clone",
             "aten::contiguous", "aten::gather", "aten::scatter"),
}
KEYS = ("gemm_s", "attention_s", "comm_wait_s", "copy_s", "other_s")


def phase_of(name: str) -> str | None:
    for phase, patterns in PHASES.items():
        if any(p in name for p in patterns):
            return phase
    return None


def profile_step(workload) -> dict:
    """Seconds per phase of one step of `workload` on this rank, plus its wall time and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    counter = workload.tsp_counter
    if counter is not None:
        counter.reset()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
        workload.step()
    wall = time.perf_counter() - start  # includes profiler overhead: the phases are shares of THIS step
    out = {f"{p}_s": 0.0 for p in PHASES}
    ops = {}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        ops[event.key] = seconds
        phase = phase_of(event.key)
        if phase is not None:
            out[f"{phase}_s"] += seconds
    out["comm_wait_s"] = float(counter.snapshot()["wait_s"]) if counter is not None else 0.0
    out["other_s"] = max(0.0, wall - sum(out[k] for k in KEYS if k != "other_s"))
    out["wall_s"] = wall
    out["top_ops"] = [[name, round(s, 6)] for name, s in sorted(ops.items(), key=lambda kv: -kv[1])[:8]]
    return {k: out[k] for k in (*KEYS, "wall_s", "top_ops")}


def profile_table(results: list[dict]) -> str:
    """Markdown table of the rows that carry a "profile" (seconds and share of the profiled step)."""
    rows = [r for r in results if r.get("profile")]
    if not rows:
        return ""
    head = "| layout | S | " + " | ".join(k[:-2] for k in KEYS) + " | wall s |"
    lines = [head, "|" + "---|" * (len(KEYS) + 3)]
    for r in rows:
        p = r["profile"]
        cells = [f"{p[k]:.3f} ({100 * p[k] / p['wall_s']:.0f}%)" for k in KEYS]
        lines.append(f"| {r['layout']} | {r['seq']} | " + " | ".join(cells) + f" | {p['wall_s']:.3f} |")
    return "\n".join(lines)
