"""`--profile`: where one step's wall time goes, by phase and (TSP) by layer type (one extra step after the timed
ones).

Every profiler event's SELF time is charged once, to a (layer type, phase) cell, so the cells are disjoint and sum
to the step's wall time:
- phase: what the event is. GEMMs, the attention kernel and copies/reorders by op name; "comm_wait" is time in
  communication calls: TSP blocked on a handle (ds_tsp.core.comm.communicator.COMM_WAIT_RANGE, also reported alone as
  "blocked_s") plus posting its async collectives (c10d ops), a peer's time inside its c10d calls;
  "elementwise" is every other aten op (pointwise math, reductions, allocation); "other" is time inside no op
  at all: Python, autograd bookkeeping, launch overhead (and, for the peers, waits on a collective's Work that
  happen outside any op).
- layer type: the nearest enclosing TSP autograd Function (its forward range or its backward node), or the
  optimizer's step/zero_grad; everything outside them (norms, residuals, RoPE tables, the loop itself) is "rest".
The profiled step runs under the profiler, so it is slower than a timed step: read the shares, not the seconds.

Work (TSP): the same step also counts, per layer type, the GEMM FLOPs of its aten mm-family ops (FlopCounterMode's
formulas over the shapes the profiler records) and the bytes of TSP's CommCounter, the cp axis's bytes and waits
apart (tsp_cp: attention's cp ring / all-to-all, the Gated DeltaNet's cp gathers), each charged like the time to
the enclosing layer type (the counters leave zero-length marks, _MarkedCounter); the runner sums them over the
ranks and sets them against the least the layer type needs (ds_tsp.tools.bench.work) under "work".
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from torch.autograd.profiler import record_function

from ds_tsp.core.comm.communicator import COMM_WAIT_RANGE, CommCounter

# op-name substrings per phase; first match wins, so the order matters (attention before the generic copies)
PHASES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("flash_attention", "scaled_dot_product", "_masked_attention", "aten::_softmax"),
    "comm_wait": (COMM_WAIT_RANGE, "c10d::", "c10d_functional::", "record_param_comms"),
    "copy": ("aten::copy_", "aten::cat", "aten::stack", "aten::index", "aten::narrow_copy", "aten::clone",
             "aten::contiguous", "aten::gather", "aten::scatter", "aten::repeat_interleave"),
}
KEYS = ("gemm_s", "attention_s", "comm_wait_s", "copy_s", "elementwise_s", "other_s")

# event-name substrings -> layer type; matched against the event and then its ancestors, nearest first
LAYERS = {
    "attention": ("_TSPAttention",),
    "gdn": ("_TSPGatedDeltaNet",),  # a hybrid model's Gated DeltaNet (linear attention) layers
    "mlp": ("_TSPGatedMLP",),
    "moe": ("MoERing", "MoEAllToAll"),  # the experts of a mixture-of-experts layer, either dispatch schedule
    "vocab": ("_TSPEmbedding", "_TSPLMHeadLoss", "_SelectedLogits"),
    "optimizer": ("Optimizer.step", "Optimizer.zero_grad"),
}
LAYER_TYPES = (*LAYERS, "rest")


def phase_of(name: str) -> str | None:
    """The phase an op or range of this name is charged to; None for ranges that are not ops (-> "other")."""
    for phase, patterns in PHASES.items():
        if any(p in name for p in patterns):
            return phase
    return "elementwise" if name.startswith("aten::") else None


# Spans of asynchronous collectives (post to completion): they overlap the ops that run meanwhile, so they are
# not part of the nesting; the waits on them are (comm_wait).
ASYNC_SPANS = ("gloo:", "nccl:")


@dataclass
class _Node:
    name: str
    seconds: float
    parent: "_Node | None"
    children_s: float = 0.0
    shapes: list | None = None  # the op's input shapes (profiler record_shapes), for its GEMM FLOPs

    @property
    def self_s(self) -> float:
        return max(0.0, self.seconds - self.children_s)


def _gemm_formulas() -> dict:
    """aten GEMM op name -> FlopCounterMode's own formula (torch.utils.flop_counter) over input shapes."""
    from torch.utils import flop_counter as fc

    return {"aten::mm": lambda a, b, *_: fc.mm_flop(a, b), "aten::addmm": lambda c, a, b, *_: fc.addmm_flop(c, a, b),
            "aten::addmm_": lambda c, a, b, *_: fc.addmm_flop(c, a, b), "aten::bmm": lambda a, b, *_: fc.bmm_flop(a, b),
            "aten::baddbmm": lambda c, a, b, *_: fc.baddbmm_flop(c, a, b),
            "aten::baddbmm_": lambda c, a, b, *_: fc.baddbmm_flop(c, a, b)}


