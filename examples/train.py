"""Train a small Llama-style model with TSP under DeepSpeed: the launch line users already know.

    deepspeed --num_gpus 4 examples/train.py --ds_config ds_configs/tsp.json
    python examples/train.py --ds_config ds_configs/tsp.json      # one process: the tsp=1 reference
    torchrun --standalone --nproc_per_node 4 examples/train.py --ds_config ds_configs/tsp_zero3.json
    torchrun ... examples/train.py --ds_config ... --save_dir ckpt --save_every 100 --resume

--save_dir/--save_every write ds_tsp training checkpoints (weights + optimizer state per shard, manifest with
checksums, the newest --keep_last kept); --resume continues from the newest complete one (a fresh start when there
is none), also on another TSP x data layout with the same global batch.

The "tsp" block of the config turns TSP on ({"size": D}); ZeRO shards over the data axis, pipeline_stages adds
an outer pipe axis. Works on CPU (gloo) and on GPUs (NCCL) unchanged. Rank 0 shows a progress bar and prints one
JSON line per step ({"step", "loss", "step_s"}); at the end every rank's peak memory is printed. Stdout carries
these JSON lines only (DeepSpeed's own messages and the progress bar go to stderr); a bad config is one line on
stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import ds_tsp
from ds_tsp import ModelShape, emit, json_stream, load_ds_config, pipeline_batches, save_consolidated
from ds_tsp.testing import ReferenceCausalLM, RepeatingPatterns, full_state_dict, init_weights_

MODELS = {
    "tiny": ModelShape(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                       num_kv_heads=2),
    "small": ModelShape(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                        num_kv_heads=8),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON config with a \"tsp\" block")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--save_dir", default=None, help="write ds_tsp training checkpoints here (step-<N>/)")
    p.add_argument("--save_every", type=int, default=0, help="save every N steps (0: only with --save_dir at the end)")
    p.add_argument("--keep_last", type=int, default=3, help="checkpoints to keep in --save_dir")
    p.add_argument("--resume", action="store_true", help="continue from --save_dir's newest complete checkpoint")
    p.add_argument("--export", default=None, help="write a consolidated safetensors checkpoint here at the end")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    if (args.resume or args.save_every) and not args.save_dir:
        p.error("--resume and --save_every need --save_dir DIR")
    if args.save_every < 0:
        p.error(f"--save_every {args.save_every}: a number of steps >= 1 (or 0 for the end only)")
    return args


def peak_memory_mib(step_fn) -> float:
    """Run one step and return this rank's peak memory in MiB (CUDA allocator, or MemTracker on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        step_fn()
        return torch.cuda.max_memory_allocated() / 2**20
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step_fn()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(v for dev in peak.values() for k, v in dev.items() if str(k) == "Total") / 2**20


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = MODELS[args.model]
    reference = ReferenceCausalLM(shape)  # one deterministic init, identical on every rank and every layout
    init_weights_(reference, args.seed)
    data = RepeatingPatterns(vocab_size=shape.vocab_size, seq_len=args.seq_len, num_samples=100_000, seed=args.seed)
    config = load_ds_config(args.ds_config)
    if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: one process, the tsp=1 reference of the same run
        config["tsp"] = {**config.get("tsp", {}), "size": 1, "pipeline_stages": 1}
        emit({"note": "one process (no launcher): tsp=1 reference run; launch with torchrun or deepspeed for TSP"})
    engine, _, loader, _ = ds_tsp.initialize(model=shape, config=config, training_data=data,
                                             state_dict=full_state_dict(reference), seed=args.seed)
    del reference
    rank = dist.get_rank()
    groups = engine.tsp_groups
    pipelined = groups.pipe_size > 1
    start = 0
    if args.resume:  # before the first batch is drawn: the loader continues where the checkpoint stopped
        start = ds_tsp.load_training_checkpoint(engine, args.save_dir, loader=loader) or 0
        if rank == 0:
            emit({"resumed_from_step": start} if start else {"resume": "no checkpoint, fresh start"})
    batches = pipeline_batches(loader) if pipelined else iter(loader)

    step_count = [start]

    def train_step() -> float:
        step_count[0] += 1
        if pipelined:
            share = engine.train_batch(batches)
        else:
            share = 0.0
            for _ in range(engine.gradient_accumulation_steps()):
                b = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in next(batches).items()}
                loss = engine(**b)  # this rank's share of the loss (the loader's batch, whole: already sharded)
                engine.backward(loss)
                # NaN/inf anywhere: every rank stops (or, with "on_nonfinite": "skip", skips) in the same step
                if engine.tsp_guard.check(loss, step_count[0]):
                    engine.step()
                else:
                    engine.zero_grad()
                share += loss.detach() / engine.gradient_accumulation_steps()
        share = torch.as_tensor(share, dtype=torch.float32).clone()
        # guarded: a stalled or dead peer ends this rank within timeout_s with one line naming it
        with engine.tsp_comm.guard("loss logging all_reduce", group=groups.tsp_group, poll=share.device):
            dist.all_reduce(share, group=groups.tsp_group)  # TSP ranks hold shares of the loss
        if not pipelined and groups.data_size > 1:
            with engine.tsp_comm.guard("loss logging all_reduce over data", group=groups.data_group,
                                       poll=share.device):
                dist.all_reduce(share, group=groups.data_group)
            share /= groups.data_size
        return float(share)

    if rank == 0:
        emit({"layout": {"pipe": groups.pipe_size, "data": groups.data_size, "tsp": groups.tsp_size},
              "model": args.model, "seq_len": args.seq_len,
              "activation_checkpointing": engine.tsp_config.activation_checkpointing,
              "offload_activations": engine.tsp_config.offload_activations})
    def maybe_save(step: int) -> None:
        if args.save_dir and ((args.save_every and step % args.save_every == 0) or step == args.max_steps):
            ds_tsp.save_training_checkpoint(engine, args.save_dir, step, loader=loader, keep_last=args.keep_last)

    losses, peak = [], 0.0
    for step in tqdm(range(start + 1, args.max_steps), disable=rank != 0, desc="train", file=sys.stderr):
        began = time.perf_counter()
        losses.append(train_step())
        if rank == 0:  # the full float: a resumed run can be compared bit for bit
            tqdm.write(json.dumps({"step": step, "loss": losses[-1], "step_s": round(time.perf_counter() - began, 4)}),
                       file=json_stream())
        maybe_save(step)
    if start < args.max_steps:
        last = []
        peak = peak_memory_mib(lambda: last.append(train_step()))
        losses += last
        if rank == 0:
            emit({"step": args.max_steps, "loss": losses[-1]})
        maybe_save(args.max_steps)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, round(peak, 2))
    if rank == 0:
        emit({"peak_memory_mib_per_rank": peaks, "first_loss": losses[0] if losses else None,
              "last_loss": losses[-1] if losses else None})
    if args.export and not pipelined:
        save_consolidated(engine.tsp_model, args.export)
    return 0


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad config: one line, once, exit 2; ends through exit_rank (gloo can abort at exit)
    run_main(main, "train.py")
