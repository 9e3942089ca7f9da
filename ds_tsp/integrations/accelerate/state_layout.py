"""The layout a TSPAccelerator.save_state ran on, recorded beside the state so load_state refuses another one.

save_state writes each rank's own TSP shards (and DeepSpeed's files are per model-parallel and data-parallel rank):
the state holds the shards of ONE layout. With the same number of processes another tsp x cp x data layout finds
a file for every rank, of the right kind but cut for other ranks (a cp rank's file is a TSP rank's, a data
replica's is another TSP shard), so without the record a resume could load it silently wrong. The layout-free
way is ds_tsp.save_training_checkpoint / load_training_checkpoint (one file per TSP shard, resharded on load).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ds_tsp.core.errors import TSPConfigError

LAYOUT_FILE = "tsp_layout.json"


def layout_record(tsp: int, cp: int, data: int) -> dict[str, int]:
    return {"tsp": tsp, "cp": cp, "data": data}


def _describe(layout: dict) -> str:
    return " x ".join(f"{axis}={layout.get(axis)}" for axis in ("tsp", "cp", "data"))


def write_layout(directory: str | Path, layout: dict[str, int], writer: int) -> None:
    """Write the record (one writer per node: every node that holds part of the state gets it); `writer` names
    the temporary file, so writers sharing a file system never write the same file."""
    target = Path(directory) / LAYOUT_FILE
    temporary = target.with_name(f".{LAYOUT_FILE}.{writer}")
    temporary.write_text(json.dumps(layout))
    os.replace(temporary, target)


def check_layout(directory: str | Path, layout: dict[str, int]) -> None:
    """One clear error when the state in `directory` was saved on another layout. A state without the record (saved
    before it existed) is left to the per-rank checks that follow."""
    path = Path(directory) / LAYOUT_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise TSPConfigError(f"{path} is unreadable ({err}): the saved state is damaged; save it again") from err
    if saved != layout:
        raise TSPConfigError(
            f"{directory}: TSPAccelerator.save_state ran at {_describe(saved)}, this run is {_describe(layout)}: "
            "save_state / load_state hold each rank's own shards, so they resume on the same layout only. Launch "
            f"with the saved layout (tsp={saved.get('tsp')}, cp_size={saved.get('cp')}), or save with "
            "ds_tsp.save_training_checkpoint, which load_training_checkpoint resumes at any tsp x cp x data layout")
