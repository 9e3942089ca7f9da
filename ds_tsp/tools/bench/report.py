"""Write a benchmark's results: results.json (the objects as measured), results.md (a table, and where TSP's rows
waited, per collective), PNG plots.

Plots (matplotlib, Agg backend; skipped with a note in the table if matplotlib is missing):
    memory_vs_seq.png       peak MiB per rank vs sequence length, one line per layout (and degree D, when a run
                            measured several)
    throughput_vs_seq.png   tokens/s of the whole group vs sequence length
    memory_breakdown.png    stacked peak breakdown per layout (and D) at the largest sequence length measured
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from ds_tsp.tools.cli_types import MIB

BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "temporaries", "other")
PLOTS = ("memory_vs_seq.png", "throughput_vs_seq.png", "memory_breakdown.png")
WAITS_SHOWN = 5  # collectives listed per row in results.md's "Where TSP waits"


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _name(r: dict) -> str:
    """A result's layout as tables and plots name it (an MoE run's label adds its schedule: tsp[ring])."""
    return r.get("label") or r["layout"]


def _series(results: Sequence[dict]) -> dict[tuple[str, int], str]:
    """(layout, D) -> its label, in first-seen order; D appears in the label only when the run has several."""
    keys = list(dict.fromkeys((_name(r), r.get("tsp")) for r in results))
    several = len({d for _, d in keys}) > 1
    titles = {_name(r): r.get("title", r["layout"]) for r in results}
    return {(layout, d): f"{titles[layout]} D={d}" if several else titles[layout] for layout, d in keys}


def _batch_words(meta: dict) -> str:
    if meta.get("global_batch"):
        return (f"global batch {meta['global_batch']} sequences per step (a data-parallel layout's ranks run "
                "their share each, every other layout all of them)")
    return f"batch {meta.get('batch')}"


def markdown_table(results: Sequence[dict], meta: dict | None = None) -> str:
    """One row per (layout, seq). Sizes in MiB per rank; comm in MiB per rank per step."""
    lines = []
    if meta:
        shape = meta.get("shape", {})
        lines += ["# ds-tsp bench", "",
                  f"D={meta.get('tsp')} ranks (gloo, CPU, 1 thread each), {_batch_words(meta)}, fp32, "
                  f"{shape.get('num_layers')} layers, hidden {shape.get('hidden_size')}, heads "
                  f"{shape.get('num_heads')}/{shape.get('num_kv_heads')} kv, MLP {shape.get('intermediate_size')}, "
                  f"vocab {shape.get('vocab_size')}; {meta.get('warmup')} warm-up + {meta.get('steps')} timed steps "
                  + (f"in each of {meta['rounds']} rounds " if meta.get("rounds", 1) > 1 else "")
                  + f"(median of the slowest rank); activation checkpointing: "
                  f"{meta.get('activation_checkpointing', 'none')}.", ""]
    header = ["layout", "S", "D", "peak MiB/rank", *BREAKDOWN_KEYS, "comm MiB/step/rank", "step s", "tokens/s",
              "CPU s/step", "exposed comm"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    notes = []
    for r in results:
        if not r.get("ok"):
            notes.append(f"- {_name(r)} S={r['seq']}: FAILED: {_first_line(r.get('error'))}")
            lines.append(f"| {_name(r)} | {r['seq']} | {r.get('tsp')} | failed |" + " |" * (len(header) - 4))
            continue
        parts = r.get("peak_breakdown") or {}
        fraction = r.get("exposed_comm_fraction")
        row = [_name(r), str(r["seq"]), str(r.get("tsp")), _mib(r["peak_bytes_per_rank"]),
               *(_mib(parts.get(k)) for k in BREAKDOWN_KEYS), _comm_cell(r),
               _num(r.get("step_s"), ".3f"), _num(r.get("tokens_per_s"), ".0f"),
               _num(r.get("cpu_s_per_step"), ".2f"),
               "-" if fraction is None else f"{100 * fraction:.0f}%"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Peak: MemTracker's peak per rank (max over ranks), broken down by category AT the peak; "
              "`other` = persistent framework buffers outside modules and optimizer states (DeepSpeed flat "
              "partitions, gradient buckets). Comm: logical bytes per rank per step (ds_tsp.core.comm.communicator "
              "convention); TSP from its own counter (the busiest rank's, and in brackets the mean over ranks where "
              "it is less: the causal K/V gather and dK/dV scatter send different amounts per rank), peers from "
              "every c10d / functional collective seen by the dispatcher. "
              "Step s: median over timed steps of the slowest rank's wall time; tokens/s = B*S / step s "
              "(hf_zero3_dp, hf_fsdp2_dp: D*B*S, a sequence per rank). "
              "CPU s/step: CPU seconds of all ranks together per step (less disturbed by other load than wall "
              "time). Exposed comm: TSP's time blocked on communication handles / step time. "
              "Wall times on a shared CPU are noisy (results.json has the load average around each layout): "
              "compare within one run."]
    if notes:
        lines += ["", "Failures:", *notes]
    waits = waits_table(results)
    if waits:
        lines += ["", waits]
    if meta and meta.get("plot_note"):
        lines += ["", meta["plot_note"]]
    return "\n".join(lines) + "\n"


def _comm_cell(r: dict) -> str:
    """Comm MiB: the busiest rank's, with the mean over ranks in brackets where it is lower by 0.1 MiB or more."""
    most, mean = r.get("comm_bytes"), r.get("comm_bytes_mean")
    if most is None or mean is None or most - mean < 0.05 * MIB:
        return _mib(most)
    return f"{_mib(most)} (mean {_mib(mean)})"


