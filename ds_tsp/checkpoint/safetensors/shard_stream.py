"""Tensors in, safetensors part files out: `ShardStream` buffers tensors until the next one would pass
max_shard_size, then writes the buffer as one numbered part file (`{stem}-0000k.safetensors.part`) and drops it.

It names nothing final and moves nothing: StreamingCheckpointWriter (safetensors_writer.py) is a ShardStream over its
own temporary directory that names, indexes and renames the parts at close; a TSP rank that saves its own MoE
experts (hf_save.py) is a bare ShardStream over that same temporary directory, with a stem of its own, whose parts
the writer adopts.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds_tsp.checkpoint.safetensors.durable import fsync_path
from ds_tsp.checkpoint.safetensors.reader import DEFAULT_METADATA
from ds_tsp.core.errors import TSPConfigError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
PART_SUFFIX = ".safetensors.part"


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB", "100KB" (HF's convention: GB=10**9, GiB=2**30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (m := _SIZE_RE.match(size)) and m.group(2).upper() in _SIZE_UNITS:
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    else:
        raise TSPConfigError(
            f"max_shard_size={size!r} is not a size: pass bytes as an int or a string like '5GB', '500MB', '2GiB'"
        )
    if value <= 0:
        raise TSPConfigError(f"max_shard_size={size!r} must be positive: pass e.g. '5GB'")
    return value


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(DEFAULT_METADATA if metadata is None else metadata)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out.items()):
        raise TSPConfigError(f"metadata={out!r}: safetensors metadata must map str to str")
    return out


class ShardStream:
    """Writes tensors into `directory` as numbered safetensors part files, holding at most one part plus one tensor.

    `add` buffers a tensor (a reference, or a copy when it is a view or on another device: do not modify it in
    place until the part is written) until the part would exceed `max_shard_size`; then the part is written with
    safetensors' `save_file`, fsync'd and dropped. A tensor bigger than `max_shard_size` gets a part of its own,
    as in transformers. `finish` writes what is buffered and returns the parts: [(file name, tensor names)].
    """

    def __init__(self, directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                 metadata: Mapping[str, str] | None = DEFAULT_METADATA, stem: str = "model"):
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = check_metadata(metadata)
        self._dir = Path(directory)
        self._stem = stem
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (part file name, tensor names), in write order
        self._names: set[str] = set()
        self._total_size = 0
        self._state = "open"

    @property
    def total_size(self) -> int:
        """Bytes of every tensor added (the index's metadata.total_size)."""
        return self._total_size

    def _describe(self) -> str:
        return f"{type(self).__name__} into {self._dir}"

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise TSPConfigError(f"{what} on a {self._describe()} that is {self._state}")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._check_open(f"add({name!r})")
        if not isinstance(name, str) or not name:
            raise TSPConfigError(f"tensor name {name!r} must be a non-empty string")
        if name in self._names:
            raise TSPConfigError(f"tensor {name!r} was already added to the {self._describe()}: each name goes in once")
        if tensor.device.type == "meta":
            raise TSPConfigError(f"tensor {name!r} is on the meta device (no data): materialize it before saving")
        t = tensor.detach().cpu().contiguous()
        # A view would pin its whole base storage in the buffer, and two tensors sharing storage make save_file
        # refuse the part: copy those.
        ptr = t.untyped_storage().data_ptr()
        shared = any(b.untyped_storage().data_ptr() == ptr for b in self._buffer.values())
        if shared or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        self._names.add(name)
        self._total_size += t.nbytes
        if t.nbytes > self.max_shard_size:  # too big for any part: alone, now, like transformers
            self._write_shard({name: t})
            return
        if self._buffer and self._buffer_bytes + t.nbytes > self.max_shard_size:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += t.nbytes

    def _flush(self) -> None:
        self._write_shard(self._buffer)
        self._buffer, self._buffer_bytes = {}, 0

    def _write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        # The final name needs the part count of every writer, known only at close: a numbered temporary name.
        file = f"{self._stem}-{len(self._shards) + 1:05d}{PART_SUFFIX}"
        save_file(tensors, self._dir / file, metadata=self.metadata)
        # safetensors 0.8 writes through a private temp file (mode 0600): give parts the mode the umask gives
        # ordinary files (read from the directory's mode), so others who can read config.json can load it.
        os.chmod(self._dir / file, self._dir.stat().st_mode & 0o666)
        fsync_path(self._dir / file)
        self._shards.append((file, list(tensors)))

    def finish(self) -> list[tuple[str, list[str]]]:
        """Write what is buffered; the parts written, [(file name, tensor names)]. Nothing can be added after."""
        self._check_open("finish()")
        if self._buffer:
            self._flush()
        self._state = "finished"
        return [(file, list(names)) for file, names in self._shards]
