"""Which stack frames are ds_tsp's own (a helper module for tests; nothing here is collected).

A frame is ours when its file lies inside the installed package directory (`ds_tsp.__file__`'s parent, resolved).
A substring such as "/ds_tsp/" is not enough: `git clone` names the checkout `ds_tsp`, so with the README's
`.venv` inside it the test files and torch's own files (`ds_tsp/.venv/lib/.../torch/...`) match it too.
"""
from __future__ import annotations

import os
import traceback
from functools import lru_cache
from pathlib import Path

import ds_tsp

PACKAGE_DIR = Path(ds_tsp.__file__).resolve().parent


@lru_cache(maxsize=None)
def package_path(filename: str) -> str | None:
    """`filename` relative to the package directory ("core/tokens/rope.py"), with "/" separators, or None when the file
    is not part of ds_tsp. Cached: dispatch modes call this for every frame of every op."""
    try:
        rel = Path(os.path.realpath(filename)).relative_to(PACKAGE_DIR)
    except ValueError:
        return None
    return rel.as_posix()


def package_frames(frames: list[traceback.FrameSummary] | None = None) -> list[tuple[str, traceback.FrameSummary]]:
    """(path inside the package, frame) for each ds_tsp frame of `frames` (default: the current stack), outermost
    first."""
    frames = traceback.extract_stack() if frames is None else frames
    return [(p, f) for f in frames if (p := package_path(f.filename)) is not None]
