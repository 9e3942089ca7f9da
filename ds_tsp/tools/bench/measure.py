"""What one rank measures for one (layout, sequence length): step time, peak memory with a breakdown, bytes moved.

Protocol (identical for every layout; `measure_workload`):
  1. `warmup` untimed steps (first-call costs: allocator growth, DeepSpeed buckets, lazy optimizer state, masks).
  2. `steps` timed steps: barrier, then the wall time of forward + backward + optimizer step on each rank. A step
     of the group takes as long as its slowest rank, so the driver uses max over ranks per step, then the median.
     The layout's own TSP counter (if any) is reset per step: bytes and `wait_s` (time blocked on handles =
     exposed communication) are per step.
  3. one tracked step under MemTracker (once per tracked iteration, as torch recommends) and CollectiveBytes.
     Peak = MemTracker's peak total for this rank's device, broken down by what MemTracker attributes it to AT
     THE PEAK (the optimizer state may read 0 there when the peak comes before `step()`: that is honest, not a
     bug). Persistent tensors that exist before the tracked step must be registered with MemTracker or it cannot
     see them: modules (params, grads), torch optimizers (states), and every tensor reachable from framework
     objects such as a DeepSpeed ZeRO optimizer (flat fp32 partitions, gradient buckets) -> category "other".
"""
from __future__ import annotations

import gc
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.tools.bench.comm_count import CollectiveBytes

# MemTracker category (its _MemRefType values) -> the name used in results.json
CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Other": "other"}


@dataclass
class Workload:
    """One layout at one sequence length, ready to step. Built by a layout module on every rank."""

    step: Callable[[], float | None]  # forward + backward + optimizer step (+ zero_grad); returns the loss or None
    tokens_per_step: int  # global tokens the whole group processes per step (B * S)
    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    framework_state: list[object] = field(default_factory=list)  # walked for persistent tensors ("other")
    tsp_counter: object | None = None  # ds_tsp.core.comm.communicator.CommCounter for TSP layouts
    before_tracked: Callable[[], None] | None = None  # e.g. make sure no mask is first built inside MemTracker
    loss_reduce: str = "mean"  # how ranks' step() losses combine into the model's loss: "mean" or "sum" (shares)
    info: dict = field(default_factory=dict)  # layout settings worth recording in results.json
    tower: nn.Module | None = None  # a vision-language model's vision tower: its share of the peak (tower_share)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed_steps(workload: Workload, n: int, on_step: Callable[[int, float], None] | None = None) -> dict:
    """Run n steps; per step: wall seconds, this process's CPU seconds (all its threads, gloo's included: less
    sensitive than wall time to other load on a shared machine) and those of the thread that runs the step alone
    (the rest is communication threads' work), TSP counter bytes and wait seconds."""
    seconds, cpu_seconds, main_cpu, tsp_bytes, tsp_wait, tsp_by_kind, losses = [], [], [], [], [], {}, []
    tsp_wait_by = []
    for i in range(n):
        _barrier()
        if workload.tsp_counter is not None:
            workload.tsp_counter.reset()
        start, cpu_start, thread_start = time.perf_counter(), time.process_time(), time.thread_time()
        loss = workload.step()
        elapsed = time.perf_counter() - start
        seconds.append(elapsed)
        cpu_seconds.append(time.process_time() - cpu_start)
        main_cpu.append(time.thread_time() - thread_start)
        if loss is not None:
            losses.append(float(loss))
        if workload.tsp_counter is not None:
            snap = workload.tsp_counter.snapshot()
            tsp_bytes.append(int(snap["total_bytes"]))
            tsp_wait.append(float(snap["wait_s"]))
            tsp_wait_by.append(dict(snap["wait_by"]))
            tsp_by_kind = dict(snap["bytes"])
        if on_step is not None:
            on_step(i, elapsed)
    out = {"step_s": seconds, "cpu_s": cpu_seconds, "main_thread_cpu_s": main_cpu,
           "loss": losses[-1] if losses else None}
    if workload.tsp_counter is not None:
        out.update(tsp_comm_bytes=tsp_bytes, tsp_wait_s=tsp_wait, tsp_comm_by_kind=tsp_by_kind,
                   tsp_wait_by=tsp_wait_by)
    return out


