"""`ds-tsp bench --layer-memory`: what ONE TSP decoder layer keeps for backward, and its peak transients, per rank.

One TSPDecoderLayer (memory-optimal TSPOptions()) runs forward + backward on D ranks, either real (D gloo processes,
real kernels) or `--fake` (each rank in turn as one rank of torch's fake process group under FakeTensorMode: no
data, no compute, the same allocations; minutes of CPU become seconds, so a 7B layer at S=8192 is measurable here).
Per rank it reports:
  saved      every tensor the layer's autograd graph keeps (saved_tensors_hooks), deduplicated by storage (views
             of one buffer count once), named by the Function that saved it and the module it was saved in.
             Parameters and the tensors the caller owns (cos/sin, shared by every layer; dy) are listed apart. The
             layer INPUT is counted as the layer's when the layer saves it: in a stack it is the previous layer's
             output and nobody else keeps it (the same convention as ds_tsp.tools.plan's per-layer figure).
  peaks      MemTracker (torch.distributed._tools.mem_tracker) per module: the peak of forward and of backward
             above the memory at the module's entry (forward: includes what the module saves and returns;
             backward: includes the weight grads it creates, shown apart).
  minimum    the design's minimum for backward (`minimum_saved`), evaluated for the shape, and measured / minimum.
  plan       ds_tsp.tools.plan's per-layer saved bytes and transients for the same shape, for comparison.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_tsp.tools.cli_types import MIB

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass(frozen=True)
class LayerMemoryConfig:
    """One layer's shape and run; defaults: Zyphra's 7B (Llama-2 7B shape) at S=8192, D=2, bf16."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None  # None: MHA
    ffn: int = 11008
    seq: int = 8192
    tsp: int = 2
    batch: int = 1
    dtype: str = "bf16"
    fake: bool = False
    seed: int = 0

    @property
    def shape(self):
        from ds_tsp.core.shape.model_shape import ModelShape

        return ModelShape(vocab_size=32000, hidden_size=self.hidden, intermediate_size=self.ffn, num_layers=1,
                          num_heads=self.heads, num_kv_heads=self.heads if self.kv_heads is None else self.kv_heads)

    @property
    def dtype_bytes(self) -> int:
        return {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}[self.dtype]

    def check(self) -> None:
        """Raises ValueError naming the flag."""
        from ds_tsp.core.errors import TSPConfigError

        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.seq % (2 * self.tsp):
            raise ValueError(f"--seq {self.seq}: must be a multiple of 2*--tsp={2 * self.tsp} (zigzag chunks)")
        try:
            self.shape.check_tsp_degree(self.tsp)
        except TSPConfigError as exc:
            raise ValueError(str(exc)) from None


def minimum_saved(cfg: LayerMemoryConfig) -> list[tuple[str, int]]:
    """What backward needs at least, by the design (memory-optimal, projections recomputed), per rank, in bytes.

    T = B * S/D local tokens, b = dtype bytes, cb = max(b, 4) (norm statistics and LSE are computed in >= fp32):
      each RMSNorm: its input [T, h] b and rstd [T] cb (dx and dweight follow from x, rstd and the weight)
      attention (a Function that recomputes q/k/v): its input x [T, h] b; per head block its output [T, nq/D, d] b
          and log-sum-exp [T, nq/D] cb: over the D blocks T*nq*d*b + T*nq*cb; K/V re-gathered, nothing kept
      MLP (recomputes gate/up): its input x [T, h] b
    The first norm's input is the layer input (see the module docstring); the second's the residual sum h1."""
    shape, D, B, b = cfg.shape, cfg.tsp, cfg.batch, cfg.dtype_bytes
    cb = max(b, 4)
    T, h, nq, d = B * cfg.seq // D, shape.hidden_size, shape.num_heads, shape.dim_per_head
    return [("input_layernorm: input (the layer input) [T, h]", T * h * b),
            ("input_layernorm: rstd [T]", T * cb),
            ("self_attn: x (input_layernorm output) [T, h]", T * h * b),
            ("self_attn: out of every head block [T, nq, d]", T * nq * d * b),
            ("self_attn: log-sum-exp of every head block [T, nq]", T * nq * cb),
            ("post_attention_layernorm: input h1 = h + attn [T, h]", T * h * b),
            ("post_attention_layernorm: rstd [T]", T * cb),
            ("mlp: x (post_attention_layernorm output) [T, h]", T * h * b)]


