"""A user's own minimal script, as the README writes one: load a local checkpoint, 2 steps, save, return normally.

    torchrun --standalone --nproc_per_node 2 benchmarks/exit_user_script.py MODEL_DIR OUT_DIR

No ds_tsp.core.parallel.launch.exit_rank, no dist.destroy_process_group, no os._exit: the interpreter finalizes as it
would for any script. benchmarks/exit_trials.py runs it many times and counts aborts at exit.
"""
from __future__ import annotations

import sys

import torch

from ds_tsp.core.parallel.launch import init_from_env, local_device
from ds_tsp.hf import TSPForCausalLM


def main(model_dir: str, out_dir: str) -> None:
    rank, _ = init_from_env()
    device = local_device()
    model = TSPForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    for step in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out_dir)
    if rank == 0:
        print(f"saved {out_dir}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
