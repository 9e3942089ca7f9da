"""`ds-tsp verify` end to end: spawns the ranks itself, prints one JSON report, exit code says ok; bad input exits 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from local_ranks import forked_ranks

from ds_tsp.tools.cli import main


@pytest.fixture(autouse=True, scope="module")
def _ranks_fork_from_the_suite_server():
    """`ds-tsp verify`, called in-process below, starts its ranks with the package's launcher: they fork
    from the session's pre-imported server instead of each importing torch afresh (tests/helpers/local_ranks.py)."""
    with forked_ranks():
        yield


def _report(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


@pytest.fixture(autouse=True)
def _not_under_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # else verify would join the launcher's group


def test_verify_d2_float64(capsys):
    assert main(["verify", "--tsp", "2", "--dtype", "float64", "--timeout", "120"]) == 0
    report = _report(capsys)
    assert report["ok"] is True and report["tsp"] == 2 and report["dtype"] == "float64"
    assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10


def test_verify_d3_mqa_bias_tied_float64(capsys):
    # MQA: one kv head replicated on all 3 ranks; plus Qwen2-style q/k/v bias and a tied LM head.
    argv = ["verify", "--tsp", "3", "--heads", "6", "--kv-heads", "1", "--hidden", "96", "--ffn", "96",
            "--vocab", "100", "--seq", "50", "--qkv-bias", "--tie-embeddings", "--dtype", "float64", "--timeout", "120"]
    assert main(argv) == 0
    report = _report(capsys)
    assert report["ok"] is True and report["tsp"] == 3
    assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10


def test_bad_shape_exits_2_with_one_line_naming_the_field():
    # Through the module entry point in a fresh interpreter: validation happens before any rank starts.
    proc = subprocess.run([sys.executable, "-m", "ds_tsp.tools.cli", "verify", "--heads", "6", "--hidden", "96",
                           "--tsp", "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "num_heads=6" in err[0] and "tsp=4" in err[0], proc.stderr


def test_ffn_not_divisible_exits_2(capsys):
    assert main(["verify", "--tsp", "3", "--heads", "6", "--hidden", "96", "--ffn", "128"]) == 2
    assert "intermediate_size=128" in capsys.readouterr().err


def test_tsp_must_match_launcher_world(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["verify", "--tsp", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tsp=4" in err and "WORLD_SIZE=2" in err


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("verify_hf")
    return {name: save_tiny_checkpoint(root / name, name) for name in ("llama3_tied", "qwen3")}


@pytest.mark.parametrize("tsp", [2, 4])
@pytest.mark.parametrize("name", ["llama3_tied", "qwen3"])
def test_verify_hf_model_llama3_and_qwen3_styles(capsys, hf_checkpoints, name, tsp):
    # The reference is transformers' own model; packed documents (the reference runs each one alone).
    argv = ["verify", "--hf-model", str(hf_checkpoints[name]), "--tsp", str(tsp), "--dtype", "float64",
            "--seq", "45", "--documents", "3", "--timeout", "120"]
    assert main(argv) == 0
    report = _report(capsys)
    assert report["ok"] is True and report["reference"] == "transformers" and report["documents"] == 3
    assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10


def test_verify_documents_against_ds_tsp_reference_d3(capsys):
    argv = ["verify", "--tsp", "3", "--heads", "6", "--kv-heads", "3", "--hidden", "48", "--ffn", "96", "--seq", "61",
            "--documents", "5", "--dtype", "float64", "--timeout", "120"]
    assert main(argv) == 0
    report = _report(capsys)
    assert report["ok"] is True and report["documents"] == 5 and report["reference"] == "ds_tsp"


def test_verify_hf_model_errors(capsys, tmp_path):
    assert main(["verify", "--hf-model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["verify", "--seq", "8", "--documents", "9"]) == 2
    assert "--documents 9" in capsys.readouterr().err


# --- numbers on every command line (ds_tsp.tools.cli_types) -----------------------------------------------------

def test_integer_takes_suffixes_and_e_notation():
    from ds_tsp.tools.cli_types import integer

    assert [integer(t) for t in ("4096", " 128k", "1M", "5e6", "2.5e1", "1_000")] == [4096, 131072, 2 ** 20,
                                                                                      5_000_000, 25, 1000]
    for bad in ("lots", "1.5", "2.5e0", "k", "", "0x10"):
        with pytest.raises(ValueError, match="is not an integer; write e.g. 4096, 128k or 1m"):
            integer(bad)


def test_type_factories_raise_argparse_type_errors():
    import argparse

    from ds_tsp.tools.cli_types import at_least, integer, non_negative, positive

    assert positive(integer)("8k") == 8192 and positive(float)("0.5") == 0.5 and non_negative(integer)("0") == 0
    assert at_least(2)("2") == 2 and positive(int)("3") == 3
    cases = ((positive(integer), "0", "0 must be >= 1"), (positive(float), "0", "0.0 must be > 0"),
             (positive(float), "nan", "'nan' is not a finite number"), (positive(float), "x", "'x' is not a number"),
             (positive(int), "8k", "'8k' is not an integer"), (non_negative(integer), "-1", "-1 must be >= 0"),
             (at_least(2), "1", "1 must be >= 2"))
    for parse, text, message in cases:
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            parse(text)
        assert str(exc.value) == message


def test_bad_number_is_one_line_naming_the_flag(capsys):
    assert main(["verify", "--tsp", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "ds-tsp verify: error: argument --tsp: 0 must be >= 1 (see ds-tsp verify --help)\n"
