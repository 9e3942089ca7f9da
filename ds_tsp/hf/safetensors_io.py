"""Hugging Face safetensors checkpoints, read and written piecewise so that no process ever holds the whole model.

`CheckpointReader` answers names, shapes and dtypes from the safetensors headers alone and reads any slice of one
tensor along one dimension (a TSP rank's rows or columns) into a fresh tensor. `StreamingCheckpointWriter` takes
tensors one at a time, writes a shard as soon as it is full, and produces the layout `save_pretrained` writes
(`model.safetensors`, or `model-0000k-of-0000N.safetensors` plus `model.safetensors.index.json`), moved into place
atomically at the end.

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
import re
import secrets
import shutil
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds_tsp.durable_io import fsync_path
from ds_tsp.errors import TSPConfigError

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

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


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


# ----------------------------------------------------------------------------------------------------- writing

# Temporary directories of writers alive in this process: never "stale", whatever their pid says.
_ACTIVE_TMP_DIRS: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


def _remove_tmp_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with _ACTIVE_LOCK:
        _ACTIVE_TMP_DIRS.discard(path)


def _is_checkpoint_file(name: str) -> bool:
    """Files a save replaces: weights, index, config (what save_pretrained writes)."""
    return name in (SAFE_WEIGHTS_INDEX_NAME, "config.json", "generation_config.json") or (
        name.startswith("model") and name.endswith(".safetensors"))


def _restore_foreign_entries(old: Path, target: Path) -> None:
    """Move everything of the replaced directory that is not checkpoint files (a Trainer's checkpoint-* folders,
    a README, ...) into the new one: saving a model into a directory replaces the model, not the directory."""
    for entry in old.iterdir():
        if not _is_checkpoint_file(entry.name) and not (target / entry.name).exists():
            os.rename(entry, target / entry.name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class StreamingCheckpointWriter:
    """Writes an HF checkpoint directory as tensors arrive, holding at most about one shard plus one tensor.

    `add` buffers a tensor (a reference, or a copy when it is a view or on another device: do not modify it
    in place until close) until the shard would exceed `max_shard_size`; then the shard is written with
    safetensors' `save_file`, fsync'd and dropped. A tensor bigger than `max_shard_size` gets a shard of its own,
    as in transformers. `close` names the shards (`model.safetensors` if one, else `model-0000k-of-0000N` plus
    `model.safetensors.index.json`), fsyncs, and moves the result into place.

    Atomicity: everything goes to a sibling `.{name}.tmp-<pid>-<random>` in the same parent. At close an existing
    `directory` is renamed aside to `.{name}.old-<pid>-<random>`, the new one renamed in, the old one deleted; so
    `directory` is always the complete old checkpoint, the complete new one, or, between the two renames only,
    absent. An exception (inside `with`, or `abort()`) removes the temporary directory and leaves `directory`
    untouched. A kill -9 can leave a stale `.tmp-` sibling (partial or complete), and if it lands between the two
    renames also the complete old checkpoint in `.old-` with `directory` absent; it never leaves a partial
    `directory`. Stale siblings of the same target (their pid no longer alive) are deleted at the end of the next
    successful save of that target, not before, so a crash of that save cannot cost the last complete copy.
    Entries of the old directory that are not checkpoint files (weights, index, config) are moved into the new
    one after the swap (also from a stale `.old-` sibling, before it is deleted): saving a model into a
    Trainer's output_dir replaces the model, not its checkpoint-* folders.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    ):
        self.directory = Path(directory).absolute()
        self.max_shard_size = parse_size(max_shard_size)
        self.metadata = dict(DEFAULT_METADATA if metadata is None else metadata)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise TSPConfigError(f"metadata={self.metadata!r}: safetensors metadata must map str to str")
        if self.directory.is_symlink() or (self.directory.exists() and not self.directory.is_dir()):
            raise TSPConfigError(
                f"checkpoint target {self.directory} exists and is not a plain directory (a file or a symlink): "
                f"pass a directory path, or remove it first"
            )
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self._sibling("tmp")
        self._tmp.mkdir()
        with _ACTIVE_LOCK:
            _ACTIVE_TMP_DIRS.add(self._tmp)
        # If the writer is dropped without close (or the interpreter exits), its temporary directory goes too.
        self._finalizer = weakref.finalize(self, _remove_tmp_dir, self._tmp)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names), in write order
        self._names: set[str] = set()
        self._files: set[str] = set()
        self._total_size = 0
        self._state = "open"

    def _sibling(self, kind: str) -> Path:
        return self.directory.parent / f".{self.directory.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def __enter__(self) -> StreamingCheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise TSPConfigError(f"{what} on a StreamingCheckpointWriter for {self.directory} that is {self._state}")

    # ---- tensors

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._check_open(f"add({name!r})")
        if not isinstance(name, str) or not name:
            raise TSPConfigError(f"tensor name {name!r} must be a non-empty string")
        if name in self._names:
            raise TSPConfigError(
                f"tensor {name!r} was already added to the checkpoint {self.directory}: each name goes in once"
            )
        if tensor.device.type == "meta":
            raise TSPConfigError(f"tensor {name!r} is on the meta device (no data): materialize it before saving")
        t = tensor.detach().cpu().contiguous()
        # A view would pin its whole base storage in the buffer, and two tensors sharing storage make save_file
        # refuse the shard: copy those.
        ptr = t.untyped_storage().data_ptr()
        shared = any(b.untyped_storage().data_ptr() == ptr for b in self._buffer.values())
        if shared or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        self._names.add(name)
        self._total_size += t.nbytes
        if t.nbytes > self.max_shard_size:  # too big for any shard: alone, now, like transformers
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
        # The final name needs the shard count, known only at close: write under a numbered temporary name.
        file = f"model-{len(self._shards) + 1:05d}.safetensors.part"
        save_file(tensors, self._tmp / file, metadata=self.metadata)
        # safetensors 0.8 writes through a private temp file (mode 0600): give shards the mode the umask gives
        # ordinary files (read from our own directory's mode), so others who can read config.json can load it.
        os.chmod(self._tmp / file, self._tmp.stat().st_mode & 0o666)
        fsync_path(self._tmp / file)
        self._shards.append((file, list(tensors)))

    # ---- other files

    def add_file(self, relative_name: str, text: str | bytes) -> None:
        """A file beside the weights (config.json, tokenizer files, ...), relative to the checkpoint directory."""
        self._check_open(f"add_file({relative_name!r})")
        rel = PurePosixPath(relative_name)
        if rel.is_absolute() or not rel.parts or ".." in rel.parts:
            raise TSPConfigError(
                f"add_file({relative_name!r}): pass a relative path inside the checkpoint, e.g. 'config.json'"
            )
        key = rel.as_posix()
        weights_file = key == SAFE_WEIGHTS_INDEX_NAME or re.fullmatch(r"model[^/]*\.safetensors(\.part)?", key)
        if key in self._files or weights_file:
            raise TSPConfigError(f"add_file({relative_name!r}): that name is taken (added already, or a weights file)")
        path = self._tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8") if isinstance(text, str) else bytes(text))
        fsync_path(path)
        self._files.add(key)

    # ---- finishing

    def abort(self) -> None:
        """Drop everything written so far; `directory` is left as it was."""
        if self._state == "closed":
            return
        self._state = "aborted"
        self._buffer, self._buffer_bytes = {}, 0
        self._finalizer()  # removes the temporary directory (once)

    def close(self) -> None:
        """Write what is buffered, name the shards, write the index, fsync, and move the checkpoint into place."""
        if self._state == "closed":
            return
        self._check_open("close()")
        try:
            if self._buffer or not self._shards:
                self._flush()
            self._name_shards()
            fsync_path(self._tmp)
            self._move_into_place()
        except BaseException:
            self.abort()
            raise
        self._state = "closed"
        self._finalizer.detach()
        with _ACTIVE_LOCK:
            _ACTIVE_TMP_DIRS.discard(self._tmp)
        self._remove_stale_siblings()

    def _name_shards(self) -> None:
        n = len(self._shards)
        if n == 1:
            os.rename(self._tmp / self._shards[0][0], self._tmp / SAFE_WEIGHTS_NAME)
            return
        weight_map = {}
        for k, (file, names) in enumerate(self._shards, start=1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.rename(self._tmp / file, self._tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_size}, "weight_map": weight_map}
        path = self._tmp / SAFE_WEIGHTS_INDEX_NAME
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        fsync_path(path)

    def _move_into_place(self) -> None:
        parent = self.directory.parent
        if not self.directory.exists():
            os.rename(self._tmp, self.directory)
            fsync_path(parent)
            return
        old = self._sibling("old")
        os.rename(self.directory, old)
        try:
            os.rename(self._tmp, self.directory)
        except BaseException:
            os.rename(old, self.directory)  # put the old checkpoint back
            raise
        fsync_path(parent)
        _restore_foreign_entries(old, self.directory)
        shutil.rmtree(old, ignore_errors=True)

    def _remove_stale_siblings(self) -> None:
        """Delete `.{name}.tmp-*` / `.{name}.old-*` left by dead writers of this same target."""
        pattern = re.compile(rf"\.{re.escape(self.directory.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]+")
        for entry in self.directory.parent.iterdir():
            m = pattern.fullmatch(entry.name)
            if m is None or not entry.is_dir() or entry.is_symlink():
                continue
            pid = int(m.group(1))
            with _ACTIVE_LOCK:
                active = entry in _ACTIVE_TMP_DIRS
            if not active and (pid == os.getpid() or not _pid_alive(pid)):
                if ".old-" in entry.name and self.directory.is_dir():
                    _restore_foreign_entries(entry, self.directory)  # a kill came before they were moved back
                shutil.rmtree(entry, ignore_errors=True)
