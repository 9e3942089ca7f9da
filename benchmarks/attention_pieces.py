"""Time one rank's causal attention kernels under TSP's zigzag split against Ulysses' whole-sequence call, in one
process on one thread (no communication): are TSP's kernel calls slower by themselves?

    python benchmarks/attention_pieces.py --tsp 4 --seq 8192 --heads 8 --head-dim 32

Ulysses' rank: one causal forward + backward of H/D heads over all S queries. TSP's rank p: for each of the D head
blocks (H/D heads), both of its zigzag chunks (p and 2D-1-p, S/(2D) queries each) as the kernels module calls them:
the keys before the chunk unmasked, then the chunk's own keys causal (ds_tsp.core.layers.attention.kernels). Both do
the same FLOPs. Prints the seconds per layer (best of --repeats after one untimed call) of Ulysses' rank and of each
TSP rank, and TSP's mean over Ulysses'. Run it with nothing else on the machine.

    python benchmarks/attention_pieces.py --per-pair --tsp 4 --seq 8192

prints instead what each kernel call costs per (query, key) pair it keeps, forward and backward, for the CPU kernel
(aten::_scaled_dot_product_flash_attention_for_cpu and its backward, called directly, the calls interleaved, best
of --repeats): Ulysses' causal S x S call, a rank's unmasked c x (prefix) pieces and its causal c x c diagonals
(c = S / 2D), so a gap between the two splits can be traced to a piece shape.
"""
from __future__ import annotations

import argparse
import time
import timeit

import torch

from ds_tsp.core.layers.attention.kernels import attention_backward, attention_forward


def _best(call, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one untimed call."""
    call()
    return min(timeit.repeat(call, number=1, repeat=repeats))


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
    parser.add_argument("--per-pair", action="store_true",
                        help="the CPU kernel's nanoseconds per kept (query, key) pair of each piece shape instead")
    args = parser.parse_args(argv)
    D, S, H, d = args.tsp, args.seq, args.heads, args.head_dim
    if S % (2 * D) or H % D:
        parser.error(f"--seq must be a multiple of 2 * --tsp and --heads of --tsp (S={S}, H={H}, D={D})")
    torch.set_num_threads(1)
    if args.per_pair:
        _per_pair(D, S, H, d, args.repeats)
        return
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


def _per_pair(D: int, S: int, H: int, d: int, repeats: int) -> None:
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    gen = torch.Generator().manual_seed(0)
    heads, c, scale = H // D, S // (2 * D), d ** -0.5
    shapes = {f"Ulysses' causal {S} x {S}": (S, S, True), f"causal diagonal {c} x {c}": (c, c, True)}
    shapes.update({f"unmasked {c} x {p * c}": (c, p * c, False) for p in sorted({1, D - 1, 2 * D - 1})})
    calls = {}
    for name, (rows, keys, causal) in shapes.items():
        q = torch.randn(1, heads, rows, d, generator=gen)
        k, v = (torch.randn(1, heads, keys, d, generator=gen) for _ in range(2))
        out, lse = forward(q, k, v, 0.0, causal, scale=scale)[:2]
        dout = torch.randn(out.shape, generator=gen)
        pairs = heads * rows * keys * (0.5 if causal else 1.0)
        calls[name] = (pairs, lambda q=q, k=k, v=v, causal=causal: forward(q, k, v, 0.0, causal, scale=scale),
                       lambda q=q, k=k, v=v, o=out, lse=lse, do=dout, causal=causal:
                       backward(do, q, k, v, o, lse, 0.0, causal, scale=scale))
    best = {name: [float("inf"), float("inf")] for name in calls}
    for _ in range(repeats):  # interleaved: a drifting machine slows every shape alike
        for name, (pairs, fwd, bwd) in calls.items():
            for i, call in enumerate((fwd, bwd)):
                start = time.perf_counter()
                call()
                best[name][i] = min(best[name][i], (time.perf_counter() - start) / pairs * 1e9)
    print(f"D={D} S={S} H={H} d={d} (H / D = {heads} per call): ns per kept (query, key) pair, forward / backward")
    for name, (f, b) in best.items():
        print(f"  {name}: {f:.2f} / {b:.2f}")


if __name__ == "__main__":
    main()
