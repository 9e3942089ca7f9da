"""One DeprecationWarning per moved import path, pointed at the user's line (not at importlib or ds_tsp).

The moved paths themselves are listed where they are served: ds_tsp/_moved.py (whole modules, e.g. ds_tsp.launch),
the __getattr__ of ds_tsp.model, ds_tsp.checkpoint and ds_tsp.integrations.fsdp (single names)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

REMOVED_IN = "0.3.0"
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_warned: set[str] = set()  # one line per moved path and process, however often it is imported


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside ds_tsp and the import machinery (warnings itself
    skips importlib's frames when it counts, so they are not counted here either)."""
    frame, level = sys._getframe(2), 2  # 1 is warnings.warn's caller (this module's warn_moved)
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            if not str(Path(name).resolve()).startswith(_PACKAGE_DIR):
                return level
            level += 1
        frame = frame.f_back
    return 2


def warn_moved(old: str, new: str, *, as_main: bool = False) -> None:
    """`old` (an import path the pre-release README documented) is replaced by `new` (what to write instead); the
    old path goes in REMOVED_IN. as_main: the old path was run (python -m), so there is no importing line: the
    warning is issued as __main__'s, which Python's default filters show."""
    if old in _warned:
        return
    _warned.add(old)
    message = f"{old} moved: use {new} (the old path is removed in ds_tsp {REMOVED_IN})"
    if as_main:
        warnings.warn_explicit(message, DeprecationWarning, filename=f"python -m {old}", lineno=0, module="__main__")
    else:
        warnings.warn(message, DeprecationWarning, stacklevel=_caller_stacklevel())
