"""`ds-tsp bench`: the same model, S, batch and degree D under TSP and its peers; JSON, a table and plots.

    ds-tsp bench --quick --out DIR                    all layouts, S in {512, 1024}, 2 steps (~2-3 min, 2 cores)
    ds-tsp bench --layouts tsp,tsp_speed,ulysses_zero3 --seq 2048 8192 --out DIR
    ds-tsp bench --tsp 2 --cp 2 --seq 2048 8192       tsp_cp (2 TSP groups of 2) vs TSP=4 and Ulysses on 4 ranks

`register(subparsers)` adds the subcommand to ds_tsp.tools.cli's parser; `build_parser()` is a standalone one
(`python -m ds_tsp.tools.bench ...`). Exit codes: 0 every run ok (with --max-seq a layout that fits nothing is a
result: max S "none"), 1 a run failed (its object has "ok": false and "error"), 2 bad input (one line on stderr
naming the flag). Without --out, results go to default_out_dir() (the user's cache), printed on the last line.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ds_tsp.tools.bench.config import DEFAULT_DS_BUCKET, DEFAULT_SHAPE, LAYOUTS
from ds_tsp.tools.cli_types import MIB, OneLineErrors, integer, non_negative, positive

if TYPE_CHECKING:
    from ds_tsp.core.shape.model_shape import ModelShape

__all__ = ["register", "build_parser", "run", "main", "QUICK"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# --quick: the default model with 2 of its 4 layers, two lengths, 2 timed steps. Startup of 7 process groups
# (torch, transformers, DeepSpeed imports on 4 ranks each) is ~half of its ~2-3 minutes on 2 cores.
QUICK = {"seqs": (512, 1024), "steps": 2, "warmup": 1, "layers": 2}
DEFAULT_SEQS = (2048, 8192)
# --layer-memory defaults: one decoder layer of Zyphra's 7B (Llama-2 7B shape) at S=8192 over D=2, bf16
LAYER_MEMORY_DEFAULTS = {"hidden": 4096, "heads": 32, "ffn": 11008, "seq": 8192, "tsp": 2, "dtype": "bf16"}
_count = positive(integer)  # 8192, 8k, 5e6


def _seq_list(text: str) -> list[int]:
    return [_count(part) for part in text.split(",") if part.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(LAYOUTS)
    p.add_argument("--layouts", default="all",
                   help=f"comma-separated layouts to run, or 'all' (default). Known: {names}")
    p.add_argument("--seq", type=_seq_list, nargs="+", default=None, metavar="S",
                   help=f"sequence lengths (space or comma separated; default {' '.join(map(str, DEFAULT_SEQS))}, "
                        f"--quick: {' '.join(map(str, QUICK['seqs']))}); multiples of 2*--tsp")
    p.add_argument("--tsp", type=_count, nargs="+", default=None,
                   help="degree D: ranks of every parallel layout (4; --layer-memory: 2); several (e.g. 2 4) measure "
                        "every layout at each degree in one run")
    p.add_argument("--cp", type=_count, default=1, metavar="C",
                   help="context-parallel degree C (1): layout tsp_cp runs C TSP groups of --tsp D ranks sharing each "
                        "sequence (a cp ring between them), against its peers on the same C x D ranks (default: "
                        "tsp and ulysses_zero3; ds_tsp.tools.bench.cp_flags); S a multiple of 2*D*C")
    p.add_argument("--cp-comm", default="ring", metavar="LIST",
                   help="with --cp: comma list of tsp_cp's cp schedules to measure, ring, all_to_all and / or auto "
                        "(the model's choice per length, named in the row's cp_comm_chosen) (ring); one tsp_cp row "
                        "each")
    p.add_argument("--batch", type=_count, default=None, help="micro-batch size B of every layout (1)")
    p.add_argument("--global-batch", type=_count, default=None, metavar="N",
                   help="instead of --batch: N sequences per optimizer step under every layout, so each moves its "
                        "weights for the same tokens; a data-parallel layout (hf_zero3_dp, hf_fsdp2_dp) runs "
                        "N / ranks per rank, every other layout N (its ranks share each sequence)")
    p.add_argument("--layers", type=_count, default=None,
                   help=f"decoder layers ({DEFAULT_SHAPE.num_layers}; --quick: {QUICK['layers']})")
    p.add_argument("--hidden", type=_count, default=None,
                   help=f"hidden size ({DEFAULT_SHAPE.hidden_size}; --layer-memory: {LAYER_MEMORY_DEFAULTS['hidden']})")
    p.add_argument("--heads", type=_count, default=None,
                   help=f"query heads ({DEFAULT_SHAPE.num_heads}; --layer-memory: {LAYER_MEMORY_DEFAULTS['heads']})")
    p.add_argument("--kv-heads", type=_count, default=None, help="kv heads (default: --heads, MHA)")
    p.add_argument("--ffn", type=_count, default=None,
                   help=f"MLP width ({DEFAULT_SHAPE.intermediate_size}; "
                        f"--layer-memory: {LAYER_MEMORY_DEFAULTS['ffn']})")
    p.add_argument("--vocab", type=_count, default=DEFAULT_SHAPE.vocab_size)
    p.add_argument("--steps", type=_count, default=None, help="timed steps per run (3; --quick: 2)")
    p.add_argument("--warmup", type=non_negative(integer), default=None, help="untimed warm-up steps (1)")
    p.add_argument("--rounds", type=_count, default=1,
                   help="run the layouts this many times in turn (A B, A B, ...): step s is the median over every "
                        "round's timed steps, and results.md shows each round's tokens/s and the first layout's "
                        "over each one's, round by round, so a machine whose speed drifts slows every layout alike "
                        "(1)")
    p.add_argument("--activation-checkpointing", nargs="?", const="peers", default="none",
                   choices=("none", "peers", "all"),
                   help="bare flag or 'peers': HF gradient checkpointing for every peer (TSP's schedule already "
                        "saves O(S/D) per layer); 'all': TSP too (TSPOptions(activation_checkpointing=True))")
    p.add_argument("--quick", action="store_true",
                   help="small run for ~2-3 minutes on 2 CPU cores: S 512 and 1024, 2 layers, 2 timed steps "
                        "(explicit flags still win)")
    p.add_argument("--max-seq", action="store_true",
                   help="instead of fixed --seq: per layout, with and without activation checkpointing, the "
                        "longest S whose measured per-rank peak fits --budget-mib (doubling, then bisection to 5%%; "
                        "1 tracked step per probe, --warmup default 0)")
    p.add_argument("--budget-mib", type=positive(float), default=None,
                   help="per-rank memory budget for --max-seq (MiB)")
    p.add_argument("--out", default=None,
                   help="output folder (default: $XDG_CACHE_HOME/ds_tsp/bench, else ~/.cache/ds_tsp/bench; the "
                        "last line says where)")
    p.add_argument("--ds-bucket", type=_count, default=DEFAULT_DS_BUCKET,
                   help=f"DeepSpeed bucket sizes in elements ({DEFAULT_DS_BUCKET:.0e}; DeepSpeed's own 5e8 default "
                        "alone shows ~1.9 GB per rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive(float), default=3600.0, help="seconds per layout's process group (3600)")
    p.add_argument("--profile", action="store_true",
                   help="one extra profiled step per layout and S after the timed ones; per-phase seconds "
                        "(GEMM, attention, comm wait, copies, elementwise, other) under 'profile' in results.json, "
                        "split by layer type (attention, gdn, mlp, moe, vocab, optimizer, rest) for TSP, with each "
                        "layer type's counted GEMM FLOPs and bytes against its minimum ('work')")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (neither the lines nor, on a terminal, the bar)")
    moe = p.add_argument_group(
        "mixture of experts (TSP layouts only)",
        "Every layer sparse (Mixtral-like: top-k probabilities renormalised). --moe-dispatch ring,all_to_all "
        "measures both schedules in one run (one row each); the MoE table beside results.md shows the plan's "
        "\"auto\" choice next to the measured faster schedule (ds_tsp.tools.bench.moe_report).")
    moe.add_argument("--num-experts", type=_count, default=None, help="experts per layer (a multiple of --tsp)")
    moe.add_argument("--top-k", type=_count, default=None, help="experts per token (2)")
    moe.add_argument("--moe-ffn", type=_count, default=None, help="per-expert MLP width (--ffn)")
    moe.add_argument("--moe-dispatch", default="auto", metavar="LIST",
                     help="comma list of TSP MoE schedules to measure: auto, ring, all_to_all (auto)")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="take the model shape from an HF config.json (or its directory): Llama, Mistral, Qwen2/3, "
                        "Qwen3-MoE, Mixtral; --layers still shortens it, the other shape flags are refused")
    vision = p.add_argument_group(
        "a vision-language model (--hf-config of a multimodal Qwen3.5 / Qwen3-VL; ds_tsp.tools.bench.vision)",
        "A step with images and / or videos in the batch, on tsp, hf_zero3_dp and hf_fsdp2_dp; results.json gives "
        "each rank's vision tower share (MemTracker) under vision_tower.")
    vision.add_argument("--images", type=non_negative(integer), default=0, metavar="N", help="images in the batch")
    vision.add_argument("--image-tokens", type=non_negative(integer), default=0, metavar="T",
                        help="vision tokens per image (after the spatial merge)")
    vision.add_argument("--videos", type=non_negative(integer), default=0, metavar="M", help="videos in the batch")
    vision.add_argument("--video-tokens", type=non_negative(integer), default=0, metavar="F",
                        help="vision tokens per video (frames of up to 256 tokens each)")
    layer = p.add_argument_group(
        "one decoder layer's memory (--layer-memory; ds_tsp.tools.bench.layer_memory)",
        "ONE TSPDecoderLayer (memory-optimal) forward + backward on D ranks: its saved tensors one by one "
        "(deduplicated by storage), MemTracker's forward / backward peaks above entry per module, the design's "
        "minimum and the plan's figures. Uses --hidden --heads --kv-heads --ffn --seq (one value) --tsp (one) "
        "--batch; defaults: Zyphra's 7B layer (h=4096, 32 heads, SwiGLU 11008) at S=8192, D=2, bf16.")
    layer.add_argument("--layer-memory", action="store_true", help="measure one decoder layer instead of a model")
    layer.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32", "fp64"),
                       help="--layer-memory dtype (bf16); the model benchmark always runs fp32")
    layer.add_argument("--fake", action="store_true",
                       help="--layer-memory under FakeTensorMode with torch's fake process group: the same "
                            "allocations without data or compute (seconds instead of an hour for the 7B layer)")
    layer.add_argument("--offload-activations", action="store_true",
                       help="--layer-memory --fake: a stack of --layers (8) checkpointed layers, one step with the "
                            "layer inputs kept and one offloaded to host memory: the device peak drop and the host "
                            "pool against the plan (ds_tsp.tools.bench.offload_memory)")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="compare TSP with TP+SP (DTensor), DeepSpeed Ulysses (ZeRO-3/1) and AutoTP",
        description="Run one model at each sequence length under every layout, each in its own group of --tsp "
                    "local gloo processes; measure per-rank peak memory (MemTracker breakdown), bytes "
                    "communicated, step time and tokens/s; write OUT/results.json, OUT/results.md and PNG plots.")
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="ds-tsp bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _error(message: str) -> int:
    print(f"ds-tsp bench: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def configs_from_args(args: argparse.Namespace):
    """Validated BenchConfig per layout; raises ValueError naming the flag."""
    from ds_tsp.core.errors import TSPConfigError

    _model_defaults(args)
    if getattr(args, "global_batch", None) and args.batch:
        raise ValueError(f"--batch {args.batch} and --global-batch {args.global_batch}: give one (--batch: the same "
                         "micro-batch under every layout; --global-batch: the same sequences per step)")
    args.global_batch = getattr(args, "global_batch", None)
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.bench.config import BenchConfig

    if isinstance(args.tsp, (list, tuple)):
        configs = [cfg for degree in dict.fromkeys(args.tsp)
                   for cfg in configs_from_args(argparse.Namespace(**{**vars(args), "tsp": degree}))]
        single = [c for c in configs if c.spec.single_rank]
        # a single-rank layout does not depend on D: measured once, with the first degree
        return [c for c in configs if not c.spec.single_rank or c is single[0]]
    if args.layouts.strip() == "all":
        layouts = [name for name, spec in LAYOUTS.items() if not spec.named_only]
    else:
        layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
        unknown = [name for name in layouts if name not in LAYOUTS]
        if unknown or not layouts:
            raise ValueError(f"--layouts: unknown {unknown or '(empty)'}; choose from {', '.join(LAYOUTS)} or all")
    from ds_tsp.tools.bench.cp_flags import cp_comms, cp_configs, cp_degree, cp_layouts

    layouts, cp, comms = cp_layouts(args, layouts), cp_degree(args), cp_comms(args)
    seqs = tuple(sorted({s for group in args.seq for s in group})) if args.seq else \
        (QUICK["seqs"] if args.quick else DEFAULT_SEQS)
    bad = [s for s in seqs if s % (2 * args.tsp * cp)]
    if bad:
        raise ValueError(f"--seq {bad}: every layout gets the same tokens, so S must be a multiple of 2*--tsp"
                         f"{'*--cp' if cp > 1 else ''}={2 * args.tsp * cp} (TSP's zigzag chunks; Ulysses / sequence "
                         "parallel split S by D)")
    steps = args.steps if args.steps is not None else (QUICK["steps"] if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else QUICK["warmup"]
    layers = args.layers if args.layers is not None else (QUICK["layers"] if args.quick else DEFAULT_SHAPE.num_layers)
    from ds_tsp.tools.bench.moe_report import moe_dispatches, moe_fields, moe_layouts

    try:
        if getattr(args, "hf_config", None):
            shape = _shape_from_hf_config(args.hf_config, args.layers)
        else:
            shape = ModelShape(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                               num_layers=layers, num_heads=args.heads,
                               num_kv_heads=args.heads if args.kv_heads is None else args.kv_heads, **moe_fields(args))
        from ds_tsp.tools.bench.hybrid import hybrid_layouts

        layouts = hybrid_layouts(shape, args.layouts, layouts)
        if shape.layer_types is None:  # a hybrid MoE's layouts are hybrid_layouts'
            layouts = moe_layouts(args, layouts, shape)
        dispatches = moe_dispatches(args, shape)
        if cp == 1 and any(LAYOUTS[name].module == "tsp" for name in layouts):
            shape.check_tsp_degree(args.tsp)
    except TSPConfigError as exc:
        raise ValueError(str(exc)) from None
    vision = _vision_bench(args, layouts, cp, seqs)
    configs = [BenchConfig(layout=name, seqs=seqs, tsp=args.tsp, batch=args.batch or 1, shape=shape, steps=steps,
                           warmup=warmup, activation_checkpointing=args.activation_checkpointing, seed=args.seed,
                           ds_bucket_elements=args.ds_bucket, profile=getattr(args, "profile", False),
                           moe_dispatch=dispatch, vision=vision) for name in layouts
               for dispatch in (dispatches if LAYOUTS[name].module in ("tsp", "tsp_cp") else ["auto"])]
    configs = cp_configs(configs, cp, tuple(comms))  # tsp_cp on C groups of D (per cp schedule), its peers on C x D
    return _with_global_batch(configs, args.global_batch) if args.global_batch else configs


def _with_global_batch(configs: list, n: int) -> list:
    """Each layout's micro-batch for N sequences per step (--global-batch): N / ranks for a data-parallel layout,
    N for one whose ranks share each sequence; ValueError naming the flag where N does not split."""
    from dataclasses import replace

    out = []
    for cfg in configs:
        if cfg.spec.data_parallel and n % cfg.world:
            raise ValueError(f"--global-batch {n}: {cfg.layout} runs its own sequences on each of its {cfg.world} "
                             f"ranks; give a multiple of {cfg.world}")
        out.append(replace(cfg, batch=n // cfg.world if cfg.spec.data_parallel else n))
    return out


def _vision_bench(args: argparse.Namespace, layouts: list[str], cp: int, seqs: tuple[int, ...]):
    """--images / --videos: the VisionBench of the run (None without them); ValueError naming the flag."""
    if not (getattr(args, "images", 0) or getattr(args, "videos", 0) or getattr(args, "image_tokens", 0)
            or getattr(args, "video_tokens", 0)):
        return None
    import json
    from pathlib import Path

    from ds_tsp.tools.bench.vision import check_layouts, vision_bench

    if not getattr(args, "hf_config", None):
        raise ValueError("--images / --videos: give --hf-config with a multimodal config.json")
    if cp > 1 or getattr(args, "max_seq", False) or getattr(args, "profile", False):
        raise ValueError("--images / --videos: not with --cp, --max-seq or --profile (a fixed-S step of the VLM)")
    path = Path(args.hf_config)
    config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    vision = vision_bench(config, args.layers, args.images, args.image_tokens, args.videos, args.video_tokens)
    check_layouts(layouts)
    if args.global_batch:
        raise ValueError("--global-batch: not with --images / --videos (give --batch: every layout runs the same "
                         "rows)")
    batch = args.batch or 1
    short = [s for s in seqs if s < vision.tokens_needed(batch)]
    if short:
        raise ValueError(f"--seq {short}: the images and videos over --batch {batch} rows need S >= "
                         f"{vision.tokens_needed(batch)}")
    return vision


def _check_hf_config_flags(args: argparse.Namespace) -> None:
    """--hf-config gives the shape: an explicit shape flag beside it is ambiguous (ValueError naming it)."""
    if not getattr(args, "hf_config", None):
        return
    for flag, name in (("--hidden", "hidden"), ("--heads", "heads"), ("--kv-heads", "kv_heads"), ("--ffn", "ffn"),
                       ("--num-experts", "num_experts"), ("--top-k", "top_k"), ("--moe-ffn", "moe_ffn")):
        if getattr(args, name, None) is not None:
            raise ValueError(f"{flag}: the shape comes from --hf-config; remove {flag} (or --hf-config)")


def _shape_from_hf_config(path: str, layers: int | None) -> ModelShape:
    """The config's shape (MoE fields included), with num_layers cut to --layers when given."""
    from dataclasses import replace

    from ds_tsp.tools.plan.inputs import PlanInputError
    from ds_tsp.tools.plan.shapes import shape_from_hf_config

    try:
        shape = shape_from_hf_config(path)
    except PlanInputError as exc:
        raise ValueError(f"--hf-config: {exc}") from None
    if layers is None or layers == shape.num_layers:
        return shape
    if shape.layer_types is not None:
        from ds_tsp.tools.bench.hybrid import cut_layers

        return cut_layers(shape, layers)
    windows = shape.attention_windows[:layers] if shape.attention_windows else None
    dense = tuple(i for i in shape.dense_mlp_layers if i < layers)
    return replace(shape, num_layers=layers, attention_windows=windows, dense_mlp_layers=dense)