# the GEMM ops whose FLOPs are counted; composites (aten::linear, aten::matmul) reach one of them
# (and their in-place forms, which FlopCounterMode's registry leaves out: the vocab ring accumulates with addmm_)
GEMM_FLOPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_")

# Zero-length marker ranges the profiled step emits for each counted transfer and each wait of the TSP group's and
# the cp axis's CommCounter (see _MarkedCounter), so bytes and cp waits are charged to the enclosing layer type too.
BYTES_MARK, WAIT_MARK = "ds_tsp::counted_bytes", "ds_tsp::counted_wait"


def gemm_flops(node) -> int:
    """FLOPs of one profiled GEMM op from its recorded input shapes (FlopCounterMode's formulas); 0 otherwise."""
    if node.name not in GEMM_FLOPS or not node.shapes:
        return 0
    return int(_gemm_formulas()[node.name](*node.shapes))


def layer_of(node) -> str:
    """Layer type of a profiled range: its own name or its nearest ancestor's that names one."""
    while node is not None:
        for layer, patterns in LAYERS.items():
            if any(p in node.name for p in patterns):
                return layer
        node = node.parent
    return "rest"


def nest(events) -> list[_Node]:
    """Events of one thread -> nodes with parents by interval containment (profiler time_range, microseconds)."""
    spans = sorted(((e.time_range.start, e.time_range.end, e.name, getattr(e, "input_shapes", None)) for e in events
                    if not e.name.startswith(ASYNC_SPANS)), key=lambda t: (t[0], -t[1]))
    nodes, stack = [], []
    for start, end, name, shapes in spans:
        while stack and stack[-1][1] <= start:
            stack.pop()
        parent = stack[-1][0] if stack else None
        node = _Node(name, (end - start) / 1e6, parent, shapes=shapes if name in GEMM_FLOPS else None)
        if parent is not None:
            parent.children_s += node.seconds
        stack.append((node, end))
        nodes.append(node)
    return nodes


def attribute(nodes: list[_Node], wall_s: float) -> tuple[dict, dict]:
    """(phase -> seconds, layer type -> phase -> seconds) of a profiled step from its nested events (`nest`)."""
    cells = {layer: {k: 0.0 for k in KEYS} for layer in LAYER_TYPES}
    in_roots = 0.0
    for node in nodes:
        phase = phase_of(node.name)
        cells[layer_of(node)][f"{phase}_s" if phase else "other_s"] += node.self_s
        if node.parent is None:
            in_roots += node.seconds
    cells["rest"]["other_s"] += max(0.0, wall_s - in_roots)  # the step's own Python between top-level ranges
    totals = {k: sum(cells[layer][k] for layer in LAYER_TYPES) for k in KEYS}
    return totals, cells


def _marker(name: str) -> None:
    with record_function(name):
        pass


class _MarkedCounter(CommCounter):
    """A CommCounter that also leaves a zero-length profiler range for every transfer it counts and every wait it
    times ("ds_tsp::counted_bytes[axis]=N", "ds_tsp::counted_wait[axis]=S"), inside whatever layer's range is open:
    the profile charges the counter's own figures to layer types. Installed on the counter objects for one profiled
    step only (_marked_counters), so what the counter counts is unchanged."""

    axis = "tsp"

    def add(self, kind: str, nbytes: int) -> None:
        super().add(kind, nbytes)
        _marker(f"{BYTES_MARK}[{self.axis}]={int(nbytes)}")

    @property
    def wait_s(self) -> float:
        return self.__dict__["wait_s"]

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        delta = value - self.__dict__.get("wait_s", 0.0)
        self.__dict__["wait_s"] = value
        if delta > 0:
            _marker(f"{WAIT_MARK}[{self.axis}]={delta:.9f}")


class _MarkedCpCounter(_MarkedCounter):
    axis = "cp"


@contextmanager
def _marked_counters(counter):
    """The TSP counter (and a tsp_cp session's cp counter: TSPAndCpCounters) as _MarkedCounters while inside."""
    pairs = [(getattr(counter, "tsp", counter), _MarkedCounter)]
    if getattr(counter, "cp", None) is not None:
        pairs.append((counter.cp, _MarkedCpCounter))
    pairs = [(c, cls) for c, cls in pairs if type(c) is CommCounter]
    for c, cls in pairs:
        c.__class__ = cls
    try:
        yield
    finally:
        for c, _ in pairs:
            c.__class__ = CommCounter


