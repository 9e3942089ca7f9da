"""`ds-tsp bench` on a mixture-of-experts shape: the MoE flags, and the table of both dispatch schedules beside the
plan's "auto" choice.

Flags: --num-experts E (every layer sparse; Mixtral-like routing, top-k probabilities renormalised), --top-k (2),
--moe-ffn (--ffn), --moe-dispatch LIST (auto, ring, all_to_all; one row per schedule); or an --hf-config with
experts (Qwen3-MoE, Mixtral). MoE runs on the TSP layouts and on transformers' own model of the shape under
hf_zero3_dp / hf_fsdp2_dp / single (named: "all" is the TSP layouts); the other peers build HF Llama, which has no
experts, and are refused.

The MoE table (appended to results.md, written as moe.json): per (layout, D, S) and schedule the measured peak per
rank (MemTracker), comm per rank per step (CommCounter) and step time, the plan's peak and comm for that schedule
(ds_tsp.tools.plan.plan_tsp), the plan's "auto" choice (choose_moe_dispatch for that batch shape, the model's own
call), the measured faster schedule, and whether auto's measured step time is within 10% of the faster one
(auto is chosen from bytes alone: within 10% it costs a user little for never having to pick), on wall time and on
CPU seconds per step.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from ds_tsp.tools.cli_types import MIB

SCHEDULES = ("auto", "ring", "all_to_all")
TARGET = 0.10  # auto's step time may exceed the measured faster one by this fraction
# layout modules that build transformers' own model of the shape (ds_tsp.tools.bench.common.hf_config): Qwen3-MoE
# or Mixtral for an MoE shape
HF_MOE_MODULES = ("zero3_dp", "fsdp2_dp", "single")


def moe_dispatches(args: argparse.Namespace, shape=None) -> list[str]:
    """The schedules to measure (["auto"] for a dense shape; `shape`: the run's, whose experts may come from
    --hf-config); ValueError naming the flag."""
    text = getattr(args, "moe_dispatch", None) or "auto"
    names = list(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    bad = [n for n in names if n not in SCHEDULES]
    if bad or not names:
        raise ValueError(f"--moe-dispatch: unknown {bad or '(empty)'}; a comma list of {', '.join(SCHEDULES)}")
    if getattr(args, "num_experts", None) is None and not (shape is not None and shape.num_experts):
        given = [flag for flag, key in (("--top-k", "top_k"), ("--moe-ffn", "moe_ffn"))
                 if getattr(args, key, None) is not None]
        if given or names != ["auto"]:
            raise ValueError(f"{(given or ['--moe-dispatch'])[0]}: only with --num-experts N (a mixture-of-experts "
                             "shape)")
    return names


def moe_fields(args: argparse.Namespace) -> dict:
    """ModelShape keyword arguments of the MoE flags ({} without --num-experts)."""
    if getattr(args, "num_experts", None) is None:
        return {}
    return {"num_experts": args.num_experts, "num_experts_per_tok": args.top_k or 2,
            "moe_intermediate_size": args.moe_ffn or args.ffn, "norm_topk_prob": True}


def moe_layouts(args: argparse.Namespace, layouts: list[str], shape=None) -> list[str]:
    """An MoE shape (--num-experts, or an --hf-config with experts: `shape`) runs on the TSP layouts and, named, on
    transformers' own MoE model (hf_zero3_dp, hf_fsdp2_dp, single): "all" means the TSP layouts, another peer named
    explicitly is an error (its session builds an HF Llama, a dense model)."""
    from ds_tsp.tools.bench.config import LAYOUTS

    if not (getattr(args, "num_experts", None) or (shape is not None and shape.num_experts)):
        return layouts
    tsp_modules = ("tsp", "tsp_cp")  # tsp_cp: C TSP groups under --cp (ds_tsp.tools.bench.cp_flags)
    if args.layouts.strip() == "all":
        return [name for name in layouts if LAYOUTS[name].module in tsp_modules]
    peers = [name for name in layouts if LAYOUTS[name].module not in (*tsp_modules, *HF_MOE_MODULES)]
    if peers:
        raise ValueError(f"--layouts {peers}: a mixture-of-experts shape runs on the TSP layouts only among the "
                         "sequence-parallel ones, and on transformers' own MoE model under hf_zero3_dp, hf_fsdp2_dp "
                         "and single (the other peers' sessions build an HF Llama, which has no experts); use "
                         "--layouts tsp,hf_zero3_dp")
    return layouts


def _planned(r: dict, schedule: str):
    """The plan of this result's run under `schedule` (fp32, as the bench runs)."""
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.plan import PlanInput, plan_tsp
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    shape = dict(r["shape"])
    shape["dense_mlp_layers"] = tuple(shape.get("dense_mlp_layers") or ())
    if shape.get("rope_scaling") is not None:  # not used by the bench; keep the plan input simple
        shape["rope_scaling"] = None
    options = r.get("tsp_options") or {}
    inp = PlanInput(model=ModelShape(**shape), seq=r["seq"], batch=r["batch"], degree=r["tsp"], dtype="fp32",
                    keep_gathered_kv=options.get("keep_gathered_kv", False),
                    recompute_projections=options.get("recompute_projections", True),
                    activation_checkpointing=bool(r.get("activation_checkpointing")), moe_dispatch=schedule)
    return plan_tsp_cp(inp, r["cp"]) if r.get("cp", 1) > 1 else plan_tsp(inp)


