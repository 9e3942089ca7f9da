"""Numbers on the `ds-tsp` command lines, parsed once: argparse `type=` factories, and the byte units printed.

    p.add_argument("--seq", type=positive(integer), default=4096)      4096, 128k, 1m, 5e6
    p.add_argument("--zero-stage", type=non_negative(integer), default=0)
    p.add_argument("--gpu-mem-gib", type=positive(float))
    p.add_argument("--head-dim", type=at_least(2))

A bad value is argparse's error naming the flag, on ONE line (OneLineErrors): `ds-tsp plan: error: argument --seq:
'lots' is not an integer; write e.g. 4096, 128k or 1m` (exit 2, nothing on stdout).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["GIB", "MIB", "OneLineErrors", "integer", "positive", "non_negative", "at_least"]

GIB, MIB = 2 ** 30, 2 ** 20
_SUFFIX = {"k": 2 ** 10, "m": 2 ** 20}
_WHAT = {int: "an integer", float: "a number"}


class OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, as every other ds-tsp error is (a log or CI
    reads the line that names the flag, not a usage block); `--help` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(text: str) -> int:
    """An integer, with a binary k / m suffix (128k = 131072, 1m = 1048576) or in e-notation (5e6)."""
    s = str(text).strip().lower().replace("_", "")
    scale = _SUFFIX.get(s[-1:], 1)
    digits = s[:-1] if scale > 1 else s
    try:
        if "e" in digits:
            value = float(digits)
            if not value.is_integer():
                raise ValueError
            return int(value) * scale
        return int(digits) * scale
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is not an integer; write e.g. 4096, 128k or 1m") from None


def _checked(kind: Callable[[str], int | float], ok: Callable[[int | float], bool], bound: str):
    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError) as exc:
            what = _WHAT.get(kind)
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}" if what else str(exc)) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} must be {bound}")
        return value
    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its own messages
    return parse


def positive(kind: Callable[[str], int | float] = integer):
    """`type=` for a number > 0 (kind: integer, int or float; an integer's message says >= 1)."""
    if kind in (integer, int):
        return at_least(1, kind)
    return _checked(kind, lambda v: v > 0, "> 0")


def non_negative(kind: Callable[[str], int | float] = integer):
    """`type=` for a number >= 0."""
    return _checked(kind, lambda v: v >= 0, ">= 0")


def at_least(minimum: int | float, kind: Callable[[str], int | float] = integer):
    """`type=` for a number >= minimum."""
    return _checked(kind, lambda v: v >= minimum, f">= {minimum}")
