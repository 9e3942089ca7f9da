"""RL with TRL's GRPOTrainer under TSP: `TSPGRPOTrainer` in place of `GRPOTrainer`, the "tsp" block of the DeepSpeed
config; the policy and the reference model are sharded, completions scored through TSP's streaming LM head.
`--trainer rloo` runs TRL's RLOOTrainer the same way (`TSPRLOOTrainer`; RLOO has no --loss_type).

    torchrun --standalone --nproc_per_node 2 examples/grpo.py --ds_config ds_configs/tsp.json \\
        --max_steps 4 --output_dir /tmp/grpo_out
    python examples/grpo.py --max_steps 4 --output_dir /tmp/grpo_ref    # one process: a plain GRPOTrainer

The task is a toy one that runs on CPU in seconds: prompts are a few words of a small vocabulary, and the reward
(`echo_reward`) is the share of the completion's words that appear in its prompt. Without --model_name_or_path a
tiny Qwen3-style model and a word-level tokenizer are built locally (no downloads). Rank 0 prints one JSON line per
optimizer step ("step", "loss", "reward", "kl", "grad_norm", "completion_length"; reward and completion_length on
the steps that generate); stdout carries the JSON lines only, a bad config is one line and exit 2. With the same
seed and learning rate (--lr for the plain run: the DeepSpeed JSON's under TSP, 3e-3 in ds_configs/tsp.json) a TSP
run samples the same completions and logs the same rewards and losses as the plain one: the per-process seeds are
those of the data replicas.
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
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt (GRPO's group)")
    p.add_argument("--steps_per_generation", type=int, default=2)
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.04, help="KL weight against the reference model (0: none)")
    p.add_argument("--loss_type", default="grpo", help="TRL's: grpo, bnpo, dr_grpo, dapo, cispo, sapo, ...")
    p.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo", help="TRL's GRPOTrainer or RLOOTrainer")
    p.add_argument("--lr", type=float, default=3e-3, help="ignored under TSP when the DeepSpeed JSON sets one")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def echo_reward(prompts, completions, **kwargs) -> list[float]:
    """Share of the completion's words found in its prompt (0 for an empty completion)."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        words, allowed = completion.split(), set(prompt.split())
        out.append(sum(w in allowed for w in words) / max(1, len(words)))
    return out


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


def prompt_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.sample(WORDS, rng.randint(2, 5)))} for _ in range(n)]


class JsonLines(transformers.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            emit({"step": state.global_step, "loss": logs["loss"], "reward": logs.get("reward"),
                  "kl": logs.get("kl"), "grad_norm": logs.get("grad_norm"),
                  "completion_length": logs.get("completions/mean_length")})


def main(argv=None):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

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
    rloo = args.trainer == "rloo"
    training = (RLOOConfig if rloo else GRPOConfig)(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=micro,
        steps_per_generation=args.steps_per_generation, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, beta=args.beta,
        **({} if rloo else {"loss_type": args.loss_type}),
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=args.seed,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, bf16=False,
        gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
        deepspeed=args.ds_config if distributed else None)
    if args.model_name_or_path is None:
        if training.process_index == 0:
            build_tiny(Path(model_path), args.seed)
        if distributed:
            torch.distributed.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, padding_side="left")
    prompts_per_step = micro * data_size * args.steps_per_generation // args.num_generations
    dataset = Dataset.from_list(prompt_rows(max(1, prompts_per_step) * args.max_steps, args.seed))
    if distributed:  # the one TSP line
        from ds_tsp.hf import TSPGRPOTrainer, TSPRLOOTrainer

        Trainer = TSPRLOOTrainer if rloo else TSPGRPOTrainer
    else:
        Trainer = RLOOTrainer if rloo else GRPOTrainer  # the single-process reference
    trainer = Trainer(model=model, reward_funcs=echo_reward, args=training, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[JsonLines()])
    trainer.remove_callback(transformers.PrinterCallback)  # one JSON line per step, nothing else
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad config: one line, once, exit 2; ends through exit_rank (gloo can abort at exit)
    run_main(main, "grpo.py")
