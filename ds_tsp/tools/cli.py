"""`ds-tsp` command line: one subcommand per task, each a thin layer over a library function.

    ds-tsp verify [--tsp D] [--cp C] [...]  TSP model vs the single-device reference (ds_tsp.tools.verify)
    ds-tsp plan   [--model 7b] [--seq ...]  analytic per-rank memory and communication per layout (ds_tsp.tools.plan)
    ds-tsp bench  [--quick] [--out DIR]     TSP side by side with its peers, measured (ds_tsp.tools.bench)

Exit codes: 0 success, 1 the check failed (or a rank crashed), 2 bad input (one line on stderr naming the field).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.cli_types import OneLineErrors, at_least, integer, positive
from ds_tsp.tools.entry_point import config_error_in, report_error

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_DTYPE_CHOICES = ("float32", "float64", "bfloat16")  # keys of ds_tsp.tools.verify.DTYPES (kept torch-free for --help)


def _error(command: str, message: str) -> int:
    report_error(f"ds-tsp {command}", message)  # one line; under a launcher printed once, not once per rank
    return EXIT_USAGE


# --- verify -------------------------------------------------------------------------------------------------------

def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check the TSP model against the single-device reference (loss and every gradient)",
        description="Run the TSP model on --tsp local gloo processes (or on the whole world under torchrun / "
                    "deepspeed) and compare its loss and gradients with the single-device reference built from the "
                    "same weights and batch. Prints one JSON line; exits 0 only when both errors are within the "
                    "dtype's tolerance (float64 1e-10, float32 1e-5, bfloat16 5e-2).")
    p.add_argument("--tsp", type=positive(integer), default=2, help="TSP degree D (default 2)")
    p.add_argument("--cp", type=positive(integer), default=1,
                   help="context-parallel degree C: C TSP groups share each sequence, C x D ranks (default 1)")
    p.add_argument("--cp-comm", choices=("auto", "ring", "all_to_all"), default="auto",
                   help="with --cp C > 1: K/V around the cp ring, each head block's heads scattered over the cp "
                        "groups by all-to-all, or per attention layer the one with less exposed inter-node time "
                        "(tsp.cp_comm; default auto: the report names the schedule run)")
    p.add_argument("--layers", type=positive(integer), default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=positive(integer), default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=positive(integer), default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=positive(integer), default=None, help="kv heads (default: --heads, i.e. MHA)")
    p.add_argument("--head-dim", type=at_least(2), default=None, help="head dim (default hidden/heads)")
    p.add_argument("--ffn", type=positive(integer), default=128, help="MLP intermediate size (default 128)")
    p.add_argument("--vocab", type=positive(integer), default=128, help="vocab size (default 128)")
    p.add_argument("--seq", type=at_least(2), default=64, help="global sequence length (default 64)")
    p.add_argument("--batch", type=positive(integer), default=2, help="micro-batch size (default 2)")
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default="float32", help="default float32")
    p.add_argument("--seed", type=int, default=0, help="weights and batch seed (default 0)")
    p.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--qkv-bias", action="store_true", help="Qwen2-style bias on q/k/v")
    p.add_argument("--hf-model", metavar="DIR", default=None,
                   help="a local HF checkpoint: the reference is transformers' own model loaded from DIR, TSP loads "
                        "DIR by slices; the shape flags are then taken from the checkpoint")
    p.add_argument("--documents", type=positive(integer), default=1,
                   help="pack K documents of random lengths into every sequence (position_ids restarting); the "
                        "reference runs every document on its own (default 1)")
    p.add_argument("--images", type=positive(integer), default=None,
                   help="with --hf-model of a multimodal checkpoint (Qwen3.5, Qwen3.5-MoE, Qwen3-VL, Qwen3-VL-MoE): N "
                        "images in the batch; the reference is transformers' ForConditionalGeneration, TSP runs "
                        "TSPForConditionalGeneration (the vision tower's gradients compared too)")
    p.add_argument("--videos", type=positive(integer), default=None,
                   help="with --hf-model of a multimodal checkpoint: M videos (2 frames each) in the batch")
    p.add_argument("--timeout", type=positive(float), default=600.0,
                   help="seconds before the ranks are stopped (default 600)")
    p.set_defaults(run=_verify)


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    return ModelShape(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
                      head_dim=args.head_dim, tie_word_embeddings=args.tie_embeddings, qkv_bias=args.qkv_bias)


def _verify_under_launcher(case, tsp: int, timeout_s: float, cp: int = 1,
                           cp_comm: str = "auto") -> tuple[dict | None, bool]:
    """torchrun / deepspeed started us: the whole world is the TSP group (cp > 1: C TSP groups sharing the
    sequence). Returns (report on rank 0, ok)."""
    import torch.distributed as dist

    from ds_tsp.core.parallel.launch import init_from_env
    from ds_tsp.core.reliability.watchdog import guarded
    from ds_tsp.tools.verify import run_cp_case

    rank, world = init_from_env(timeout_s=timeout_s)
    try:
        report = _world_entry(case)(case) if cp == 1 else run_cp_case(case, tsp, cp, {"cp_comm": cp_comm})
        verdict = [None if report is None else bool(report["ok"])]
        if world > 1:  # every rank exits with rank 0's verdict; a stalled rank 0 is reported, not waited for
            with guarded(None, "verify: rank 0's verdict broadcast_object_list", context="verify",
                         timeout_s=timeout_s):
                dist.broadcast_object_list(verdict, src=0)
    finally:
        dist.destroy_process_group()
    return report, bool(verdict[0])


def _shape_from_checkpoint(directory: str) -> ModelShape:
    from pathlib import Path

    config = Path(directory) / "config.json"
    if not config.is_file():
        raise TSPConfigError(f"--hf-model {directory}: no config.json there; pass a local HF checkpoint directory")
    values = json.loads(config.read_text())
    from ds_tsp.model.hf_conditional_generation import ARCHITECTURES as MULTIMODAL
    from ds_tsp.model.hf_conditional_generation import multimodal_shape

    if values.get("model_type") in MULTIMODAL:  # read as TSPForConditionalGeneration reads it (Qwen3-VL's text)
        return multimodal_shape(values)
    return ModelShape.from_hf_config(values)


def _world_entry(case):
    """The check's entry on a world that is one TSP group: the multimodal one for --images."""
    if case.images or case.videos:
        from ds_tsp.tools.verify_multimodal import run_multimodal_case_on_world

        return run_multimodal_case_on_world
    from ds_tsp.tools.verify import run_case_on_world

    return run_case_on_world