class SavedLedger:
    """Records what autograd saves while open (saved_tensors_hooks), deduplicated by storage; holds no tensor
    (weak references only), so nothing outlives the graph because of it.

        with SavedLedger(module) as ledger:   # module: optional, to attribute each save to its innermost submodule
            y = f(x)
        ledger.name_savers(y)                 # optional: which autograd Functions saved each storage
        ledger.entries -> [{"bytes", "dtype", "shapes", "modules", "savers"}]
    """

    def __init__(self, module=None):
        from torch.utils.weak import WeakIdKeyDictionary

        self._by_storage = WeakIdKeyDictionary()
        self._order: list[dict] = []
        self._module, self._stack, self._handles = module, [], []

    def __enter__(self) -> "SavedLedger":
        import torch

        if self._module is not None:
            def enter(label):
                def hook(module, args):
                    self._stack.append(label)
                return hook

            def leave(module, args, output):  # returns None: a forward hook's return value replaces the output
                self._stack.pop()

            for name, sub in self._module.named_modules():
                self._handles.append(sub.register_forward_pre_hook(enter(name or type(self._module).__name__)))
                self._handles.append(sub.register_forward_hook(leave))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _entry(self, t):
        storage = t.untyped_storage()
        entry = self._by_storage.get(storage)
        if entry is None:
            entry = {"bytes": storage.nbytes(), "dtype": str(t.dtype).replace("torch.", ""), "shapes": [],
                     "modules": [], "savers": [], "owner": None}
            self._by_storage[storage] = entry
            self._order.append(entry)
        return entry

    def _pack(self, t):
        entry = self._entry(t)
        shape = list(t.shape)
        if shape not in entry["shapes"]:
            entry["shapes"].append(shape)
        where = self._stack[-1] if self._stack else "(outside)"
        if where not in entry["modules"]:
            entry["modules"].append(where)
        return t

    def mark(self, owner: str, tensors) -> None:
        """Label storages that belong to someone else (parameters, caller-owned inputs) if they were saved."""
        for t in tensors:
            entry = self._by_storage.get(t.untyped_storage())
            if entry is not None and entry["owner"] is None:
                entry["owner"] = owner

    def name_savers(self, *outputs) -> None:
        """Walk the graph from `outputs` and record, per saved storage, the autograd nodes holding it."""
        import torch

        seen, todo = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            todo.extend(fn for fn, _ in node.next_functions)
            name = type(node).__name__
            tensors = []
            if hasattr(node, "saved_tensors"):  # a custom autograd.Function's ctx
                tensors = list(node.saved_tensors)
            else:
                for attr in dir(node):
                    if attr.startswith("_saved_"):
                        value = getattr(node, attr)
                        values = value if isinstance(value, (list, tuple)) else (value,)
                        tensors += [v for v in values if isinstance(v, torch.Tensor)]
            for t in tensors:
                entry = self._by_storage.get(t.untyped_storage())
                if entry is not None and name not in entry["savers"]:
                    entry["savers"].append(name)
            del tensors

    @property
    def entries(self) -> list[dict]:
        return list(self._order)


def _snap_total(snap: dict, key: str = "Total") -> int:
    return sum(int(v) for dev in snap.values() for k, v in dev.items() if getattr(k, "value", k) == key)


