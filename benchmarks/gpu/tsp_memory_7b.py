"""One-GPU check for a lent H200: per-rank peak CUDA memory of TSP vs PyTorch TP+SP at a Zyphra-like 7B shape
(h=4096, 32 heads MHA, SwiGLU 11008, 32 layers, bf16 on CUDA) for S=16K and 128K at D=8, and flash-attn time of one rank's
zigzag attention.

    python benchmarks/gpu/tsp_memory_7b.py --out $OUT          # on the GPU machine, < 8 minutes
    python benchmarks/gpu/tsp_memory_7b.py --device cpu --tiny  # self-test of the script on CPU (CI)

How: one process is TSP rank 0 of a D=8 group through torch's fake process group (FakeStore): collectives move
no data, but every buffer a rank would hold is allocated, so torch.cuda.max_memory_allocated is that rank's peak.
TP+SP is HF Llama parallelised with DTensor on the same fake mesh. Ulysses (+ZeRO-3) is not runnable on a fake
group (DeepSpeed's engine needs real peers): its figure is `ds-tsp plan`'s, labelled so. Prints one JSON line per
measurement and writes results.json to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tsp.core.shape.model_shape import ModelShape

ZYPHRA_7B = ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32)
TINY = ModelShape(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=8)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _simulated_peers_comm(group):
    """A TSPComm on the fake group whose input-check all-gather returns what EVERY simulated rank would send.

    The fake backend moves no data, so every slot of a gather would hold this rank's own payload: the model would
    see each chunk's positions restart and silently run document-masked attention (the causal prefix never runs).
    Every other gather (K/V, weights) only needs its buffers allocated, which the fake backend does.
    """
    from ds_tsp.core.comm.communicator import TSPComm

    class SimulatedPeersComm(TSPComm):
        peer_payloads: torch.Tensor | None = None  # [D, payload] int64, what each rank's input check sends

        def all_gather(self, out, local, what=None):
            handle = super().all_gather(out, local, what)
            peers = self.peer_payloads
            if peers is not None and out.dtype == peers.dtype and out.numel() == peers.numel():
                handle.wait()
                out.view(peers.shape).copy_(peers)
            return handle

    # timeout_s=None: no watchdog, no poller. The fake backend's works never report is_completed(), so a poller
    # would keep every CUDA collective of the run in its list, re-scan it every poll, and report a false stall
    # timeout_s after the first wait.
    return SimulatedPeersComm(group, timeout_s=None)


def tsp_peak(shape: ModelShape, seq: int, tsp: int, device, dtype, options) -> dict:
    """Rank 0's peak over one training step (after a warm-up step, so optimizer state exists) and that step's time."""
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    _reset_peak(device)
    comm = _simulated_peers_comm(dist.group.WORLD)
    model = ShardedCausalLM(shape, comm, options=options, dtype=dtype, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, shape.vocab_size, (1, seq), device=device)
    shards = [shard_batch(ids, tsp=tsp, rank=r) for r in range(tsp)]  # every simulated rank holds a real shard
    comm.peer_payloads = torch.stack([model.input_check_payload(b["input_ids"], b["shift_labels"], b["position_ids"],
                                                                None) for b in shards])
    batch = shards[0]
    document_starts = []
    check_inputs = model._check_inputs

    def watched_check(*args):
        total, starts = check_inputs(*args)
        document_starts.append(starts)
        return total, starts

    model._check_inputs = watched_check

    def step() -> None:
        model(batch["input_ids"], batch["shift_labels"], batch["position_ids"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: allocator, kernels' first launch, optimizer state
    _reset_peak(device)
    start = time.perf_counter()
    step()
    result = {"peak_bytes_per_rank": _peak(device), "step_s_no_comm": time.perf_counter() - start,
              "document_masking": any(s is not None for s in document_starts),
              "comm_timeout_s": comm.timeout_s}  # None: no stall poller on the fake group
    if result["document_masking"]:
        raise RuntimeError("the simulated step ran document-masked attention: the peers' input-check payloads did "
                           "not reach the model, so this is not the causal step being measured")
    return result


def tp_sp_peak(shape: ModelShape, seq: int, tsp: int, device, dtype) -> dict:
    """Rank 0's TP+SP peak over one training step after a warm-up step, measured as tsp_peak measures TSP.

    The model is built on the meta device in `dtype` and parallelized there; only then are this rank's shards
    materialized on `device`, and the peak is reset before the measured step. Built on the GPU instead, the fp32
    model (27 GB at 7B) and its bf16 copy would be counted as a "training" peak. `phases` records the order.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_tsp.tools.bench.dtensor_tp_sp import parallelize

    phases = []
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         max_position_embeddings=seq, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    phases.append(f"built:{next(model.parameters()).device.type}")
    parallelize(model, init_device_mesh(device.type, (tsp,)))
    phases.append("parallelized")
    _materialize(model, config, device)
    phases.append("materialized")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, shape.vocab_size, (1, seq), device=device)
    positions = torch.arange(seq, device=device)[None]  # the embedding output is sequence-sharded

    def step() -> None:
        logits = model.lm_head(model.model(input_ids=ids, position_ids=positions).last_hidden_state)
        with loss_parallel():
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        del logits
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: allocator, kernels' first launch, optimizer state (as tsp_peak)
    phases.append("warm-up")
    _reset_peak(device)
    phases.append("peak reset")
    start = time.perf_counter()
    step()
    phases.append("step")
    result = {"peak_bytes_per_rank": _peak(device), "step_s_no_comm": time.perf_counter() - start, "phases": phases}
    del model, opt
    return result


