"""A nested state (dicts, lists, tuples, numbers, strings, tensors) as ONE safetensors file plus ONE JSON file.

For per-rank states that a training loop saves as a whole (a model's and an optimizer's state_dict): loading reads
JSON and safetensors only, never unpickles, so a state directory from elsewhere cannot run code. The JSON holds the
structure with every tensor replaced by a reference into the safetensors file; dict keys keep their type (an
optimizer's state is keyed by int), tuples stay tuples (Adam's betas). Anything else (a custom object in a state
dict) is one TSPConfigError at save time naming where it sits.

The JSON file is written last and renamed into place: a state whose JSON exists is complete.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ds_tsp.core.errors import TSPConfigError

FORMAT = "ds_tsp-tensor-tree-1"
_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"


def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    if isinstance(value, torch.Tensor):
        key = seen.get(id(value))
        if key is None:  # the same tensor object twice (tied weights): stored once, restored as one
            key = seen[id(value)] = f"t{len(tensors)}"
            # own contiguous CPU storage: safetensors refuses views sharing memory, and copies to host anyway
            tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TSPConfigError(f"{where} has a key of type {type(k).__name__}: a saved state keeps str, int, "
                                     "float, bool or None keys only (nothing is pickled)")
            items.append([k, _encode(v, f"{where}.{k}", tensors, seen)])
        return {_DICT: items}
    raise TSPConfigError(f"{where} is a {type(value).__name__}: a saved state holds only tensors, numbers, strings, "
                         "lists and dicts (safetensors + JSON, nothing is pickled); drop it from the state_dict or "
                         "store it as plain numbers")


def _decode(value: Any, tensors: dict[str, torch.Tensor], path: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, path) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        if value[_TENSOR] not in tensors:
            raise TSPConfigError(f"{path} names tensor {value[_TENSOR]!r}, which its safetensors file lacks: the "
                                 "state is damaged or mixed with another save; save it again")
        return tensors[value[_TENSOR]]
    if set(value) == {_TUPLE}:
        return tuple(_decode(v, tensors, path) for v in value[_TUPLE])
    if set(value) == {_DICT}:
        return {k: _decode(v, tensors, path) for k, v in value[_DICT]}
    raise TSPConfigError(f"{path} is not a ds_tsp saved state (unexpected entry {sorted(value)[:3]}); save it again")


def paths(directory: str | Path, stem: str) -> tuple[Path, Path]:
    """The two files of one saved state: (safetensors, JSON)."""
    directory = Path(directory)
    return directory / f"{stem}.safetensors", directory / f"{stem}.json"


def save_tree(directory: str | Path, stem: str, tree: Any) -> None:
    """Write `tree` as DIR/<stem>.safetensors and DIR/<stem>.json (the JSON last, each renamed into place)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, stem, tensors, {})
    tensor_path, json_path = paths(directory, stem)
    partial = tensor_path.with_name(f".{tensor_path.name}.partial")
    save_file(tensors, str(partial), metadata={"format": FORMAT})
    os.replace(partial, tensor_path)
    partial = json_path.with_name(f".{json_path.name}.partial")
    partial.write_text(json.dumps({"format": FORMAT, "tree": structure}))
    os.replace(partial, json_path)


def load_tree(directory: str | Path, stem: str, device: torch.device | str = "cpu") -> Any:
    """Read what save_tree wrote (tensors onto `device`); reads JSON and safetensors only, never unpickles."""
    tensor_path, json_path = paths(directory, stem)
    try:
        record = json.loads(json_path.read_text())
    except (OSError, ValueError) as err:
        raise TSPConfigError(f"{json_path} is unreadable ({err}): the saved state is damaged; save it again") from err
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise TSPConfigError(f"{json_path} is not a ds_tsp saved state (format {FORMAT!r} expected); save it again")
    try:
        tensors = load_file(str(tensor_path), device="cpu")  # a read error here is the file's, never the device's
    except (OSError, SafetensorError) as err:
        raise TSPConfigError(f"cannot read {tensor_path} as safetensors ({err}): the saved state is damaged or "
                             "not ds_tsp's; save it again") from err
    device = torch.device(device)
    if device.type != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return _decode(record["tree"], tensors, json_path)