def counted_work(nodes: list[_Node]) -> dict:
    """layer type -> {"gemm_flops", "comm_bytes" (TSP group), "cp_bytes", "cp_wait_s"} of a profiled step: the GEMM
    ops' FLOPs (FlopCounterMode's formulas over the recorded shapes) and the counters' markers, each charged to the
    layer type of its nearest enclosing range."""
    work = {layer: {"gemm_flops": 0, "comm_bytes": 0, "cp_bytes": 0, "cp_wait_s": 0.0} for layer in LAYER_TYPES}
    for node in nodes:
        if node.name in GEMM_FLOPS:
            work[layer_of(node)]["gemm_flops"] += gemm_flops(node)
        elif node.name.startswith(BYTES_MARK):
            axis, value = node.name.split("[", 1)[1].split("]=")
            work[layer_of(node)]["comm_bytes" if axis == "tsp" else "cp_bytes"] += int(value)
        elif node.name.startswith(f"{WAIT_MARK}[cp]="):  # the TSP group's waits are the comm_wait phase already
            work[layer_of(node)]["cp_wait_s"] += float(node.name.split("=", 1)[1])
    return work


def _main_thread_events(prof):
    """Events of the thread that ran the step (gloo's worker threads record their own spans)."""
    events = list(prof.events())
    if not events:
        return events
    by_thread: dict[int, int] = {}
    for e in events:
        by_thread[e.thread] = by_thread.get(e.thread, 0) + 1
    main = max(by_thread, key=by_thread.get)
    return [e for e in events if e.thread == main]


TOP_OPS_PER_LAYER = 6  # aten ops per layer type in results.json's top_ops_by_layer and results.md's table


def op_seconds_by_layer(nodes: list[_Node]) -> dict[str, dict[str, float]]:
    """layer type -> aten op -> self seconds in a profiled step: which kernels each layer type's time is (a phase
    such as "elementwise" sums many ops; this names them)."""
    out: dict[str, dict[str, float]] = {}
    for node in nodes:
        if node.name.startswith("aten::"):
            layer_ops = out.setdefault(layer_of(node), {})
            layer_ops[node.name] = layer_ops.get(node.name, 0.0) + node.self_s
    return out


def _top(ops: dict[str, float], n: int) -> list:
    return [[name, round(seconds, 6)] for name, seconds in sorted(ops.items(), key=lambda kv: -kv[1])[:n]]


def profile_step(workload) -> dict:
    """Seconds per phase (and per layer type x phase) of one step of `workload` on this rank, its wall time and
    the top ops by self time; for TSP also this rank's work per layer type ("work": counted_work, which the runner
    sums over the ranks and sets against the minimum: ds_tsp.tools.bench.work.group_work)."""
    from torch.profiler import ProfilerActivity, profile

    counter = workload.tsp_counter
    if counter is not None:
        counter.reset()
    marked = _marked_counters(counter) if counter is not None else nullcontext()
    start = time.perf_counter()
    with marked, profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=False) as prof:
        workload.step()
    wall = time.perf_counter() - start  # includes profiler overhead: the phases are shares of THIS step
    nodes = nest(_main_thread_events(prof))
    totals, by_layer = attribute(nodes, wall)
    blocked = sum(node.seconds for node in nodes if node.name == COMM_WAIT_RANGE)
    per_layer = op_seconds_by_layer(nodes)
    ops: dict[str, float] = {}
    for layer_ops in per_layer.values():
        for name, seconds in layer_ops.items():
            ops[name] = ops.get(name, 0.0) + seconds
    out = {**totals, "wall_s": wall, "blocked_s": blocked,
           "by_layer": {layer: cells for layer, cells in by_layer.items() if any(cells.values())},
           "top_ops": _top(ops, 10),
           "top_ops_by_layer": {layer: _top(layer_ops, TOP_OPS_PER_LAYER) for layer, layer_ops in per_layer.items()}}
    if counter is not None:
        out["counter_wait_s"] = float(counter.snapshot()["wait_s"])  # cross-check of blocked_s (TSP only)
        out["work"] = counted_work(nodes)
    return out


def _cells(p: dict, wall: float) -> list[str]:
    return [f"{p[k]:.3f} ({100 * p[k] / wall:.0f}%)" for k in KEYS]


