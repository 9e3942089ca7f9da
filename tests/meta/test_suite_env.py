"""The README's test command alone is CI's run: the environment the suite needs is set by tests/conftest.py, not by
.ci/run, so a newcomer's `python -m pytest -q tests` runs under exactly what CI runs under."""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from conftest import SUITE_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_sets_its_own_environment():
    assert SUITE_ENV == {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    assert {k: os.environ.get(k) for k in SUITE_ENV} == SUITE_ENV
    assert torch.get_num_threads() == 1  # read by torch when it loaded, after conftest set it


def test_ci_runs_the_readme_test_command_and_exports_nothing():
    ci = (ROOT / ".ci" / "run").read_text()
    assert not re.search(r"^\s*export\s", ci, re.MULTILINE), "put what the tests need into tests/conftest.py"
    readme_command = re.search(r"&& (python -m pytest[^\n`]*)", (ROOT / "README.md").read_text()).group(1).strip()
    ci_command = re.search(r"^\s*(python -m pytest[^|\n]*)", ci, re.MULTILINE).group(1).strip()
    assert ci_command == readme_command == "python -m pytest -q tests"
