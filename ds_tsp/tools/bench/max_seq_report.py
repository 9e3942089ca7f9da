"""Report of `ds-tsp bench --max-seq`: a markdown table and max_seq_vs_d.png (max sequence vs D per layout).

results.json / results.md are written by report.write_report as for every bench run (same row contract, plus
the max-seq keys); this module adds the max-seq table in front of results.md and its own plot.
"""
from __future__ import annotations

from collections.abc import Sequence

from ds_tsp.tools.bench.report import save_figure, write_report
from ds_tsp.tools.cli_types import MIB

PLOT = "max_seq_vs_d.png"


def _label(row: dict) -> str:
    return f"{row['layout']}{' +ckpt' if row.get('activation_checkpointing') else ''}"


def max_seq_table(rows: Sequence[dict], budget_bytes: int) -> str:
    header = ["layout", "checkpointing", "D", "max S", "peak MiB/rank at max S", "next probe S",
              "its peak MiB/rank", "probes", "probe step s"]
    lines = [f"Longest sequence whose measured per-rank peak (MemTracker) fits {budget_bytes / MIB:.0f} MiB "
             f"({budget_bytes} bytes); within 5% (next probe = shortest length measured over the budget).", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for r in rows:
        ckpt = "on" if r.get("activation_checkpointing") else "off"
        if r.get("max_seq") is None and r.get("ok"):  # nothing fits the budget: a result
            nxt = r.get("next_probe_peak_bytes")
            lines.append(f"| {r['layout']} | {ckpt} | {r['tsp']} | none | - | {r.get('next_probe_seq') or '-'} "
                         f"| {'-' if nxt is None else f'{nxt / MIB:.2f}'} | {len(r.get('probes') or [])} | |")
            continue
        if r.get("max_seq") is None:
            lines.append(f"| {r['layout']} | {ckpt} | {r['tsp']} | - | failed: "
                         f"{str(r.get('error', '')).strip().splitlines()[-1][:160] if r.get('error') else ''} "
                         f"| | | {len(r.get('probes') or [])} | |")
            continue
        nxt = r.get("next_probe_peak_bytes")
        lines.append(f"| {r['layout']} | {ckpt} | {r['tsp']} | {r['max_seq']} | {r['peak_bytes_per_rank'] / MIB:.2f} "
                     f"| {r.get('next_probe_seq') or '-'} | {'-' if nxt is None else f'{nxt / MIB:.2f}'} "
                     f"| {len(r.get('probes') or [])} | {r['step_s']:.2f} |")
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict], out_dir: str) -> str:
    """One line per layout (+ checkpointing variant); x = D. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(_label(r) for r in rows):
        # x = ranks: D, or C x D for tsp_cp (C TSP groups of D), so tsp_cp sits beside its peers on C x D ranks
        pts = sorted((r.get("world") or r["tsp"], r["max_seq"]) for r in rows
                     if _label(r) == label and r.get("max_seq"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linestyle="--" if label.endswith("+ckpt") else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks (degree D; tsp_cp: C x D)")
    ax.set_ylabel("max sequence length S")
    budget = next((r["budget_bytes"] for r in rows), 0)
    ax.set_title(f"Longest sequence within {budget / MIB:.0f} MiB per rank")
    return save_figure(fig, ax, out_dir, PLOT)


def write_max_seq_report(rows: Sequence[dict], out_dir: str, meta: dict, budget_bytes: int) -> dict:
    paths = write_report(rows, out_dir, meta)
    table = max_seq_table(rows, budget_bytes)
    try:
        paths["plots"] = [*paths["plots"], write_plot(rows, out_dir)]
    except ImportError:
        pass  # write_report already noted the missing matplotlib in results.md
    with open(paths["md"]) as f:
        rest = f.read()
    with open(paths["md"], "w") as f:
        f.write("# ds-tsp bench --max-seq\n\n" + table + "\n" + rest)
    paths["table"] = table
    return paths