def profile_table(results: list[dict]) -> str:
    """Markdown: one row per profiled (layout, S) with seconds and share of the profiled step per phase, then,
    for TSP rows, one row per layer type."""
    rows = [r for r in results if r.get("profile")]
    if not rows:
        return ""
    head = "| layout | S | D | layer type | " + " | ".join(k[:-2] for k in KEYS) + " | wall s |"
    lines = [head, "|" + "---|" * (len(KEYS) + 5)]
    for r in rows:
        p = r["profile"]
        lines.append(f"| {r['layout']} | {r['seq']} | {r.get('tsp')} | all | " + " | ".join(_cells(p, p["wall_s"]))
                     + f" | {p['wall_s']:.3f} |")
        for layer, cells in p.get("by_layer", {}).items():
            if r["layout"].startswith("tsp"):
                lines.append(f"| | | | {layer} | " + " | ".join(_cells(cells, p["wall_s"]))
                             + f" | {sum(cells.values()):.3f} |")
    return "\n".join(lines)


def top_ops_table(results: list[dict]) -> str:
    """Markdown: per profiled (layout, S) and layer type, its aten ops with the most self time."""
    rows = [r for r in results if r.get("profile", {}).get("top_ops_by_layer")]
    if not rows:
        return ""
    lines = ["| layout | S | D | layer type | ops by self seconds |", "|---|---:|---:|---|---|"]
    for r in rows:
        label = r.get("label") or r["layout"]
        for layer, ops in r["profile"]["top_ops_by_layer"].items():
            named = ", ".join(f"{name.removeprefix('aten::')} {seconds:.3f}" for name, seconds in ops)
            lines.append(f"| {label} | {r['seq']} | {r.get('tsp')} | {layer} | {named} |")
    return "\n".join(lines)


def work_table(results: list[dict]) -> str:
    """Markdown: per profiled TSP (layout, S) and layer type, the counted GEMM FLOPs and bytes against the least
    the layer type needs (ds_tsp.tools.bench.work), and the cp axis's bytes and waits."""
    rows = [r for r in results if r.get("profile", {}).get("work")]
    if not rows:
        return ""

    def num(v, scale, fmt):
        return "-" if v is None else format(v / scale, fmt)

    lines = ["| layout | S | D | layer type | GFLOP | min GFLOP | FLOPs / min | MiB | min MiB | bytes / min | "
             "cp MiB | cp wait s |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = r.get("label") or r["layout"]
        for layer, w in r["profile"]["work"].items():
            lines.append(f"| {label} | {r['seq']} | {r.get('tsp')} | {layer} | {num(w['gemm_flops'], 1e9, '.3f')} | "
                         f"{num(w['min_gemm_flops'], 1e9, '.3f')} | {num(w['flops_over_min'], 1, '.3f')} | "
                         f"{num(w['comm_bytes'], 2 ** 20, '.2f')} | {num(w['min_comm_bytes'], 2 ** 20, '.2f')} | "
                         f"{num(w['bytes_over_min'], 1, '.3f')} | {num(w['cp_bytes'], 2 ** 20, '.2f')} | "
                         f"{w['cp_wait_s']:.3f} |")
    return "\n".join(lines)


def append_profile(md_path: str, results: list[dict]) -> None:
    """Add the profile table (and TSP's work against the minimum) to a run's results.md."""
    def section(title: str, intro: str, table: str) -> None:
        if table:
            with open(md_path, "a") as f:
                f.write(f"\n## Profile: {title}\n\n{intro}\n\n{table}\n")

    section("seconds (share of the profiled step) per phase",
            "One extra step per layout and S under torch.profiler, the slowest rank's; TSP rows are also split by "
            "layer type. See ds_tsp/tools/bench/profile.py for what each phase counts.", profile_table(results))
    section("work per layer type against the minimum (TSP, all ranks summed)",
            "Counted in the profiled step on every rank: GEMM FLOPs of every aten mm / addmm / bmm / baddbmm "
            "(and their in-place forms; FlopCounterMode's formulas over the recorded shapes) and the "
            "CommCounter's bytes (TSP group; cp axis apart, with its waits), each charged to the enclosing "
            "layer type. min: the least forward + backward with nothing recomputed, and the bytes the "
            "schedule needs (ds_tsp/tools/bench/work.py); '-' where no closed form is given. The memory-"
            "optimal mode's documented recomputes show as FLOPs / min = 22/18 = 1.222 for the gated MLP and "
            "the experts (gate/up again), above 1 for attention (q/k/v again: 1.25 with as many kv heads as "
            "heads) and 8/6 = 1.333 for the vocab "
            "(the logits rebuilt per tile).", work_table(results))
    section("the ops behind each layer type's seconds",
            f"The same profiled step: per layer type (a peer's whole step is \"rest\"), its {TOP_OPS_PER_LAYER} aten "
            "ops with the most self time, in seconds.", top_ops_table(results))
