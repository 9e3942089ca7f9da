"""Time TSPComm.reduce_scatter on CPU tensors (one batch of point-to-point pieces and a sum at wait) against gloo's
own reduce-scatter, on local gloo processes; checks that both give the same sums first.

    python benchmarks/gloo_reduce_scatter.py --ranks 2 4 --kib 96 512 4096 16384

Prints one markdown row per (ranks, size): milliseconds per call (median of --repeats timed calls after 3 untimed
ones, rank 0's clock, every rank posting in lockstep) and gloo's time over TSPComm's. Run it with nothing else on
the machine.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_tsp.core.comm.communicator import TSPComm

_gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _timed(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _run(rank: int, world: int, port: int, sizes_kib: list[int], repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = TSPComm(dist.group.WORLD)
    rows = []
    for kib in sizes_kib:
        n = max(kib * 1024 // 4 // world, 1)
        full = torch.randn(world * n, generator=torch.Generator().manual_seed(rank))
        ours, theirs = torch.empty(n), torch.empty(n)
        comm.reduce_scatter(ours, full).wait()
        _gloo_reduce_scatter(theirs, full)
        if not torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6):
            raise AssertionError(f"D={world}, {kib} KiB: TSPComm.reduce_scatter differs from gloo's")
        gloo_ms = _timed(lambda: _gloo_reduce_scatter(theirs, full), repeats)
        tsp_ms = _timed(lambda: comm.reduce_scatter(ours, full).wait(), repeats)
        rows.append((world, kib, gloo_ms, tsp_ms))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kib", type=int, nargs="+", default=[96, 512, 4096, 16384],
                        help="size of the whole buffer each rank reduce-scatters, KiB")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| D | buffer KiB | gloo reduce_scatter ms | TSPComm.reduce_scatter ms | gloo / TSPComm |")
    print("|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        queue = mp.get_context("spawn").Queue()
        mp.spawn(_run, args=(world, _free_port(), args.kib, args.repeats, queue), nprocs=world)
        for d, kib, gloo_ms, tsp_ms in queue.get():
            print(f"| {d} | {kib} | {gloo_ms:.2f} | {tsp_ms:.2f} | {gloo_ms / tsp_ms:.2f}x |")


if __name__ == "__main__":
    main()
