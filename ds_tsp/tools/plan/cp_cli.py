"""`ds-tsp plan --cp C` (TSP inside each node, a cp ring across nodes) and `ds-tsp plan --recommend --cp auto`
(pick D and C for a node size, a device count and a sequence): ds_tsp.tools.plan.tsp_cp's numbers, printed."""
from __future__ import annotations

import argparse
import json
_GIB = 2 ** 30


def _gbps(args, usage_error) -> float:
    try:
        value = float(args.inter_node_gbps)
    except ValueError:
        raise usage_error("--inter-node-gbps", f"{args.inter_node_gbps!r} is not a number; e.g. 400") from None
    if not value > 0:
        raise usage_error("--inter-node-gbps", f"{value} must be > 0")
    return value


def cp_lines(plan) -> list[str]:
    """The cp ring's lines: memory per rank, inter- vs intra-node bytes, ring seconds vs the attention they hide."""
    cp = plan.cp
    hidden = cp["cp_ring_seconds_per_step"] <= cp["overlapped_attention_seconds_per_step"]
    return [
        f"D={cp['tsp']} (TSP inside a node) x C={cp['cp']} (cp ring across nodes): seq {cp['seq_padded']}, "
        f"{cp['tokens_per_rank']} tokens per rank; peak {plan.peak_bytes_per_rank / _GIB:.2f} GiB per rank"
        + (f", host {plan.host_bytes_per_rank / _GIB:.2f} GiB per rank (offloaded layer inputs)"
           if plan.host_bytes_per_rank else ""),
        f"per step and rank: inter-node (cp axis) {cp['inter_node_bytes_per_step'] / _GIB:.1f} GiB, intra-node (TSP) "
        f"{cp['intra_node_bytes_per_step'] / _GIB:.1f} GiB, grad sync over dp x cp "
        f"{cp['grad_sync_bytes_per_step'] / _GIB:.2f} GiB",
        f"cp ring at {cp['inter_node_gbps']:g} Gb/s per GPU: {cp['cp_ring_seconds_per_step']:.1f} s per step vs "
        f"{cp['overlapped_attention_seconds_per_step']:.1f} s of the attention it overlaps at {cp['gpu_tflops']:g} "
        f"TFLOP/s (per hop {cp['hop_seconds'] * 1e3:.1f} ms vs {cp['hop_attention_seconds'] * 1e3:.1f} ms): "
        + ("hidden behind attention" if hidden else "NOT hidden: the ring stalls the step"),
    ]


def run_cp(args: argparse.Namespace, plan_input, usage_error, or_usage_error, rates, exit_ok: int,
           exit_no_fit: int) -> int:
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp, recommend_tsp_cp

    def build():
        if args.layout and [n for n in args.layout if n.strip().lower() != "tsp"]:
            raise usage_error("--layout", "--cp plans TSP with a cp ring (layout tsp_cp) only; drop --layout")
        inp, model_name = plan_input(args)
        kw = {"inter_node_gbps": _gbps(args, usage_error), **rates(args)}
        if args.recommend:
            if args.gpu_mem_gib is None or args.devices is None:
                raise usage_error("--gpu-mem-gib" if args.gpu_mem_gib is None else "--devices",
                                  "--recommend --cp auto needs --gpu-mem-gib G and --devices N")
            try:
                gpu_mem = float(args.gpu_mem_gib) * _GIB
            except ValueError:
                raise usage_error("--gpu-mem-gib", f"{args.gpu_mem_gib!r} is not a number; e.g. 141") from None
            devices = int(str(args.devices)) if str(args.devices).isdigit() else 0
            if devices < 1:
                raise usage_error("--devices", f"{args.devices!r} is not an integer >= 1; e.g. --devices 32")
            gpus_per_node = kw.pop("gpus_per_node")
            choice, tried = recommend_tsp_cp(inp, devices=devices, gpu_mem_bytes=int(gpu_mem),
                                             gpus_per_node=gpus_per_node, **kw)
            return "recommend", (choice, tried, gpu_mem), inp, model_name
        if str(args.cp).strip().lower() == "auto":
            raise usage_error("--cp", "--cp auto picks D and C with --recommend; otherwise give --cp C")
        cp = _int_flag(args.cp, "--cp", usage_error)
        return "plan", plan_tsp_cp(inp, cp, **kw), inp, model_name

    built, failed = or_usage_error(build)
    if failed is not None:
        return failed
    kind, result, inp, model_name = built
    if kind == "plan":
        if args.json:
            print(json.dumps({**result.to_dict(), "model": model_name, "input": inp.to_dict()}), flush=True)
        else:
            print(f"{model_name}: seq={inp.seq} batch={inp.batch} D={inp.degree} dp={inp.dp} {inp.dtype}"
                  f"{' +AC' if inp.activation_checkpointing else ''}{' +offload' if inp.offload_activations else ''}")
            for line in cp_lines(result) + [f"  {n}" for n in result.notes]:
                print(line, flush=True)
        return exit_ok
    choice, tried, gpu_mem = result
    if args.json:
        print(json.dumps({"choice": None if choice is None else {"tsp": choice[0], "cp": choice[1]},
                          "tried": [{"tsp": d, "cp": c, **({"peak_bytes_per_rank": p.peak_bytes_per_rank,
                                                             "cp_summary": p.cp} if not isinstance(p, str)
                                                            else {"error": p})} for d, c, p in tried],
                          "model": model_name, "input": inp.to_dict()}), flush=True)
    else:
        print(f"{model_name}: seq={inp.seq} batch={inp.batch} {inp.dtype} | {args.devices} devices x "
              f"{gpu_mem / _GIB:g} GiB, {args.gpus_per_node} per node")
        for d, c, p in tried:
            verdict = p if isinstance(p, str) else (f"peak {p.peak_bytes_per_rank / _GIB:.2f} GiB: "
                                                   + ("fits" if p.peak_bytes_per_rank <= gpu_mem else "too big"))
            print(f"  D={d} C={c}: {verdict}")
        if choice is None:
            print("no D x C fits: more devices, activation checkpointing (+ offload) or a shorter sequence")
        else:
            plan = next(p for d, c, p in tried if (d, c) == choice)
            dp = int(args.devices) // (choice[0] * choice[1])
            print(f'recommended: "tsp": {{"size": {choice[0]}, "cp_size": {choice[1]}}} (data-parallel degree {dp})')
            for line in cp_lines(plan):
                print(f"  {line}", flush=True)
    return exit_ok if choice is not None else exit_no_fit


def _int_flag(text, flag: str, usage_error) -> int:
    s = str(text).strip()
    if not s.isdigit() or int(s) < 1:
        raise usage_error(flag, f"{text!r} is not an integer >= 1; e.g. {flag} 4")
    return int(s)
