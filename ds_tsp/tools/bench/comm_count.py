"""Count the bytes every collective moves, for any framework, without patching it.

`CollectiveBytes` is a TorchDispatchMode (like torch's CommDebugMode, which counts calls only). Everything that
talks to a process group reaches the dispatcher as an op: eager `torch.distributed` calls as `c10d::*` ops
(DeepSpeed's comm layer, gloo async handles and isend/irecv included), DTensor redistributions and functional
collectives as `_c10d_functional::*` ops, DeepSpeed's shared-memory all-reduce as `deepspeed::inference_all_reduce_`.
So one counter serves DTensor TP+SP, DeepSpeed (Ulysses, ZeRO, AutoTP) and TSP alike (for TSP it cross-checks the
library's own CommCounter). Only traffic that bypasses the dispatcher (none in these peers) would be missed.

Bytes are the LOGICAL volume per rank, the convention of ds_tsp.core.comm.communicator.CommCounter (D = size of the op's
group):

| op kind        | counted bytes per rank                         |
|----------------|------------------------------------------------|
| all-gather     | (D-1)/D of the gathered output                 |
| reduce-scatter | (D-1)/D of the input                           |
| all-reduce     | 2 (D-1)/D of the tensor (ring: reduce-scatter + all-gather) |
| all-to-all     | (D-1)/D of the input                           |
| broadcast      | the tensor, on receivers (0 on the root)       |
| reduce         | the tensor, on senders (0 on the root)         |
| send / recv    | the tensor on the sender / 0 on the receiver   |
| gather/scatter | the tensor on non-roots / (D-1)/D on the root  |
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes", "logical_bytes"]

# op name (without namespace and overload) -> kind
_KINDS = {
    # c10d (eager torch.distributed and ProcessGroup methods)
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast", "reduce_": "reduce", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "gather_": "gather", "scatter_": "scatter",
    # functional collectives (DTensor, torch.distributed._functional_collectives)
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "shard_dim_alltoall": "all_to_all", "broadcast": "broadcast",
    # DeepSpeed: the shared-memory all-reduce (AutoTP inference path), Ulysses' all-to-all custom op
    "inference_all_reduce_": "all_reduce", "inference_all_reduce": "all_reduce",
    "dim_zero_all_to_all": "all_to_all",
}
# Other libraries' custom ops are opaque to a dispatch mode (their inner c10d call runs below it), so an unknown
# op outside aten/prims is classified by its name; one that hides a collective under another name is missed.
_NAME_HINTS = (("all_to_all", "all_to_all"), ("alltoall", "all_to_all"), ("reduce_scatter", "reduce_scatter"),
               ("all_gather", "all_gather"), ("allgather", "all_gather"), ("all_reduce", "all_reduce"),
               ("allreduce", "all_reduce"), ("broadcast", "broadcast"))
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "deepspeed")
_TORCH_COMM_NAMESPACES = _NAMESPACES[:-1]  # all but "deepspeed"
_COMPUTE_NAMESPACES = ("aten", "prims", "prim", "quantized", "profiler", "debugprims")


def logical_bytes(kind: str, nbytes: int, group_size: int, is_root: bool = False) -> int:
    """Bytes one rank is charged for an op of `kind` on `nbytes` (the input; the output for all-gather)."""
    d = max(group_size, 1)
    share = nbytes * (d - 1) // d
    if kind == "all_reduce":
        return 2 * share
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return share
    if kind in ("broadcast", "reduce", "gather"):
        return 0 if is_root else nbytes
    if kind == "scatter":
        return share if is_root else 0
    if kind == "send":
        return nbytes
    return 0  # recv: charged to the sender


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_size_and_rank(named: dict) -> tuple[int, int]:
    import torch.distributed as dist

    if "group_size" in named:
        size = int(named["group_size"])
        return size, -1
    pg = named.get("process_group", named.get("pg"))
    if pg is None and "group_name" in named:
        from torch.distributed.distributed_c10d import _resolve_process_group
        pg = _resolve_process_group(named["group_name"])
    if pg is not None:
        try:
            return int(pg.size()), int(pg.rank())
        except Exception:  # noqa: BLE001 - a ScriptObject without the methods: fall back to the world
            pass
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class CollectiveBytes(TorchDispatchMode):
    """Context manager: `.bytes` / `.calls` per op kind, `.total_bytes`, and `.blocking_s` (seconds spent inside
    collective calls; for synchronous gloo calls that is exposed communication, async calls return at once)."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.blocking_s = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls), "total_bytes": self.total_bytes,
                "blocking_s": self.blocking_s}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_dtensor_call(types):
            return NotImplemented  # let DTensor lower to local ops and functional collectives, then count those
        kind = _kind(func)
        if kind is None:
            return func(*args, **kwargs)
        self._count(func, kind, args, kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.blocking_s += time.perf_counter() - start
        return out

    def _count(self, func, kind, args, kwargs) -> None:
        named = dict(kwargs)
        for arg, value in zip(func._schema.arguments, args):
            named[arg.name] = value
        size, rank = _group_size_and_rank(named)
        if kind == "all_gather":
            outputs = [v for k, v in named.items() if k.startswith("output")]
            nbytes = _nbytes(_tensors(outputs)) if outputs else _nbytes(_tensors(_inputs(named))) * size
        else:
            nbytes = _nbytes(_tensors(_inputs(named)))
        root = named.get("root_rank", named.get("src"))
        is_root = root is not None and rank >= 0 and int(root) == rank
        self.bytes[kind] += logical_bytes(kind, nbytes, size, is_root)
        self.calls[kind] += 1


def _inputs(named: dict) -> list:
    picked = [v for k, v in named.items() if k.startswith("input")]
    if picked:
        return picked
    for key in ("tensors", "tensor", "self"):
        if key in named:
            return [named[key]]
    return [v for v in named.values() if isinstance(v, torch.Tensor)][:1]


_KIND_CACHE: dict = {}


def _kind(func) -> str | None:
    if func in _KIND_CACHE:
        return _KIND_CACHE[func]
    namespace, _, name = func._schema.name.partition("::")
    if namespace in _NAMESPACES and name in _KINDS:
        kind = _KINDS[name]
    elif namespace in _COMPUTE_NAMESPACES or namespace in _TORCH_COMM_NAMESPACES:
        kind = None  # compute, or a torch comm op that moves no data (barrier, wait_tensor, ...)
    else:
        lowered = name.lower()
        kind = next((k for hint, k in _NAME_HINTS if hint in lowered), None)
    _KIND_CACHE[func] = kind
    return kind


_DTENSOR_CLS = None


def _is_dtensor_call(types) -> bool:
    global _DTENSOR_CLS
    if _DTENSOR_CLS is None:
        from torch.distributed.tensor import DTensor
        _DTENSOR_CLS = DTensor
    return any(issubclass(t, _DTENSOR_CLS) for t in types)