def _module_peaks(tracker, module) -> dict:
    """Forward / backward peak above the module's entry (MemTracker's per-module snapshots). Weight grads being
    formed count in the backward peak (MemTracker labels them grads only once accumulated into .grad)."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = tracker.memory_tracking[module]
    snaps = {state: stats.snapshots.get(state, [None])[-1] for state in
             (_ModState.PRE_FW, _ModState.PEAK_FW, _ModState.POST_FW, _ModState.PRE_BW, _ModState.PEAK_BW,
              _ModState.POST_BW)}
    out = {}
    if snaps[_ModState.PRE_FW] and snaps[_ModState.PEAK_FW]:
        entry = _snap_total(snaps[_ModState.PRE_FW])
        out["fwd_peak_above_entry"] = _snap_total(snaps[_ModState.PEAK_FW]) - entry
        if snaps[_ModState.POST_FW]:
            out["fwd_kept_after"] = _snap_total(snaps[_ModState.POST_FW]) - entry
    if snaps[_ModState.PRE_BW] and snaps[_ModState.PEAK_BW]:
        entry, peak = snaps[_ModState.PRE_BW], snaps[_ModState.PEAK_BW]
        out["bwd_peak_above_entry"] = _snap_total(peak) - _snap_total(entry)
    return out


def measure_rank(cfg: LayerMemoryConfig) -> dict:
    """This rank's measurement (a process group over the D ranks is up: gloo, or fake under FakeTensorMode)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.tokens.positions import RopeTables
    from ds_tsp.core.tokens.rope import rope_cos_sin
    from ds_tsp.core.tokens.zigzag import zigzag_positions
    from ds_tsp.model.modules.decoder import TSPDecoderLayer

    comm = TSPComm(dist.group.WORLD)
    if comm.size != cfg.tsp:
        raise ValueError(f"--tsp {cfg.tsp}: the process group has {comm.size} ranks")
    dtype = getattr(torch, DTYPES[cfg.dtype])
    shape = cfg.shape
    gen = torch.Generator().manual_seed(cfg.seed + comm.rank)
    layer = TSPDecoderLayer(shape, comm, TSPOptions(), dtype, "cpu")
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1 and p.numel() == shape.hidden_size:
                continue  # norm weights: ones
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    L = cfg.seq // cfg.tsp
    positions = zigzag_positions(cfg.seq, cfg.tsp, comm.rank).expand(cfg.batch, L)
    cos, sin = rope_cos_sin(positions, shape.dim_per_head, shape.rope_theta, dtype)
    x = torch.randn(cfg.batch, L, shape.hidden_size, generator=gen, dtype=torch.float32).to(dtype).requires_grad_()
    dy = torch.randn(cfg.batch, L, shape.hidden_size, generator=gen, dtype=torch.float32).to(dtype)

    tracker = MemTracker()
    tracker.track_external(layer, x, cos, sin, dy)
    ledger = SavedLedger(layer)
    with tracker:
        with ledger:
            y = layer(x, RopeTables(cos, sin))
        ledger.mark("parameter", list(layer.parameters()))
        ledger.mark("caller: layer input", [x])
        ledger.mark("caller: cos/sin (shared by every layer)", [cos, sin])
        ledger.name_savers(y)
        y.backward(dy)
    del y
    entries = ledger.entries
    mine = [e for e in entries if e["owner"] in (None, "caller: layer input")]
    others = [e for e in entries if e["owner"] not in (None, "caller: layer input")]
    saved = sum(e["bytes"] for e in mine)
    peaks = {"layer": _module_peaks(tracker, layer)}
    peaks.update({name: _module_peaks(tracker, getattr(layer, name)) for name in SUBMODULES})
    return {"rank": comm.rank, "saved_bytes": saved, "saved": mine, "not_counted": others, "peaks": peaks,
            "peak_bytes": _snap_total(tracker.get_tracker_snapshot("peak"))}


def run_real(cfg: LayerMemoryConfig, timeout_s: float = 3600) -> list[dict]:
    """D gloo processes, real tensors and kernels."""
    from ds_tsp.core.parallel.launch import run_on_local_ranks

    return run_on_local_ranks(measure_rank, cfg.tsp, cfg, timeout_s=timeout_s)


def run_fake(cfg: LayerMemoryConfig) -> list[dict]:
    """Each rank in turn as one rank of a fake process group (collectives complete at once and move nothing) under
    FakeTensorMode (shapes, dtypes and storages, no data). Needs a process with no process group up."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("--fake needs a process without a process group (it starts one fake group per rank)")
    out = []
    for rank in range(cfg.tsp):
        dist.init_process_group("cpu:fake", store=FakeStore(), rank=rank, world_size=cfg.tsp)
        try:
            with FakeTensorMode():
                out.append(measure_rank(cfg))
        finally:
            dist.destroy_process_group()
    return out


def plan_layer(cfg: LayerMemoryConfig) -> dict:
    """ds_tsp.tools.plan's per-layer saved bytes and transients for this shape (memory-optimal, no checkpointing)."""
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp import tsp_layer_saved, tsp_transients
    from ds_tsp.tools.plan.tsp_comm import TSPGeometry

    inp = PlanInput(model=cfg.shape, seq=cfg.seq, batch=cfg.batch, degree=cfg.tsp, dtype=cfg.dtype)
    g = TSPGeometry.of(inp)
    transients = tsp_transients(inp, g)
    return {"saved_bytes": tsp_layer_saved(inp, g),
            "transients": {k: v for k, v in transients.items() if not k.startswith("lm_head")}}


