"""Record `ds-tsp bench` peaks as the fixture tests/tools/test_plan.py checks `ds-tsp plan` against (within 10%).

    for D in 2 4; do
      ds-tsp bench --layouts tsp,tsp_speed,dtensor_tp_sp,ulysses_zero3,ulysses_zero1,autotp_zero1 \
          --seq 2048 4096 --tsp $D --steps 1 --warmup 1 --out /tmp/plan_bench_D$D
    done
    python benchmarks/plan_vs_bench.py /tmp/plan_bench_D*/results.json --out tests/fixtures/plan_bench.json

Prints the plan-vs-bench table (markdown). MemTracker's peak is deterministic: the machine's load does not move it.
"""
from __future__ import annotations

import argparse
import json
import sys

# bench layout -> (plan layout, PlanInput options); the bench runs fp32 with DeepSpeed buckets of 5e6 elements
BENCH_TO_PLAN = {
    "tsp": ("tsp", {}),
    "tsp_speed": ("tsp", {"keep_gathered_kv": True, "recompute_projections": False}),
    "dtensor_tp_sp": ("tp_sp", {}),
    "ulysses_zero3": ("ulysses", {}),
    "ulysses_zero1": ("ulysses_replicated", {"zero_stage": 1}),
    "autotp_zero1": ("autotp", {}),
}
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def records(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        data = json.load(open(path))
        for r in data["results"] if isinstance(data, dict) else data:
            if r.get("ok") and r["layout"] in BENCH_TO_PLAN:
                out.append({"bench_layout": r["layout"], "degree": r["world"], "seq": r["seq"], "batch": r["batch"],
                            "shape": {k: r["shape"][k] for k in SHAPE_KEYS},
                            "bucket_elements": 5_000_000, "measured_peak_bytes": r["peak_bytes_per_rank"],
                            "measured_breakdown": {k: v for k, v in r["peak_breakdown"].items() if v}})
    return sorted(out, key=lambda r: (r["bench_layout"], r["degree"], r["seq"]))


def planned(record: dict):
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.plan import LAYOUTS, PlanInput

    layout, options = BENCH_TO_PLAN[record["bench_layout"]]
    inp = PlanInput(model=ModelShape(**record["shape"]), seq=record["seq"], batch=record["batch"],
                    degree=record["degree"], dtype="fp32", zero_bucket_elements=record["bucket_elements"], **options)
    return LAYOUTS[layout](inp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="ds-tsp bench results.json files")
    p.add_argument("--out", default=None, help="write the fixture JSON here")
    args = p.parse_args(argv)
    recs = records(args.results)
    mib = 2 ** 20
    print("| bench layout | D | seq | planned MiB | measured MiB | error % | plan's peak phase |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in recs:
        plan = planned(r)
        err = 100 * (plan.peak_bytes_per_rank - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        print(f"| {r['bench_layout']} | {r['degree']} | {r['seq']} | {plan.peak_bytes_per_rank / mib:.1f} | "
              f"{r['measured_peak_bytes'] / mib:.1f} | {err:+.1f} | {plan.peak_phase} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "see benchmarks/plan_vs_bench.py", "made_by": provenance(args.results),
                       "records": recs}, f, indent=1)
            f.write("\n")
    return 0


def provenance(paths: list[str]) -> dict:
    """How the fixture was made: the commands (this module's docstring), the commit and the library versions of
    the machine that ran the bench."""
    import platform
    import subprocess

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    return {"commands": [line.strip() for line in __doc__.splitlines()[2:7] if line.strip()],
            "results": paths, "commit": commit or None, "torch": torch.__version__, "deepspeed": ds_version,
            "machine": platform.machine(), "note": "MemTracker's peak is deterministic: the load does not move it"}


if __name__ == "__main__":
    sys.exit(main())
