"""Stdout carries JSON lines only: a script's records go to the real stdout, anything else written there goes to
stderr, so `torchrun ... examples/train.py | jq` parses every line.

    reserve_stdout()          # first thing in a script's __main__, before deepspeed is imported
    emit({"step": 1, "loss": 2.5})

What else lands on stdout is not ours to change: DeepSpeed's logger is a StreamHandler on sys.stdout ("[WARNING]
Setting accelerator to CPU"), its op builder print()s ("deepspeed_shm_comm_op built successfully") and its first
build runs a compiler whose output is written to file descriptor 1 directly. So the redirection happens at the
file descriptor: fd 1 is pointed at stderr (sys.stdout, every library's handler on it, and child processes follow),
and the records are written to a duplicate of the original fd 1 kept for them.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

_json_stream: TextIO | None = None  # the original stdout once reserved; None: not reserved (a library call, a test)


def reserve_stdout() -> TextIO:
    """Keep the process's stdout for `emit`; everything else written to stdout goes to stderr from now on.
    Idempotent (a second call returns the same stream: redirecting twice would send the records to stderr)."""
    global _json_stream
    if _json_stream is None:
        kept = os.dup(1)  # sys.stdout is not flushed first: what an import left in its buffer goes to stderr too
        os.dup2(2, 1)  # sys.stdout's file descriptor now writes to stderr, and so does everything holding it
        _json_stream = os.fdopen(kept, "w", buffering=1, encoding="utf-8")
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)  # keep its lines in order with stderr's
    return _json_stream


def json_stream() -> TextIO:
    """Where records go: the reserved stdout, else sys.stdout (nothing was reserved: a test calling main())."""
    return _json_stream if _json_stream is not None else sys.stdout


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed at once."""
    stream = json_stream()
    stream.write(json.dumps(record) + "\n")
    stream.flush()
