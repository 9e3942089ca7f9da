"""What each marked figures block of README.md and docs/*.md says, rendered from its committed source files.

BLOCKS maps a block name to (its source files, its renderer). A renderer gets the parsed sources and returns the
block's text exactly as the docs carry it. Ratios are taken of the figures as printed (rounded), so a reader can
redo them from the tables on the page.

Sources: docs/bench/**/results.json are `ds-tsp bench` runs (docs/benchmarks.md says which command made each);
docs/results/*.json are the stdout of the deterministic commands the docs show (`python -m
ds_tsp.tools.doc_figures --measure` reruns them).
"""
from __future__ import annotations

import json
from typing import Callable

MIB = 2 ** 20
RUN1 = "docs/bench/results.json"
MAX_SEQ = "docs/bench/max_seq/results.json"
OVERLAP = {(when, d): f"docs/bench/overlap/{when}_D{d}/results.json" for when in ("before", "after") for d in (2, 4)}
CP_STEP, CP_MAX_SEQ = "docs/bench/cp/step/results.json", "docs/bench/cp/max_seq/results.json"
CP_STEP_REVERSED = "docs/bench/cp/step_reversed/results.json"  # the same command, layouts in reverse order
CP_MAX_SEQ_64 = "docs/bench/cp/max_seq_64/results.json"  # tsp_cp and Ulysses only, at 64 MiB
DEMO2, DEMO1, VERIFY = "docs/results/demo_tsp2.json", "docs/results/demo_tsp1.json", "docs/results/verify_tsp3.json"

# The names docs/benchmarks.md gives each `ds-tsp bench` layout, in the order its tables list them.
LAYOUT_NAMES = {"single": "single device (HF Llama)", "tsp": "**TSP memory-optimal**", "tsp_speed": "**TSP speed**",
                "dtensor_tp_sp": "PyTorch TP+SP (DTensor)", "ulysses_zero3": "DeepSpeed Ulysses + ZeRO-3",
                "ulysses_zero1": "DeepSpeed Ulysses + ZeRO-1", "autotp_zero1": "DeepSpeed AutoTP + ZeRO-1"}


def _mib(nbytes: float) -> float:
    return nbytes / MIB


def _row(rows: list[dict], layout: str, tsp: int, seq: int | None = None, checkpointing: bool | None = None) -> dict:
    """The one row of a bench results.json with these keys (a KeyError naming them when the run lacks it)."""
    hits = [r for r in rows if r["layout"] == layout and r["tsp"] == tsp and (seq is None or r["seq"] == seq)
            and (checkpointing is None or bool(r.get("activation_checkpointing")) == checkpointing)]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows for layout={layout} tsp={tsp} seq={seq} checkpointing={checkpointing}")
    return hits[0]


def _tokens_s(row: dict) -> int:
    return round(row["tokens_per_s"])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _demo_records(result: dict) -> list[dict]:
    return [json.loads(line) for line in result["stdout"] if line.startswith("{")]


# ---- README.md (demo, demo-tsp1) and docs/cli.md (verify, memory-8192, speed-8192, max-seq) --------------------

def readme_demo(src: dict) -> str:
    """The demo's config figures, its memory lines and summary, as `python examples/demo_train.py` prints them."""
    result = src[DEMO2]
    records = _demo_records(result)
    config = next(r for r in records if "config" in r)
    shown = [line for line in result["stdout"] if line.startswith(('{"memory"', '{"summary"'))]
    return (f"The demo prints JSON lines: a config line (`params_full` {config['params_full']}, `params_per_rank` "
            f"{config['params_per_rank']} at D={config['config']['tsp']}), one\n"
            "`{\"step\", \"loss\"}` per step, a `{\"memory\": ...}` line per rank and a summary. Measured here "
            f"({result['machine']},\n"
            "default settings: vocab 256, hidden 64, 2 layers, 4 heads / 2 kv heads, ffn 172, seq 128, batch 4, 30 "
            f"steps,\n{result['wall_s']:.0f} s wall clock including process start; every figure but `train_s` is the "
            "same in every run):\n\n```\n" + "\n".join(shown) + "\n```")


