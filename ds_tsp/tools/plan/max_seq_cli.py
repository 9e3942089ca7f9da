"""`ds-tsp plan --max-seq`: the longest sequence TSP fits in --gpu-mem-gib per device (and, with
--offload-activations, --host-mem-gib of host memory per rank), with the plan at that length."""
from __future__ import annotations

import argparse
import json

_GIB = 2 ** 30


def _gib(flag: str, text, usage_error) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise usage_error(flag, f"{text!r} is not a number; e.g. {flag} 80") from None
    if not value > 0:
        raise usage_error(flag, f"{value} must be > 0")
    return value


def run_max_seq(args: argparse.Namespace, plan_input, usage_error, or_usage_error, layouts, rates_of,
                exit_codes: tuple[int, int]) -> int:
    """plan_input, usage_error, or_usage_error, layouts, rates_of: ds_tsp.tools.plan.cli's (this module does not
    import it: cli imports this one); exit_codes: (fits, nothing fits)."""
    from ds_tsp.tools.plan.max_seq import longest_seq
    from ds_tsp.tools.plan.offload_cli import offload_lines
    from ds_tsp.tools.plan.offload import with_offload
    from ds_tsp.tools.plan.tsp import plan_tsp
    from ds_tsp.tools.plan.tsp_comm import TSPGeometry

    def build():
        if args.gpu_mem_gib is None:
            raise usage_error("--gpu-mem-gib", "--max-seq needs --gpu-mem-gib G (device memory per GPU)")
        if args.layout and [n for n in layouts(args.layout) if n != "tsp"]:
            raise usage_error("--layout", "--max-seq plans the tsp layout only")
        gpu = _gib("--gpu-mem-gib", args.gpu_mem_gib, usage_error)
        host = None if args.host_mem_gib is None else _gib("--host-mem-gib", args.host_mem_gib, usage_error)
        if args.offload_activations and host is None:
            raise usage_error("--host-mem-gib", "--max-seq --offload-activations needs --host-mem-gib H (host "
                                                "memory per rank for the offloaded layer inputs)")
        inp, model_name = plan_input(args)
        rates = rates_of(args)
        result = longest_seq(inp, gpu_mem_bytes=int(gpu * _GIB),
                             host_mem_bytes=None if host is None else int(host * _GIB),
                             plan_fn=lambda trial: with_offload(plan_tsp(trial), trial, TSPGeometry.of(trial),
                                                                **rates))
        return result, inp, model_name, gpu, host

    built, failed = or_usage_error(build)
    if failed is not None:
        return failed
    result, inp, model_name, gpu, host = built
    exit_ok, exit_no_fit = exit_codes
    if args.json:
        print(json.dumps({**result.to_dict(), "model": model_name, "gpu_mem_gib": gpu, "host_mem_gib": host,
                          "input": {**inp.to_dict(), "seq": result.seq}}), flush=True)
        return exit_ok if result.seq else exit_no_fit
    mode = ("+activation checkpointing +offload" if inp.offload_activations
            else "+activation checkpointing" if inp.activation_checkpointing else "no checkpointing")
    limits = f"{gpu:g} GiB per device" + (f", {host:g} GiB host per rank" if inp.offload_activations else "")
    if not result.seq:
        print(f"{model_name}: tsp D={inp.degree} {mode}: not even {result.unit} tokens fit {limits} "
              f"({result.limit} memory)")
        return exit_no_fit
    p = result.plan
    print(f"{model_name}: tsp D={inp.degree} batch={inp.batch} {inp.dtype} {mode}: longest sequence within {limits}: "
          f"{result.seq} tokens ({result.seq / 2 ** 20:.2f}M); {result.unit} more would exceed {result.limit} memory")
    print(f"  at {result.seq}: peak {p.peak_bytes_per_rank / _GIB:.2f} GiB per device ({p.peak_phase})"
          + (f", host {p.host_bytes_per_rank / _GIB:.2f} GiB per rank" if inp.offload_activations else ""))
    for line in offload_lines(p):
        print(f"  {line}")
    print("  (ds_tsp.tools.plan's estimate: no CUDA context or allocator slack; leave some)", flush=True)
    return exit_ok
