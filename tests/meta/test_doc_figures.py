"""The figures README.md and docs/*.md quote are their sources' figures, and the deterministic ones are what the
commands print today.

- Every `<!-- figures:NAME -->` block renders, from its committed source files (docs/bench/**/results.json,
  docs/results/*.json), to exactly the text the docs carry: a hand-edited figure, or a new results file without
  `python -m ds_tsp.tools.doc_figures --write`, fails here.
- The demo (`python examples/demo_train.py`, with and without `--tsp 1`) and the `ds-tsp verify` line of
  docs/cli.md are rerun and compared with their results files. MemTracker's sizes, the seeded losses (4 decimals)
  and every non-float verify field must be equal; verify's float64 figures are compared to 1e-12 relative (their
  last digits are rounding noise of the CPU's BLAS kernels: equal run to run here, but another CPU may sum in
  another order).
- `python tests/reliability/test_error_catalogue.py > docs/errors.md`, as docs/errors.md documents it, reproduces that file.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from demo_run import DEMO_TSP2, ROOT, readme_command_output

from ds_tsp.tools import doc_figures
from ds_tsp.tools.doc_figure_blocks import BLOCKS

DOCS = {doc: (ROOT / doc).read_text() for doc in doc_figures.documents(ROOT)}  # README.md and docs/*.md


def _results(results_file: str) -> dict:
    return json.loads((ROOT / results_file).read_text())


def test_every_block_equals_its_rendered_source():
    assert doc_figures.stale_blocks(ROOT) == [], "run: python -m ds_tsp.tools.doc_figures --write"


def test_the_quoted_figures_are_in_blocks():
    # The quoted figures stay generated: removing a block's markers (and editing the text by hand) fails here.
    found = {name for text in DOCS.values() for name, _ in doc_figures.blocks_in(text)}
    assert found == set(BLOCKS), f"unused renderers: {set(BLOCKS) - found}; unknown blocks: {found - set(BLOCKS)}"
    assert {"demo", "demo-tsp1", "verify", "memory-8192", "max-seq"} <= found
    # The quick start's command is followed by what it prints.
    assert {"demo", "demo-tsp1"} <= {n for n, _ in doc_figures.blocks_in(DOCS["README.md"])}


def test_a_changed_figure_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    for doc, text in DOCS.items():
        (tmp_path / doc).write_text(text)
    (doc,) = [d for d, text in DOCS.items() if "demo-tsp1" in {n for n, _ in doc_figures.blocks_in(text)}]
    text = DOCS[doc].replace("PARAM 0.472", "PARAM 0.999")
    assert text != DOCS[doc]
    (tmp_path / doc).write_text(text)
    for results_file in {path for sources, _ in BLOCKS.values() for path in sources}:
        (tmp_path / results_file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / results_file).write_text((ROOT / results_file).read_text())
    assert doc_figures.stale_blocks(tmp_path) == [f"{doc}: demo-tsp1"]
    assert doc_figures.main(["--check", "--root", str(tmp_path)]) == 1
    assert doc_figures.main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / doc).read_text() == DOCS[doc]


def test_the_docs_show_the_measured_commands():
    for results_file, (command, _) in doc_figures.MEASURED.items():
        assert _results(results_file)["command"] == command
        assert any(command in text for text in DOCS.values()), command
    assert "python examples/demo_train.py" in DOCS["README.md"]  # the quick start's demo


def _without_wall_time(line: str) -> dict:
    record = json.loads(line)
    record.get("summary", {}).pop("train_s", None)  # the one figure that is a wall time
    return record


@pytest.mark.parametrize("results_file", [DEMO_TSP2, "docs/results/demo_tsp1.json"])
def test_demo_prints_the_readme_figures(results_file):
    printed = [_without_wall_time(line) for line in readme_command_output(results_file)]
    committed = [_without_wall_time(line) for line in _results(results_file)["stdout"]]
    memory = [r for r in printed if "memory" in r]
    assert memory and memory == [r for r in committed if "memory" in r]  # MemTracker's peaks, exactly
    assert printed == committed


def test_verify_prints_the_readme_figures():
    (line,) = readme_command_output("docs/results/verify_tsp3.json")
    (committed_line,) = _results("docs/results/verify_tsp3.json")["stdout"]
    printed, committed = json.loads(line), json.loads(committed_line)
    assert printed.keys() == committed.keys()
    for key, value in committed.items():
        if isinstance(value, float):
            assert math.isclose(printed[key], value, rel_tol=1e-12, abs_tol=1e-14), (key, printed[key], value)
        else:
            assert printed[key] == value, key


def test_error_catalogue_regenerates_docs_errors_md():
    # The command docs/errors.md names, in a plain environment (no suite PYTHONPATH: the script finds its helpers
    # itself); DeepSpeed's accelerator warning must not reach it.
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONPATH")}
    command = re.search(r"Generated by `(python tests/reliability/test_error_catalogue.py) > docs/errors.md`",
                        (ROOT / "docs" / "errors.md").read_text())
    assert command, "docs/errors.md no longer says how it is generated"
    proc = subprocess.run([sys.executable, "tests/reliability/test_error_catalogue.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == (ROOT / "docs" / "errors.md").read_text()
