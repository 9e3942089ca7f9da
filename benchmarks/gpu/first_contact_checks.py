"""One-GPU checks of GPU first contact that the CPU cannot prove (one process, a 1-rank "cpu:gloo,cuda:nccl" group, < 1 min):

- poller_memory: what a collective's output costs after its last Python reference is gone while the GPU has not
  run it yet, with the stall watchdog (timeout_s set: its poller watches the work) and without (timeout_s=None).
  Equal is right: the poller must hold a CUDA event, never the WorkNCCL (which keeps its outputs).
- nccl_timeout_margin: the timeout every group build_runtime creates gets, against the tsp block's timeout_s.
  On NCCL it must be longer (ds_tsp's one-line report first, NCCL's abort as the backstop).
- offload_pool: activation offload's host pool page-locked at exact sizes and equal to the plan (R3-2), the step
  equal to the one without offload.
- moe_autocast: a 2-layer MoE step (fp32 weights) under bf16 autocast, per dispatch, against the fp32 step with the
  experts each token is routed to held at the fp32 step's choice (bf16 router logits can flip a near-tie top-k, and a
  flipped token moves a tiny expert's gradient past any tolerance: that is routing, not a defect); the flips of the
  free bf16 routing are reported beside it.

    python benchmarks/gpu/first_contact_checks.py --out $OUT   # on the GPU machine
    python benchmarks/gpu/first_contact_checks.py --device cpu  # self-test (CI): the MoE check runs, CUDA ones skip

Prints one JSON line per check and writes results.json to --out. Exit 0 when no check has ok == False.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 2 ** 20


def poller_memory(device: torch.device, n: int = 8, mib: int = 64) -> dict:
    from ds_tsp.core.comm.communicator import TSPComm

    if device.type != "cuda":
        return {"skipped": "needs CUDA (CPU works are never polled)"}
    numel = mib * MIB // 4
    held = {}
    for label, timeout_s in (("with_poller", 600.0), ("without_poller", None)):
        comm = TSPComm(dist.group.WORLD, timeout_s=timeout_s)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued first: the collectives stay in flight after wait()
        for _ in range(n):
            out, local = torch.empty(numel, device=device), torch.ones(numel, device=device)
            # a 1-rank TSPComm posts nothing itself: post the NCCL work and give it the path every collective takes
            work = dist.all_gather_into_tensor(out, local, group=comm.group, async_op=True)
            comm._started([work], (out, local), "all_gather", ("group",), "first-contact check").wait()
            del out, local, work
        in_flight = torch.cuda.memory_allocated(device) - base
        torch.cuda.synchronize()
        time.sleep(0.2)  # past a poll round
        held[label] = {"in_flight_bytes": in_flight, "after_sync_bytes": torch.cuda.memory_allocated(device) - base}
    extra = held["with_poller"]["in_flight_bytes"] - held["without_poller"]["in_flight_bytes"]
    return {**held, "extra_bytes_with_poller": extra, "collectives": n, "bytes_each": numel * 4,
            "ok": extra < numel * 4}


def nccl_timeout_margin(device: torch.device, timeout_s: int = 5) -> dict:
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime

    created, new_group = [], dist.new_group

    def spy(*args, **kwargs):
        created.append(kwargs.get("timeout"))
        return new_group(*args, **kwargs)

    dist.new_group = spy
    try:
        runtime = build_runtime(parse_tsp_config({"size": 1, "timeout_s": timeout_s}))
    finally:
        dist.new_group = new_group
    seconds = [None if t is None else t.total_seconds() for t in created]
    result = {"timeout_s": timeout_s, "backend": dist.get_backend_config(), "group_timeouts_s": seconds}
    try:  # the timeout the NCCL backend itself holds (torch-internal: informative only)
        backend = runtime.groups.tsp_group._get_backend(torch.device("cuda"))
        result["nccl_backend_timeout_s"] = backend.options._timeout.total_seconds()
    except Exception as err:  # noqa: BLE001 - no NCCL backend (CPU), or the internals moved
        result["nccl_backend_timeout_s"] = f"unavailable: {type(err).__name__}"
    if device.type == "cuda":
        result["ok"] = bool(seconds) and all(s is not None and s > timeout_s for s in seconds)
    return result


def moe_autocast(device: torch.device) -> dict:
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.verify import TOLERANCE

    shape = ModelShape(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ids = torch.randint(0, shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    batch = shard_batch(ids, tsp=1, rank=0, labels=ids)
    tolerance = TOLERANCE["bfloat16"]
    result = {"tolerance": tolerance}
    routing = _FrozenRouting()
    for dispatch in ("ring", "all_to_all"):
        model = ShardedCausalLM(shape, TSPComm.single(), options=TSPOptions(moe_dispatch=dispatch),
                                dtype=torch.float32, device=device).init_weights_(seed=1)

        def step(autocast: bool, mode: str):
            model.zero_grad(set_to_none=True)
            with routing.mode(mode), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
            loss.backward()
            return loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

        try:
            want, want_grads = step(False, "record")
            got, got_grads = step(True, "replay")
            step(True, "compare")  # free bf16 routing: only its flips are reported
        except Exception as err:  # noqa: BLE001 - recorded: the MoE autocast dtype error is what this looks for
            result[dispatch] = {"error": f"{type(err).__name__}: {err}"[:500], "ok": False}
            continue
        grad_err = max(float((got_grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in want_grads.items())
        loss_err = float((got - want).abs() / want.abs())
        result[dispatch] = {"loss_rel_err": loss_err, "grad_rel_err": grad_err, "routing": "held at fp32's choice",
                            "free_bf16_routing_flips": routing.flips,
                            "ok": loss_err <= tolerance and grad_err <= tolerance}
    result["ok"] = all(result[d]["ok"] for d in ("ring", "all_to_all"))
    return result


class _FrozenRouting:
    """Wraps the MoE layer's `route`: "record" keeps each call's expert ids (the fp32 step), "replay" routes every
    token to the recorded experts with the weights of its own logits at those experts (softmax top-k, renormalised
    as the model does), "compare" routes freely and counts the tokens whose experts differ from the recorded ones."""

    def __init__(self):
        self._mode, self._recorded, self._calls, self.flips = "off", [], 0, 0

    def mode(self, mode: str):
        import contextlib

        from ds_tsp.core.layers.moe import layer as moe_layer

        @contextlib.contextmanager
        def active():
            real = moe_layer.route
            self._mode, self._calls = mode, 0
            if mode == "record":
                self._recorded = []
            if mode == "compare":
                self.flips = 0

            def route(x2d, router_weight, top_k, norm_topk_prob, router_bias=None, routing="softmax_topk"):
                logits, top_w, top_i = real(x2d, router_weight, top_k, norm_topk_prob, router_bias, routing)
                if self._mode == "record":
                    self._recorded.append(top_i.detach())
                    return logits, top_w, top_i
                held = self._recorded[self._calls % len(self._recorded)]
                self._calls += 1
                if self._mode == "compare":
                    self.flips += int((top_i.sort(-1).values != held.sort(-1).values).any(-1).sum())
                    return logits, top_w, top_i
                if routing != "softmax_topk":
                    raise ValueError(f"routing {routing!r}: only softmax_topk is replayed")
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, held)
                if norm_topk_prob:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                return logits, weights.to(logits.dtype), held

            moe_layer.route = route
            try:
                yield
            finally:
                moe_layer.route, self._mode = real, "off"

        return active()


def offload_pool(device: torch.device, seq: int = 2500, hidden: int = 5120) -> dict:
    """R3-2 on the device: a 3-layer step with offloaded layer inputs [1, seq, hidden] fp32 (not a power-of-two
    size): every pool buffer is page-locked (cudaHostRegister reports as pinned), the pool holds what
    `ds-tsp plan --offload-activations` counts (plus at most two pages per buffer; torch's pinned allocator would
    have rounded each 48.8 MiB input up to 64 MiB), and the loss and gradients equal the step without offload."""
    from dataclasses import replace

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.plan import PlanInput, plan_tsp

    if device.type != "cuda":
        return {"skipped": "needs CUDA (the pool is page-locked for CUDA inputs only)"}
    shape = ModelShape(vocab_size=256, hidden_size=hidden, intermediate_size=512, num_layers=3, num_heads=40,
                       num_kv_heads=8)
    ids = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = shard_batch(ids, tsp=1, rank=0, labels=ids)
    result = {}
    for label, offload in (("kept", False), ("offloaded", True)):
        model = ShardedCausalLM(shape, TSPComm.single(), dtype=torch.float32, device=device,
                                options=TSPOptions(activation_checkpointing=True, offload_activations=offload))
        model.init_weights_(seed=1)
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        if offload:
            pool = model.activation_offload
            result["pinned"] = all(h.is_pinned() for h in pool.host_in_use())
            result["pool_bytes"] = pool.host_bytes
        loss.backward()
        torch.cuda.synchronize()
        result[label] = (loss.detach().float().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()})
        del model, loss
    plan = plan_tsp(replace(PlanInput(model=shape, seq=seq, batch=1, dtype="fp32", activation_checkpointing=True),
                            offload_activations=True)).host_bytes_per_rank
    (want_loss, want), (got_loss, got) = result.pop("kept"), result.pop("offloaded")
    grad_err = max(float((got[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in want.items())
    over = result["pool_bytes"] - plan
    return {**result, "plan_bytes": plan, "pool_over_plan_bytes": over, "loss_equal": bool(got_loss == want_loss),
            "grad_rel_err": grad_err,
            "ok": result["pinned"] and 0 <= over <= 2 * 4096 * (shape.num_layers - 1) and grad_err <= 1e-5}


CHECKS = {"poller_memory": poller_memory, "nccl_timeout_margin": nccl_timeout_margin, "moe_autocast": moe_autocast,
          "offload_pool": offload_pool}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from ds_tsp.core.parallel.launch import default_backend, local_device

    local_device()  # the GPU made current before the group is built (init_from_env's rule)
    # one rank: an in-process store, no TCP port to race other processes for
    dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=600))
    device = local_device() if args.device == "cuda" else torch.device(args.device)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name, check in CHECKS.items():
        entry = {"check": name, "device": str(device)}
        try:
            entry.update(check(device))
        except Exception as err:  # noqa: BLE001 - one failing check must not lose the others
            entry.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=4), ok=False)
        results.append(entry)
        print(json.dumps(entry), flush=True)
        if out_dir is not None:  # written as it comes: a crash later keeps the earlier checks
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 1 if any(r.get("ok") is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