def _model_defaults(args: argparse.Namespace) -> None:
    """Fill the shape / degree flags left unset with the model benchmark's defaults (in place, idempotent); with
    --hf-config the shape flags stay unset (the config gives the shape)."""
    _check_hf_config_flags(args)
    shape_defaults = () if getattr(args, "hf_config", None) else (
        ("hidden", DEFAULT_SHAPE.hidden_size), ("heads", DEFAULT_SHAPE.num_heads),
        ("ffn", DEFAULT_SHAPE.intermediate_size))
    for name, value in (*shape_defaults, ("tsp", [4])):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def layer_memory_config(args: argparse.Namespace):
    """--layer-memory's LayerMemoryConfig from the flags (unset ones: LAYER_MEMORY_DEFAULTS); ValueError naming
    the flag."""
    from ds_tsp.tools.bench.layer_memory import LayerMemoryConfig

    for flag, name in (("--layouts", "layouts"), ("--max-seq", "max_seq"), ("--profile", "profile"),
                       ("--num-experts", "num_experts"), ("--hf-config", "hf_config")):
        if getattr(args, name, None) not in (None, False, "all"):
            raise ValueError(f"{flag}: not used with --layer-memory (it measures one TSP decoder layer)")
    seqs = [s for group in args.seq for s in group] if args.seq else [LAYER_MEMORY_DEFAULTS["seq"]]
    tsp = args.tsp if args.tsp else [LAYER_MEMORY_DEFAULTS["tsp"]]
    if len(seqs) != 1 or len(tsp) != 1:
        raise ValueError("--seq / --tsp: --layer-memory takes one sequence length and one degree")
    cfg = LayerMemoryConfig(hidden=args.hidden or LAYER_MEMORY_DEFAULTS["hidden"],
                            heads=args.heads or LAYER_MEMORY_DEFAULTS["heads"], kv_heads=args.kv_heads,
                            ffn=args.ffn or LAYER_MEMORY_DEFAULTS["ffn"], seq=seqs[0], tsp=tsp[0],
                            batch=args.batch or 1, dtype=args.dtype or LAYER_MEMORY_DEFAULTS["dtype"], fake=args.fake,
                            seed=args.seed)
    cfg.check()
    return cfg


