"""`ds-tsp bench --layer-memory --fake --offload-activations`: what offload takes off the device, measured.

A stack of `layers` TSP decoder layers (ShardedCausalLM with the --layer-memory shape, a small vocabulary so the LM
head does not dominate) runs one training step with activation checkpointing, once keeping the checkpointed layer
inputs on the device and once offloading them (TSPOptions.offload_activations: the production path,
ds_tsp.core.activation_offload), under MemTracker. The offload pool is put on the meta device for the measurement
(ActivationOffload(host_device="meta")), so MemTracker reports the device (here: the CPU, fake) and the host pool
apart. The step's one input check (a value read, which fake tensors cannot answer) is skipped. Per rank:
  device_peak        MemTracker's peak on the device, without and with offload; their difference is what offload
                     took off the device at the peak;
  host_peak          the pool's peak (every offloaded layer input);
  device_held_inputs layer inputs still on the device at the peak with offload: layers - drop / one input;
and the plan (ds_tsp.tools.plan.plan_tsp) for the same shape: its peak drop and host bytes per rank. On a CPU (or
fake) device every copy is synchronous, so between layers nothing is in flight: the measured device-held count is
what the schedule keeps (the last layer's input, and the one in use and the one prefetched in backward); the plan
counts at most two.
"""
from __future__ import annotations

from dataclasses import asdict, replace

from ds_tsp.tools.cli_types import MIB

OFFLOAD_VOCAB = 512


def _device_total(snap: dict, device_type: str) -> int:
    return sum(int(v) for dev, cats in snap.items() if getattr(dev, "type", str(dev)) == device_type
               for k, v in cats.items() if getattr(k, "value", k) == "Total")


def measure_offload_rank(cfg, layers: int) -> dict:
    """This rank's peaks without and with offload (a process group over cfg.tsp ranks is up, fake or gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from ds_tsp.core.activation_offload import ActivationOffload
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.tokens.zigzag import zigzag_positions
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.tools.bench.layer_memory import DTYPES

    comm = TSPComm(dist.group.WORLD)
    dtype = getattr(torch, DTYPES[cfg.dtype])
    shape = replace(cfg.shape, num_layers=layers, vocab_size=OFFLOAD_VOCAB)
    L = cfg.seq // cfg.tsp
    out = {"rank": comm.rank}
    for offload in (False, True):
        model = ShardedCausalLM(shape, comm, dtype=dtype, device="cpu",
                                options=TSPOptions(activation_checkpointing=True, offload_activations=offload))
        model.activation_offload = ActivationOffload(host_device="meta")
        # the input check reads values once per step (fake tensors have none); what it validates is not measured
        model._check_inputs = lambda ids, labels, positions, mask: ((labels != -100).sum(), None)
        ids = torch.zeros(cfg.batch, L, dtype=torch.long)
        positions = zigzag_positions(cfg.seq, cfg.tsp, comm.rank).expand(cfg.batch, L)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(ids, ids, positions).backward()
        peak = tracker.get_tracker_snapshot("peak")
        key = "offload" if offload else "on_device"
        out[key] = {"device_peak": _device_total(peak, "cpu"), "host_peak": _device_total(peak, "meta"),
                    "host_pool_bytes": model.activation_offload.host_bytes}
        del model, tracker
    x = cfg.batch * L * cfg.hidden * cfg.dtype_bytes
    drop = out["on_device"]["device_peak"] - out["offload"]["device_peak"]
    out.update(layer_input_bytes=x, device_peak_drop=drop, device_held_inputs=layers - drop / x)
    return out


def plan_offload(cfg, layers: int) -> dict:
    from ds_tsp.tools.plan import PlanInput, plan_tsp

    shape = replace(cfg.shape, num_layers=layers, vocab_size=OFFLOAD_VOCAB)
    inp = PlanInput(model=shape, seq=cfg.seq, batch=cfg.batch, degree=cfg.tsp, dtype=cfg.dtype,
                    activation_checkpointing=True)
    kept, off = plan_tsp(inp), plan_tsp(replace(inp, offload_activations=True))
    return {"device_peak_drop": kept.peak_bytes_per_rank - off.peak_bytes_per_rank,
            "host_bytes_per_rank": off.host_bytes_per_rank,
            "device_held_inputs": off.offload["device_held_layer_inputs"]}


def run_fake_offload(cfg, layers: int) -> list[dict]:
    """Each rank in turn as one rank of a fake process group under FakeTensorMode (see layer_memory.run_fake)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("--fake needs a process without a process group (it starts one fake group per rank)")
    out = []
    for rank in range(cfg.tsp):
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=cfg.tsp)
        try:
            with FakeTensorMode():
                out.append(measure_offload_rank(cfg, layers))
        finally:
            dist.destroy_process_group()
    return out


def measure_offload(cfg, layers: int) -> dict:
    """The whole report: per-rank measurements (fake), the plan, and the worst rank's ratios."""
    cfg.check()
    if layers < 2:
        raise ValueError(f"--layers {layers}: offload needs at least 2 layers (the last one's input is kept)")
    if not cfg.fake:
        raise ValueError("--offload-activations: measured with --fake (FakeTensorMode) only")
    ranks = run_fake_offload(cfg, layers)
    plan = plan_offload(cfg, layers)
    worst = min(ranks, key=lambda r: r["device_peak_drop"])
    return {"mode": "offload_memory", "source": "fake (FakeTensorMode + fake process group)", "config": asdict(cfg),
            "layers": layers, "ranks": ranks, "plan": plan,
            "drop_over_plan": worst["device_peak_drop"] / plan["device_peak_drop"],
            "host_over_plan": max(r["offload"]["host_peak"] for r in ranks) / plan["host_bytes_per_rank"]}


def markdown(result: dict) -> str:
    cfg, plan = result["config"], result["plan"]
    lines = ["# ds-tsp bench --layer-memory --fake --offload-activations", "",
             f"{result['layers']} TSP decoder layers (hidden {cfg['hidden']}, heads {cfg['heads']}/"
             f"{cfg['kv_heads'] or cfg['heads']} kv, MLP {cfg['ffn']}), S={cfg['seq']}, D={cfg['tsp']}, batch "
             f"{cfg['batch']}, {cfg['dtype']}, activation checkpointing; one step without and with offload. "
             f"Numbers from: {result['source']}.", "",
             "| rank | device peak, inputs kept MiB | device peak, offloaded MiB | drop MiB | host pool MiB | "
             "layer inputs left on the device |", "|---:|---:|---:|---:|---:|---:|"]
    for r in result["ranks"]:
        lines.append(f"| {r['rank']} | {r['on_device']['device_peak'] / MIB:.2f} | "
                     f"{r['offload']['device_peak'] / MIB:.2f} | {r['device_peak_drop'] / MIB:.2f} | "
                     f"{r['offload']['host_peak'] / MIB:.2f} | {r['device_held_inputs']:.2f} |")
    lines += ["", f"Plan (ds_tsp.tools.plan.plan_tsp): drop {plan['device_peak_drop'] / MIB:.2f} MiB, host "
              f"{plan['host_bytes_per_rank'] / MIB:.2f} MiB per rank, at most {plan['device_held_inputs']} layer "
              f"inputs on the device. Measured / plan: drop {result['drop_over_plan']:.3f}, host "
              f"{result['host_over_plan']:.3f}.", ""]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> dict[str, str]:
    from ds_tsp.tools.bench.layer_memory import write_results

    return write_results(result, out_dir, "offload_memory", markdown(result))
