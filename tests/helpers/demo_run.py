"""The README's deterministic commands, run once per test session: tests/meta/test_demo.py and tests/meta/test_doc_figures.py
both read the demo's output, so it is started once (a run costs 15-25 s on 2 cores)."""
from __future__ import annotations

import functools
from pathlib import Path

from ds_tsp.tools import doc_figures

ROOT = Path(__file__).resolve().parents[2]
DEMO_TSP2 = "docs/results/demo_tsp2.json"


@functools.cache
def readme_command_output(results_file: str) -> tuple[str, ...]:
    """stdout JSON lines of the command that made `results_file` (doc_figures.MEASURED), run as the README shows it."""
    return tuple(doc_figures.run_measured(results_file, ROOT)["stdout"])