def persistent_tensors(roots: list[object], max_depth: int = 4) -> list[torch.Tensor]:
    """Tensors reachable from `roots` through containers and framework objects' attributes (not through modules,
    optimizers or torch internals, which are tracked or irrelevant). Used to show DeepSpeed's flat buffers."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj, depth):
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
            return
        if isinstance(obj, (nn.Module, torch.optim.Optimizer)) and depth > 0:
            return
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif depth == 0 or type(obj).__module__.split(".")[0] in ("deepspeed", "ds_tsp"):
            items = list(getattr(obj, "__dict__", {}).values())
        else:
            return
        for item in items:
            visit(item, depth + 1)

    for root in roots:
        visit(root, 0)
    return list(found.values())


def _breakdown(snapshot: dict) -> tuple[int, dict[str, int]]:
    """MemTracker snapshot {device: {category: bytes, "Total": bytes}} -> (total, {name: bytes}) for the CPU."""
    total, parts = 0, {name: 0 for name in CATEGORIES.values()}
    for dev_snap in snapshot.values():  # one device on CPU runs; sum in case a layout left tensors elsewhere
        for key, value in dev_snap.items():
            key = getattr(key, "value", key)
            if key == "Total":
                total += int(value)
            elif key in CATEGORIES:
                parts[CATEGORIES[key]] += int(value)
    return total, parts


def tracked_step(workload: Workload) -> dict:
    """One step under MemTracker and CollectiveBytes: peak bytes with breakdown, state bytes after the step, and
    every collective's logical bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if workload.before_tracked is not None:
        workload.before_tracked()
    gc.collect()
    _barrier()
    tracker = MemTracker()
    # Order matters: a later registration re-labels a storage, so generic tensors ("other") go first and
    # modules / optimizer states take over the storages they own.
    extra = persistent_tensors(workload.framework_state)
    if extra:
        tracker.track_external(*extra)
    tracker.track_external(*workload.modules, *workload.optimizers)
    comm = CollectiveBytes()
    with tracker:
        with comm:
            workload.step()
        state_total, state_parts = _breakdown(tracker.get_tracker_snapshot("current"))
    peak_total, peak_parts = _breakdown(tracker.get_tracker_snapshot("peak"))
    out = {"peak_bytes": peak_total, "peak_breakdown": peak_parts, "state_bytes": state_total,
           "state_breakdown": state_parts, "c10d": comm.snapshot()}
    if workload.tower is not None:
        out["vision_tower"] = tower_share(tracker, workload.tower)
    return out


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters held on this rank: a ZeRO-3 partition, an FSDP2 shard, or the whole."""
    total = 0
    for p in module.parameters():
        local = getattr(p, "ds_tensor", None)
        if local is None:
            local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def tower_share(tracker, tower: nn.Module) -> dict:
    """The vision tower's part of the tracked step, from MemTracker's statistics of the tower module: the rank's
    total when the tower's (first) forward starts and ends, and the rank's peak inside the tower (forward and
    backward, recomputation included); activation_bytes = what its forward leaves alive for backward (saved
    tensors and output), peak_rise_bytes = how far inside it the rank climbs above the forward's entry."""
    stats = tracker.memory_tracking.get(tower)
    if stats is None or not stats.snapshots:  # a TSP rank with no item to encode (fewer items than ranks)
        return {"params_bytes": local_param_bytes(tower), "ran": False, "entry_bytes": None,
                "after_forward_bytes": None, "peak_bytes": None, "activation_bytes": 0, "peak_rise_bytes": 0}

    def total(state):
        from torch.distributed._tools.mem_tracker import _ModState

        snaps = stats.snapshots.get(getattr(_ModState, state), [])
        return _breakdown(snaps[0])[0] if snaps else None

    pre, post = total("PRE_FW"), total("POST_FW")
    peak = max(sum(int(v) for v in stats.local_peak.values()), post or 0)
    return {"params_bytes": local_param_bytes(tower), "ran": True, "entry_bytes": pre, "after_forward_bytes": post,
            "peak_bytes": peak, "activation_bytes": None if pre is None or post is None else post - pre,
            "peak_rise_bytes": None if pre is None else peak - pre}


def measure_workload(workload: Workload, *, steps: int, warmup: int,
                     progress: Callable[[str, int, int, float | None], None] | None = None) -> dict:
    """The whole protocol on this rank; returns plain data (the driver aggregates across ranks)."""
    def report(phase, i, n, seconds=None):
        if progress is not None:
            progress(phase, i, n, seconds)

    for i in range(warmup):
        report("warmup", i, warmup)
        start = time.perf_counter()
        workload.step()
        report("warmup", i + 1, warmup, time.perf_counter() - start)
    timed = timed_steps(workload, steps, on_step=lambda i, s: report("timed", i + 1, steps, s))
    report("memory", 0, 1)
    tracked = tracked_step(workload)
    report("memory", 1, 1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"rank": rank, "tokens_per_step": workload.tokens_per_step, "loss_reduce": workload.loss_reduce,
            "info": workload.info,
            **timed, **tracked,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