def run_layer_memory_cli(args: argparse.Namespace) -> int:
    """--layer-memory: measure, write OUT/layer_memory.json and .md, print the markdown."""
    from ds_tsp.tools.bench.layer_memory import markdown, measure, write

    layers = getattr(args, "layers", None)
    try:
        if getattr(args, "offload_activations", False):
            return _run_offload_memory(args, layer_memory_config(args), layers or 8)
        cfg = layer_memory_config(args)
    except ValueError as exc:
        return _error(str(exc))
    start = time.monotonic()
    result = measure(cfg, timeout_s=args.timeout)
    paths = write(result, args.out)
    print(markdown(result), flush=True)
    print(f"wrote {paths['json']}, {paths['md']} in {time.monotonic() - start:.0f} s", flush=True)
    return EXIT_OK


def _run_offload_memory(args: argparse.Namespace, cfg, layers: int) -> int:
    from ds_tsp.tools.bench import offload_memory

    if not cfg.fake:
        raise ValueError("--offload-activations: add --fake (the offload stack is measured under FakeTensorMode)")
    start = time.monotonic()
    result = offload_memory.measure_offload(cfg, layers)
    paths = offload_memory.write(result, args.out)
    print(offload_memory.markdown(result), flush=True)
    print(f"wrote {paths['json']}, {paths['md']} in {time.monotonic() - start:.0f} s", flush=True)
    return EXIT_OK


