"""`ds-tsp plan --recommend`: parse its flags, print the choice, why, and one line per rejected alternative."""
from __future__ import annotations

import argparse
import json

_GIB = 2 ** 30


def recommend_from_args(args: argparse.Namespace, plan_input, usage_error):
    """(Recommendation, base PlanInput, model name); plan_input / usage_error are tools.plan.cli's."""
    from ds_tsp.tools.plan import recommend

    if args.gpu_mem_gib is None or args.devices is None:
        flag = "--gpu-mem-gib" if args.gpu_mem_gib is None else "--devices"
        raise usage_error(flag, "--recommend needs --gpu-mem-gib G and --devices N")
    try:
        gib = float(args.gpu_mem_gib)
    except ValueError:
        raise usage_error("--gpu-mem-gib", f"{args.gpu_mem_gib!r} is not a number; e.g. --gpu-mem-gib 80") from None
    if not gib > 0:
        raise usage_error("--gpu-mem-gib", f"{gib} must be > 0")
    text = str(args.devices).strip()
    if not text.isdigit() or int(text) < 1:
        raise usage_error("--devices", f"{args.devices!r} is not an integer >= 1; e.g. --devices 8")
    if args.layout:
        raise usage_error("--layout", "--recommend chooses among tsp, ulysses, tp_sp and fsdp_cp itself")
    host = None
    if args.host_mem_gib is not None:
        if not args.offload_activations:
            raise usage_error("--host-mem-gib", "with --recommend it limits the offloaded activations: add "
                                                "--offload-activations")
        try:
            host = float(args.host_mem_gib)
        except ValueError:
            raise usage_error("--host-mem-gib", f"{args.host_mem_gib!r} is not a number; e.g. --host-mem-gib 232") \
                from None
        if not host > 0:
            raise usage_error("--host-mem-gib", f"{host} must be > 0")
    inp, model_name = plan_input(args)
    return recommend(inp, gpu_mem_gib=gib, devices=int(text), offload=args.offload_activations,
                     host_mem_gib=host), inp, model_name


def print_recommendation(rec, inp, model_name: str, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**rec.to_dict(), "model": model_name, "input": inp.to_dict()}), flush=True)
        return
    m = inp.model
    print(f"{model_name}: h={m.hidden_size} layers={m.num_layers} heads={m.num_heads}/{m.num_kv_heads} "
          f"ffn={m.intermediate_size} vocab={m.vocab_size} | seq={inp.seq} batch={inp.batch} {inp.dtype} | "
          f"{rec.devices} devices x {rec.gpu_mem_bytes / _GIB:g} GiB")
    if rec.best is None:
        print(f"no layout fits: {rec.why}")
    else:
        b = rec.best
        print(f"recommended: {b.label}: peak {b.peak_bytes_per_rank / _GIB:.2f} GiB per rank, "
              f"comm {b.comm_bytes_per_step / _GIB:.2f} GiB per rank per step"
              + (f", host {b.host_bytes_per_rank / _GIB:.2f} GiB per rank (offloaded layer inputs)"
                 if b.offload_activations else ""))
        print(f"  why: {rec.why}")
    print("rejected:")
    for c in rec.rejected:
        print(f"  {c.label}: {c.verdict}")
    print("  (peak: ds_tsp.tools.plan's estimate, no CUDA context or allocator slack; comm: equal global batch per step, "
          "see ds_tsp/tools/plan/recommend.py)", flush=True)
