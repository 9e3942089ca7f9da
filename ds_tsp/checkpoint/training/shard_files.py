"""Safetensors files of one writer, cut at `max_file_bytes`, each with its sha256 computed as it is written."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from ds_tsp.checkpoint.training.manifest import FileEntry

DEFAULT_FILE_BYTES = 2 << 30


class ShardFileWriter:
    """`add(name, tensor)` buffers up to max_file_bytes, then writes `<prefix>-<k>.safetensors` (fsync'd)."""

    def __init__(self, directory: Path, prefix: str, max_file_bytes: int = DEFAULT_FILE_BYTES):
        self.directory, self.prefix, self.max_file_bytes = directory, prefix, max_file_bytes
        self.files: dict[str, FileEntry] = {}
        self.tensor_files: dict[str, str] = {}  # tensor name -> file
        self._buffer: dict[str, torch.Tensor] = {}
        self._bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu", copy=True).contiguous()  # a copy: the caller's buffer may change after
        if self._buffer and self._bytes + t.nbytes > self.max_file_bytes:
            self.flush()
        self._buffer[name] = t
        self._bytes += t.nbytes

    def flush(self) -> None:
        if not self._buffer:
            return
        name = f"{self.prefix}-{len(self.files) + 1:05d}.safetensors"
        data = safetensors_bytes(self._buffer, metadata={"format": "pt"})
        write_file(self.directory / name, data)
        self.files[name] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        self.tensor_files.update(dict.fromkeys(self._buffer, name))
        self._buffer, self._bytes = {}, 0


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class ShardFileReader:
    """Tensors by name from a checkpoint's safetensors files (opened lazily, memory-mapped, never unpickled)."""

    def __init__(self, directory: Path, tensor_files: dict[str, str]):
        self.directory, self.tensor_files = directory, tensor_files
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensor_files

    def get(self, name: str) -> torch.Tensor:
        file = self.tensor_files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.directory / file), framework="pt")
        return self._open[file].get_tensor(name)

    def close(self) -> None:
        self._open.clear()
