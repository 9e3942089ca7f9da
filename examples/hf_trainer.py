"""Train with the HF Trainer and TSP: `TSPTrainer` in place of `Trainer`, the "tsp" block of the DeepSpeed config.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --ds_config ds_configs/tsp.json \\
        --max_steps 10 --seed 0 --output_dir /tmp/trainer_out
    deepspeed --num_gpus 4 examples/hf_trainer.py --ds_config ds_configs/tsp_zero2.json ...   # TSP=2 x DP=2
    python examples/hf_trainer.py --max_steps 10 --output_dir /tmp/ref   # one process: a plain Trainer, the reference

Deterministic synthetic data from --seed (labels with a sample-dependent share of -100, so replicas hold different
numbers of labelled tokens; --packed packs variable-length documents with DataCollatorWithFlattening). The GLOBAL
batch (--global_batch samples per optimizer step) is the same whatever the layout, so losses are comparable. Rank 0
prints one JSON line per optimizer step ("step", "loss": the logged global loss, "grad_norm"); --eval_samples adds
an evaluation under TSP ("eval_loss"); the final model is written in HF layout to --output_dir. Without
--model_name_or_path a tiny Llama-3-style model is built from a config and saved first (no downloads). Stdout carries
the JSON lines only (DeepSpeed's and transformers' messages go to stderr); a bad config is one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers

from ds_tsp import TSPConfigError, emit
from ds_tsp.testing import RepeatingPatterns, save_tiny_llama


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", help="local HF checkpoint (default: build a tiny Llama-3-style one)")
    p.add_argument("--ds_config", help="DeepSpeed JSON with a \"tsp\" block (ignored with one process)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--global_batch", type=int, default=None,
                   help="samples per optimizer step over all replicas (default: what the DeepSpeed JSON implies, "
                        "micro batch x data replicas x accumulation; 4 without one)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--packed", action="store_true", help="pack documents with DataCollatorWithFlattening")
    p.add_argument("--eval_samples", type=int, default=0)
    p.add_argument("--save_steps", type=int, default=0, help="write a checkpoint every N steps (0: none)")
    p.add_argument("--resume_from_checkpoint", help="a checkpoint-N directory to continue from")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train a PEFT LoRA adapter of rank R (alpha 2R) on q/k/v/o and gate/up/down; the base frozen")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


class SyntheticLM(torch.utils.data.Dataset):
    """RepeatingPatterns with a sample-dependent share of labels -100; --packed: documents of varied lengths."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int, packed: bool, offset: int = 0):
        self.patterns = RepeatingPatterns(vocab_size=vocab_size, seq_len=seq_len, num_samples=offset + num_samples,
                                          seed=seed)
        self.seq_len, self.num_samples, self.packed, self.offset = seq_len, num_samples, packed, offset

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        index += self.offset
        ids = self.patterns[index]["input_ids"]
        if self.packed:  # a document of 1/4 .. 1/2 of seq_len; DataCollatorWithFlattening concatenates them
            ids = ids[: self.seq_len // 4 + (index * 7) % (self.seq_len // 4)]
        labels = ids.clone()
        g = torch.Generator().manual_seed(index)
        labels[torch.rand(labels.shape, generator=g) < 0.3 * (index % 3)] = -100
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}


class JsonLines(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            emit({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm")})
        if "eval_loss" in logs:
            emit({"eval_loss": logs["eval_loss"]})


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    ds = json.loads(Path(args.ds_config).read_text()) if args.ds_config and distributed else {}
    data_size = world // ds.get("tsp", {}).get("size", 1) if distributed else 1
    # Values the DeepSpeed JSON states are the run's (the Trainer insists they match its arguments).
    accumulation = _explicit(ds, "gradient_accumulation_steps") or args.gradient_accumulation_steps
    micro = _explicit(ds, "train_micro_batch_size_per_gpu")
    if args.global_batch is None:
        args.global_batch = micro * data_size * accumulation if micro else 4
    micro = micro or args.global_batch // (data_size * accumulation)
    lr = (ds.get("optimizer") or {}).get("params", {}).get("lr", args.lr)
    if micro * data_size * accumulation != args.global_batch:
        raise TSPConfigError(f"--global_batch {args.global_batch} != micro batch {micro} x data replicas {data_size} x "
                         f"gradient accumulation {accumulation}")
    model_path = args.model_name_or_path or str(Path(args.output_dir) / "initial")
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro, gradient_accumulation_steps=accumulation, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=args.seed,
        logging_steps=1, report_to=[], save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, train_sampling_strategy="sequential", disable_tqdm=True,
        deepspeed=args.ds_config if distributed else None, use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True, average_tokens_across_devices=True)
    if args.model_name_or_path is None:
        if training.process_index == 0:
            save_tiny_llama(model_path, seed=args.seed)
        if distributed:
            torch.distributed.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False  # training: with a cache transformers would not mask packed documents apart
    if args.lora:  # the TSP model trains exactly the adapter; save_model writes it as PEFT does
        import peft

        torch.manual_seed(args.seed)  # PEFT draws lora_A from the global generator: the same on every run
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    data = dict(vocab_size=model.config.vocab_size, seq_len=args.seq_len, seed=args.seed, packed=args.packed)
    train = SyntheticLM(num_samples=args.max_steps * args.global_batch, **data)
    held_out = SyntheticLM(num_samples=args.eval_samples, offset=len(train), **data) if args.eval_samples else None
    collator = transformers.DataCollatorWithFlattening() if args.packed else _stack
    if distributed:
        from ds_tsp.hf import TSPTrainer as Trainer  # the one TSP line
    else:
        Trainer = transformers.Trainer  # the single-process reference
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=held_out, data_collator=collator,
                      callbacks=[JsonLines()])
    trainer.remove_callback(transformers.PrinterCallback)  # one JSON line per step, nothing else
    if distributed and training.process_index == 0:  # what the "tsp" block (and DeepSpeed's own keys) turned on
        emit({"activation_checkpointing": trainer.tsp_config.activation_checkpointing,
              "offload_activations": trainer.tsp_config.offload_activations})
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if held_out is not None:
        trainer.evaluate()
    trainer.save_model(args.output_dir)


def _explicit(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) else None


def _stack(rows):
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad config: one line, once, exit 2; ends through exit_rank (gloo can abort at exit)
    run_main(main, "hf_trainer.py")
