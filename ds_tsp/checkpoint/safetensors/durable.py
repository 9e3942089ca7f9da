"""Durable file-system steps shared by the checkpoint writers."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's contents (for a directory: its entries) to stable storage."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
