"""`ds-tsp bench --rounds N`: the layouts run N times in turn (A B C, A B C, ...), so a machine whose speed drifts
(a shared or virtual CPU) slows every layout alike instead of the one that happened to run during the slow minute.

Each round gives one result per (layout, seq) as usual; `merge_rounds` folds the rounds into one result: the
timed steps of every round together (step s: their median; tokens/s from it), CPU s/step the median over rounds,
memory and bytes from the first round (they do not depend on timing), and `rounds`, one entry per round. A
(layout, seq) that failed in any round is reported as that failure. `rounds_table` shows each round's tokens/s
and, round by round, the first layout's tokens/s over this one's (measured minutes apart, not half an hour):
the ratio's median and its range over the rounds.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

ROUND_KEYS = ("step_s", "tokens_per_s", "cpu_s_per_step", "loadavg_before_after", "group_wall_s")


def _key(result: dict) -> tuple:
    return result["config_index"], result["seq"]


def merge_rounds(per_round: Sequence[Sequence[dict]]) -> list[dict]:
    """Results of every round (each a list in run order, tagged with its config's `config_index`) -> one list."""
    if len(per_round) == 1:
        return list(per_round[0])
    keyed = [{_key(r): r for r in results} for results in per_round]
    merged = []
    for key in dict.fromkeys(_key(r) for results in per_round for r in results):
        runs = [round_results.get(key) for round_results in keyed]
        failed = next((r for r in runs if r is None or not r.get("ok")), False)
        if failed is not False:
            merged.append(failed if failed is not None else
                          {**next(r for r in runs if r is not None), "ok": False,
                           "error": "missing in a round (its group failed before this length ran)"})
            continue
        first = dict(runs[0])
        steps = [s for r in runs for s in r["step_s_per_step"]]
        first["step_s_per_step"] = steps
        first["step_s"] = statistics.median(steps)
        first["tokens_per_s"] = first["tokens_per_step"] / first["step_s"]
        cpu = [r["cpu_s_per_step"] for r in runs if r.get("cpu_s_per_step")]
        if cpu:
            first["cpu_s_per_step"] = statistics.median(cpu)
            first["tokens_per_cpu_s"] = first["tokens_per_step"] / first["cpu_s_per_step"]
        first["rounds"] = [{k: r.get(k) for k in ROUND_KEYS} for r in runs]
        merged.append(first)
    return merged


def _label(result: dict) -> str:
    return result.get("label") or result["layout"]


def rounds_table(results: Sequence[dict]) -> str:
    """Markdown: per (layout, seq, D) the tokens/s of each round and the reference's over this one's per round,
    the reference being the run's first layout at the same seq and D. Empty when the run had one round."""
    ok = [r for r in results if r.get("ok") and r.get("rounds")]
    if not ok:
        return ""
    reference = {}
    for r in ok:
        reference.setdefault((r["seq"], r.get("tsp")), r)
    lines = ["", f"Rounds ({len(ok[0]['rounds'])}, the layouts in turn): tokens/s per round, and the first layout's "
             "tokens/s over this one's in the same round (median, min - max):", "",
             "| layout | S | D | tokens/s per round | first layout | first / this |",
             "|---|---:|---:|---|---|---:|"]
    for r in ok:
        ref = reference[(r["seq"], r.get("tsp"))]
        mine = [x["tokens_per_s"] for x in r["rounds"]]
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ref["rounds"], r["rounds"])]
        spread = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} - {max(ratios):.2f})"
                  if r is not ref else "-")
        lines.append(f"| {_label(r)} | {r['seq']} | {r.get('tsp')} | {', '.join(f'{t:.0f}' for t in mine)} | "
                     f"{_label(ref)} | {spread} |")
    return "\n".join(lines) + "\n"
