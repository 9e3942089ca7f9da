"""Shared pytest setup: `slow` tests are opt-in (pytest --runslow, or RUN_SLOW=1 in the environment); `soak`
tests run only when selected (pytest -m soak)."""
from __future__ import annotations

import os

import pytest

# Tests never download anything: tiny models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def _run_slow(config: pytest.Config) -> bool:
    return config.getoption("--runslow") or os.environ.get("RUN_SLOW", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" not in (config.getoption("-m") or ""):
        skip_soak = pytest.mark.skip(reason="soak: run with pytest -m soak")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(skip_soak)
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
