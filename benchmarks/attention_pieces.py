"""Time one rank's causal attention kernels under TSP's zigzag split against Ulysses' whole-sequence call, in one
process on one thread (no communication): are TSP's kernel calls slower by themselves?

    python benchmarks/attention_pieces.py --tsp 4 --seq 8192 --heads 8 --head-dim 32

Ulysses' rank: one causal forward + backward of H/D heads over all S queries. TSP's rank p: for each of the D head
blocks (H/D heads), both of its zigzag chunks (p and 2D-1-p, S/(2D) queries each) as the kernels module calls them:
the keys before the chunk unmasked, then the chunk's own keys causal (ds_tsp.core.layers.attention.kernels). Both do
the same FLOPs. Prints the seconds per layer (best of --repeats after one untimed call) of Ulysses' rank and of each
TSP rank, and TSP's mean over Ulysses'. Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import time

import torch

from ds_tsp.core.layers.attention.kernels import attention_backward, attention_forward


def _best(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _forward_backward(q, k, v, q_start: int, scale: float) -> None:
    out, lse = attention_forward(q, k, v, q_start=q_start, scale=scale)
    attention_backward(torch.ones_like(out), q, k, v, out, lse, q_start=q_start, scale=scale)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tsp", type=int, default=4, help="D, the ranks")
    parser.add_argument("--seq", type=int, default=8192, help="S, a multiple of 2D")
    parser.add_argument("--heads", type=int, default=8, help="H, a multiple of D")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    D, S, H, d = args.tsp, args.seq, args.heads, args.head_dim
    if S % (2 * D) or H % D:
        parser.error(f"--seq must be a multiple of 2 * --tsp and --heads of --tsp (S={S}, H={H}, D={D})")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H // D, d, generator=gen) for _ in range(3))  # [B, L, heads, d]
    scale = d ** -0.5
    ulysses = _best(lambda: _forward_backward(q, k, v, 0, scale), args.repeats)
    c = S // (2 * D)

    def tsp_rank(p: int) -> None:
        for _ in range(D):  # head blocks
            for chunk in (p, 2 * D - 1 - p):
                _forward_backward(q[:, :c], k[:, :(chunk + 1) * c], v[:, :(chunk + 1) * c], chunk * c, scale)

    ranks = [_best(lambda: tsp_rank(p), args.repeats) for p in range(D)]
    print(f"D={D} S={S} H={H} d={d}: Ulysses' rank {ulysses:.3f} s per layer; TSP's ranks "
          f"{', '.join(f'{t:.3f}' for t in ranks)} s; TSP's mean over Ulysses' {sum(ranks) / D / ulysses:.3f}")


if __name__ == "__main__":
    main()
