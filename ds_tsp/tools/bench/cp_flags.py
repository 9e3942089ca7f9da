"""`ds-tsp bench --tsp D --cp C`: which layouts run, on how many ranks, and what --cp refuses.

With --cp C (C >= 2) the bench compares, in one run and at one world size C x D:
  tsp_cp         C TSP groups of D ranks sharing each sequence (the cp ring between them; ds_tsp.tools.bench.tsp_cp)
  tsp            TSP alone over C x D ranks (one group)
  ulysses_zero3  DeepSpeed Ulysses over C x D ranks, ZeRO-3 over the same ranks
("all", the default, means these three; --layouts may name tsp_cp and any other layout, each peer then runs on
C x D ranks). Without --cp, tsp_cp is not part of "all" and naming it is an error naming --cp.

A mixture-of-experts shape (--num-experts, or an MoE --hf-config) runs on the TSP layouts only, as without --cp:
"all" is then tsp_cp and tsp (ds_tsp.tools.bench.moe_report.moe_layouts), each under every --moe-dispatch schedule.
Refused by name (one error naming --cp): shapes the cp planner refuses (the report prints its cp bytes beside the
counters), --layer-memory / --offload-activations (one TSP layer on one group).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from ds_tsp.tools.bench.config import LAYOUTS, BenchConfig

CP_LAYOUT = "tsp_cp"
# The alternatives to a cp ring on the same C x D ranks: one TSP group over all of them, and DeepSpeed Ulysses +
# ZeRO-3 (sequence parallel with the weights sharded over every rank, as TSP's are).
CP_PEERS = ("tsp", "ulysses_zero3")


def cp_degree(args: argparse.Namespace) -> int:
    return getattr(args, "cp", None) or 1


def check_cp_flags(args: argparse.Namespace) -> None:
    """Flags that cannot go with --cp C >= 2 (ValueError naming --cp and the flag)."""
    cp = cp_degree(args)
    if cp == 1:
        return
    for flag, name in (("--layer-memory", "layer_memory"), ("--offload-activations", "offload_activations")):
        if getattr(args, name, None):
            raise ValueError(f"--cp {cp} with {flag}: {flag} measures one TSP group's decoder layer(s); drop --cp "
                             f"(or {flag})")


def cp_layouts(args: argparse.Namespace, layouts: list[str]) -> list[str]:
    """The layouts of this run: with --cp, "all" -> tsp_cp and its peers; without, tsp_cp is dropped from "all"
    and refused when named (ValueError naming --cp)."""
    cp = cp_degree(args)
    explicit = args.layouts.strip() != "all"
    if cp == 1:
        if explicit and CP_LAYOUT in layouts:
            raise ValueError(f"--layouts {CP_LAYOUT}: C TSP groups sharing a sequence; add --cp C (C >= 2), e.g. "
                             f"--tsp 2 --cp 2")
        return [name for name in layouts if name != CP_LAYOUT]
    if not explicit:
        return [CP_LAYOUT, *CP_PEERS]
    return layouts


def cp_comms(args: argparse.Namespace) -> list[str]:
    """--cp-comm's schedules of layout tsp_cp (a comma list of ring, all_to_all, auto: the model's choice per
    length, its row naming the schedule run); ValueError naming the flag."""
    names = list(dict.fromkeys(n.strip() for n in str(getattr(args, "cp_comm", None) or "ring").split(",")
                               if n.strip()))
    bad = [n for n in names if n not in ("ring", "all_to_all", "auto")]
    if bad or not names:
        raise ValueError(f"--cp-comm: unknown {bad or '(empty)'}; a comma list of ring, all_to_all, auto")
    if names != ["ring"] and cp_degree(args) == 1:
        raise ValueError("--cp-comm: the cp schedules of layout tsp_cp; add --cp C (C >= 2)")
    return names


def cp_configs(configs: list[BenchConfig], cp: int, comms: tuple[str, ...] = ("ring",)) -> list[BenchConfig]:
    """tsp_cp gets cp = C (its tsp stays D), one config per cp schedule in `comms`; every other multi-rank layout
    runs on C x D ranks (tsp = C x D). Checks the shape against both degrees and against what the cp schedules run
    (ValueError naming --cp)."""
    if cp == 1:
        return configs
    from ds_tsp.core.errors import TSPConfigError

    out = []
    for cfg in configs:
        if cfg.layout == CP_LAYOUT:
            out += [replace(cfg, cp=cp, cp_comm=comm) for comm in comms]
        else:
            out.append(replace(cfg, tsp=cfg.tsp * cp))
    shape = configs[0].shape
    try:
        for cfg in out:
            if LAYOUTS[cfg.layout].module in ("tsp", "tsp_cp"):
                shape.check_tsp_degree(cfg.tsp)
    except TSPConfigError as exc:
        raise ValueError(str(exc)) from None
    # always: --cp asks for the cp comparison, even where "all" was narrowed to the TSP layouts (hybrid, MoE)
    check_cp_shape(shape, configs[0].tsp, cp)
    if "all_to_all" in comms:
        from ds_tsp.tools.plan import PlanInput
        from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all

        try:
            plan_tsp_cp_all_to_all(PlanInput(model=shape, seq=2 * configs[0].tsp * cp, degree=configs[0].tsp,
                                             dtype="fp32"), cp)
        except TSPConfigError as exc:
            raise ValueError(f"--cp {cp} --cp-comm all_to_all: {exc}") from None
    return out


def check_cp_shape(shape, tsp: int, cp: int) -> None:
    """What the cp planner refuses, refused before any rank starts (the report sets its cp bytes beside the
    counters)."""
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp

    try:
        plan_tsp_cp(PlanInput(model=shape, seq=2 * tsp * cp, degree=tsp, dtype="fp32"), cp)
    except TSPConfigError as exc:
        raise ValueError(f"--cp {cp}: layout {CP_LAYOUT} cannot run this model: {exc}") from None
