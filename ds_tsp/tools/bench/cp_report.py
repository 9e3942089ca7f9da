"""Report of `ds-tsp bench --tsp D --cp C`: bytes split by communicator, the plan's cp bytes, ratios to tsp_cp.

`with_cp_fields` adds to every row (results.json) what the cp comparison reads:
  comm_group_bytes          bytes per step and rank inside the layout's own group: tsp_cp's TSP group of D ranks
                            (intra-node in a real run), a peer's one group of C x D ranks
  comm_cp_ring_bytes        tsp_cp only: the layers' bytes on the cp communicator (inter-node in a real run): the
                            all-to-alls of tsp.cp_comm "all_to_all" (a tsp_cp[all_to_all] row), or the
                            ring's K/V and dK/dV hops, and a hybrid model's Gated DeltaNet halo and transition
                            all-gathers / reduce-scatters over cp (ds_tsp.core.layers.linear_attention.scan)
  comm_cp_grad_sync_bytes   tsp_cp only: the gradient all-reduce over cp (weights are replicated over cp)
  comm_cp_input_check_bytes tsp_cp only: the input check's all-gather over cp (whole-sequence facts: a fixed-size
                            payload, ds_tsp.tools.plan.tsp_comm.input_check_cp_bytes, the plan's own formula; the
                            rest of the cp all-gathers are the Gated DeltaNet's)
  plan_cp_ring_bytes        tsp_cp only: `ds-tsp plan --cp`'s inter-node bytes for the same shape (fp32, as the
                            bench runs; ds_tsp.tools.plan.tsp_cp), its layers' part (less the input check's
                            all-gather and an MoE model's aux counts over cp): equal to comm_cp_ring_bytes for full
                            attention (the by-kind bytes are global rank 0's; with sliding windows the cp ranks move
                            different amounts and the plan gives the busiest one's)
  plan_cp_bytes_per_step    tsp_cp only: the plan's whole inter-node bytes per step (plan_cp_ring_bytes + the input
                            check's all-gather over cp + an MoE model's aux counts over cp)
  plan_comm_bytes_per_step  tsp_cp only: the plan's bytes per step and rank, = comm_bytes (every byte of both
                            communicators: comm_group_bytes + comm_cp_ring_bytes + comm_cp_grad_sync_bytes +
                            comm_cp_input_check_bytes, + an MoE model's aux counts over cp)
  step_s_vs_tsp_cp          this row's s/step / tsp_cp's at the same S and checkpointing (same run)
  cpu_s_vs_tsp_cp           the same for CPU seconds of all ranks per step (less disturbed by other load)
  max_seq_vs_tsp_cp         --max-seq: this row's max S / tsp_cp's
`append_cp_table` writes the markdown table of those columns after results.md's tables.
"""
from __future__ import annotations

from collections.abc import Sequence

from ds_tsp.tools.bench.cp_flags import CP_LAYOUT
from ds_tsp.tools.bench.tsp_cp import CP_PREFIX
from ds_tsp.tools.cli_types import MIB


def _split(row: dict) -> dict:
    from ds_tsp.tools.plan.tsp_comm import input_check_cp_bytes

    by_kind = row.get("comm_by_op") or {}
    if row["layout"] != CP_LAYOUT:
        return {"comm_group_bytes": row.get("comm_bytes")}
    gathered = by_kind.get(CP_PREFIX + "all_gather", 0)
    check = min(gathered, input_check_cp_bytes(row["tsp"], row["cp"]))
    return {"comm_group_bytes": sum(v for k, v in by_kind.items() if not k.startswith(CP_PREFIX)),
            "comm_cp_ring_bytes": by_kind.get(CP_PREFIX + "ring", 0) + by_kind.get(CP_PREFIX + "reduce_scatter", 0)
            + by_kind.get(CP_PREFIX + "all_to_all", 0) + gathered - check,
            "comm_cp_grad_sync_bytes": by_kind.get(CP_PREFIX + "grad_sync", 0),
            "comm_cp_input_check_bytes": check}


def _planned(row: dict, shape) -> dict:
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp
    from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all

    # cp_comm auto: the plan of the schedule the row ran
    comm = row.get("cp_comm_chosen") if row.get("cp_comm") == "auto" else row.get("cp_comm")
    if isinstance(comm, dict):  # layers on both schedules (windowed on the ring): no plan models that mix
        return {}
    schedule = plan_tsp_cp_all_to_all if comm == "all_to_all" else plan_tsp_cp
    plan = schedule(PlanInput(model=shape, seq=row["seq"], batch=row["batch"], degree=row["tsp"], dtype="fp32",
                                 activation_checkpointing=bool(row.get("activation_checkpointing")),
                                 moe_dispatch=row.get("moe_dispatch") or "auto"), row["cp"])
    cp = plan.cp
    steps = cp["input_check_cp_bytes_per_step"] + cp.get("moe_aux_cp_bytes_per_step", 0)
    return {"plan_cp_ring_bytes": cp["inter_node_bytes_per_step"] - steps,
            "plan_cp_bytes_per_step": cp["inter_node_bytes_per_step"],
            "plan_comm_bytes_per_step": plan.comm_bytes_per_step,
            "plan_peak_bytes_per_rank": plan.peak_bytes_per_rank}


