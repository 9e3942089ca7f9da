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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ds_tsp.core.comm.communicator import COMM_WAIT_RANGE

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

    @property
    def self_s(self) -> float:
        return max(0.0, self.seconds - self.children_s)


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
    spans = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                    if not e.name.startswith(ASYNC_SPANS)), key=lambda t: (t[0], -t[1]))
    nodes, stack = [], []
    for start, end, name in spans:
        while stack and stack[-1][1] <= start:
            stack.pop()
        parent = stack[-1][0] if stack else None
        node = _Node(name, (end - start) / 1e6, parent)
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


def profile_step(workload) -> dict:
    """Seconds per phase (and per layer type x phase) of one step of `workload` on this rank, its wall time and
    the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    counter = workload.tsp_counter
    if counter is not None:
        counter.reset()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
        workload.step()
    wall = time.perf_counter() - start  # includes profiler overhead: the phases are shares of THIS step
    nodes = nest(_main_thread_events(prof))
    totals, by_layer = attribute(nodes, wall)
    ops: dict[str, float] = {}
    blocked = 0.0
    for node in nodes:
        if node.name.startswith("aten::"):
            ops[node.name] = ops.get(node.name, 0.0) + node.self_s
        elif node.name == COMM_WAIT_RANGE:
            blocked += node.seconds
    out = {**totals, "wall_s": wall, "blocked_s": blocked,
           "by_layer": {layer: cells for layer, cells in by_layer.items() if any(cells.values())},
           "top_ops": [[name, round(s, 6)] for name, s in sorted(ops.items(), key=lambda kv: -kv[1])[:10]]}
    if counter is not None:
        out["counter_wait_s"] = float(counter.snapshot()["wait_s"])  # cross-check of blocked_s (TSP only)
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


def append_profile(md_path: str, results: list[dict]) -> None:
    """Add the profile table to a run's results.md."""
    table = profile_table(results)
    if table:
        with open(md_path, "a") as f:
            f.write("\n## Profile: seconds (share of the profiled step) per phase\n\n"
                    "One extra step per layout and S under torch.profiler, the slowest rank's; TSP rows are also "
                    "split by layer type. See ds_tsp/tools/bench/profile.py for what each phase counts.\n\n"
                    + table + "\n")
