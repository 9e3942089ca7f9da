"""Preference tuning with TRL's DPOTrainer under TSP: `TSPDPOTrainer` in place of `DPOTrainer`, the "tsp" block of the
DeepSpeed config; the policy and the reference model are sharded, every chosen and rejected sequence zigzag-cut over
the TSP group, their log-probs summed through TSP's streaming LM head.

    torchrun --standalone --nproc_per_node 2 examples/dpo.py --ds_config ds_configs/tsp.json \\
        --max_steps 4 --output_dir /tmp/dpo_out
    python examples/dpo.py --max_steps 4 --output_dir /tmp/dpo_ref    # one process: a plain DPOTrainer

The preference data is a toy one that runs on CPU in seconds: the prompt is a few words of a small vocabulary, the
chosen completion repeats them, the rejected one is other words. Without --model_name_or_path a tiny Qwen3-style
model and a word-level tokenizer are built locally (no downloads). Rank 0 prints one JSON line per optimizer step
("step", "loss", "grad_norm", "margin", "accuracy", "chosen_logps", "rejected_logps"); stdout carries the JSON lines
only, a bad config is one line and exit 2. With the same seed and learning rate (--lr for the plain run: the
DeepSpeed JSON's under TSP, 3e-3 in ds_configs/tsp.json) a TSP run logs the plain run's losses and rewards.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch
import transformers

from ds_tsp import TSPConfigError, emit

WORDS = [f"w{i}" for i in range(24)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", help="local HF checkpoint with its tokenizer (default: build a tiny one)")
    p.add_argument("--ds_config", help="DeepSpeed JSON with a \"tsp\" block (ignored with one process)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beta", type=float, default=0.1, help="DPO's temperature on the log-ratio")
    p.add_argument("--loss_type", default="sigmoid", help="TRL's, comma-separated: sigmoid, ipo, hinge, ...")
    p.add_argument("--lr", type=float, default=3e-3, help="ignored under TSP when the DeepSpeed JSON sets one")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def build_tiny(directory: Path, seed: int) -> None:
    """A word-level tokenizer over WORDS and a tiny Qwen3-style model (tied, q/k norms) for it, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                         unk_token="<unk>").save_pretrained(directory)
    config = transformers.Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, max_position_embeddings=128, eos_token_id=1,
                                      pad_token_id=0, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformers.Qwen3ForCausalLM(config).save_pretrained(directory)


def preference_rows(n: int, seed: int) -> list[dict]:
    """Chosen: the prompt's words again; rejected: as many or more other words (the lengths differ)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.sample(WORDS, rng.randint(2, 6))
        others = [w for w in WORDS if w not in prompt]
        out.append({"prompt": " ".join(prompt), "chosen": " " + " ".join(prompt),
                    "rejected": " " + " ".join(rng.sample(others, len(prompt) + rng.randint(0, 3)))})
    return out


class JsonLines(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs and "rewards/margins" in logs:
            emit({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm"),
                  "margin": logs["rewards/margins"], "accuracy": logs["rewards/accuracies"],
                  "chosen_logps": logs["logps/chosen"], "rejected_logps": logs["logps/rejected"]})


def main(argv=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    if distributed and not args.ds_config:
        raise TSPConfigError(f"{world} processes need --ds_config: a DeepSpeed JSON with a \"tsp\" block, e.g. "
                             "ds_configs/tsp.json")
    ds = json.loads(Path(args.ds_config).read_text()) if distributed else {}
    data_size = world // ds.get("tsp", {}).get("size", 1) if distributed else 1
    micro = ds.get("train_micro_batch_size_per_gpu")
    micro = micro if isinstance(micro, int) else 2
    lr = (ds.get("optimizer") or {}).get("params", {}).get("lr", args.lr)
    model_path = args.model_name_or_path or str(Path(args.output_dir) / "initial")
    training = DPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=micro,
        beta=args.beta, loss_type=args.loss_type.split(","), learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, seed=args.seed, logging_steps=1, report_to=[], save_strategy="no",
        disable_tqdm=True, bf16=False, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
        deepspeed=args.ds_config if distributed else None)
    if args.model_name_or_path is None:
        if training.process_index == 0:
            build_tiny(Path(model_path), args.seed)
        if distributed:
            torch.distributed.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_list(preference_rows(micro * data_size * args.max_steps, args.seed))
    if distributed:
        from ds_tsp.hf import TSPDPOTrainer as Trainer  # the one TSP line
    else:
        Trainer = DPOTrainer  # the single-process reference
    trainer = Trainer(model=model, args=training, train_dataset=dataset, processing_class=tokenizer,
                      callbacks=[JsonLines()])
    trainer.remove_callback(transformers.PrinterCallback)  # one JSON line per step, nothing else
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad config: one line, once, exit 2; ends through exit_rank (gloo can abort at exit)
    run_main(main, "dpo.py")
