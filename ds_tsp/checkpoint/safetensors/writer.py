"""Hugging Face safetensors checkpoints written piecewise: `StreamingCheckpointWriter` takes tensors one at a time,
writes a shard as soon as it is full, and produces the layout `save_pretrained` writes (`model.safetensors`, or
`model-0000k-of-0000N.safetensors` plus `model.safetensors.index.json`), moved into place atomically at the end.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from ds_tsp.checkpoint.safetensors.durable import fsync_path
from ds_tsp.checkpoint.safetensors.reader import DEFAULT_METADATA, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from ds_tsp.checkpoint.safetensors.shard_stream import PART_SUFFIX, ShardStream, check_metadata, parse_size
from ds_tsp.core.errors import TSPConfigError

__all__ = ["StreamingCheckpointWriter", "parse_size"]


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


class StreamingCheckpointWriter(ShardStream):
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

    Several writers, one checkpoint: other processes may stream parts into `tmp_dir` (a ShardStream there with a
    stem of its own, on a shared filesystem) and hand their (file, tensor names) lists to `adopt_parts` before
    close; the parts are then numbered with this writer's own, listed in the index and covered by the same rename.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    ):
        self.directory = Path(directory).absolute()
        size, metadata = parse_size(max_shard_size), check_metadata(metadata)  # refused before anything is created
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
        super().__init__(self._tmp, size, metadata)
        self._files: set[str] = set()

    @property
    def tmp_dir(self) -> Path:
        """Where everything is written until close: other writers' parts (adopt_parts) go here too."""
        return self._tmp

    def _describe(self) -> str:
        return f"StreamingCheckpointWriter for {self.directory}"

    def _sibling(self, kind: str) -> Path:
        return self.directory.parent / f".{self.directory.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def __enter__(self) -> StreamingCheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---- tensors: add (ShardStream), and parts other processes wrote

    def adopt_parts(self, parts: list[tuple[str, list[str]]], total_size: int) -> None:
        """Take in part files another ShardStream wrote into tmp_dir (a TSP rank saving its own experts): they are
        named, indexed and moved into place with this writer's own at close, and dropped with them on abort."""
        self._check_open("adopt_parts()")
        taken = {file for file, _ in self._shards}
        for file, names in parts:
            if (PurePosixPath(file).name != file or not file.endswith(PART_SUFFIX) or file in taken
                    or not (self._tmp / file).is_file()):
                raise TSPConfigError(f"adopt_parts: {file!r} is not a new part file in {self._tmp} (written there by "
                                     "a ShardStream, not adopted before); every writer needs its own stem")
            if twice := sorted(self._names.intersection(names)):
                raise TSPConfigError(f"adopt_parts: {file!r} holds {twice[:3]} already in the checkpoint "
                                     f"{self.directory}: each name goes in once")
            self._names.update(names)
            self._shards.append((file, list(names)))
            taken.add(file)
        self._total_size += total_size

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