def readme_demo_tsp1(src: dict) -> str:
    peak = next(r for r in _demo_records(src[DEMO1]) if "memory" in r)["memory"]["peak_mib"]
    return (f"On one process, `{src[DEMO1]['command']}` peaks at PARAM {peak['PARAM']:.3f}, ACT "
            f"{peak['ACT']:.3f}, total {peak['total']:.3f} MiB.")


def readme_verify(src: dict) -> str:
    return "```\n" + "\n".join(src[VERIFY]["stdout"]) + "\n```"


def readme_memory_8192(src: dict) -> str:
    run1, after = src[RUN1], {d: src[OVERLAP["after", d]][0] for d in (2, 4)}
    tsp = " | ".join(f"**{_mib(after[d]['peak_bytes_per_rank']):.1f}**" for d in (2, 4))
    lines = ["| layout | D=2 | D=4 |", "|---|---:|---:|", f"| **TSP, memory-optimal** | {tsp} |"]
    for layout, name in (("ulysses_zero3", "DeepSpeed Ulysses + ZeRO-3"), ("dtensor_tp_sp", "PyTorch TP+SP (DTensor)")):
        peaks = " | ".join(f"{_mib(_row(run1, layout, d, 8192)['peak_bytes_per_rank']):.1f}" for d in (2, 4))
        lines.append(f"| {name} | {peaks} |")
    return ("\n".join(lines) + "\n\nTSP: the current schedule (docs/benchmarks.md, \"Weights on their own channel\": "
            "`docs/bench/overlap/after_D*/`);\nthe peers: run 1 (`docs/bench/results.json`).")


def readme_speed_8192(src: dict) -> str:
    run1 = src[RUN1]
    t = {(layout, d): _tokens_s(_row(run1, layout, d, 8192))
         for layout in ("tsp", "tsp_speed", "ulysses_zero1", "dtensor_tp_sp") for d in (2, 4)}
    modes = [(layout, d) for layout in ("tsp", "tsp_speed") for d in (2, 4)]
    vs_uly = {key: _ratio(t[key], t["ulysses_zero1", key[1]]) for key in modes}
    vs_tp = {key: _ratio(t[key], t["dtensor_tp_sp", key[1]]) for key in modes}
    return ("On this 2-core machine TSP's speed is level with the peers at D=2 (run 1, tokens/s): memory-optimal\n"
            f"{vs_uly['tsp', 2]} Ulysses+ZeRO-1 and {vs_tp['tsp', 2]} TP+SP, speed mode {vs_uly['tsp_speed', 2]} and "
            f"{vs_tp['tsp_speed', 2]}. At D=4, where 4 ranks share 2 cores, it is\n{vs_tp['tsp', 4]} TP+SP but "
            f"{vs_uly['tsp', 4]} Ulysses+ZeRO-1. This misses the speed targets; the reasons are written there.")


def _max_seq(rows: list[dict], layout: str, d: int, checkpointing: bool) -> int | None:
    return _row(rows, layout, d, checkpointing=checkpointing)["max_seq"]


def readme_max_seq(src: dict) -> str:
    rows = src[MAX_SEQ]
    peers = ("ulysses_zero3", "dtensor_tp_sp")
    best_on = max(_max_seq(rows, p, 4, True) or 0 for p in peers)
    return ("At 64 MiB and D=4 (run 2 of docs/benchmarks.md, `docs/bench/max_seq/results.json`):\n"
            f"- TSP fits S={_max_seq(rows, 'tsp', 4, False)}, against {_max_seq(rows, 'ulysses_zero3', 4, False)} "
            f"for Ulysses + ZeRO-3 and {_max_seq(rows, 'dtensor_tp_sp', 4, False)} for TP+SP.\n"
            f"- With checkpointing, TSP fits {_max_seq(rows, 'tsp', 4, True)}, against {best_on} for the best peer.")