def moe_rows(results: Sequence[dict]) -> list[dict]:
    """One row per measured MoE result, with the plan's figures and the group's verdict (see module doc)."""
    rows = []
    for r in results:
        if not r.get("moe_dispatch"):
            continue
        plan = _planned(r, r["moe_dispatch"]) if r.get("ok") else None
        resolved = plan.moe["schedule"] if plan else None
        rows.append({"layout": r["layout"], "tsp": r["tsp"], "seq": r["seq"], "moe_dispatch": r["moe_dispatch"],
                     "schedule": resolved, "ok": bool(r.get("ok")), "peak_bytes_per_rank": r.get("peak_bytes_per_rank"),
                     "comm_bytes_per_step": r.get("comm_bytes"), "step_s": r.get("step_s"),
                     "cpu_s_per_step": r.get("cpu_s_per_step"),
                     "plan_peak_bytes": plan.peak_bytes_per_rank if plan else None,
                     "plan_comm_bytes_per_step": plan.comm_bytes_per_step if plan else None,
                     "plan_bytes_per_layer": plan.moe["bytes_per_layer"] if plan else None,
                     "plan_auto": plan.moe["auto"] if plan else None})
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["layout"], row["tsp"], row["seq"]), []).append(row)
    for members in groups.values():
        auto = next((m["plan_auto"] for m in members if m["plan_auto"]), None)
        for key, suffix in (("step_s", ""), ("cpu_s_per_step", "_cpu")):
            measured = {m["schedule"]: m[key] for m in members if m["ok"] and m[key]}
            faster = min(measured, key=measured.get) if measured else None
            within = (measured[auto] <= (1 + TARGET) * measured[faster]) if auto in measured and faster else None
            for m in members:
                m.update({f"measured_faster{suffix}": faster, f"auto_within_10pct{suffix}": within,
                          f"auto_over_faster{suffix}": (measured[auto] / measured[faster]) if within is not None
                          else None})
    return rows


def moe_markdown(rows: Sequence[dict]) -> str:
    def mib(v):
        return "-" if v is None else f"{v / MIB:.1f}"

    def verdict(m, suffix):
        within = m[f"auto_within_10pct{suffix}"]
        return "-" if within is None else f"{'yes' if within else 'NO'} ({m[f'auto_over_faster{suffix}']:.2f}x)"

    lines = ["## Mixture of experts: schedules vs the plan's auto choice", "",
             "| layout | D | S | schedule | peak MiB | plan peak MiB | comm MiB/step | plan comm MiB/step | step s | "
             "CPU s/step | plan's auto | faster (step s) | auto within 10%? (step s) | faster (CPU s) | "
             "auto within 10%? (CPU s) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|"]
    for m in rows:
        schedule = m["moe_dispatch"] if m["moe_dispatch"] == m["schedule"] or not m["schedule"] else \
            f"{m['moe_dispatch']} -> {m['schedule']}"
        lines.append(f"| {m['layout']} | {m['tsp']} | {m['seq']} | {schedule} | {mib(m['peak_bytes_per_rank'])} | "
                     f"{mib(m['plan_peak_bytes'])} | {mib(m['comm_bytes_per_step'])} | "
                     f"{mib(m['plan_comm_bytes_per_step'])} | "
                     f"{'-' if m['step_s'] is None else format(m['step_s'], '.3f')} | "
                     f"{'-' if m['cpu_s_per_step'] is None else format(m['cpu_s_per_step'], '.2f')} | "
                     f"{m['plan_auto'] or '-'} | {m['measured_faster'] or '-'} | {verdict(m, '')} | "
                     f"{m['measured_faster_cpu'] or '-'} | {verdict(m, '_cpu')} |")
    lines += ["", "Plan: ds_tsp.tools.plan.plan_tsp (tsp_cp: plan_tsp_cp) at the same shape (fp32); plan comm "
              "assumes even routing "
              "(all_to_all rows = tokens x top_k x (D-1)/D), the counter counts the real rows. auto within 10%: "
              "the measured step time of the schedule the plan's auto picks <= 1.10 x the faster one's; judged on "
              "wall time (step s, what the target names) and on CPU s/step (all ranks' CPU seconds per step, much less "
              "disturbed by other load on a shared machine)."]
    return "\n".join(lines) + "\n"


def write_moe_report(results: Sequence[dict], out_dir: str, md_path: str) -> str:
    """Append the MoE table to results.md, write moe.json; returns the table."""
    rows = moe_rows(results)
    text = moe_markdown(rows)
    with open(md_path, "a") as f:
        f.write("\n" + text)
    with open(os.path.join(out_dir, "moe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return text
