"""Train a small Llama-style TSP model on CPU and show that it learns and that each rank holds 1/D of it.

    python examples/demo_train.py                              # starts --tsp gloo processes itself (on the CPU)
    torchrun --standalone --nproc_per_node 2 examples/demo_train.py   # the whole world is one TSP group

Every rank builds the same global batch from a deterministic synthetic task (random token patterns, each repeated
to fill the sequence: a model that memorises the patterns predicts almost every token) and keeps its zigzag shard.
Weights come from the single-device reference's deterministic init, so every rank takes its shards of one model.
Output (rank 0, JSON lines): a config line, {"step", "loss"} per step (the full loss over all ranks), one
{"memory": ...} line per rank with the peak breakdown of one tracked training step (MemTracker, MiB), and a summary.
Exit code 0 only when the loss decreased (1 if not, 2 on bad arguments).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from ds_tsp import (
    ModelShape,
    ShardedCausalLM,
    TSPComm,
    TSPConfigError,
    init_from_env,
    local_device,
    run_on_local_ranks,
    shard_batch,
)
from ds_tsp.testing import ReferenceCausalLM, RepeatingPatterns, full_state_dict, init_weights_

MIB = 2 ** 20
# MemTracker's category names -> the short names printed here.
MEMORY_KINDS = {"Parameter": "PARAM", "Gradient": "GRAD", "Optstate": "OPT", "Activation": "ACT", "Temp": "TEMP"}


@dataclass(frozen=True)
class DemoConfig:
    tsp: int = 2
    steps: int = 30
    seq: int = 128
    batch: int = 4
    lr: float = 3e-3
    seed: int = 0
    num_patterns: int = 8
    alphabet: int = 64  # patterns use this many distinct tokens out of the vocab
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 172

    @property
    def shape(self) -> ModelShape:
        return ModelShape(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                          num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads)


def global_batch(cfg: DemoConfig, data: RepeatingPatterns, step: int) -> torch.Tensor:
    """input_ids [batch, seq] for `step`: samples step*batch .. of the dataset. Same on every rank."""
    return torch.stack([data[step * cfg.batch + i]["input_ids"] for i in range(cfg.batch)])


def peak_memory_mib(tracker: MemTracker, device: torch.device) -> dict[str, float]:
    """Peak snapshot of the tracked step on this rank's device, by category, in MiB (plus the total)."""
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = next((v for dev, v in snapshot.items() if torch.device(dev).type == device.type), {})
    out = {short: round(per_device.get(kind, 0) / MIB, 3) for kind, short in MEMORY_KINDS.items()}
    out["total"] = round(per_device.get("Total", 0) / MIB, 3)
    return out


def train(cfg: DemoConfig) -> dict:
    """Body of every rank (the default process group is already up). Prints on rank 0; returns the summary."""
    world = dist.get_world_size()
    comm = TSPComm(dist.group.WORLD if world > 1 else None)
    shape = cfg.shape
    device = local_device()  # this rank's GPU under a launcher on a GPU node, else (also spawned ranks) the CPU

    reference = ReferenceCausalLM(shape, dtype=torch.float32)
    init_weights_(reference, cfg.seed)
    full = full_state_dict(reference)
    params_full = sum(p.numel() for p in reference.parameters())
    del reference
    model = ShardedCausalLM(shape, comm, dtype=torch.float32, device=device)
    model.load_full_state_dict(full)
    del full
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def log(record: dict) -> None:
        if comm.rank == 0:
            print(json.dumps(record), flush=True)

    log({"config": asdict(cfg), "params_full": params_full,
         "params_per_rank": sum(p.numel() for p in model.parameters())})
    data = RepeatingPatterns(vocab_size=cfg.vocab, seq_len=cfg.seq, num_samples=cfg.batch * cfg.steps,
                             num_patterns=cfg.num_patterns, alphabet=cfg.alphabet, seed=cfg.seed)
    tracked_step = max(cfg.steps - 1, 0)  # a late step, so the optimizer state already exists
    losses, peak, start = [], {}, time.perf_counter()
    for step in range(cfg.steps):
        batch = shard_batch(global_batch(cfg, data, step).to(device), tsp=comm.size, rank=comm.rank)
        tracker = MemTracker() if step == tracked_step else None
        if tracker is not None:
            tracker.track_external(model, optimizer)
            tracker.__enter__()
        try:
            loss_share = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
            loss_share.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        if tracker is not None:
            peak = peak_memory_mib(tracker, device)
        loss = float(model.loss_for_logging(loss_share))
        losses.append(loss)
        log({"step": step, "loss": round(loss, 4)})

    peaks = [None] * world
    if world > 1:
        dist.all_gather_object(peaks, peak)
    else:
        peaks = [peak]
    for rank, p in enumerate(peaks):
        log({"memory": {"rank": rank, "tracked_step": tracked_step, "peak_mib": p}})
    summary = {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
               "loss_decrease": round(losses[0] - losses[-1], 4), "decreased": losses[-1] < losses[0],
               "tsp": comm.size, "steps": cfg.steps, "train_s": round(time.perf_counter() - start, 2)}
    log({"summary": summary})
    return summary


def _train_from_env(cfg: DemoConfig, timeout_s: float) -> dict:
    """Under torchrun / deepspeed: join the launcher's group; the whole world is the TSP group."""
    _, world = init_from_env(timeout_s=timeout_s)
    try:
        if world != cfg.tsp:
            raise TSPConfigError(f"--tsp={cfg.tsp} but the launcher started {world} ranks: the whole world is one "
                                 f"TSP group; pass --tsp {world}")
        return train(cfg)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> tuple[DemoConfig, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    p.add_argument("--tsp", type=int, default=defaults.tsp, help="TSP degree D = number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default 30)")
    p.add_argument("--seq", type=int, default=defaults.seq, help="global sequence length (default 128)")
    p.add_argument("--batch", type=int, default=defaults.batch, help="batch size (default 4)")
    p.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="data and weights seed (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are stopped")
    args = p.parse_args(argv)
    cfg = DemoConfig(tsp=args.tsp, steps=args.steps, seq=args.seq, batch=args.batch, lr=args.lr, seed=args.seed)
    return cfg, args.timeout


def main(argv: list[str] | None = None) -> int:
    cfg, timeout_s = parse_args(argv)
    try:
        if cfg.steps < 2 or cfg.seq < 2 or cfg.batch < 1:
            raise TSPConfigError(f"steps={cfg.steps}, seq={cfg.seq}, batch={cfg.batch}: need steps >= 2 (to see the "
                                 "loss move), seq >= 2 and batch >= 1")
        cfg.shape.check_tsp_degree(cfg.tsp)
    except TSPConfigError as exc:
        print(f"demo_train: error: {exc}", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ:
        summary = _train_from_env(cfg, timeout_s)
    else:
        summary = run_on_local_ranks(train, cfg.tsp, cfg, timeout_s=timeout_s)[0]
    if not summary["decreased"]:
        print(f"demo_train: the loss did not decrease ({summary['loss_first']} -> {summary['loss_last']})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from ds_tsp import run_main

    # A bad argument or launch (--tsp != the launcher's world): one line, once, exit 2. Stdout is left as it is:
    # nothing but the JSON lines reaches it here (no DeepSpeed), and spawned ranks print their records to it.
    run_main(main, "demo_train", json_stdout=False)