# ---- docs/benchmarks.md -----------------------------------------------------------------------------------------

def bench_run1_table(src: dict) -> str:
    lines = ["| layout | S | D | peak MiB/rank | activations | comm MiB/step/rank | step s | tokens/s | CPU s/step "
             "(all ranks) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in src[RUN1]:
        peak = f"{_mib(r['peak_bytes_per_rank']):.1f}"
        lines.append(f"| {LAYOUT_NAMES[r['layout']]} | {r['seq']} | {r['tsp']} | "
                     f"{f'**{peak}**' if r['layout'] == 'tsp' else peak} | "
                     f"{_mib(r['peak_breakdown']['activations']):.1f} | {_mib(r['comm_bytes']):.1f} | "
                     f"{r['step_s']:.3f} | {_tokens_s(r)} | {r['cpu_s_per_step']:.2f} |")
    return "\n".join(lines)


def bench_targets(src: dict) -> str:
    rows, run1 = src[MAX_SEQ], src[RUN1]
    tsp_off, tsp_on = _max_seq(rows, "tsp", 4, False), _max_seq(rows, "tsp", 4, True)
    uly, tpsp = _max_seq(rows, "ulysses_zero3", 4, False), _max_seq(rows, "dtensor_tp_sp", 4, False)
    best_layout = max(("ulysses_zero3", "dtensor_tp_sp"), key=lambda p: _max_seq(rows, p, 4, True) or 0)
    best = _max_seq(rows, best_layout, 4, True)
    best_name = {"ulysses_zero3": "Ulysses+ZeRO-3", "dtensor_tp_sp": "TP+SP"}[best_layout]
    t = {(layout, d): _tokens_s(_row(run1, layout, d, 8192))
         for layout in ("tsp", "tsp_speed", "ulysses_zero1", "dtensor_tp_sp") for d in (2, 4)}
    cpu = {(layout, d): round(_row(run1, layout, d, 8192)["cpu_s_per_step"], 2)
           for layout, d in (("single", 1), ("tsp", 2), ("tsp_speed", 2), ("tsp", 4))}

    def met(value: float, target: float) -> str:
        return "met" if value >= target else "missed"

    def ratio_row(target: str, a: int, b: int, goal: float, extra: str = "") -> str:
        return f"| {target} | {a} vs {b}: **{_ratio(a, b)}**{extra} | {met(round(a / b, 2), goal)} |"

    def extra_cpu(layout: str, d: int) -> float:
        return (cpu[layout, d] / cpu["single", 1] - 1) * 100

    best4 = max(t["tsp", 4], t["tsp_speed", 4])
    return "\n".join([
        "| target | measured | |", "|---|---|---|",
        f"| max-seq, 64 MiB, D=4, no checkpointing: TSP >= 3x Ulysses+ZeRO-3 | {tsp_off} vs {uly}: "
        f"**{tsp_off / uly:.1f}x** | {met(tsp_off / uly, 3)} |",
        f"| same: TSP >= 3x TP+SP | {tsp_off} vs {tpsp}: **{tsp_off / tpsp:.1f}x** | {met(tsp_off / tpsp, 3)} |",
        f"| with checkpointing: TSP >= 2x the best peer | {tsp_on} vs {best} ({best_name}): **{tsp_on / best:.1f}x** "
        f"| {met(tsp_on / best, 2)} |",
        ratio_row("D=2, S=8192: TSP memory-optimal >= 1.0x Ulysses+ZeRO-1", t["tsp", 2], t["ulysses_zero1", 2], 1.0,
                  f" (speed mode {_ratio(t['tsp_speed', 2], t['ulysses_zero1', 2])})"),
        ratio_row("D=2, S=8192: >= 1.2x TP+SP", t["tsp", 2], t["dtensor_tp_sp", 2], 1.2,
                  f" (speed mode {_ratio(t['tsp_speed', 2], t['dtensor_tp_sp', 2])})"),
        ratio_row("D=4, S=8192: TSP (either mode) >= 1.3x TP+SP", best4, t["dtensor_tp_sp", 4], 1.3),
        ratio_row("D=4, S=8192: >= 0.9x Ulysses+ZeRO-1", t["tsp", 4], t["ulysses_zero1", 4], 0.9),
        f"| extra CPU of TSP memory-optimal over one device | D=2: {cpu['tsp', 2]:.2f} vs {cpu['single', 1]:.2f} s: "
        f"**+{extra_cpu('tsp', 2):.1f}%** (speed mode +{extra_cpu('tsp_speed', 2):.1f}%); D=4: "
        f"**+{extra_cpu('tsp', 4):.0f}%** | {'met' if extra_cpu('tsp', 2) <= 0 else 'missed'} |",
        "| K/V bytes with GQA at D > n_kv = the gather-once formula | exact (tests/core/test_kv_gather_once.py) "
        "| met |"])


def bench_overlap_table(src: dict) -> str:
    lines = ["| D | S | | peak MiB/rank | step s | exposed comm (blocked / step) | profile: comm share | load avg |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for d in (2, 4):
        before_shown: list[str] = []
        for when in ("before", "after"):
            r = src[OVERLAP[when, d]][0]
            share = r["profile"]["comm_wait_s"] / r["profile"]["wall_s"]
            shown = [f"{_mib(r['peak_bytes_per_rank']):.1f}", f"{r['exposed_comm_fraction']:.1%}", f"{share:.0%}"]
            if when == "after":  # bold where the new schedule lowered the figure (as printed)
                shown = [f"**{s}**" if float(s.rstrip("%")) < float(b.rstrip("%")) else s
                         for s, b in zip(shown, before_shown)]
            before_shown = shown
            load = r["loadavg_before_after"]
            lines.append(f"| {d} | {r['seq']} | {when} | {shown[0]} | {r['step_s']:.2f} | {shown[1]} | {shown[2]} | "
                         f"{load[0]:.1f} -> {load[1]:.1f} |")
    return "\n".join(lines)


def bench_max_seq_table(src: dict) -> str:
    rows = src[MAX_SEQ]
    lines = ["| layout | checkpointing | D=2 max S | D=4 max S | peak MiB/rank at max S (D=4) |",
             "|---|---|---:|---:|---:|"]
    for layout in ("tsp", "ulysses_zero3", "dtensor_tp_sp"):
        for checkpointing in (False, True):
            d2, d4 = (_max_seq(rows, layout, d, checkpointing) for d in (2, 4))
            peak = _mib(_row(rows, layout, 4, checkpointing=checkpointing)["peak_bytes_per_rank"])
            bold = (lambda s: f"**{s}**") if layout == "tsp" else str
            lines.append(f"| {LAYOUT_NAMES[layout]} | {'on' if checkpointing else 'off'} | "
                         f"{bold(d2) if d2 else 'none'} | {bold(d4) if d4 else 'none'} | {peak:.2f} |")
    return "\n".join(lines)


def bench_max_seq_reading(src: dict) -> str:
    rows = src[MAX_SEQ]
    m = {(layout, d, on): _max_seq(rows, layout, d, on)
         for layout in ("tsp", "ulysses_zero3", "dtensor_tp_sp") for d in (2, 4) for on in (False, True)}
    lines = []
    if m["ulysses_zero3", 2, False] is None:
        over = _row(rows, "ulysses_zero3", 2, checkpointing=False)["next_probe_peak_bytes"]  # the S=4 probe's peak
        lines.append(f"At D=2, Ulysses + ZeRO-3 does not fit 64 MiB at any length. Even at S=4 it peaks at "
                     f"{_mib(over):.1f} MiB: the model's state\nplus DeepSpeed's buffers are already over. ")
    lines.append(
        f"At D=4 TSP fits {m['tsp', 4, False] / m['ulysses_zero3', 4, False]:.1f}x the sequence of Ulysses + ZeRO-3 "
        f"and {m['tsp', 4, False] / m['dtensor_tp_sp', 4, False]:.1f}x that of\nTP+SP. With checkpointing on every "
        f"side, it fits {m['tsp', 4, True] / m['dtensor_tp_sp', 4, True]:.1f}x TP+SP. At D=2 it fits "
        f"{m['tsp', 2, False] / m['dtensor_tp_sp', 2, False]:.1f}x TP+SP, and "
        f"{m['tsp', 2, True] / m['dtensor_tp_sp', 2, True]:.1f}x with\ncheckpointing. Doubling D from 2 to 4 "
        f"multiplies TSP's reach by {m['tsp', 4, False] / m['tsp', 2, False]:.1f}x: its weights, grads and "
        "optimizer state\nshrink with D, as do its activations. TP+SP gains "
        f"{m['dtensor_tp_sp', 4, False] / m['dtensor_tp_sp', 2, False]:.1f}x.\n\n")
    return "".join(lines).rstrip("\n")


def bench_memory_reading(src: dict) -> str:
    """Run 1's memory reading, with TSP's peaks from the current schedule (overlap/after_D*) against run 1's peers."""
    run1 = src[RUN1]

    def peak(layout: str, d: int) -> float:
        row = src[OVERLAP["after", d]][0] if layout == "tsp" else _row(run1, layout, d, 8192)
        return round(_mib(row["peak_bytes_per_rank"]), 1)

    tsp2, tsp4, ideal = peak("tsp", 2), peak("tsp", 4), peak("single", 1) / 4
    return ("**Memory: TSP wins, as designed.** At S=8192 the memory-optimal schedule peaks at (TSP: the current "
            "schedule,\n`overlap/after_D*`; the peers: run 1):\n"
            f"- D=4: {tsp4:.1f} MiB per rank. That is {tsp4 / peak('ulysses_zero3', 4):.2f}x Ulysses+ZeRO-3, "
            f"{tsp4 / peak('dtensor_tp_sp', 4):.2f}x TP+SP, and {tsp4 / ideal:.2f}x the ideal single device / 4\n"
            f"  ({ideal:.0f} MiB).\n"
            f"- D=2: {tsp2:.1f} MiB, which is {tsp2 / peak('ulysses_zero3', 2):.2f}x Ulysses+ZeRO-3 and "
            f"{tsp2 / peak('dtensor_tp_sp', 2):.2f}x TP+SP.")


def _cp_cells(r: dict) -> list[str]:
    """The layout and its ranks (C x D for tsp_cp) of a `ds-tsp bench --cp` row (ds_tsp.tools.bench.cp_report)."""
    ranks = f"{r['world']} ({r['tsp']} x {r['cp']})" if r.get("cp", 1) > 1 else str(r["world"])
    return [f"`{r['layout']}`", ranks]


def _cp_mib(value) -> str:
    return "-" if value is None else f"{_mib(value):.2f}"


def bench_cp_step_table(src: dict) -> str:
    """`ds-tsp bench --tsp 2 --cp 2`, run twice (layouts in order, then reversed): tsp_cp against TSP = 4 and
    Ulysses on 4 ranks, per S; time columns give both runs (run 1 / run 2)."""
    lines = ["| layout | ranks (D x C) | S | tokens/s | s/step / tsp_cp's | CPU s/step / tsp_cp's | peak MiB/rank | "
             "own group MiB/step/rank | cp ring MiB/step/rank (plan) | cp grad sync MiB/step/rank | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    reversed_run = {(r["layout"], r["seq"]): r for r in src[CP_STEP_REVERSED]}

    def runs(pair, cell) -> str:
        return " / ".join(cell(x) for x in pair)

    for r in sorted(src[CP_STEP], key=lambda r: (r["seq"], r["layout"] != "tsp_cp")):
        pair = (r, reversed_run[r["layout"], r["seq"]])
        ring = "-" if "comm_cp_ring_bytes" not in r else \
            f"{_cp_mib(r['comm_cp_ring_bytes'])} ({_cp_mib(r['plan_cp_ring_bytes'])})"
        cells = [runs(pair, lambda x: str(_tokens_s(x))), runs(pair, lambda x: f"{x['step_s_vs_tsp_cp']:.2f}"),
                 runs(pair, lambda x: f"{x['cpu_s_vs_tsp_cp']:.2f}"), f"{_mib(r['peak_bytes_per_rank']):.1f}",
                 _cp_mib(r["comm_group_bytes"]), ring, _cp_mib(r.get("comm_cp_grad_sync_bytes")),
                 runs(pair, lambda x: "->".join(f"{v:.0f}" for v in x["loadavg_before_after"]))]
        lines.append(f"| {' | '.join(_cp_cells(r))} | {r['seq']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def bench_cp_max_seq_table(src: dict) -> str:
    """`ds-tsp bench --max-seq --tsp 2 --cp 2` at 48 MiB (all three) and 64 MiB (tsp_cp and Ulysses): the longest S
    in the budget, checkpointing off and on."""
    lines = ["| budget MiB/rank | layout | ranks (D x C) | checkpointing | max S | / tsp_cp's | peak MiB/rank at max S "
             "| next probe S | its peak MiB/rank |", "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    rows = [*src[CP_MAX_SEQ], *src[CP_MAX_SEQ_64]]
    for r in sorted(rows, key=lambda r: (r["budget_bytes"], bool(r.get("activation_checkpointing")),
                                         r["layout"] != "tsp_cp")):
        ratio = r.get("max_seq_vs_tsp_cp")
        fits = r.get("max_seq")
        lines.append(f"| {_mib(r['budget_bytes']):.0f} | {' | '.join(_cp_cells(r))} | "
                     f"{'on' if r.get('activation_checkpointing') else 'off'} | "
                     f"{fits or 'none'} | {'-' if ratio is None else f'{ratio:.2f}'} | "
                     f"{_cp_mib(r['peak_bytes_per_rank']) if fits else '-'} | {r.get('next_probe_seq') or '-'} | "
                     f"{_cp_mib(r.get('next_probe_peak_bytes'))} |")
    return "\n".join(lines)


BLOCKS: dict[str, tuple[tuple[str, ...], Callable[[dict], str]]] = {
    "demo": ((DEMO2,), readme_demo),
    "demo-tsp1": ((DEMO1,), readme_demo_tsp1),
    "verify": ((VERIFY,), readme_verify),
    "memory-8192": ((RUN1, OVERLAP["after", 2], OVERLAP["after", 4]), readme_memory_8192),
    "speed-8192": ((RUN1,), readme_speed_8192),
    "max-seq": ((MAX_SEQ,), readme_max_seq),
    "run1-table": ((RUN1,), bench_run1_table),
    "targets": ((MAX_SEQ, RUN1), bench_targets),
    "overlap-table": (tuple(OVERLAP.values()), bench_overlap_table),
    "max-seq-table": ((MAX_SEQ,), bench_max_seq_table),
    "max-seq-reading": ((MAX_SEQ,), bench_max_seq_reading),
    "memory-reading": ((RUN1, OVERLAP["after", 2], OVERLAP["after", 4]), bench_memory_reading),
    "cp-step-table": ((CP_STEP, CP_STEP_REVERSED), bench_cp_step_table),
    "cp-max-seq-table": ((CP_MAX_SEQ, CP_MAX_SEQ_64), bench_cp_max_seq_table),
}
