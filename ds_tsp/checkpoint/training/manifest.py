"""The manifest of a training checkpoint: what was saved, on which layout, and the checksum of every file."""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ds_tsp.core.errors import TSPConfigError

FORMAT = "ds_tsp.checkpoint.training"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HASH_CHUNK_BYTES = 8 << 20


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str
    bytes: int


class Layout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tsp: int = Field(ge=1)
    data: int = Field(ge=1)
    pipe: int = Field(ge=1)
    cp: int = Field(1, ge=1)  # tsp.cp_size: TSP groups sharing each sequence (the same shards, saved once)


class OptimizerRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str  # class of the torch optimizer that holds the state (e.g. AdamW)
    state_keys: list[str]  # per-parameter tensors saved beside each weight ("exp_avg", "exp_avg_sq")
    step: float | int | None  # the optimizer's own step count (Adam's bias correction reads it)
    param_groups: list[dict[str, Any]]  # hyperparameters of each group (lr, betas, ...), without the params


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    step: int = Field(ge=0)
    layout: Layout
    model: dict[str, Any]  # ModelShape.to_dict()
    dtype: str  # the model's dtype; weights are stored as the fp32 master copy when there is one
    global_batch_size: int  # samples per optimizer step (micro x accumulation x data)
    optimizer: OptimizerRecord
    lr_scheduler: dict[str, Any] | None
    engine: dict[str, int]  # engine counters (global_steps, global_samples, ...)
    data: dict[str, Any] | None  # the data loader's position
    versions: dict[str, str]
    shards: dict[int, dict[str, str]]  # TSP rank -> tensor name -> file
    files: dict[str, FileEntry]

    def write(self, directory: Path) -> None:
        path = directory / MANIFEST_NAME
        path.write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = directory / MANIFEST_NAME
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TSPConfigError(f"{path}: not a readable ds_tsp training checkpoint manifest ({err}); resume "
                                 "from another checkpoint or delete this directory") from err
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise TSPConfigError(f"{path}: format={raw.get('format') if isinstance(raw, dict) else None!r} is not "
                                 f"{FORMAT!r}: this is not a ds_tsp training checkpoint (DeepSpeed's own "
                                 "checkpoints load with engine.load_checkpoint)")
        if raw.get("format_version") != FORMAT_VERSION:
            raise TSPConfigError(f"{path}: format_version={raw.get('format_version')!r}; this ds_tsp reads version "
                                 f"{FORMAT_VERSION}: resume with the ds_tsp version that wrote it")
        try:
            return cls.model_validate(raw)
        except ValueError as err:
            raise TSPConfigError(f"{path}: malformed manifest ({str(err).splitlines()[0]}): the checkpoint is "
                                 "damaged; resume from another one") from err


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(directory: Path, name: str, entry: FileEntry) -> None:
    """Raise one clear error when a checkpoint file is missing, truncated or corrupted."""
    path = directory / name
    fix = (f"the checkpoint {directory} is damaged: resume from an earlier step-* directory (move this one away) "
           "or restore the file")
    if not path.is_file():
        raise TSPConfigError(f"checkpoint file {path} is missing: {fix}")
    size = path.stat().st_size
    if size != entry.bytes:
        raise TSPConfigError(f"checkpoint file {path} has {size} bytes, the manifest says {entry.bytes} (truncated?): "
                             f"{fix}")
    if sha256_of(path) != entry.sha256:
        raise TSPConfigError(f"checkpoint file {path}: sha256 does not match the manifest (corrupted): {fix}")


def versions() -> dict[str, str]:
    import torch

    from ds_tsp.core.version import __version__

    out = {"ds_tsp": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return out


def verify_checkpoint(directory: str | Path) -> Manifest:
    """Read a checkpoint's manifest and check every file it lists (size and sha256); returns the manifest."""
    directory = Path(directory)
    manifest = Manifest.read(directory)
    for name, entry in sorted(manifest.files.items()):
        verify_file(directory, name, entry)
    return manifest
