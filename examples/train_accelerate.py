"""Train an HF causal LM with Accelerate and TSP; the only TSP line is the Accelerator import.

    accelerate launch --config_file ds_configs/accelerate_tsp.yaml [--num_processes N] examples/train_accelerate.py \\
        --max_steps 10 --output_dir /tmp/acc_out            # DeepSpeed (ZeRO on the data axis), tsp from the JSON
    accelerate launch --config_file ds_configs/accelerate_tsp_fsdp2.yaml examples/train_accelerate.py ...   # FSDP2
    python examples/train_accelerate.py --max_steps 10 --output_dir /tmp/ref   # one process: the reference

Deterministic synthetic data from --seed; the GLOBAL batch (--global_batch samples per optimizer step) is the same
whatever the layout, so losses are comparable across layouts. Rank 0 prints one JSON line per optimizer step
("step", "loss": the global loss, "grad_norm"); the final model is written in HF layout to --output_dir. Without
--model_name_or_path a tiny Llama-3-style model is built from a config and saved first (no downloads). Stdout carries
the JSON lines only (DeepSpeed's, Accelerate's and transformers' messages go to stderr); a bad config is one line
and exit 2.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ds_tsp import TSPConfigError, emit
from ds_tsp.accelerate import TSPAccelerator as Accelerator
from ds_tsp.testing import RepeatingPatterns, save_tiny_llama


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", help="local HF checkpoint (default: build a tiny Llama-3-style one)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--global_batch", type=int, default=4, help="samples per optimizer step, over all replicas")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--eval_samples", type=int, default=0, help="evaluate on this many held-out samples at the end")
    p.add_argument("--checkpoint_at", type=int, default=0, help="save_state to OUTPUT_DIR/state after this step")
    p.add_argument("--resume", action="store_true", help="load_state from OUTPUT_DIR/state and continue from there")
    p.add_argument("--trainable", help="comma-separated parameter name prefixes to train; the rest is frozen and the "
                                       "optimizer holds the trainable parameters only")
    return p.parse_args(argv)


def batches(samples, batch_size):
    def collate(rows):
        return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}

    return DataLoader(samples, batch_size=batch_size, shuffle=False, collate_fn=collate)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from accelerate.utils import DataLoaderConfiguration

    # split_batches: the loader's batch is the GLOBAL micro-batch, split over the data replicas, and schedulers step
    # once per optimizer step: the same run whatever the layout.
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    model_path = args.model_name_or_path
    if model_path is None:
        model_path = str(Path(args.output_dir) / "initial")
        if accelerator.is_main_process:
            save_tiny_llama(model_path, seed=args.seed)
        accelerator.wait_for_everyone()

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if args.trainable:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(tuple(args.trainable.split(","))))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    micro = args.global_batch // args.gradient_accumulation_steps  # over all data replicas
    if micro % accelerator.data_size or micro * args.gradient_accumulation_steps != args.global_batch:
        raise TSPConfigError(f"--global_batch {args.global_batch} must be a multiple of data replicas "
                         f"({accelerator.data_size}) x gradient_accumulation_steps")
    data = RepeatingPatterns(vocab_size=model.config.vocab_size, seq_len=args.seq_len,
                             num_samples=args.max_steps * args.global_batch + args.eval_samples, seed=args.seed)
    samples = [{"input_ids": data[i]["input_ids"], "labels": data[i]["input_ids"], "index": i}
               for i in range(len(data))]
    train, held_out = samples[:args.max_steps * args.global_batch], samples[args.max_steps * args.global_batch:]
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5,
                                                  total_iters=args.max_steps)
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, batches(train, micro), batches(held_out or train[:1], micro), scheduler)
    state_dir = Path(args.output_dir) / "state"
    log, losses, done = [], [], 0
    if args.resume:
        accelerator.load_state(str(state_dir))
        done = json.loads((state_dir / "steps.json").read_text())["steps"]
        loader = accelerator.skip_first_batches(loader, done * args.gradient_accumulation_steps)

    for batch in loader:
        batch.pop("index")
        with accelerator.accumulate(model):
            loss = model(**batch).loss  # the global loss of this micro-batch on every rank
            accelerator.backward(loss)
            losses.append(loss.detach())
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            line = {"step": done + len(log) + 1, "loss": float(torch.stack(losses).mean()), "grad_norm": float(norm)}
            log.append(line)
            losses = []
            if accelerator.is_main_process:
                emit(line)
            if line["step"] == args.checkpoint_at:
                accelerator.save_state(str(state_dir))
                if accelerator.is_main_process:
                    (state_dir / "steps.json").write_text(json.dumps({"steps": line["step"]}))
            if line["step"] == args.max_steps:
                break
    if args.eval_samples:
        evaluate(accelerator, model, eval_loader)
    accelerator.unwrap_model(model).save_pretrained(args.output_dir)
    accelerator.end_training()
    return log


@torch.no_grad()
def evaluate(accelerator, model, loader) -> None:
    """Eval under TSP (sharded like training); gather_for_metrics returns every held-out sample exactly once."""
    model.eval()
    losses, seen = [], []
    for batch in loader:
        seen.append(accelerator.gather_for_metrics(batch.pop("index")))
        losses.append(model(**batch).loss)
    if accelerator.is_main_process:
        emit({"eval_loss": float(torch.stack(losses).mean()), "eval_indices": torch.cat(seen).tolist()})
    model.train()


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad config: one line, once, exit 2; ends through exit_rank (gloo can abort at exit)
    run_main(main, "train_accelerate.py")
