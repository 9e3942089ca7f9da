"""Hugging Face safetensors checkpoints, read and written piecewise so that no process ever holds the whole model.

`CheckpointReader` answers names, shapes and dtypes from the safetensors headers alone and reads any slice of one
tensor along one dimension (a TSP rank's rows or columns) into a fresh tensor. The writer is in
ds_tsp.checkpoint.safetensors.writer.

Why reads go the way they do (safetensors 0.8, measured): `safe_open(...).get_slice(name)[...]` returns a VIEW into
the file's mmap, not a copy. Nothing is read until the view is touched, but every page it touches stays mapped,
and counted in the process's resident memory, until both the view and the `safe_open` handle are released.
Deleting the view alone frees nothing. So a read copies into its own tensor in chunks of about `chunk_bytes`,
and opens and closes the file around each chunk: resident file pages stay bounded by one chunk. (The `pread`
backend of `safe_open` is no help here: it reads the whole tensor to hand out a slice.)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import torch
from safetensors import safe_open

from ds_tsp.core.errors import TSPConfigError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
READ_CHUNK_BYTES = 8 * 2**20
# transformers refuses to load a safetensors file whose metadata lacks format=pt.
DEFAULT_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})

# safetensors dtype codes -> torch dtypes; the float8 types only where this torch has them.
_DTYPES: dict[str, torch.dtype] = {
    code: dt
    for code, dt in {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None), "F16": torch.float16, "BF16": torch.bfloat16,
        "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dt is not None
}

# ----------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointReader:
    """A local HF checkpoint directory (single `model.safetensors` or sharded with an index), read by slices.

    Only headers are parsed at construction. `read` returns new tensors that own their memory; while it runs,
    besides the result, at most about `chunk_bytes` of file pages (or one row along dim 0, if that is bigger)
    are resident. Inside `reading()` handles stay open for a batch of reads, so the pages touched by the whole
    batch stay resident until the batch ends.
    """

    def __init__(self, directory: str | os.PathLike, *, chunk_bytes: int = READ_CHUNK_BYTES):
        self.directory = Path(directory)
        self.chunk_bytes = int(chunk_bytes)
        self._tensors: dict[str, _TensorInfo] = {}
        for file, names in self._locate_weights().items():
            self._read_header(file, names)
        self._batch: dict[Path, object] | None = None  # open safe_open handles inside reading()
        self._batch_stack: contextlib.ExitStack | None = None

    # ---- locating the files

    def _locate_weights(self) -> dict[Path, list[str] | None]:
        """{file: tensor names the index puts there (None: all of the file's tensors)}."""
        d = self.directory
        if not d.exists():
            raise TSPConfigError(
                f"checkpoint directory {d} does not exist: pass the directory that holds {SAFE_WEIGHTS_NAME} "
                f"(or {SAFE_WEIGHTS_INDEX_NAME}) and config.json"
            )
        if not d.is_dir():
            raise TSPConfigError(f"checkpoint {d} is not a directory: pass the directory that holds it ({d.parent})")
        # Same precedence as transformers: the single file wins over an index.
        if (d / SAFE_WEIGHTS_NAME).is_file():
            return {d / SAFE_WEIGHTS_NAME: None}
        index = d / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            return self._parse_index(index)
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise TSPConfigError(
                f"checkpoint directory {d} has only pickled weights ({', '.join(pickles[:4])}): ds_tsp reads "
                f"safetensors only and never unpickles (unpickling can run arbitrary code). Convert it once, e.g. "
                f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) in a trusted environment"
            )
        strays = sorted(p.name for p in d.glob("*.safetensors"))
        hint = f" (found {', '.join(strays[:4])} but no index naming them)" if strays else ""
        raise TSPConfigError(
            f"checkpoint directory {d} has no {SAFE_WEIGHTS_NAME} and no {SAFE_WEIGHTS_INDEX_NAME}{hint}: "
            f"pass a directory written by save_pretrained or StreamingCheckpointWriter"
        )

    @staticmethod
    def _parse_index(index: Path) -> dict[Path, list[str]]:
        def malformed(why: str) -> TSPConfigError:
            return TSPConfigError(
                f"index {index} is malformed: {why}. It must be JSON like "
                f'{{"metadata": {{...}}, "weight_map": {{"tensor.name": "model-00001-of-00002.safetensors"}}}}: '
                f"re-save the checkpoint or re-download the index"
            )

        try:
            content = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise malformed(f"not valid JSON ({e})") from e
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise malformed("no non-empty 'weight_map' object")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            # Shards are plain file names beside the index; anything else could point outside the checkpoint.
            if not isinstance(file, str) or not file or PurePosixPath(file).name != file or file in (".", ".."):
                raise malformed(f"tensor {name!r} maps to {file!r}, not a file name in the same directory")
            files.setdefault(index.parent / file, []).append(name)
        for path, names in files.items():
            if not path.is_file():
                raise TSPConfigError(
                    f"index {index} puts {len(names)} tensors (e.g. {names[0]!r}) in shard file {path.name}, but "
                    f"{path} does not exist: the download or copy is incomplete; fetch the missing shard or re-save"
                )
        return files

    def _read_header(self, file: Path, names: list[str] | None) -> None:
        try:
            with safe_open(file, framework="pt") as f:
                keys = list(f.keys())
                present = set(keys)
                for name in keys if names is None else names:
                    if name not in present:
                        raise TSPConfigError(
                            f"index {self.directory / SAFE_WEIGHTS_INDEX_NAME} puts tensor {name!r} in {file.name}, "
                            f"but that file has no such tensor: the index and its shards do not match; re-save"
                        )
                    header = f.get_slice(name)  # header only: no tensor data is touched
                    code = header.get_dtype()
                    if code not in _DTYPES:
                        raise TSPConfigError(f"tensor {name!r} in {file} has dtype {code}, which this torch lacks")
                    self._tensors[name] = _TensorInfo(file, tuple(header.get_shape()), _DTYPES[code])
        except TSPConfigError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise TSPConfigError(f"cannot read the safetensors header of {file}: {e}; re-save or re-download it") from e

    # ---- headers

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise TSPConfigError(
                f"tensor {name!r} is not in the checkpoint {self.directory} ({len(self._tensors)} tensors, e.g. "
                f"{', '.join(map(repr, list(self._tensors)[:3]))}): check the name against names()"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._info(name).dtype

    # ---- data

    @contextlib.contextmanager
    def reading(self) -> Iterator[CheckpointReader]:
        """Keep files open for a batch of reads (no header re-parsed per chunk or tensor).

        The price: every page read inside the batch stays resident until the batch ends.
        """
        if self._batch is not None:  # nested: the outer batch owns the handles
            yield self
            return
        with contextlib.ExitStack() as stack:
            self._batch, self._batch_stack = {}, stack
            try:
                yield self
            finally:
                self._batch, self._batch_stack = None, None

    @contextlib.contextmanager
    def _opened(self, file: Path):
        if self._batch is None:
            # Closing the handle is what unmaps the pages a read touched.
            with safe_open(file, framework="pt") as handle:
                yield handle
        else:
            if file not in self._batch:
                self._batch[file] = self._batch_stack.enter_context(safe_open(file, framework="pt"))
            yield self._batch[file]

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int = 0,
        length: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Slice [start, start+length) of `name` along `dim` (all of it if dim is None), as a new contiguous tensor.

        `dtype` casts (chunk by chunk, so no full-size copy in the file's dtype is made); `out` receives the
        slice instead (any dtype or device, same shape) and is returned.
        """
        info = self._info(name)
        index = self._slice_index(name, info, dim, start, length)
        shape = tuple(s.stop - s.start for s in index)
        if out is None:
            out = torch.empty(shape, dtype=dtype or info.dtype)
        elif tuple(out.shape) != shape or (dtype is not None and out.dtype != dtype):
            raise TSPConfigError(
                f"out for {name!r} has shape {tuple(out.shape)} and dtype {out.dtype}, but the slice has shape "
                f"{shape}" + (f" and dtype={dtype} was asked" if dtype is not None else "") + ": pass a matching out"
            )
        if out.numel() == 0:
            return out
        with torch.no_grad():  # out may be a parameter
            if not index:  # a 0-d tensor: nothing to chunk
                with self._opened(info.file) as f:
                    view = f.get_tensor(name)
                    out.copy_(view)
                    del view
                return out
            # Chunk along dim 0: a chunk of whole rows touches about rows * row_bytes of the file, whichever dim
            # is sliced (a column slice of a row-major tensor touches every page of its rows).
            row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
            rows_per_chunk = max(1, self.chunk_bytes // max(1, row_bytes))
            first, stop = index[0].start, index[0].stop
            for a in range(first, stop, rows_per_chunk):
                b = min(a + rows_per_chunk, stop)
                with self._opened(info.file) as f:
                    view = f.get_slice(name)[(slice(a, b),) + index[1:]]
                    out[a - first : b - first].copy_(view)
                    del view  # the handle cannot unmap while a view is alive
        return out

    def _slice_index(
        self, name: str, info: _TensorInfo, dim: int | None, start: int, length: int | None
    ) -> tuple[slice, ...]:
        index = [slice(0, n) for n in info.shape]
        if dim is None:
            if start != 0 or length is not None:
                raise TSPConfigError(f"read({name!r}) got start/length without dim: pass dim= to slice")
            return tuple(index)
        ndim = len(info.shape)
        if not -ndim <= dim < ndim:
            raise TSPConfigError(
                f"read({name!r}, dim={dim}): the tensor has shape {info.shape} ({ndim} dims) in {info.file}"
            )
        dim %= ndim
        size = info.shape[dim]
        length = size - start if length is None else length
        if start < 0 or length < 0 or start + length > size:
            raise TSPConfigError(
                f"read({name!r}, dim={dim}, start={start}, length={length}) is out of range: dim {dim} of "
                f"{name!r} has size {size} (shape {info.shape}) in {info.file}"
            )
        index[dim] = slice(start, start + length)
        return tuple(index)