def waits_table(results: Sequence[dict], top: int = WAITS_SHOWN) -> str:
    """Where TSP's exposed communication goes: per TSP row the `top` collectives it waited on longest (runner's
    exposed_by_collective); "" when no row has them."""
    rows = [r for r in results if r.get("ok") and r.get("exposed_by_collective")]
    if not rows:
        return ""
    lines = ["## Where TSP waits", "",
             f"Seconds per step blocked on each collective, the {top} largest per row: the mean over timed steps "
             "and ranks, and in brackets the rank that waited most. A label is the collective's kind and what it "
             "moves (every block, hop and layer number written #, so they add up). Summed over every collective, a "
             "step's waits are its exposed comm (the table above takes the median step, this one the mean).", "",
             "| layout | S | D | exposed s/step | waits: s/step (most on one rank) |", "|---|---:|---:|---:|---|"]
    for r in rows:
        waits = list(r["exposed_by_collective"].items())[:top]
        cells = "; ".join(f"{label} {w['mean_s']:.3f} ({w['max_s']:.3f})" for label, w in waits)
        lines.append(f"| {_name(r)} | {r['seq']} | {r.get('tsp')} | {_num(r.get('exposed_comm_s'), '.3f')} | "
                     f"{cells} |")
    return "\n".join(lines)


def _first_line(error) -> str:
    if not error:
        return "unknown error"
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "unknown error"


def write_plots(results: Sequence[dict], out_dir: str) -> list[str]:
    """Write the PNGs; returns their paths. Raises ImportError if matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("ok")]
    series = _series(results)
    paths = []

    # one colour per layout, one line style per degree (a single-rank layout keeps its own colour, solid)
    colours = {layout: f"C{i % 10}" for i, layout in enumerate(dict.fromkeys(layout for layout, _ in series))}
    multi = sorted({d for (layout, d) in series if d != 1})
    styles = {d: ("-", "--", ":", "-.")[i % 4] for i, d in enumerate(multi)}

    def line_plot(filename, key, scale, ylabel, title):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (layout, degree), label in series.items():
            pts = sorted((r["seq"], r[key] / scale) for r in ok
                         if (_name(r), r.get("tsp")) == (layout, degree) and r.get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                        color=colours[layout], linestyle=styles.get(degree, "-"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        paths.append(save_figure(fig, ax, out_dir, filename))

    line_plot("memory_vs_seq.png", "peak_bytes_per_rank", MIB, "peak MiB per rank", "Peak memory per rank")
    line_plot("throughput_vs_seq.png", "tokens_per_s", 1.0, "tokens / s (whole group)", "Training throughput")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if ok:
        seq = max(r["seq"] for r in ok)
        rows = [r for r in ok if r["seq"] == seq]
        bottom = [0.0] * len(rows)
        for key in BREAKDOWN_KEYS:
            values = [(r.get("peak_breakdown") or {}).get(key, 0) / MIB for r in rows]
            ax.bar(range(len(rows)), values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        several = len({d for _, d in series}) > 1
        ax.set_xticks(range(len(rows)), [f"{_name(r)} D={r.get('tsp')}" if several else _name(r)
                                         for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"Peak memory breakdown per rank at S={seq}")
        ax.legend(fontsize=8)
    ax.set_ylabel("MiB")
    fig.tight_layout()
    path = os.path.join(out_dir, "memory_breakdown.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_report(results: Sequence[dict], out_dir: str, meta: dict | None = None) -> dict[str, object]:
    """results.json + results.md + plots in out_dir; returns {"json", "md", "plots"} paths."""
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(meta or {})
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(_jsonable(list(results)), f, indent=1)
    try:
        plots = write_plots(results, out_dir)
    except ImportError:
        plots = []
        meta["plot_note"] = "No plots: matplotlib is not installed (pip install 'ds_tsp[bench]')."
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w") as f:
        f.write(markdown_table(results, meta))
    return {"json": json_path, "md": md_path, "plots": plots}


def save_figure(fig, ax, out_dir: str, filename: str) -> str:
    """Grid, legend when there are lines, tight layout, written to out_dir/filename; returns the path."""
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