def with_cp_fields(rows: Sequence[dict], shape) -> list[dict]:
    """The rows with the cp comparison's fields (module doc); rows that failed get none."""
    out = [dict(r) for r in rows]
    ok = [r for r in out if r.get("ok") and r.get("comm_bytes") is not None]
    for r in ok:
        r.update(_split(r))
        if r["layout"] == CP_LAYOUT:
            r.update(_planned(r, shape))

    def key(r):  # an MoE run measures each schedule: compare like with like
        return r["seq"], bool(r.get("activation_checkpointing")), r.get("moe_dispatch")

    base = {key(r): r for r in ok if r["layout"] == CP_LAYOUT and r.get("cp_comm", "ring") == "ring"}
    for r in ok:
        ref = base.get(key(r))
        if ref is not None and r.get("max_seq") is None:
            r["step_s_vs_tsp_cp"] = r["step_s"] / ref["step_s"]
            if r.get("cpu_s_per_step") and ref.get("cpu_s_per_step"):
                r["cpu_s_vs_tsp_cp"] = r["cpu_s_per_step"] / ref["cpu_s_per_step"]
    max_base = {key(r)[1:]: r for r in out if r["layout"] == CP_LAYOUT and r.get("max_seq")
                and r.get("cp_comm", "ring") == "ring"}
    for r in out:
        ref = max_base.get(key(r)[1:])
        if ref is not None and r.get("max_seq"):
            r["max_seq_vs_tsp_cp"] = r["max_seq"] / ref["max_seq"]
    return out


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def _load(row: dict) -> str:
    load = row.get("loadavg_before_after") or []
    return "/".join("-" if x is None else f"{x:.1f}" for x in load) or "-"


def cp_table(rows: Sequence[dict]) -> str:
    """One line per row: ranks, (D, C), throughput and its ratio, memory, bytes per communicator."""
    max_seq = any("max_seq" in r for r in rows)
    first = ["layout", "checkpointing", "ranks", "D", "C", "max S" if max_seq else "S"]
    timing = ["max S / tsp_cp's"] if max_seq else ["tokens/s", "s/step / tsp_cp's", "CPU s/step / tsp_cp's"]
    header = [*first, *timing, "peak MiB/rank", "own group MiB/step/rank", "cp ring MiB/step/rank",
              "plan cp ring", "cp grad sync MiB/step/rank", "load before/after"]
    lines = ["## tsp_cp against its peers on the same ranks", "",
             "tsp_cp = C TSP groups of D ranks sharing each sequence (K/V around the cp ring); its peers run on "
             "C x D ranks. Own group: bytes inside the layout's group (tsp_cp: its TSP group of D, intra-node in a "
             "real run; a peer: its one group of C x D). cp ring: the K/V and dK/dV hops between TSP groups "
             "(inter-node in a real run); plan cp ring = `ds-tsp plan --cp`'s inter-node bytes for the same shape. "
             "cp grad sync: one all-reduce of the gradients over cp (the weights are replicated over cp). Ratios "
             "are within this run; the layouts run one after another, so other load on the machine may differ "
             "between them: load = the 1-minute load average before and after the layout's group (CPU seconds "
             "are less disturbed by it than wall time).", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for r in rows:
        ckpt = "on" if r.get("activation_checkpointing") else "off"
        head = [r.get("label") or r["layout"], ckpt, str(r.get("world")), str(r.get("tsp")), str(r.get("cp", 1))]
        length = r.get("max_seq") if max_seq else r["seq"]
        if not r.get("ok") or (max_seq and not length):
            why = "none fits" if r.get("ok") else "failed"
            lines.append("| " + " | ".join([*head, why] + [""] * (len(header) - len(head) - 1)) + " |")
            continue
        if max_seq:
            ratio = r.get("max_seq_vs_tsp_cp")
            timing_cells = ["-" if ratio is None else f"{ratio:.2f}"]
        else:
            ratios = (r.get("step_s_vs_tsp_cp"), r.get("cpu_s_vs_tsp_cp"))
            timing_cells = [f"{r['tokens_per_s']:.0f}", *("-" if x is None else f"{x:.2f}" for x in ratios)]
        lines.append("| " + " | ".join([*head, str(length), *timing_cells, _mib(r["peak_bytes_per_rank"]),
                                        _mib(r.get("comm_group_bytes")), _mib(r.get("comm_cp_ring_bytes")),
                                        _mib(r.get("plan_cp_ring_bytes")),
                                        _mib(r.get("comm_cp_grad_sync_bytes")), _load(r)]) + " |")
    return "\n".join(lines) + "\n"


def append_cp_table(rows: Sequence[dict], md_path: str) -> str:
    """cp_table(rows) appended to results.md; returns the table."""
    table = cp_table(rows)
    with open(md_path, "a") as f:
        f.write("\n" + table)
    return table
