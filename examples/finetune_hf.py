"""Fine-tune a local Hugging Face checkpoint (Llama 3.x / Mistral / Qwen2 / Qwen3) with TSP and save it back.

    torchrun --standalone --nproc_per_node 2 examples/finetune_hf.py --model_dir DIR --output_dir OUT

Every rank reads only its slices of DIR, trains on the same full-length batches (the model keeps its zigzag part),
and save_pretrained streams the HF layout to OUT one module at a time. Without --model_dir a tiny Llama-3-style
checkpoint is built from a config and saved first (no downloads). Rank 0 prints one JSON line per step; stdout
carries these JSON lines only (other messages go to stderr), and a bad checkpoint or input is one line and exit 2.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist

from ds_tsp import emit, init_from_env, local_device
from ds_tsp.hf import TSPForCausalLM
from ds_tsp.testing import RepeatingPatterns


def tiny_llama3(directory: str) -> str:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="local HF checkpoint (default: build a tiny Llama-3-style one)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rank, _ = init_from_env()
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = [tempfile.mkdtemp(prefix="tiny_llama3_") if rank == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(model_dir, src=0)
        if rank == 0:
            tiny_llama3(model_dir[0])
        if dist.get_world_size() > 1:
            dist.barrier()
        model_dir = model_dir[0]

    device = local_device()  # this rank's GPU under a launcher on a GPU node, else the CPU
    model = TSPForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)  # world = one TSP group
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = RepeatingPatterns(vocab_size=model.config.vocab_size, seq_len=args.seq, num_samples=args.steps * args.batch,
                             seed=args.seed)
    losses = []
    for step in range(args.steps):
        ids = torch.stack([data[step * args.batch + i]["input_ids"] for i in range(args.batch)]).to(device)
        loss = model(input_ids=ids, labels=ids).loss  # the global loss on every rank
        loss.backward()  # each rank: its own shard grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            emit({"step": step, "loss": round(losses[-1], 4)})
    model.save_pretrained(args.output_dir)
    if rank == 0:
        emit({"saved": args.output_dir, "params": model.num_parameters()})
    if __name__ == "__main__":  # a process group left to interpreter exit can abort in its destructor
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    from ds_tsp import run_main

    # stdout: JSON lines only; a bad checkpoint or input: one line, once, exit 2; ends through exit_rank, which skips
    # interpreter finalization, where torch's gloo backend can abort
    run_main(main, "finetune_hf.py")
