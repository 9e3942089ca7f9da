"""Time TSPComm.reduce_scatter and TSPComm.all_gather on CPU tensors (one batch of point-to-point pieces) against
gloo's own reduce-scatter and all-gather, on local gloo processes; checks that both give the same results first.

    python benchmarks/gloo_collectives.py --ranks 2 4 --kib 96 512 4096 16384

Prints one markdown row per (op, ranks, size): milliseconds per call (median of --repeats timed calls after 3
untimed ones, rank 0's clock, every rank posting in lockstep) and gloo's time over TSPComm's. --kib is the whole
buffer a rank reduce-scatters, and the whole buffer an all-gather fills. Run it with nothing else on the machine.
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
_gloo_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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
        rows.append(("reduce_scatter", world, kib, gloo_ms, tsp_ms))
        gathered_ours, gathered_theirs = torch.empty(world * n), torch.empty(world * n)
        comm.all_gather(gathered_ours, ours).wait()
        _gloo_all_gather(gathered_theirs, ours)
        if not torch.equal(gathered_ours, gathered_theirs):
            raise AssertionError(f"D={world}, {kib} KiB: TSPComm.all_gather differs from gloo's")
        gloo_ms = _timed(lambda: _gloo_all_gather(gathered_theirs, ours), repeats)
        tsp_ms = _timed(lambda: comm.all_gather(gathered_ours, ours).wait(), repeats)
        rows.append(("all_gather", world, kib, gloo_ms, tsp_ms))
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
                        help="the whole buffer, KiB")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| op | D | buffer KiB | gloo ms | TSPComm ms | gloo / TSPComm |")
    print("|---|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        queue = mp.get_context("spawn").Queue()
        mp.spawn(_run, args=(world, _free_port(), args.kib, args.repeats, queue), nprocs=world)
        for op, d, kib, gloo_ms, tsp_ms in queue.get():
            print(f"| {op} | {d} | {kib} | {gloo_ms:.2f} | {tsp_ms:.2f} | {gloo_ms / tsp_ms:.2f}x |")


if __name__ == "__main__":
    main()
