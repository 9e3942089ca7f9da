"""`ds-tsp plan`: per-rank memory and communication of TSP and its peers side by side (ds_tsp.tools.plan does the math).

    ds-tsp plan --model 7b --seq 128k --tsp 8                  rich table: tsp, tp, tp_sp, ulysses, fsdp_cp
    ds-tsp plan --hf-config path/config.json --seq 32768 --layout tsp,tp --json    one JSON object per layout
    ds-tsp plan --model 8b --layers 16 --seq 64k --tsp 8       shape flags override the model's fields
    ds-tsp plan --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --layers 32 --vocab 128256 --seq 32k
    ds-tsp plan --model 8b --seq 128k --recommend --gpu-mem-gib 80 --devices 8 [--json]
    ds-tsp plan --model 8b --seq 4m --tsp 8 --activation-checkpointing --offload-activations   host + PCIe lines
    ds-tsp plan --model 8b --tsp 8 --max-seq --gpu-mem-gib 80 --host-mem-gib 232 --offload-activations
    ds-tsp plan --model 8b --seq 1m --tsp 8 --cp 4             TSP in a node x a cp ring across 4 nodes

Every number is parsed by argparse (ds_tsp.tools.cli_types): a malformed one is argparse's usage error naming the
flag. What the flags mean together (a preset and a shape, a degree the heads do not split over) is checked after.

Exit codes: 0 success, 1 --recommend (or --max-seq) found nothing that fits, 2 bad input (on stderr, one line
naming the flag and the fix; argparse's usage line comes first for a malformed number).
"""
from __future__ import annotations

import argparse
import json

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.tools.cli_types import GIB, MIB, at_least, integer, non_negative, positive

__all__ = ["register", "run"]

EXIT_OK, EXIT_NO_FIT, EXIT_USAGE = 0, 1, 2
_FLAGS = {"degree": "--tsp/--tp", "seq": "--seq", "batch": "--batch", "dp": "--dp", "pp": "--pp", "dtype": "--dtype",
          "hf_config": "--hf-config", "model": "--model", "layout": "--layout", "zero_stage": "--zero-stage",
          "hidden": "--hidden", "heads": "--heads", "kv_heads": "--kv-heads", "ffn": "--ffn", "layers": "--layers",
          "vocab": "--vocab", "devices": "--devices", "gpu_mem_gib": "--gpu-mem-gib",
          "zero_bucket_elements": "--zero-bucket", "lm_head_chunk_tokens": "--lm-head-chunk-tokens",
          "num_experts": "--num-experts", "top_k": "--top-k", "moe_ffn": "--moe-ffn", "moe_dispatch": "--moe-dispatch",
          "moe_load": "--moe-load",
          "offload_activations": "--offload-activations", "host_mem_gib": "--host-mem-gib", "images": "--images"}
_MOE_FLAGS = (("--num-experts", "num_experts", "experts per sparse layer (0: dense); a dense model becomes an MoE "
                                              "with every layer sparse"),
              ("--top-k", "top_k", "experts per token (default 2 for a model made sparse here)"),
              ("--moe-ffn", "moe_ffn", "per-expert intermediate size (default: --ffn for a model made sparse here)"))
_SHAPE_FLAGS = (("--hidden", "hidden", "hidden size"), ("--heads", "heads", "query heads"),
                ("--kv-heads", "kv_heads", "kv heads (default: --heads when the shape comes from flags alone)"),
                ("--ffn", "ffn", "MLP intermediate size"), ("--layers", "layers", "decoder layers"),
                ("--vocab", "vocab", "vocabulary size"))


class _UsageError(Exception):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")


