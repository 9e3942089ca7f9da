"""`ds-tsp plan`: per-rank memory and communication of TSP and its peers side by side (ds_tsp.tools.plan does the math).

    ds-tsp plan --model 7b --seq 128k --tsp 8                  rich table: tsp, tp, tp_sp, ulysses, fsdp_cp
    ds-tsp plan --hf-config path/config.json --seq 32768 --layout tsp,tp --json    one JSON object per layout
    ds-tsp plan --model 8b --layers 16 --seq 64k --tsp 8       shape flags override the model's fields
    ds-tsp plan --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --layers 32 --vocab 128256 --seq 32k
    ds-tsp plan --model 8b --seq 128k --recommend --gpu-mem-gib 80 --devices 8 [--json]
    ds-tsp plan --model 8b --seq 4m --tsp 8 --activation-checkpointing --offload-activations   host + PCIe lines
    ds-tsp plan --model 8b --tsp 8 --max-seq --gpu-mem-gib 80 --host-mem-gib 232 --offload-activations

Exit codes: 0 success, 1 --recommend found nothing that fits, 2 bad input (one line on stderr naming the flag
and the fix).
"""
from __future__ import annotations

import argparse
import json

from ds_tsp.core.errors import TSPConfigError

__all__ = ["register", "run"]

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE = 0, 1, 2
_FLAGS = {"degree": "--tsp/--tp", "seq": "--seq", "batch": "--batch", "dp": "--dp", "pp": "--pp", "dtype": "--dtype",
          "hf_config": "--hf-config", "model": "--model", "layout": "--layout", "zero_stage": "--zero-stage",
          "hidden": "--hidden", "heads": "--heads", "kv_heads": "--kv-heads", "ffn": "--ffn", "layers": "--layers",
          "vocab": "--vocab", "devices": "--devices", "gpu_mem_gib": "--gpu-mem-gib",
          "zero_bucket_elements": "--zero-bucket", "lm_head_chunk_tokens": "--lm-head-chunk-tokens",
          "num_experts": "--num-experts", "top_k": "--top-k", "moe_ffn": "--moe-ffn", "moe_dispatch": "--moe-dispatch",
          "offload_activations": "--offload-activations", "host_mem_gib": "--host-mem-gib"}
_MOE_FLAGS = (("--num-experts", "num_experts", "experts per sparse layer (0: dense); a dense model becomes an MoE "
                                              "with every layer sparse"),
              ("--top-k", "top_k", "experts per token (default 2 for a model made sparse here)"),
              ("--moe-ffn", "moe_ffn", "per-expert intermediate size (default: --ffn for a model made sparse here)"))
_SHAPE_FLAGS = (("--hidden", "hidden", "hidden size"), ("--heads", "heads", "query heads"),
                ("--kv-heads", "kv_heads", "kv heads (default: --heads when the shape comes from flags alone)"),
                ("--ffn", "ffn", "MLP intermediate size"), ("--layers", "layers", "decoder layers"),
                ("--vocab", "vocab", "vocabulary size"))
_GIB, _MIB = 2 ** 30, 2 ** 20