def measure(cfg: LayerMemoryConfig, timeout_s: float = 3600) -> dict:
    """The whole report: per-rank measurements, the design minimum, the plan, and the worst rank's ratios."""
    cfg.check()
    ranks = run_fake(cfg) if cfg.fake else run_real(cfg, timeout_s)
    minimum = minimum_saved(cfg)
    min_total = sum(b for _, b in minimum)
    worst = max(ranks, key=lambda r: r["saved_bytes"])
    return {"mode": "layer_memory", "source": "fake (FakeTensorMode + fake process group)" if cfg.fake
            else "real (gloo, CPU kernels)", "config": asdict(cfg), "ranks": ranks,
            "minimum": [{"what": what, "bytes": b} for what, b in minimum], "minimum_bytes": min_total,
            "saved_bytes": worst["saved_bytes"], "saved_over_minimum": worst["saved_bytes"] / min_total,
            "plan": plan_layer(cfg)}


def _mib(n: int) -> str:
    return f"{n / MIB:.3f}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    worst = max(result["ranks"], key=lambda r: r["saved_bytes"])
    lines = ["# ds-tsp bench --layer-memory", "",
             f"One TSPDecoderLayer, memory-optimal TSPOptions(): hidden {cfg['hidden']}, heads {cfg['heads']}/"
             f"{cfg['kv_heads'] or cfg['heads']} kv, MLP {cfg['ffn']}, S={cfg['seq']}, D={cfg['tsp']}, batch "
             f"{cfg['batch']}, {cfg['dtype']}. Numbers from: {result['source']}.", "",
             f"Saved for backward per layer (rank {worst['rank']}, the largest): **{_mib(result['saved_bytes'])} MiB**;"
             f" design minimum {_mib(result['minimum_bytes'])} MiB; measured / minimum = "
             f"**{result['saved_over_minimum']:.3f}**; plan's tsp_layer_saved {_mib(result['plan']['saved_bytes'])} "
             "MiB.", "", "## What the backward keeps (deduplicated by storage)", "",
             "| MiB | dtype | shapes | saved by (Function) | in module | note |", "|---:|---|---|---|---|---|"]
    for e in sorted(worst["saved"], key=lambda e: -e["bytes"]):
        lines.append(f"| {_mib(e['bytes'])} | {e['dtype']} | {' '.join(map(str, e['shapes']))} | "
                     f"{', '.join(e['savers']) or '?'} | {', '.join(e['modules'])} | {e['owner'] or ''} |")
    lines += ["", "Not counted (parameters; cos/sin, which every layer shares):", ""]
    lines += [f"- {_mib(e['bytes'])} MiB {e['dtype']} {e['shapes']}: {e['owner']} ({', '.join(e['savers'])})"
              for e in worst["not_counted"]]
    lines += ["", "## Design minimum", "", "| MiB | term |", "|---:|---|"]
    lines += [f"| {_mib(m['bytes'])} | {m['what']} |" for m in result["minimum"]]
    lines += ["", "## Peaks above entry (MemTracker, per module)", "",
              "| rank | module | fwd peak above entry MiB | fwd kept after MiB | bwd peak above entry MiB |",
              "|---:|---|---:|---:|---:|"]
    for r in result["ranks"]:
        for name, p in r["peaks"].items():
            lines.append(f"| {r['rank']} | {name} | " + " | ".join(
                _mib(p[k]) if k in p else "-" for k in ("fwd_peak_above_entry", "fwd_kept_after",
                                                         "bwd_peak_above_entry")) + " |")
    lines += ["", "Plan transients (ds_tsp.tools.plan.tsp.tsp_transients) for this shape, MiB: "
              + ", ".join(f"{k} {_mib(v)}" for k, v in result["plan"]["transients"].items()), ""]
    return "\n".join(lines)


def write(result: dict, out_dir: str) -> dict[str, str]:
    return write_results(result, out_dir, "layer_memory", markdown(result))


def write_results(result: dict, out_dir: str, stem: str, markdown_text: str) -> dict[str, str]:
    """<out_dir>/<stem>.json (the result) and <stem>.md (its tables); returns both paths."""
    import json
    import os

    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "md": os.path.join(out_dir, f"{stem}.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown_text)
    return paths
