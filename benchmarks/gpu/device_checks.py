"""Device checks of what landed after first_contact_checks.py: the FLA chunk kernel, offload's streams, the cp ring.

- fla_delta_rule: flash-linear-attention's chunk_gated_delta_rule through ds_tsp's adapter (fla_chunk_transition:
  o_local, q_eff, M, U from one call) against the pure-torch chunk kernel in float64, forward and backward (the
  gradients of q, k, v, g, beta under one random projection of the four outputs), in bf16 and fp16, rows with
  packed documents (starts at offset 0, mid-chunk, at the chunk's end) and without; the float32 torch kernel
  against float64 as the fp32 tolerance. CUDA host syncs inside the FLA call are counted
  (torch.cuda.set_sync_debug_mode("warn")): ds_tsp passes FLA the host copy of cu_seqlens, so none are expected
  from ds_tsp's side (FLA's own, if any, are reported).
- offload_overlap: a checkpointed step with activation offload against the same step without, on one GPU: the
  step-time overhead against the time the copies take alone (copy time hidden = 1 - overhead / copy time), the
  host pool's bytes against `ds-tsp plan --offload-activations` after steps of varying length (the longest
  counts), every buffer page-locked, loss and gradients equal.
- cp_ring: `ds-tsp verify`'s cp case (C TSP groups sharing each sequence: the cp ring's batched hops) on 2 and 4
  processes against the single-device reference: one GPU per process when there are enough, else every process
  on the one GPU with NCCL where it allows that, else gloo on the CPU (said in `backend`).

    python benchmarks/gpu/device_checks.py --out $OUT            # on the GPU machine (a few minutes)
    python benchmarks/gpu/device_checks.py --device cpu --out D  # self-test (the suite runs it): FLA through a
                                                                 # stand-in of its contract, offload's pool on the CPU,
                                                                 # the cp ring on gloo, CUDA-only parts skipped

Prints one JSON line per check and writes results.json to --out as it goes. Exit 0 when no check has ok == False.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

# norm-wise relative errors against the float64 torch kernel (bf16 keeps 8 mantissa bits, fp16 11: the kernel's
# sums over 64-token sub-chunks and the chunk's 128 tokens stay well inside these)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}


# --- FLA ----------------------------------------------------------------------------------------------------------
def _standin_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **_):
    """FLA's documented contract (fla.ops.gated_delta_rule.chunk_gated_delta_rule) as a token-by-token float32
    recurrence: [B, T, H, *] inputs, one initial state [dk, dv] per sequence (cu_seqlens: B == 1, variable
    lengths). For the CPU self-test only: it checks the harness and the adapter, not FLA."""
    assert not use_qk_l2norm_in_kernel
    dtype = q.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist() if cu_seqlens is not None \
        else None
    seqs = [(b, 0, q.shape[1]) for b in range(q.shape[0])] if bounds is None else \
        [(0, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    out = torch.zeros_like(v)
    finals = []
    for n, (b, lo, hi) in enumerate(seqs):
        state = initial_state[n].float().clone()  # [H, dk, dv]
        for t in range(lo, hi):
            state = state * g[b, t].exp()[:, None, None]
            kt, vt = k[b, t], v[b, t]  # [H, dk], [H, dv]
            delta = (vt - torch.einsum("hk,hkv->hv", kt, state)) * beta[b, t][:, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            out[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, state)
        finals.append(state)
    return out.to(dtype), (torch.stack(finals) if output_final_state else None)


def _delta_inputs(B: int, H: int, c: int, dk: int, dv: int, device, seed: int = 0):
    from ds_tsp.core.layers.linear_attention.delta_rule import l2_normalize

    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, H, c, dk, generator=gen, dtype=torch.float64)) * dk ** -0.5
    k = l2_normalize(torch.randn(B, H, c, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(B, H, c, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, H, c, generator=gen, dtype=torch.float64) * 0.2  # log decay <= 0
    beta = torch.rand(B, H, c, generator=gen, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, g, beta)]


def _torch_kernel(inputs, starts, dtype):
    from ds_tsp.core.layers.linear_attention.delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta = (t.to(dtype) for t in inputs)
    B, c = q.shape[0], q.shape[2]
    reset = torch.zeros(B, c, dtype=dtype, device=q.device)
    for row, row_starts in enumerate(starts):
        for s in row_starts:
            reset[row, s] = 1
    return chunk_gated_delta_rule(q, k, v, g, beta, reset=reset if any(starts) else None)


def _outputs_and_grads(run, inputs, weights):
    """The four outputs and the gradients of <outputs, weights> w.r.t. the five inputs, all float64."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = run(leaves)
    total = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(total, leaves)
    return [o.detach().double() for o in outs], [gr.double() for gr in grads]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fla_delta_rule(device: torch.device, B: int = 2, H: int = 4, c: int = 128, dk: int = 64, dv: int = 64) -> dict:
    from ds_tsp.core.layers.linear_attention.delta_rule_fla import _fla_status, fla_chunk_transition

    if device.type == "cuda":
        fn, why = _fla_status()
        if fn is None:
            return {"skipped": why}
        kernel = "fla"
    else:  # the self-test: tiny, the stand-in is a Python loop over tokens
        fn, kernel = _standin_fla, "stand-in (the CPU self-test: FLA's contract, token by token)"
        B, H, c, dk, dv = 2, 2, 24, 8, 8
    inputs = _delta_inputs(B, H, c, dk, dv, device)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
               for shape in ((B, H, c, dv), (B, H, c, dk), (B, H, dk, dk), (B, H, dk, dv))]
    layouts = {"no_documents": ((),) * B, "documents": ((0, c // 3), (c // 2, c - 1))[:B]}
    result = {"kernel": kernel, "shape": {"B": B, "H": H, "chunk": c, "dk": dk, "dv": dv}, "cases": {}}
    ok = True
    for layout, starts in layouts.items():
        want_out, want_grad = _outputs_and_grads(lambda t: _torch_kernel(t, starts, torch.float64), inputs, weights)
        fp32_out, fp32_grad = _outputs_and_grads(lambda t: _torch_kernel(t, starts, torch.float32), inputs, weights)
        fp32 = {"forward": max(map(_rel, fp32_out, want_out)), "backward": max(map(_rel, fp32_grad, want_grad))}
        case = {"torch_float32": fp32}
        ok &= max(fp32.values()) <= TOLERANCE[torch.float32]
        for dtype in (torch.bfloat16, torch.float16):
            def run(t, dtype=dtype):
                q, k, v, g, beta = (x.to(torch.float32) for x in t)
                return fla_chunk_transition(fn, q, k, v, g, beta, starts, dtype)

            syncs = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    got_out, got_grad = _outputs_and_grads(run, inputs, weights)
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
            errs = {"forward": dict(zip(("o_local", "q_eff", "M", "U"), map(_rel, got_out, want_out))),
                    "backward": dict(zip(("q", "k", "v", "g", "beta"), map(_rel, got_grad, want_grad)))}
            worst = max(max(e.values()) for e in errs.values())
            case[str(dtype).replace("torch.", "")] = {**errs, "worst": worst, "tolerance": TOLERANCE[dtype],
                                                      "host_syncs": len(syncs), "first_syncs": syncs[:3]}
            ok &= worst <= TOLERANCE[dtype]
        result["cases"][layout] = case
    return {**result, "ok": bool(ok)}


# --- offload --------------------------------------------------------------------------------------------------------
def offload_overlap(device: torch.device, seq: int = 8192, hidden: int = 4096, layers: int = 6,
                    steps: int = 3) -> dict:
    from dataclasses import replace

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.plan import PlanInput, plan_tsp

    cuda = device.type == "cuda"
    if not cuda:  # the self-test: the same pool and plan on the CPU, tiny, no timing
        seq, hidden, layers, steps = 32, 32, 3, 1
    shape = ModelShape(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                       num_heads=max(1, hidden // 128), num_kv_heads=max(1, hidden // 512))
    dtype = torch.bfloat16 if cuda else torch.float32

    def batch(length: int):
        ids = torch.randint(0, shape.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        return shard_batch(ids.to(device), tsp=1, rank=0, labels=ids.to(device))

    def timed_steps(model, length: int, n: int) -> tuple[float, torch.Tensor]:
        b = batch(length)
        times, loss = [], None
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
            loss.backward()
            if cuda:
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                times.append(time.perf_counter() - t0)
        return min(times), loss.detach().float().cpu()

    result, grads = {"shape": {"seq": seq, "hidden": hidden, "layers": layers, "dtype": str(dtype)}}, {}
    for label, offload in (("kept", False), ("offloaded", True)):
        model = ShardedCausalLM(shape, TSPComm.single(), dtype=dtype, device=device,
                                options=TSPOptions(activation_checkpointing=True, offload_activations=offload))
        model.init_weights_(seed=1)
        if offload:  # varying lengths first: the pool must end at the plan of the longest
            for length in (seq // 2, seq, seq // 4):
                timed_steps(model, length, 1)
            pool = model.activation_offload
            buffers = list(pool._free)  # after the steps every buffer is back in the pool
            result["pool_bytes"], result["pool_buffers"] = pool.host_bytes, len(buffers)
            result["pinned"] = bool(buffers) and all(b.data.is_pinned() for b in buffers) if cuda else None
        if cuda:
            timed_steps(model, seq, 1)  # warm-up (allocator, kernels)
        step_s, loss = timed_steps(model, seq, steps)
        result[f"step_s_{label}"] = step_s
        grads[label] = (loss, {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()})
        del model
    plan = plan_tsp(replace(PlanInput(model=shape, seq=seq, batch=1, dtype="bf16" if cuda else "fp32",
                                      activation_checkpointing=True), offload_activations=True)).host_bytes_per_rank
    (want_loss, want), (got_loss, got) = grads["kept"], grads["offloaded"]
    result.update(plan_bytes=plan, pool_over_plan_bytes=result["pool_bytes"] - plan,
                  loss_equal=bool(torch.equal(got_loss, want_loss)),
                  grad_rel_err=max(_rel(got[n], g) for n, g in want.items()))
    pool_ok = 0 <= result["pool_over_plan_bytes"] <= 2 * 4096 * (layers - 1) and result["pool_buffers"] == layers - 1
    # a copy is exact: on the CPU bit for bit; on CUDA the attention backward's atomics reorder bf16 sums run to run
    grad_tol = 1e-2 if cuda else 0.0
    ok = pool_ok and result["loss_equal"] and result["grad_rel_err"] <= grad_tol
    if cuda:
        # what the copies take alone: each offloaded input out and back, on a side stream, nothing to hide behind
        layer_input = torch.empty(seq, hidden, dtype=dtype, device=device)
        host = torch.empty(layer_input.shape, dtype=dtype, pin_memory=True)
        side = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            for _ in range(layers - 1):
                host.copy_(layer_input, non_blocking=True)
                layer_input.copy_(host, non_blocking=True)
            end.record(side)
        torch.cuda.synchronize(device)
        copy_s = start.elapsed_time(end) / 1e3
        overhead = max(0.0, result["step_s_offloaded"] - result["step_s_kept"])
        result.update(copy_s_alone=copy_s, overhead_s=overhead, copy_hidden=1.0 - min(1.0, overhead / copy_s))
        ok = ok and result["pinned"] and result["copy_hidden"] >= 0.5
    else:
        result["copy_hidden"] = {"skipped": "needs CUDA streams (on the CPU every copy is synchronous)"}
    return {**result, "ok": bool(ok)}


# --- the cp ring ---------------------------------------------------------------------------------------------------
def _cp_rank(rank: int, world: int, port: int, backend: str, local_rank: int, tsp: int, cp: int, seq: int,
             results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        from ds_tsp.core.shape.model_shape import ModelShape
        from ds_tsp.tools.verify import VerifyCase, run_cp_case

        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if backend == "nccl" else None)
        shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2)
        report = run_cp_case(VerifyCase(shape=shape, seq=seq, batch=2, documents=2), tsp, cp,
                             {"timeout_s": 120})
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, "error", f"{type(err).__name__}: {err}"[:600]))


def _spawn_cp(world: int, backend: str, local_ranks: list[int], tsp: int, cp: int, seq: int,
              timeout_s: float) -> dict:
    import multiprocessing as mp
    import queue

    from ds_tsp.core.parallel.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_cp_rank, args=(r, world, port, backend, local_ranks[r], tsp, cp, seq, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            got[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {r: payload for r, (status, payload) in got.items() if status == "error"}
    if errors or len(got) < world:
        return {"error": errors or f"{world - len(got)} rank(s) gave no result within {timeout_s:g} s"}
    return {"report": got[0][1]}


def cp_ring(device: torch.device, seq: int = 32) -> dict:
    cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    out, ok = {}, True
    for tsp, cp in ((1, 2), (2, 2)) if cuda else ((1, 2),):  # the self-test: 2 gloo processes
        world = tsp * cp
        tried = []
        if cuda:
            backend_runs = [("nccl", list(range(world)), f"nccl, one GPU per process ({world} GPUs)")] \
                if gpus >= world else [("nccl", [0] * world, f"nccl, {world} processes on GPU 0")]
        else:
            backend_runs = []
        backend_runs.append(("gloo", [0] * world, "gloo on the CPU"))
        entry = None
        for backend, local_ranks, label in backend_runs:
            run = _spawn_cp(world, backend, local_ranks, tsp, cp, seq, timeout_s=300)
            if "report" in run:
                entry = {"backend": label, **{k: run["report"][k] for k in ("ok", "loss_rel_err", "grad_rel_err")
                                              if k in run["report"]}}
                break
            tried.append({"backend": label, "error": run["error"]})
        if entry is None:
            entry = {"ok": False}
        if tried:
            entry["fell_back_from"] = tried
        out[f"tsp{tsp}_cp{cp}"] = entry
        ok &= bool(entry.get("ok"))
    return {**out, "ok": bool(ok)}


CHECKS = {"fla_delta_rule": fla_delta_rule, "offload_overlap": offload_overlap, "cp_ring": cp_ring}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS))
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.checks.split(","):
        entry = {"check": name, "device": str(device)}
        start = time.perf_counter()
        try:
            entry.update(CHECKS[name](device))
        except Exception as err:  # noqa: BLE001 - one failing check must not lose the others
            entry.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=4), ok=False)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        results.append(entry)
        print(json.dumps(entry), flush=True)
        if out_dir is not None:  # written as it comes: a crash later keeps the earlier checks
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return 1 if any(r.get("ok") is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
