"""The benchmark scripts under benchmarks/ that run on the CPU start and print their row at a tiny size."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_pieces_times_both_splits(capsys):
    _load("attention_pieces").main(["--tsp", "2", "--seq", "64", "--heads", "2", "--head-dim", "8", "--repeats", "1"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("D=2 S=64 H=2 d=8: Ulysses' rank ") and "TSP's ranks" in line, line
    assert float(line.rsplit(" ", 1)[1]) > 0, line


def test_attention_pieces_per_pair_names_every_piece_shape(capsys):
    _load("attention_pieces").main(["--per-pair", "--tsp", "2", "--seq", "64", "--heads", "2", "--head-dim", "8",
                                    "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("D=2 S=64 H=2 d=8 (H / D = 1 per call)"), lines
    shapes = [line.strip().split(":")[0] for line in lines[1:]]
    assert shapes == ["Ulysses' causal 64 x 64", "causal diagonal 16 x 16", "unmasked 16 x 16", "unmasked 16 x 48"]
    for line in lines[1:]:
        fwd, bwd = (float(x) for x in line.rsplit(":", 1)[1].split("/"))
        assert fwd > 0 and bwd > 0, line


def test_delta_rule_decays_times_both_forms_for_both_decays(capsys):
    _load("delta_rule_decays").main(["--tsp", "2", "--seq", "32", "--batch", "1", "--heads", "2", "--head-dim", "4",
                                     "--chunk", "4", "--repeats", "1", "--transformers"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("D=2 S=32 B=1: 2 rows x 1 heads x 8 tokens, head dim 4, sub-chunk 4"), lines
    forms = [line.strip().split(":")[0] for line in lines[1:]]
    assert forms == ["weak decays, flushed", "weak decays, plain exp", "strong decays, flushed",
                     "strong decays, plain exp", "transformers' kernel, 1 x 32 tokens x 2 heads, weak decays",
                     "transformers' kernel, 1 x 32 tokens x 2 heads, strong decays"]
    for line in lines[1:]:
        fwd, both = (float(x) for x in line.rsplit(":", 1)[1].split("/"))
        assert 0 < fwd and 0 < both, line
