"""Where training checkpoints live: DIR/step-<N>/, each complete or absent, the newest K kept.

A save writes into `DIR/.step-<N>.tmp-<pid>-<hex>/`, fsyncs every file and the directory, and renames it to
`DIR/step-<N>` with the manifest already inside: a directory named step-<N> is therefore always complete, and a
kill -9 at any moment leaves at most a stale temporary directory (removed by the next successful save). Old
checkpoints are renamed to `.trash-...` before they are deleted, so a kill while pruning never leaves a step-<N>
with some of its files gone.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from ds_tsp.checkpoint.safetensors.durable import fsync_path
from ds_tsp.checkpoint.training.manifest import MANIFEST_NAME
from ds_tsp.core.errors import TSPConfigError

_STEP = re.compile(r"step-(\d{8,})")
_STALE = re.compile(r"\.(step-\d{8,}\.tmp|trash)-.*")


class CheckpointStore:
    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise TSPConfigError(f"keep_last={keep_last!r}: keep at least the newest checkpoint (an integer >= 1)")
        self.root, self.keep_last = Path(root).absolute(), keep_last
        if self.root.exists() and not self.root.is_dir():
            raise TSPConfigError(f"save_dir {self.root} exists and is not a directory: pass a directory path")

    @staticmethod
    def step_name(step: int) -> str:
        return f"step-{step:08d}"

    def complete(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP.fullmatch(entry.name)
            if m and entry.is_dir() and (entry / MANIFEST_NAME).is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def new_temporary(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{self.step_name(step)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Move a fully written (manifest included) temporary directory into place; prune; return its path."""
        for entry in tmp.iterdir():
            fsync_path(entry)
        fsync_path(tmp)
        final = self.root / self.step_name(step)
        if final.exists():  # saving the same step again (e.g. after a resume): the new copy replaces it
            self._discard(final)
        os.rename(tmp, final)
        fsync_path(self.root)
        self._prune(keep=final)
        return final

    def discard_temporary(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self, path: Path) -> None:
        trash = self.root / f".trash-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(path, trash)  # atomic: the step directory is gone whole before any file of it is deleted
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        done = self.complete()
        for _, path in done[:max(len(done) - self.keep_last, 0)]:
            if path != keep:
                self._discard(path)
        for entry in self.root.iterdir():  # leftovers of saves and prunes a kill interrupted
            if _STALE.fullmatch(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