def default_out_dir() -> str:
    """Where results go without --out: the user's cache, never the current directory (a checkout)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ds_tsp", "bench")


def run(args: argparse.Namespace) -> int:
    from ds_tsp.tools.bench.progress import ProgressPrinter
    from ds_tsp.tools.bench.report import markdown_table, write_report
    from ds_tsp.tools.bench.runner import run_layouts

    if args.out is None:
        args.out = default_out_dir()
    from ds_tsp.tools.bench.cp_flags import check_cp_flags, cp_degree

    try:
        check_cp_flags(args)
    except ValueError as exc:
        return _error(str(exc))
    if getattr(args, "rounds", 1) > 1 and getattr(args, "layer_memory", False):
        return _error("--rounds: not with --layer-memory (it measures one layer's memory, not timed steps)")
    for flag, name in (("--layer-memory", "layer_memory"), ("--max-seq", "max_seq")):
        if getattr(args, "global_batch", None) and getattr(args, name, False):
            return _error(f"--global-batch: not with {flag} (give --batch: the micro-batch it measures)")
    if getattr(args, "layer_memory", False):
        return run_layer_memory_cli(args)
    if getattr(args, "offload_activations", False):
        return _error("--offload-activations: only with --layer-memory --fake (the offload stack's memory)")
    if getattr(args, "dtype", None) or getattr(args, "fake", False):
        return _error("--dtype / --fake: only with --layer-memory (the model benchmark runs fp32, for real)")
    _model_defaults(args)
    rounds = getattr(args, "rounds", 1)
    if rounds > 1 and getattr(args, "max_seq", False):
        return _error("--rounds: not with --max-seq (its probes are memory measurements, not timed steps)")
    if getattr(args, "max_seq", False):
        return run_max_seq_cli(args)
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        return _error(str(exc))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    printer = None if args.quiet else ProgressPrinter(rounds * sum(len(c.seqs) for c in configs))
    start = time.monotonic()
    with printer or contextlib.nullcontext():
        results = run_layouts(configs, timeout_s=args.timeout, on_event=printer, rounds=rounds)
    first = configs[0]
    if cp_degree(args) > 1:
        from ds_tsp.tools.bench.cp_report import with_cp_fields
        results = with_cp_fields(results, first.shape)
    meta = {"tsp": ", ".join(str(d) for d in dict.fromkeys(c.tsp for c in configs)), "batch": first.batch,
            **({"global_batch": args.global_batch} if args.global_batch else {}),
            "shape": first.shape.to_dict(), "steps": first.steps,
            "warmup": first.warmup, "activation_checkpointing": first.activation_checkpointing, "rounds": rounds}
    paths = write_report(results, args.out, meta)
    print(markdown_table(results), flush=True)
    if rounds > 1:
        from ds_tsp.tools.bench.rounds import rounds_table
        table = rounds_table(results)
        with open(paths["md"], "a") as f:
            f.write(table)
        print(table, flush=True)
    if cp_degree(args) > 1:
        from ds_tsp.tools.bench.cp_report import append_cp_table
        print(append_cp_table(results, paths["md"]), flush=True)
    if first.shape.num_experts:
        from ds_tsp.tools.bench.moe_report import write_moe_report
        print(write_moe_report(results, args.out, paths["md"]), flush=True)
    if getattr(args, "profile", False):
        from ds_tsp.tools.bench.profile import append_profile, profile_table, work_table
        append_profile(paths["md"], results)
        print(profile_table(results), flush=True)
        print(work_table(results), flush=True)
    print(f"wrote {paths['json']}, {paths['md']}" + "".join(f", {p}" for p in paths["plots"])
          + f" in {time.monotonic() - start:.0f} s", flush=True)
    return EXIT_OK if all(r.get("ok") for r in results) else EXIT_FAILED


def run_max_seq_cli(args: argparse.Namespace) -> int:
    """--max-seq: search per layout and checkpointing variant (ds_tsp.tools.bench.max_seq), then write the report."""
    from ds_tsp.tools.bench.cp_flags import cp_degree
    from ds_tsp.tools.bench.max_seq import VARIANTS, run_max_seq
    from ds_tsp.tools.bench.max_seq_report import write_max_seq_report
    from ds_tsp.tools.bench.progress import ProgressPrinter

    if args.budget_mib is None:
        return _error("--max-seq needs --budget-mib N (N > 0): the per-rank memory budget in MiB")
    if args.seq:
        return _error("--seq: not used with --max-seq (it searches the lengths itself)")
    if args.activation_checkpointing != "none":
        return _error("--activation-checkpointing: --max-seq always runs without and with it")
    if args.warmup is None:
        args.warmup = 0  # the first probe always gets one warm-up step (optimizer state); later ones need none
    # placeholder S that passes every degree's S check: each search picks its own lengths
    args.seq = [[2 * math.lcm(*args.tsp) * getattr(args, "cp", 1)]]
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        return _error(str(exc))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = int(args.budget_mib * MIB)
    start = time.monotonic()
    printer = None if args.quiet else ProgressPrinter(len(configs) * len(VARIANTS))
    with printer or contextlib.nullcontext():
        rows = run_max_seq(configs, budget, timeout_s=args.timeout, on_event=printer)
    if cp_degree(args) > 1:
        from ds_tsp.tools.bench.cp_report import with_cp_fields
        rows = with_cp_fields(rows, configs[0].shape)
    first = configs[0]
    meta = {"tsp": list(dict.fromkeys(args.tsp)), "batch": first.batch, "shape": first.shape.to_dict(), "steps": 1,
            "warmup": first.warmup, "activation_checkpointing": "none and all (--max-seq)",
            "budget_bytes": budget, "variants": list(VARIANTS)}
    paths = write_max_seq_report(rows, args.out, meta, budget)
    print(paths["table"], flush=True)
    if cp_degree(args) > 1:
        from ds_tsp.tools.bench.cp_report import append_cp_table
        print(append_cp_table(rows, paths["md"]), flush=True)
    print(f"wrote {paths['json']}, {paths['md']}" + "".join(f", {p}" for p in paths["plots"])
          + f" in {time.monotonic() - start:.0f} s", flush=True)
    return EXIT_OK if all(r.get("ok") for r in rows) else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