def _materialize(model, config, device) -> None:
    """Give a meta-built, parallelized HF Llama real storage on `device` (each rank its shards only) and values:
    N(0, 0.02) weights, unit norms, and RoPE tables computed afresh (buffers, which to_empty leaves undefined)."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.fill_(1.0) if "norm" in name else local.normal_(0.0, 0.02)
        with torch.device(device):
            model.model.rotary_emb = type(model.model.rotary_emb)(config)


def zigzag_kernel_time(shape: ModelShape, seq: int, tsp: int, device, dtype, repeats: int = 3) -> dict:
    """Forward+backward time of one head block's attention for the two zigzag chunks of ranks 0 and D-1."""
    from ds_tsp.core.layers.attention import kernels

    c, heads, d = seq // (2 * tsp), shape.num_heads // tsp, shape.dim_per_head
    times = {}
    for rank in (0, tsp - 1):
        chunks = (rank, 2 * tsp - 1 - rank)
        k = torch.randn(1, seq, max(shape.num_kv_heads // tsp, 1), d, device=device, dtype=dtype)
        q = torch.randn(1, c, heads, d, device=device, dtype=dtype)
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for g in chunks:
                end = (g + 1) * c
                out, lse = kernels.attention_forward(q, k[:, :end], k[:, :end], q_start=g * c, scale=d ** -0.5)
                kernels.attention_backward(out, q, k[:, :end], k[:, :end], out, lse, q_start=g * c, scale=d ** -0.5)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        times[f"rank{rank}_s"] = best
    times["backend"] = kernels.select_backend(device, dtype, head_dim=d)
    return times


def plan_figures(shape: ModelShape, seq: int, tsp: int) -> dict:
    from ds_tsp.tools.plan import PlanInput, plan_layouts

    plans = plan_layouts(PlanInput(model=shape, seq=seq, degree=tsp, dtype="bf16"), ["tsp", "tp_sp", "ulysses"])
    return {p.layout: p.peak_bytes_per_rank for p in plans}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tsp", type=int, default=8)
    p.add_argument("--seqs", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--tiny", action="store_true", help="tiny model and sequences: a CPU self-test")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ds_tsp.core.config import TSPOptions

    shape, seqs = (TINY, [256]) if args.tiny else (ZYPHRA_7B, args.seqs)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 GEMMs are slow
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tsp)
    results = []
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    def record(entry: dict) -> None:
        # Written as it comes: a case that crashes the process later does not take the earlier ones with it.
        results.append(entry)
        print(json.dumps(entry), flush=True)
        if out_dir is not None:
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))

    def attempt(entry: dict, run) -> None:
        try:
            entry.update(run())
        except torch.OutOfMemoryError as err:
            entry.update(error=f"out of memory: {str(err).splitlines()[0]}")
        except Exception as err:  # one failing case must not lose the others: recorded, and the run goes on
            entry.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=4))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record(entry)

    for seq in seqs:
        planned = plan_figures(shape, seq, args.tsp)
        runs = [("tsp", lambda: tsp_peak(shape, seq, args.tsp, device, dtype, TSPOptions())),
                ("tsp_checkpointed", lambda: tsp_peak(shape, seq, args.tsp, device, dtype,
                                                      TSPOptions(activation_checkpointing=True))),
                ("tp_sp", lambda: tp_sp_peak(shape, seq, args.tsp, device, dtype))]
        for layout, run in runs:
            attempt({"layout": layout, "seq": seq, "tsp": args.tsp,
                     "planned_peak_bytes": planned.get(layout.removesuffix("_checkpointed"))}, run)
        record({"layout": "ulysses_zero3", "seq": seq, "tsp": args.tsp, "planned_peak_bytes": planned["ulysses"],
                "source": "ds-tsp plan (not measured: needs real peers)"})
        attempt({"kernel": "zigzag attention, one head block", "seq": seq, "tsp": args.tsp},
                lambda: zigzag_kernel_time(shape, seq, args.tsp, device, dtype))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