def _cp_degree(text: str) -> int | str:
    """--cp: a degree C >= 1, or "auto" (with --recommend: pick D and C)."""
    return "auto" if str(text).strip().lower() == "auto" else positive(integer)(text)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` subcommand; its handler is `run` (set as the `run` default)."""
    from ds_tsp.tools.plan import DEFAULT_LAYOUTS, LAYOUTS, PRESETS

    count = positive(integer)  # 4096, 128k (= 131072), 1m, 5e8
    p = subparsers.add_parser(
        "plan", help="analytic per-rank memory and communication of TSP, TP, TP+SP, Ulysses and FSDP+CP",
        description="Per-rank memory (params, grads, AdamW optimizer, saved activations, transients) and "
                    "communication (per layer forward/backward, per step) of each layout, from formulas checked "
                    "against ds_tsp's byte counters. Integers accept k/m suffixes (128k = 131072).")
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default 7b, unless the shape flags "
                                                 "give the whole shape)")
    p.add_argument("--hf-config", default=None, metavar="PATH", help="a Hugging Face config.json (or its directory)")
    for flag, _, what in _SHAPE_FLAGS:
        p.add_argument(flag, type=count, default=None, metavar="N", help=f"{what}: overrides the model's field")
    for flag, _, what in _MOE_FLAGS:
        p.add_argument(flag, type=non_negative(integer), default=None, metavar="N", help=f"mixture of experts: {what}")
    p.add_argument("--moe-dispatch", default="auto", choices=("auto", "ring", "all_to_all"),
                   help="TSP's MoE schedule (TSPOptions.moe_dispatch; default auto = fewer bytes per layer)")
    p.add_argument("--moe-load", type=at_least(1.0, float), default=1.0, metavar="F",
                   help="mixture of experts: plan the busiest expert at F times its even share of the routed rows "
                        "(default 1, even routing; its GEMM block and its owner's rows, per ring step or delivered "
                        "by all_to_all, grow with F, capped at what one expert / owner can receive; bytes stay at "
                        "even routing)")
    p.add_argument("--seq", type=count, default=4096, help="global sequence length per sample (default 4096)")
    p.add_argument("--batch", type=count, default=1, help="micro-batch size in sequences (default 1)")
    p.add_argument("--tsp", type=count, default=None, help="degree D of the one parallel axis (default 8)")
    p.add_argument("--tp", type=count, default=None, help="alias of --tsp")
    p.add_argument("--dp", type=count, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--pp", type=count, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (default bf16; AdamW states are fp32)")
    p.add_argument("--zero-stage", type=non_negative(integer), default=0,
                   help="ZeRO stage over dp for tsp/tp/tp_sp: 0, 1 or 2 (default 0)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute every decoder layer")
    p.add_argument("--keep-gathered-kv", action="store_true", help="TSP keeps gathered K/V (no backward re-gather)")
    p.add_argument("--save-projections", action="store_true",
                   help="TSP saves local q/k/v and MLP gate/up instead of recomputing them (with --keep-gathered-kv: "
                        "TSPOptions.speed())")
    p.add_argument("--layout", action="append", default=None, metavar="NAMES",
                   help=f"comma list, repeatable: {', '.join(LAYOUTS)} or all (default: {','.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--zero-bucket", type=count, default=500_000_000, metavar="ELEMENTS",
                   help="DeepSpeed reduce_bucket_size for ulysses/autotp (default 5e8 = DeepSpeed's; ds-tsp bench "
                        "uses 5000000)")
    p.add_argument("--lm-head-chunk-tokens", type=count, default=4096, metavar="N",
                   help="TSP LM head tile of local tokens (TSPOptions.lm_head_chunk_tokens, default 4096)")
    p.add_argument("--recommend", action="store_true",
                   help="pick the layout (tsp, ulysses, tp_sp, fsdp_cp; degree; activation checkpointing) that "
                        "fits --gpu-mem-gib on --devices with the least communication")
    p.add_argument("--gpu-mem-gib", type=positive(float), default=None, metavar="G",
                   help="with --recommend / --max-seq: memory per device, GiB")
    p.add_argument("--devices", type=count, default=None, metavar="N", help="with --recommend: devices to use")
    p.add_argument("--offload-activations", action="store_true",
                   help="TSP keeps each checkpointed layer input in host memory (implies --activation-checkpointing; "
                        "tsp layout only): host memory per rank and node, PCIe time per step")
    p.add_argument("--max-seq", action="store_true",
                   help="the longest --seq (TSP, --tsp D) whose peak fits --gpu-mem-gib per device and, with "
                        "--offload-activations, whose host pool fits --host-mem-gib per rank")
    p.add_argument("--host-mem-gib", type=positive(float), default=None, metavar="H",
                   help="with --max-seq / --recommend: host memory per rank (GPU) for offloaded activations, GiB "
                        "(a node's host memory / --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=count, default=8, metavar="N",
                   help="GPUs per node, for the host-memory-per-node line (default 8)")
    p.add_argument("--gpu-tflops", type=positive(float), default=400.0, metavar="T",
                   help="sustained TFLOP/s per GPU for the compute time the PCIe time is set against (default 400)")
    p.add_argument("--cp", type=_cp_degree, default=None, metavar="C",
                   help="context-parallel degree: C TSP groups of --tsp D (one per node) share each sequence, K/V "
                        "passed around a ring across nodes (layout tsp_cp); with --recommend, 'auto' picks D and C")
    p.add_argument("--cp-comm", choices=("auto", "ring", "all_to_all"), default="auto",
                   help="with --cp C: the cp schedule planned, K/V around the ring, each head block's heads "
                        "scattered over the cp groups by all-to-all, or the one the model's tsp.cp_comm 'auto' "
                        "picks for these shapes, shown with both schedules' figures (default auto)")
    p.add_argument("--inter-node-gbps", type=positive(float), default=400.0, metavar="G",
                   help="with --cp: inter-node bandwidth per GPU in Gb/s for the cp ring's time (default 400)")
    p.add_argument("--images", type=non_negative(integer), default=0, metavar="N",
                   help="with --hf-config of a multimodal Qwen3.5 / Qwen3-VL config: images in the batch; the vision "
                        "tower's memory and all-to-all per rank (tsp layout)")
    p.add_argument("--image-tokens", type=non_negative(integer), default=0, metavar="T",
                   help="vision tokens per image (after the spatial merge)")
    p.add_argument("--videos", type=non_negative(integer), default=0, metavar="M", help="videos in the batch")
    p.add_argument("--video-tokens", type=non_negative(integer), default=0, metavar="F",
                   help="vision tokens per video, all frames")
    p.add_argument("--json", action="store_true", help="one JSON object per layout per line")
    p.set_defaults(run=run)
    return p


# --- flags -> PlanInput -----------------------------------------------------------------------------------------------

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
    if args.moe_load != 1 and not shape.num_experts:
        raise _UsageError("--moe-load", f"{args.moe_load:g} on {model_name}, which has no experts: the load plans "
                                        "an MoE routing; drop it or add --num-experts")
    if args.tsp is not None and args.tp is not None and args.tsp != args.tp:
        raise _UsageError("--tsp/--tp", f"--tsp {args.tsp} and --tp {args.tp} disagree; they name the same degree: "
                                        "give one")
    dtype = str(args.dtype).lower()
    if dtype not in DTYPE_BYTES:
        raise _UsageError("--dtype", f"{args.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    inp = PlanInput(model=shape, seq=args.seq, batch=args.batch, degree=args.tsp or args.tp or 8, dp=args.dp,
                    pp=args.pp, dtype=dtype,
                    activation_checkpointing=args.activation_checkpointing or args.offload_activations,
                    offload_activations=args.offload_activations, keep_gathered_kv=args.keep_gathered_kv,
                    recompute_projections=not args.save_projections, zero_stage=args.zero_stage,
                    lm_head_chunk_tokens=args.lm_head_chunk_tokens, zero_bucket_elements=args.zero_bucket,
                    moe_dispatch=args.moe_dispatch, moe_load=args.moe_load)
    return inp, model_name


def _moe_shape(args: argparse.Namespace, shape, model_name: str):
    """The shape with --num-experts / --top-k / --moe-ffn applied (ds_tsp.tools.plan.moe_shapes)."""
    from ds_tsp.tools.plan.moe_shapes import moe_shape_with

    overrides = {key: getattr(args, key) for _, key, _ in _MOE_FLAGS}
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
    overrides = {key: getattr(args, key) for _, key, _ in _SHAPE_FLAGS}
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


def _rates(args: argparse.Namespace) -> dict:
    """--gpu-tflops and --gpus-per-node (ds_tsp.tools.plan.offload.offload_summary's keywords)."""
    return {"gpu_tflops": args.gpu_tflops, "gpus_per_node": args.gpus_per_node}


def _with_rates(args: argparse.Namespace, plan, inp):
    """`plan` with its offload figures at the flags' --gpu-tflops / --gpus-per-node."""
    from ds_tsp.tools.plan.offload import with_offload
    from ds_tsp.tools.plan.tsp_comm import TSPGeometry

    return with_offload(plan, inp, TSPGeometry.of(inp), **_rates(args))


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


def _error(message: str) -> int:
    from ds_tsp.tools.entry_point import report_error

    report_error("ds-tsp plan", message)  # one line; under a launcher printed once, not once per rank
    return EXIT_USAGE


# --- the modes ----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    vision_flags = getattr(args, "images", 0) or getattr(args, "videos", 0)
    if vision_flags and (args.cp is not None or args.recommend or args.max_seq):
        mode = "--cp" if args.cp is not None else "--recommend" if args.recommend else "--max-seq"
        return _error(f"--images: {mode} does not plan the vision tower yet; plan the layouts (no {mode}) for its "
                      "bytes per rank")
    if args.cp is None and getattr(args, "cp_comm", "auto") not in ("ring", "auto"):
        return _error(f"--cp-comm {args.cp_comm}: it plans the cp schedule; give --cp C")
    if args.cp is not None:  # TSP x a cp ring (ds_tsp.tools.plan.tsp_cp)
        return _run_cp(args)
    if args.recommend:
        return _run_recommend(args)
    if args.max_seq:
        return _run_max_seq(args)
    return _run_layouts(args)


def _run_layouts(args: argparse.Namespace) -> int:
    from ds_tsp.tools.plan import plan_layouts
    from ds_tsp.tools.plan.shape_terms import gemma4_peer_refusal

    def build():
        layouts = _layouts(args.layout)
        inp, model_name = _plan_input(args)
        hybrid = inp.model.layer_types is not None or gemma4_peer_refusal(inp.model) is not None  # (Gemma 4)
        vision_flags = args.images or args.videos
        if (inp.model.num_experts or inp.offload_activations or hybrid or vision_flags) and not args.layout:
            layouts = ("tsp",)  # MoE, offload, hybrids, vision: planned for TSP only (plan_layouts refuses peers)
        vision = _vision(args, inp, layouts)
        plans = plan_layouts(inp, layouts)
        if inp.offload_activations:
            plans = [_with_rates(args, plan, inp) for plan in plans]
        return plans, inp, model_name, vision

    built, failed = _or_usage_error(build)
    if failed is not None:
        return failed
    plans, inp, model_name, vision = built
    if args.json:
        for plan in plans:
            extra = {"vision": vision} if vision is not None and plan.layout == "tsp" else {}
            print(json.dumps({**plan.to_dict(), "model": model_name, "input": inp.to_dict(), **extra}), flush=True)
    else:
        _print_table(plans, inp, model_name)
        if vision is not None:
            _print_vision(vision, inp)
    return EXIT_OK


def _vision(args: argparse.Namespace, inp, layouts) -> dict | None:
    """--images / --videos: the vision tower's bytes per TSP rank (ds_tsp.tools.plan.vision), or None."""
    from ds_tsp.tools.plan.vision import plan_vision, vision_config

    if not (args.images or args.videos or args.image_tokens or args.video_tokens):
        return None
    if args.hf_config is None:
        raise _UsageError("--images", "the vision tower is read from --hf-config PATH (a multimodal config.json)")
    v = vision_config(args.hf_config)
    if v is None:
        raise _UsageError("--images", f"{args.hf_config} has no vision_config: a text-only model")
    if [n for n in layouts if n != "tsp"]:
        raise _UsageError("--layout", "--images / --videos plan the tsp layout only (TSPForConditionalGeneration)")
    if args.offload_activations or args.pp > 1:
        raise _UsageError("--images", "--images / --videos are planned without --offload-activations and --pp")
    return plan_vision(inp, v, args.images, args.image_tokens, args.videos, args.video_tokens)


def _print_vision(v: dict, inp) -> None:
    mib = lambda n: f"{n / MIB:.2f}"  # noqa: E731
    print(f"  vision tower: {v['params']} params, whole on every rank: params {mib(v['params_bytes'])} + grads "
          f"{mib(v['grads_bytes'])} + optimizer {mib(v['optimizer_bytes'])} MiB; activations "
          f"{mib(v['activations_bytes'])} MiB ({v['tokens_encoded_per_rank']} of {v['vision_tokens']} vision "
          f"tokens, {v['patches_encoded_per_rank']} patches encoded per rank); the batch's pixel_values "
          f"{mib(v['pixel_values_bytes'])} MiB, whole on every rank")
    print(f"  vision tower memory per rank: {mib(v['memory_bytes_per_rank'])} MiB (not in the table's peak: add it); "
          f"all-to-all {v['all_to_all_bytes_per_step'] / MIB:.2f} MiB per rank per step (at most "
          f"{v['all_to_all_bytes_per_step_max'] / MIB:.2f})", flush=True)


def _run_recommend(args: argparse.Namespace) -> int:
    """--recommend: the choice, why, and one line per rejected alternative."""
    from ds_tsp.tools.plan import recommend

    def build():
        if args.gpu_mem_gib is None or args.devices is None:
            flag = "--gpu-mem-gib" if args.gpu_mem_gib is None else "--devices"
            raise _UsageError(flag, "--recommend needs --gpu-mem-gib G and --devices N")
        if args.layout:
            raise _UsageError("--layout", "--recommend chooses among tsp, ulysses, tp_sp and fsdp_cp itself")
        if args.host_mem_gib is not None and not args.offload_activations:
            raise _UsageError("--host-mem-gib", "with --recommend it limits the offloaded activations: add "
                                                "--offload-activations")
        inp, model_name = _plan_input(args)
        return recommend(inp, gpu_mem_gib=args.gpu_mem_gib, devices=args.devices, offload=args.offload_activations,
                         host_mem_gib=args.host_mem_gib), inp, model_name

    built, failed = _or_usage_error(build)
    if failed is not None:
        return failed
    rec, inp, model_name = built
    if args.json:
        print(json.dumps({**rec.to_dict(), "model": model_name, "input": inp.to_dict()}), flush=True)
    else:
        _print_recommendation(rec, inp, model_name)
    return EXIT_OK if rec.best is not None else EXIT_NO_FIT


def _run_max_seq(args: argparse.Namespace) -> int:
    """--max-seq: the longest sequence TSP fits in --gpu-mem-gib per device (and, with --offload-activations,
    --host-mem-gib of host memory per rank), with the plan at that length. A few dozen analytic plans: instant."""
    from ds_tsp.tools.plan.max_seq import longest_seq
    from ds_tsp.tools.plan.offload import with_offload
    from ds_tsp.tools.plan.tsp import plan_tsp
    from ds_tsp.tools.plan.tsp_comm import TSPGeometry

    gpu, host = args.gpu_mem_gib, args.host_mem_gib

    def build():
        if gpu is None:
            raise _UsageError("--gpu-mem-gib", "--max-seq needs --gpu-mem-gib G (device memory per GPU)")
        if args.layout and [n for n in _layouts(args.layout) if n != "tsp"]:
            raise _UsageError("--layout", "--max-seq plans the tsp layout only")
        if args.offload_activations and host is None:
            raise _UsageError("--host-mem-gib", "--max-seq --offload-activations needs --host-mem-gib H (host "
                                                "memory per rank for the offloaded layer inputs)")
        inp, model_name = _plan_input(args)
        rates = _rates(args)

        def plan_fn(trial):
            return with_offload(plan_tsp(trial), trial, TSPGeometry.of(trial), **rates)

        result = longest_seq(inp, gpu_mem_bytes=int(gpu * GIB),
                             host_mem_bytes=None if host is None else int(host * GIB), plan_fn=plan_fn)
        return result, inp, model_name

    built, failed = _or_usage_error(build)
    if failed is not None:
        return failed
    result, inp, model_name = built
    if args.json:
        print(json.dumps({**result.to_dict(), "model": model_name, "gpu_mem_gib": gpu, "host_mem_gib": host,
                          "input": {**inp.to_dict(), "seq": result.seq}}), flush=True)
        return EXIT_OK if result.seq else EXIT_NO_FIT
    mode = ("+activation checkpointing +offload" if inp.offload_activations
            else "+activation checkpointing" if inp.activation_checkpointing else "no checkpointing")
    limits = f"{gpu:g} GiB per device" + (f", {host:g} GiB host per rank" if inp.offload_activations else "")
    if not result.seq:
        print(f"{model_name}: tsp D={inp.degree} {mode}: not even {result.unit} tokens fit {limits} "
              f"({result.limit} memory)")
        return EXIT_NO_FIT
    p = result.plan
    print(f"{model_name}: tsp D={inp.degree} batch={inp.batch} {inp.dtype} {mode}: longest sequence within {limits}: "
          f"{result.seq} tokens ({result.seq / 2 ** 20:.2f}M); {result.unit} more would exceed {result.limit} memory")
    print(f"  at {result.seq}: peak {p.peak_bytes_per_rank / GIB:.2f} GiB per device ({p.peak_phase})"
          + (f", host {p.host_bytes_per_rank / GIB:.2f} GiB per rank" if inp.offload_activations else ""))
    for line in _offload_lines(p):
        print(f"  {line}")
    print("  (ds_tsp.tools.plan's estimate: no CUDA context or allocator slack; leave some)", flush=True)
    return EXIT_OK


def _run_cp(args: argparse.Namespace) -> int:
    """--cp C (TSP inside each node, a cp ring across nodes) and --recommend --cp auto (pick D and C for a node
    size, a device count and a sequence): ds_tsp.tools.plan.tsp_cp's numbers, printed."""
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp, recommend_tsp_cp

    def build():
        if args.layout and [n for n in args.layout if n.strip().lower() != "tsp"]:
            raise _UsageError("--layout", "--cp plans TSP with a cp ring (layout tsp_cp) only; drop --layout")
        inp, model_name = _plan_input(args)
        rates = {"inter_node_gbps": args.inter_node_gbps, "gpu_tflops": args.gpu_tflops}
        if args.recommend:
            if args.cp_comm == "all_to_all":
                raise _UsageError("--cp-comm", "--recommend --cp auto picks D and C for the cp ring; plan "
                                               "--cp-comm all_to_all with a given --cp C")
            if args.gpu_mem_gib is None or args.devices is None:
                raise _UsageError("--gpu-mem-gib" if args.gpu_mem_gib is None else "--devices",
                                  "--recommend --cp auto needs --gpu-mem-gib G and --devices N")
            choice, tried = recommend_tsp_cp(inp, devices=args.devices, gpu_mem_bytes=int(args.gpu_mem_gib * GIB),
                                             gpus_per_node=args.gpus_per_node, **rates)
            return (choice, tried), inp, model_name
        if args.cp == "auto":
            raise _UsageError("--cp", "--cp auto picks D and C with --recommend; otherwise give --cp C")
        if args.cp_comm == "all_to_all":  # ds_tsp.tools.plan.tsp_cp_all_to_all
            from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all

            return plan_tsp_cp_all_to_all(inp, args.cp, gpus_per_node=args.gpus_per_node, **rates), inp, model_name
        if args.cp_comm == "auto":  # the schedule the model's tsp.cp_comm "auto" runs (tsp_cp_auto)
            from ds_tsp.tools.plan.tsp_cp_auto import plan_tsp_cp_auto

            return plan_tsp_cp_auto(inp, args.cp, gpus_per_node=args.gpus_per_node, **rates), inp, model_name
        return plan_tsp_cp(inp, args.cp, gpus_per_node=args.gpus_per_node, **rates), inp, model_name

    built, failed = _or_usage_error(build)
    if failed is not None:
        return failed
    result, inp, model_name = built
    if not args.recommend:
        if args.json:
            print(json.dumps({**result.to_dict(), "model": model_name, "input": inp.to_dict()}), flush=True)
        else:
            stages = f" pp={inp.pp} (stage {result.stage}: {result.layers_per_stage} layers)" if inp.pp > 1 else ""
            print(f"{model_name}: seq={inp.seq} batch={inp.batch} D={inp.degree} dp={inp.dp}{stages} {inp.dtype}"
                  f"{' +AC' if inp.activation_checkpointing else ''}{' +offload' if inp.offload_activations else ''}")
            for line in _cp_lines(result) + [f"  {n}" for n in result.notes]:
                print(line, flush=True)
        return EXIT_OK
    choice, tried = result
    gpu_mem = args.gpu_mem_gib * GIB
    if args.json:
        print(json.dumps({"choice": None if choice is None else {"tsp": choice[0], "cp": choice[1]},
                          "tried": [{"tsp": d, "cp": c, **({"peak_bytes_per_rank": p.peak_bytes_per_rank,
                                                             "cp_summary": p.cp} if not isinstance(p, str)
                                                            else {"error": p})} for d, c, p in tried],
                          "model": model_name, "input": inp.to_dict()}), flush=True)
    else:
        print(f"{model_name}: seq={inp.seq} batch={inp.batch} {inp.dtype} | {args.devices} devices x "
              f"{gpu_mem / GIB:g} GiB, {args.gpus_per_node} per node")
        for d, c, p in tried:
            verdict = p if isinstance(p, str) else (f"peak {p.peak_bytes_per_rank / GIB:.2f} GiB: "
                                                   + ("fits" if p.peak_bytes_per_rank <= gpu_mem else "too big"))
            print(f"  D={d} C={c}: {verdict}")
        if choice is None:
            print("no D x C fits: more devices, activation checkpointing (+ offload) or a shorter sequence")
        else:
            plan = next(p for d, c, p in tried if (d, c) == choice)
            dp = args.devices // (choice[0] * choice[1])
            print(f'recommended: "tsp": {{"size": {choice[0]}, "cp_size": {choice[1]}}} (data-parallel degree {dp})')
            for line in _cp_lines(plan):
                print(f"  {line}", flush=True)
    return EXIT_OK if choice is not None else EXIT_NO_FIT


# --- text output --------------------------------------------------------------------------------------------------

def _print_table(plans, inp, model_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

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

    gib = lambda v: f"{v / GIB:.2f}"  # noqa: E731
    row("params GiB", lambda p: gib(p.params_bytes))
    row("grads GiB", lambda p: gib(p.grads_bytes))
    row("optimizer GiB (AdamW)", lambda p: gib(p.optimizer_bytes))
    row("activations GiB", lambda p: gib(p.activations_bytes))
    row("framework buffers GiB", lambda p: gib(p.framework_bytes))
    row("transients GiB", lambda p: f"{gib(p.transients_bytes)} ({p.peak_phase})")
    row("peak GiB", lambda p: f"[bold]{gib(p.peak_bytes_per_rank)}[/bold]")
    if any(p.host_bytes_per_rank for p in plans):
        row("host (offloaded) GiB", lambda p: gib(p.host_bytes_per_rank))
    row("comm / layer fwd MiB", lambda p: f"{p.comm_bytes_per_layer_fwd / MIB:.1f}")
    row("comm / layer bwd MiB", lambda p: f"{p.comm_bytes_per_layer_bwd / MIB:.1f}")
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
        for line in _offload_lines(plan):
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
        row(f"MoE {s}: bytes / sparse layer MiB", cell(lambda m, s=s: f"{m['bytes_per_layer'][s] / MIB:.2f}"))
        row(f"MoE {s}: peak GiB", cell(lambda m, s=s: f"{m['peak_bytes'][s] / GIB:.2f}" if "peak_bytes" in m
                                         else "-"))
    row("MoE auto -> / planned", cell(lambda m: f"{m['auto']} / {m['schedule']}"))


def _offload_lines(plan) -> list[str]:
    """The host-memory and PCIe lines of a plan with offload (what `ds-tsp plan --offload-activations` prints)."""
    o = plan.offload
    if not o:
        return []
    hidden = o["pcie_seconds_per_layer"] <= o["compute_seconds_per_layer_fwd"]
    return [f"host memory (offloaded layer inputs): {plan.host_bytes_per_rank / GIB:.2f} GiB per rank, "
            f"{o['host_bytes_per_node'] / GIB:.2f} GiB ({o['host_bytes_per_node'] / 1e12:.2f} TB) per node of "
            f"{o['gpus_per_node']} GPUs; {o['offloaded_layers']} layer inputs of {o['layer_input_bytes'] / GIB:.2f} "
            f"GiB, at most {o['device_held_layer_inputs']} on the device",
            f"PCIe at {o['pcie_gb_per_s_per_direction']:g} GB/s per direction: {o['pcie_seconds_per_step']:.2f} s per "
            f"step each way ({o['pcie_bytes_per_step_per_direction'] / 1e9:.1f} GB) against ~"
            f"{o['compute_seconds_per_step']:.1f} s of compute at {o['gpu_tflops']:g} TFLOP/s; per layer "
            f"{o['pcie_seconds_per_layer'] * 1e3:.1f} ms of copy vs {o['compute_seconds_per_layer_fwd'] * 1e3:.1f} ms "
            f"of forward: {'hidden behind compute' if hidden else 'NOT hidden: the copies stall the step'}"]


def _cp_lines(plan) -> list[str]:
    """The cp ring's lines: memory per rank, inter- vs intra-node bytes, ring seconds vs the attention they hide."""
    cp = plan.cp
    if "cp_comm_auto" in cp:  # cp_comm auto: the chosen schedule's lines, then which and why
        from dataclasses import replace

        from ds_tsp.tools.plan.tsp_cp_auto import auto_lines

        return _cp_lines(replace(plan, cp={k: v for k, v in cp.items() if k != "cp_comm_auto"})) + auto_lines(plan)
    if cp.get("cp_comm") == "all_to_all":
        from ds_tsp.tools.plan.tsp_cp_all_to_all import all_to_all_lines

        return all_to_all_lines(plan)
    hidden = cp["cp_ring_seconds_per_step"] <= cp["overlapped_attention_seconds_per_step"]
    return [
        f"D={cp['tsp']} (TSP inside a node) x C={cp['cp']} (cp ring across nodes): seq {cp['seq_padded']}, "
        f"{cp['tokens_per_rank']} tokens per rank; peak {plan.peak_bytes_per_rank / GIB:.2f} GiB per rank"
        + (f", host {plan.host_bytes_per_rank / GIB:.2f} GiB per rank (offloaded layer inputs)"
           if plan.host_bytes_per_rank else ""),
        f"per step and rank: inter-node (cp axis) {cp['inter_node_bytes_per_step'] / GIB:.1f} GiB, intra-node (TSP) "
        f"{cp['intra_node_bytes_per_step'] / GIB:.1f} GiB (cp blocks reassembled over TSP "
        f"{cp.get('intra_node_cp_bytes_per_step', 0) / GIB:.1f} GiB of it), grad sync over dp x cp "
        f"{cp['grad_sync_bytes_per_step'] / GIB:.2f} GiB",
        f"cp ring at {cp['inter_node_gbps']:g} Gb/s per GPU: {cp['cp_ring_seconds_per_step']:.1f} s per step vs "
        f"{cp['overlapped_attention_seconds_per_step']:.1f} s of the attention it overlaps at {cp['gpu_tflops']:g} "
        f"TFLOP/s (per hop {cp['hop_seconds'] * 1e3:.1f} ms vs {cp['hop_attention_seconds'] * 1e3:.1f} ms): "
        + ("hidden behind attention" if hidden else "NOT hidden: the ring stalls the step"),
    ]


def _print_recommendation(rec, inp, model_name: str) -> None:
    m = inp.model
    print(f"{model_name}: h={m.hidden_size} layers={m.num_layers} heads={m.num_heads}/{m.num_kv_heads} "
          f"ffn={m.intermediate_size} vocab={m.vocab_size} | seq={inp.seq} batch={inp.batch} {inp.dtype} | "
          f"{rec.devices} devices x {rec.gpu_mem_bytes / GIB:g} GiB")
    if rec.best is None:
        print(f"no layout fits: {rec.why}")
    else:
        b = rec.best
        print(f"recommended: {b.label}: peak {b.peak_bytes_per_rank / GIB:.2f} GiB per rank, "
              f"comm {b.comm_bytes_per_step / GIB:.2f} GiB per rank per step"
              + (f", host {b.host_bytes_per_rank / GIB:.2f} GiB per rank (offloaded layer inputs)"
                 if b.offload_activations else ""))
        print(f"  why: {rec.why}")
        if b.layout == "tsp" and b.tsp_settings:
            print(f"  \"tsp\" block: {json.dumps(b.tsp_settings)}")
    print("rejected:")
    for c in rec.rejected:
        print(f"  {c.label}: {c.verdict}")
    print("  (peak: ds_tsp.tools.plan's estimate, no CUDA context or allocator slack; comm: equal global batch per "
          "step, see ds_tsp/tools/plan/recommend.py)", flush=True)