def _check_images(args: argparse.Namespace) -> None:
    """--images / --videos need a multimodal checkpoint, one document per row and no cp axis (refused by name
    otherwise)."""
    from pathlib import Path

    from ds_tsp.model.hf_conditional_generation import check_multimodal_family

    if not args.hf_model:
        raise TSPConfigError("--images / --videos need --hf-model DIR of a multimodal checkpoint (Qwen3.5, "
                             "Qwen3.5-MoE, Qwen3-VL or Qwen3-VL-MoE ForConditionalGeneration)")
    check_multimodal_family(json.loads((Path(args.hf_model) / "config.json").read_text()).get("model_type"))
    if args.cp > 1 or args.documents > 1:
        raise TSPConfigError(f"--images / --videos with --cp {args.cp} / --documents {args.documents}: the "
                             "multimodal check runs cp 1 and one document per row")
    from ds_tsp.tools.verify_multimodal import tokens_needed

    need = tokens_needed(args.images or 0, args.videos or 0, args.batch)
    if need > args.seq:
        raise TSPConfigError(f"--images {args.images or 0} --videos {args.videos or 0} over --batch {args.batch} "
                             f"rows need --seq {need} at least (an image takes 7 tokens of a row, a video 14)")


def _verify(args: argparse.Namespace) -> int:
    try:
        shape = _shape_from_checkpoint(args.hf_model) if args.hf_model else _shape_from_args(args)
        shape.check_tsp_degree(args.tsp)
        if args.cp_comm == "all_to_all":  # before any rank starts: the head blocks must split over cp
            if args.cp == 1:
                raise TSPConfigError("--cp-comm all_to_all needs --cp C > 1: it schedules attention across cp groups")
            from ds_tsp.core.layers.attention.cp_all_to_all import check_all_to_all_heads

            check_all_to_all_heads(shape.num_heads // args.tsp, max(shape.num_kv_heads // args.tsp, 1), args.cp)
        if args.documents > args.seq:
            raise TSPConfigError(f"--documents {args.documents} is more than --seq {args.seq}: every document needs "
                                 "at least one token")
        if args.images or args.videos:
            _check_images(args)
    except TSPConfigError as exc:
        return _error("verify", str(exc))

    from ds_tsp.core.parallel.launch import run_on_local_ranks
    from ds_tsp.tools.verify import VerifyCase, run_cp_case

    case = VerifyCase(shape=shape, seq=args.seq, batch=args.batch, dtype=args.dtype, seed=args.seed,
                      documents=args.documents, hf_model=args.hf_model, images=args.images or 0,
                      videos=args.videos or 0)
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != args.tsp * args.cp:
            if int(os.environ.get("RANK", "0")) != 0:
                return EXIT_USAGE
            if args.cp > 1:
                return _error("verify", f"--tsp={args.tsp} --cp={args.cp} needs {args.tsp * args.cp} ranks but the "
                                        f"launcher started WORLD_SIZE={world}: launch {args.tsp * args.cp} ranks")
            return _error("verify", f"--tsp={args.tsp} but the launcher started WORLD_SIZE={world} ranks: under "
                                    f"torchrun/deepspeed the whole world is one TSP group; pass --tsp {world} or "
                                    f"launch {args.tsp} ranks")
        report, ok = _verify_under_launcher(case, args.tsp, args.timeout, cp=args.cp, cp_comm=args.cp_comm)
    else:
        try:
            report = (run_on_local_ranks(_world_entry(case), args.tsp, case, timeout_s=args.timeout)[0]
                      if args.cp == 1 else
                      run_on_local_ranks(run_cp_case, args.tsp * args.cp, case, args.tsp, args.cp,
                                         {"cp_comm": args.cp_comm}, timeout_s=args.timeout)[0])
        except RuntimeError as exc:
            if isinstance(exc, TSPConfigError):  # a rank found bad input: its one line, as in this process
                return _error("verify", str(exc))
            print(f"ds-tsp verify: failed: {exc}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        ok = bool(report["ok"])
    if report is not None:
        print(json.dumps(report), flush=True)
    return EXIT_OK if ok else EXIT_FAILED


# --- entry point ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="ds-tsp", description="TSP: tensor and sequence parallelism folded onto one mesh axis.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineErrors)
    _add_verify(sub)
    from ds_tsp.tools.plan import cli as plan_cli  # torch-free, so `ds-tsp plan` and --help stay fast

    plan_cli.register(sub)
    _add_bench(sub)
    return parser


def _add_bench(sub: argparse._SubParsersAction) -> None:
    try:
        from ds_tsp.tools.bench import cli as bench_cli
    except ImportError:  # the bench package is optional at import time (matplotlib); say so when used
        return
    bench_cli.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """The ds-tsp command: its exit code (a usage error is 2 after its one line on stderr, --help 0)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except Exception as exc:  # a ds_tsp input error found while running (a checkpoint, a rank's batch): one line
        error = config_error_in(exc)
        if error is None:
            raise
        return _error(args.command, str(error))


if __name__ == "__main__":
    sys.exit(main())
