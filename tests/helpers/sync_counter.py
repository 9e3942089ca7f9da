"""Count host syncs of a piece of code on any device (a helper module for tests; nothing here is collected).

On CUDA a host sync stalls the CPU until the GPU queue drains: every value read (`.item()`, `int(t)`, a tensor in
an `if`, `.tolist()`), every op whose output size depends on the data (`nonzero`, boolean-mask indexing,
`unique`, ...), `equal`, copies between devices (`.cpu()`, `torch.tensor(list, device="cuda")`; not a
non_blocking copy from pinned host memory), and a Python number assigned to one element (`t[i] = v`). On the CPU
none of these costs anything, which is why they are counted here by WHAT runs, not by what it costs: a CPU test
sees the syncs a GPU run would pay for.

    with SyncCounter() as syncs:
        loss = model(...); loss.backward()
    syncs.by_region()  ->  {"input_checks": 1}

Two modes cooperate: a TorchFunctionMode sees the Python-level reads (`tolist` never reaches the dispatcher on
the CPU) and host data turned into tensors; a TorchDispatchMode sees the aten ops, including those autograd runs
in backward. An op that runs INSIDE a counted Python-level read (the copy `.tolist()` makes on CUDA) is not
counted twice. Each event records where it happened (ds_tsp frames of the Python stack), and `region` sorts it
into one of REGIONS by those frames (the first region whose pattern matches any frame wins).
"""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass

import torch
from package_frames import package_frames
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Python-level calls that read tensor values on the host.
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy}
# Python-level calls that turn host data (lists, numbers) into a tensor: a host-to-device copy off the CPU.
_HOST_DATA = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}
# aten ops that read values or size their output by the data.
_SYNC_OPS = {getattr(getattr(aten, name), overload) for name, overload in (
    ("_local_scalar_dense", "default"), ("is_nonzero", "default"), ("equal", "default"), ("nonzero", "default"),
    ("masked_select", "default"), ("_unique2", "default"), ("unique_dim", "default"),
    ("unique_consecutive", "default"), ("repeat_interleave", "Tensor"))}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default}

# (region, substrings of "path:function" of any ds_tsp frame); checked in order, the first match wins.
REGIONS = (
    ("input_checks", ("core/tokens/input_check.py:check_inputs", "core/tokens/documents.py:",
                      "core/tokens/zigzag.py:_check_values")),
    ("layers", ("core/layers/", "core/tokens/rope.py:", "model/modules/")),
)


@dataclass(frozen=True)
class SyncEvent:
    kind: str  # "read", "host_data", "data_dependent" or "cross_device_copy"
    op: str
    region: str  # a REGIONS name, "other" (elsewhere in ds_tsp) or "outside"
    where: str  # innermost ds_tsp frame, "file:line function"


def _region(frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    ours = package_frames(frames)  # by the package directory: a checkout named ds_tsp holds .venv and tests too
    if not ours:
        return "outside", ""
    keys = [f"{path}:{f.name}" for path, f in ours]
    path, last = ours[-1]
    where = f"{path}:{last.lineno} {last.name}"
    for region, patterns in REGIONS:
        if any(p in k for k in keys for p in patterns):
            return region, where
    return "other", where


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices if i is not None)


def _on_host(func, kwargs) -> bool:
    """torch.tensor(data, device="cpu"): host data kept in host memory (copied once by whoever moves it)."""
    return func is not torch.Tensor.new_tensor and kwargs.get("device") is not None and \
        torch.device(kwargs["device"]).type == "cpu"


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None


def _element_assignment(target, index, value) -> bool:
    """`t[i, j] = 3`: a Python number into ONE element. torch 2.x copies a host scalar there (on CUDA a blocking
    copy: cudaMemcpy + stream sync); a slice target (`t[i:i + 1] = 3`) is an asynchronous fill instead."""
    if not isinstance(value, (bool, int, float)) or not isinstance(target, torch.Tensor):
        return False
    index = index if isinstance(index, tuple) else (index,)
    return len(index) == target.dim() and all(isinstance(i, int) for i in index)


def _devices(tensors) -> set:
    return {t.device for t in tensors if isinstance(t, torch.Tensor)}


class _Functions(TorchFunctionMode):
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None
        if func in _READS:
            kind = None if _storage(args[0]) in self.counter._host_storages else "read"
        elif func in _HOST_DATA:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            kind = None if isinstance(data, torch.Tensor) or _on_host(func, kwargs) else "host_data"
        elif func is torch.Tensor.__setitem__ and _element_assignment(*args[:3]):
            kind = "host_data"  # `t[i] = v`: on CUDA a host scalar copied into one element, waited for
        if func in _HOST_DATA and _on_host(func, kwargs):  # its reads later are of host memory: free anywhere
            out = func(*args, **kwargs)
            self.counter._host_storages.add(_storage(out))
            return out
        if kind is None or self.counter._inside:
            return func(*args, **kwargs)
        self.counter._record(kind, getattr(func, "__name__", str(func)))
        self.counter._inside += 1  # what the read itself dispatches (a device-to-host copy) is the same sync
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._inside:
            kind = None
            if func in _SYNC_OPS:
                kind = "data_dependent" if func not in (aten._local_scalar_dense.default, aten.is_nonzero.default,
                                                        aten.equal.default) else "read"
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and \
                    _bool_index(args[1]):
                kind = "data_dependent"  # a boolean mask index runs nonzero inside the kernel
            elif func in _COPIES:
                if func is aten._to_copy.default:
                    target = kwargs.get("device")
                    # from PINNED host memory, non_blocking: queued, not waited for (as copy_ below)
                    queued = kwargs.get("non_blocking", False) and args[0].device.type == "cpu" and \
                        args[0].is_pinned()
                    cross = target is not None and torch.device(target) != args[0].device and not queued
                else:
                    # a non_blocking copy between a device and PINNED host memory is queued, not waited for
                    # (ds_tsp.core.activation_offload's copies): no sync
                    queued = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and any(
                        t.device.type == "cpu" and t.is_pinned() for t in args[:2])
                    cross = len(_devices(args[:2])) > 1 and not queued
                kind = "cross_device_copy" if cross else None
            if kind is not None:
                self.counter._record(kind, str(func))
        return func(*args, **kwargs)


class SyncCounter:
    """Context manager recording every host sync (SyncEvent) of the code it wraps, forward and backward."""

    def __init__(self):
        self.events: list[SyncEvent] = []
        self._inside = 0
        self._host_storages: set = set()  # of tensors made with device="cpu" from host data (and their views)
        self._modes = None

    def _record(self, kind: str, op: str) -> None:
        region, where = _region(traceback.extract_stack())
        self.events.append(SyncEvent(kind, op, region, where))

    def __enter__(self) -> "SyncCounter":
        self._modes = (_Functions(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def by_region(self) -> dict[str, int]:
        return dict(Counter(e.region for e in self.events))

    def in_region(self, region: str) -> list[SyncEvent]:
        return [e for e in self.events if e.region == region]