class _UsageError(Exception):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` subcommand; its handler is `run` (set as the `run` default)."""
    from ds_tsp.tools.plan import DEFAULT_LAYOUTS, LAYOUTS, PRESETS

    p = subparsers.add_parser(
        "plan", help="analytic per-rank memory and communication of TSP, TP, TP+SP, Ulysses and FSDP+CP",
        description="Per-rank memory (params, grads, AdamW optimizer, saved activations, transients) and "
                    "communication (per layer forward/backward, per step) of each layout, from formulas checked "
                    "against ds_tsp's byte counters. Integers accept k/m suffixes (128k = 131072).")
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default 7b, unless the shape flags "
                                                 "give the whole shape)")
    p.add_argument("--hf-config", default=None, metavar="PATH", help="a Hugging Face config.json (or its directory)")
    for flag, _, what in _SHAPE_FLAGS:
        p.add_argument(flag, default=None, metavar="N", help=f"{what}: overrides the model's field")
    for flag, _, what in _MOE_FLAGS:
        p.add_argument(flag, default=None, metavar="N", help=f"mixture of experts: {what}")
    p.add_argument("--moe-dispatch", default="auto", choices=("auto", "ring", "all_to_all"),
                   help="TSP's MoE schedule (TSPOptions.moe_dispatch; default auto = fewer bytes per layer)")
    p.add_argument("--seq", default="4096", help="global sequence length per sample (default 4096)")
    p.add_argument("--batch", default="1", help="micro-batch size in sequences (default 1)")
    p.add_argument("--tsp", default=None, help="degree D of the one parallel axis (default 8)")
    p.add_argument("--tp", default=None, help="alias of --tsp")
    p.add_argument("--dp", default="1", help="data-parallel degree (default 1)")
    p.add_argument("--pp", default="1", help="pipeline stages (default 1)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (default bf16; AdamW states are fp32)")
    p.add_argument("--zero-stage", default="0", help="ZeRO stage over dp for tsp/tp/tp_sp: 0, 1 or 2 (default 0)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute every decoder layer")
    p.add_argument("--keep-gathered-kv", action="store_true", help="TSP keeps gathered K/V (no backward re-gather)")
    p.add_argument("--save-projections", action="store_true",
                   help="TSP saves local q/k/v and MLP gate/up instead of recomputing them (with --keep-gathered-kv: "
                        "TSPOptions.speed())")
    p.add_argument("--layout", action="append", default=None, metavar="NAMES",
                   help=f"comma list, repeatable: {', '.join(LAYOUTS)} or all (default: {','.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--zero-bucket", default="500000000", metavar="ELEMENTS",
                   help="DeepSpeed reduce_bucket_size for ulysses/autotp (default 5e8 = DeepSpeed's; ds-tsp bench "
                        "uses 5000000)")
    p.add_argument("--lm-head-chunk-tokens", default="4096", metavar="N",
                   help="TSP LM head tile of local tokens (TSPOptions.lm_head_chunk_tokens, default 4096)")
    p.add_argument("--recommend", action="store_true",
                   help="pick the layout (tsp, ulysses, tp_sp, fsdp_cp; degree; activation checkpointing) that "
                        "fits --gpu-mem-gib on --devices with the least communication")
    p.add_argument("--gpu-mem-gib", default=None, metavar="G", help="with --recommend: memory per device, GiB")
    p.add_argument("--devices", default=None, metavar="N", help="with --recommend: devices to use")
    p.add_argument("--offload-activations", action="store_true",
                   help="TSP keeps each checkpointed layer input in host memory (implies --activation-checkpointing; "
                        "tsp layout only): host memory per rank and node, PCIe time per step")
    p.add_argument("--max-seq", action="store_true",
                   help="the longest --seq (TSP, --tsp D) whose peak fits --gpu-mem-gib per device and, with "
                        "--offload-activations, whose host pool fits --host-mem-gib per rank")
    p.add_argument("--host-mem-gib", default=None, metavar="H",
                   help="with --max-seq / --recommend: host memory per rank (GPU) for offloaded activations, GiB "
                        "(a node's host memory / --gpus-per-node)")
    p.add_argument("--gpus-per-node", default="8", metavar="N", help="GPUs per node, for the host-memory-per-node "
                                                                    "line (default 8)")
    p.add_argument("--gpu-tflops", default="400", metavar="T",
                   help="sustained TFLOP/s per GPU for the compute time the PCIe time is set against (default 400)")
    p.add_argument("--cp", default=None, metavar="C",
                   help="context-parallel degree: C TSP groups of --tsp D (one per node) share each sequence, K/V "
                        "passed around a ring across nodes (layout tsp_cp); with --recommend, 'auto' picks D and C")
    p.add_argument("--inter-node-gbps", default="400", metavar="G",
                   help="with --cp: inter-node bandwidth per GPU in Gb/s for the cp ring's time (default 400)")
    p.add_argument("--json", action="store_true", help="one JSON object per layout per line")
    p.set_defaults(run=run)
    return p


def _int(flag: str, text, minimum: int = 1) -> int:
    s = str(text).strip().lower()
    scale = {"k": 1024, "m": 1024 ** 2}.get(s[-1:], 1)
    digits = s[:-1] if scale > 1 else s
    if not digits.isdigit():
        raise _UsageError(flag, f"{text!r} is not an integer; write e.g. {flag} 4096 (or 128k)")
    value = int(digits) * scale
    if value < minimum:
        raise _UsageError(flag, f"{value} must be >= {minimum}")
    return value


def _layouts(values: list[str] | None) -> tuple[str, ...]:
    from ds_tsp.tools.plan import DEFAULT_LAYOUTS, LAYOUTS

    if not values:
        return DEFAULT_LAYOUTS
    names: list[str] = []
    for value in values:
        for name in (n.strip().lower().replace("-", "_").replace("+", "_") for n in value.split(",")):
            if not name:
                continue
            if name == "all":
                names += [n for n in DEFAULT_LAYOUTS if n not in names]
            elif name not in LAYOUTS:
                raise _UsageError("--layout", f"unknown layout {name!r}; choose among {', '.join(LAYOUTS)} or all")
            elif name not in names:
                names.append(name)
    if not names:
        raise _UsageError("--layout", "no layout named; e.g. --layout tsp,tp")
    return tuple(names)


def _plan_input(args: argparse.Namespace):
    from ds_tsp.tools.plan import DTYPE_BYTES, PlanInput

    shape, model_name = _moe_shape(args, *_shape(args))
    degrees = {flag: _int(flag, v) for flag, v in (("--tsp", args.tsp), ("--tp", args.tp)) if v is not None}
    if len(set(degrees.values())) > 1:
        raise _UsageError("--tsp/--tp", f"--tsp {degrees['--tsp']} and --tp {degrees['--tp']} disagree; they name "
                                        "the same degree: give one")
    dtype = str(args.dtype).lower()
    if dtype not in DTYPE_BYTES:
        raise _UsageError("--dtype", f"{args.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    inp = PlanInput(model=shape, seq=_int("--seq", args.seq), batch=_int("--batch", args.batch),
                    degree=next(iter(degrees.values()), 8), dp=_int("--dp", args.dp), pp=_int("--pp", args.pp),
                    dtype=dtype, activation_checkpointing=args.activation_checkpointing or args.offload_activations,
                    offload_activations=args.offload_activations,
                    keep_gathered_kv=args.keep_gathered_kv,
                    recompute_projections=not args.save_projections, zero_stage=_int("--zero-stage", args.zero_stage, 0),
                    lm_head_chunk_tokens=_int("--lm-head-chunk-tokens", args.lm_head_chunk_tokens),
                    zero_bucket_elements=_int("--zero-bucket", args.zero_bucket),
                    moe_dispatch=getattr(args, "moe_dispatch", "auto"))
    return inp, model_name


def _moe_shape(args: argparse.Namespace, shape, model_name: str):
    """The shape with --num-experts / --top-k / --moe-ffn applied (ds_tsp.tools.plan.moe_shapes)."""
    from ds_tsp.tools.plan.moe_shapes import moe_shape_with

    overrides = {key: (None if getattr(args, key, None) is None else _int(flag, getattr(args, key), 0))
                 for flag, key, _ in _MOE_FLAGS}
    given = [flag for flag, key, _ in _MOE_FLAGS if overrides[key] is not None]
    if not given:
        return shape, model_name
    return moe_shape_with(shape, overrides), f"{model_name} ({' '.join(given)} set)"


def _shape(args: argparse.Namespace):
    """The model: --hf-config or --model (default 7b), with the shape flags overriding its fields; the shape
    flags alone when all of them (but --kv-heads) are given without a model."""
    from ds_tsp.tools.plan import PRESETS, shape_from_hf_config, shape_with

    if args.model is not None and args.hf_config is not None:
        raise _UsageError("--model", "give either --model PRESET or --hf-config PATH, not both")
    overrides = {key: (None if getattr(args, key) is None else _int(flag, getattr(args, key)))
                 for flag, key, _ in _SHAPE_FLAGS}
    given = [flag for flag, key, _ in _SHAPE_FLAGS if overrides[key] is not None]
    if args.hf_config is not None:
        base, model_name = shape_from_hf_config(args.hf_config), args.hf_config
    elif args.model is None and given:
        base, model_name = None, "custom"
    else:
        model_name = (args.model or "7b").lower()
        if model_name not in PRESETS:
            raise _UsageError("--model", f"unknown preset {args.model!r}; choose among {', '.join(PRESETS)} or pass "
                                         "--hf-config PATH")
        base = PRESETS[model_name]
    if not given:
        return base, model_name
    shape = shape_with(base, overrides)
    return shape, (model_name if base is None else f"{model_name} ({' '.join(given)} overridden)")


def run(args: argparse.Namespace) -> int:
    from ds_tsp.tools.plan import plan_layouts

    if args.cp is not None:  # TSP x a cp ring (ds_tsp.tools.plan.tsp_cp, cp_cli)
        from ds_tsp.tools.plan.cp_cli import run_cp

        return run_cp(args, _plan_input, _UsageError, _or_usage_error, rates, EXIT_OK, EXIT_NO_FIT)
    if args.recommend:
        return _run_recommend(args)
    if args.max_seq:
        from ds_tsp.tools.plan.max_seq_cli import run_max_seq

        return run_max_seq(args, _plan_input, _UsageError, _or_usage_error, _layouts, rates, (EXIT_OK, EXIT_NO_FIT))

    def build():
        layouts = _layouts(args.layout)
        inp, model_name = _plan_input(args)
        hybrid = inp.model.layer_types is not None
        if (inp.model.num_experts or inp.offload_activations or hybrid) and not args.layout:
            layouts = ("tsp",)  # MoE, offload and hybrids are planned for TSP only (plan_layouts refuses the peers)
        plans = plan_layouts(inp, layouts)
        if inp.offload_activations:
            plans = [_with_rates(args, plan, inp) for plan in plans]
        return plans, inp, model_name

    built, failed = _or_usage_error(build)
    if failed is not None:
        return failed
    plans, inp, model_name = built
    if args.json:
        for plan in plans:
            print(json.dumps({**plan.to_dict(), "model": model_name, "input": inp.to_dict()}), flush=True)
    else:
        _print_table(plans, inp, model_name)
    return EXIT_OK


def rates(args: argparse.Namespace) -> dict:
    """--gpu-tflops and --gpus-per-node, checked (ds_tsp.tools.plan.offload.offload_summary's keywords)."""
    try:
        tflops = float(args.gpu_tflops)
    except ValueError:
        raise _UsageError("--gpu-tflops", f"{args.gpu_tflops!r} is not a number; e.g. --gpu-tflops 400") from None
    if not tflops > 0:
        raise _UsageError("--gpu-tflops", f"{tflops} must be > 0")
    return {"gpu_tflops": tflops, "gpus_per_node": _int("--gpus-per-node", args.gpus_per_node)}


def _with_rates(args: argparse.Namespace, plan, inp):
    """`plan` with its offload figures at the flags' --gpu-tflops / --gpus-per-node."""
    from ds_tsp.tools.plan.offload import with_offload
    from ds_tsp.tools.plan.tsp_comm import TSPGeometry

    return with_offload(plan, inp, TSPGeometry.of(inp), **rates(args))


def _or_usage_error(build):
    """(build(), None), or (None, the exit code after printing the one-line error) for bad flags or shapes."""
    from ds_tsp.tools.plan import PlanInputError

    try:
        return build(), None
    except _UsageError as exc:
        return None, _error(str(exc))
    except PlanInputError as exc:
        return None, _error(f"{_FLAGS.get(exc.field, exc.field)}: {exc}")
    except TSPConfigError as exc:
        return None, _error(str(exc))


def _run_recommend(args: argparse.Namespace) -> int:
    from ds_tsp.tools.plan.recommend_cli import print_recommendation, recommend_from_args

    built, failed = _or_usage_error(lambda: recommend_from_args(args, _plan_input, _UsageError))
    if failed is not None:
        return failed
    rec, inp, model_name = built
    print_recommendation(rec, inp, model_name, as_json=args.json)
    return EXIT_OK if rec.best is not None else EXIT_NO_FIT


def _error(message: str) -> int:
    from ds_tsp.tools.entry_point import report_error

    report_error("ds-tsp plan", message)  # one line; under a launcher printed once, not once per rank
    return EXIT_USAGE


def _print_table(plans, inp, model_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from ds_tsp.tools.plan.offload_cli import offload_lines

    m = inp.model
    moe = (f" experts={m.num_experts} top_k={m.num_experts_per_tok} moe_ffn={m.moe_intermediate_size}"
           if m.num_experts else "")
    title = (f"{model_name}: h={m.hidden_size} layers={m.num_layers} heads={m.num_heads}/{m.num_kv_heads} "
             f"ffn={m.intermediate_size}{moe} vocab={m.vocab_size} | seq={inp.seq} batch={inp.batch} D={inp.degree} "
             f"dp={inp.dp} pp={inp.pp} {inp.dtype}{' +AC' if inp.activation_checkpointing else ''}"
             f"{' +offload' if inp.offload_activations else ''}")
    table = Table(title=title, title_justify="left")
    table.add_column("per rank", style="bold")
    for plan in plans:
        table.add_column(plan.layout, justify="right")

    def row(label, fn):
        table.add_row(label, *(fn(p) for p in plans))

    gib = lambda v: f"{v / _GIB:.2f}"  # noqa: E731
    row("params GiB", lambda p: gib(p.params_bytes))
    row("grads GiB", lambda p: gib(p.grads_bytes))
    row("optimizer GiB (AdamW)", lambda p: gib(p.optimizer_bytes))
    row("activations GiB", lambda p: gib(p.activations_bytes))
    row("framework buffers GiB", lambda p: gib(p.framework_bytes))
    row("transients GiB", lambda p: f"{gib(p.transients_bytes)} ({p.peak_phase})")
    row("peak GiB", lambda p: f"[bold]{gib(p.peak_bytes_per_rank)}[/bold]")
    if any(p.host_bytes_per_rank for p in plans):
        row("host (offloaded) GiB", lambda p: gib(p.host_bytes_per_rank))
    row("comm / layer fwd MiB", lambda p: f"{p.comm_bytes_per_layer_fwd / _MIB:.1f}")
    row("comm / layer bwd MiB", lambda p: f"{p.comm_bytes_per_layer_bwd / _MIB:.1f}")
    row("comm / step GiB", lambda p: gib(p.comm_bytes_per_step))
    if any(p.moe for p in plans):
        _moe_rows(row)
    if inp.pp > 1:
        row("reported stage", lambda p: f"{p.stage} ({p.layers_per_stage} layers)")
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and cut labels ("activatio…")
        console = Console(width=Console(width=10_000).measure(table).maximum, soft_wrap=True)
    console.print(table)
    for plan in plans:
        for note in plan.notes:
            console.print(f"  {plan.layout}: {note}", highlight=False)
        for line in offload_lines(plan):  # ds_tsp.tools.plan.offload_cli
            console.print(f"  {plan.layout}: {line}", highlight=False)
    console.print("  peak = params + optimizer + framework buffers + the worst phase's live activations, grads and "
                  "transients; comm in bytes per rank "
                  "(all-reduce 2(n-1)/n, all-gather/reduce-scatter/all-to-all (n-1)/n); see ds_tsp/tools/plan/",
                  highlight=False)


def _moe_rows(row) -> None:
    """Mixture-of-experts rows: bytes per sparse layer and the peak under each schedule, "auto"'s choice."""
    def cell(fn):
        return lambda p: fn(p.moe) if p.moe else "-"

    for s in ("ring", "all_to_all"):
        row(f"MoE {s}: bytes / sparse layer MiB", cell(lambda m, s=s: f"{m['bytes_per_layer'][s] / _MIB:.2f}"))
        row(f"MoE {s}: peak GiB", cell(lambda m, s=s: f"{m['peak_bytes'][s] / _GIB:.2f}" if "peak_bytes" in m
                                         else "-"))
    row("MoE auto -> / planned", cell(lambda m: f"{m['auto']} / {m['schedule']}"))
