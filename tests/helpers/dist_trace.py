"""Record the torch.distributed calls that bypass TSPComm (DeepSpeed's pipeline sends, ZeRO's data-axis collectives,
the grad-norm all-reduce, ds_tsp's own loss and token-count reductions) in tests/helpers/nccl_rules.py's op format. A helper
module for tests.

`with traced(rec.ops):` wraps the torch.distributed collectives and point-to-point calls (and the functions
DeepSpeed's TorchBackend captured at start-up) so that every call made while it is active, from anywhere except
ds_tsp.core.comm.communicator (TSPComm records its own ops), appends an op dict with source="outside" and caller (the calling
module) to the same list a CommRecorder fills: the result is one rank's post order over TSPComm and everything else.
Calls nested inside a traced call (all_gather_object's own all_gathers) are not recorded twice. Metadata only: the
calls run unchanged.
"""
from __future__ import annotations

import inspect
import sys
import threading
from contextlib import contextmanager
from functools import wraps

import torch
import torch.distributed as dist

_TSP_COMM_MODULE = "ds_tsp.core.comm.communicator"
# modules of the wrappers between a caller and the call it makes
_PASS_THROUGH = ("torch.distributed", "deepspeed.comm", "deepspeed.utils.nvtx", __name__)

# name -> (kind, the parameter holding the tensor NCCL counts, the root's parameter or None)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor", None),
    "all_reduce_coalesced": ("all_reduce", "tensors", None),
    "broadcast": ("broadcast", "tensor", "src"),
    "reduce": ("reduce", "tensor", "dst"),
    "all_gather": ("all_gather", "tensor", None),
    "all_gather_into_tensor": ("all_gather", "input_tensor", None),
    "all_gather_single": ("all_gather", "input_tensor", None),
    "_all_gather_base": ("all_gather", "input_tensor", None),
    "reduce_scatter": ("reduce_scatter", "output", None),
    "reduce_scatter_tensor": ("reduce_scatter", "output", None),
    "reduce_scatter_single": ("reduce_scatter", "output", None),
    "_reduce_scatter_base": ("reduce_scatter", "output", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "gather": ("gather", "tensor", "dst"),
    "scatter": ("scatter", "tensor", "src"),
    "barrier": ("barrier", None, None),
    "all_gather_object": ("all_gather_object", None, None),
    "broadcast_object_list": ("broadcast_object_list", None, "src"),
    "gather_object": ("gather_object", None, "dst"),
}
_P2P = {"send": ("send", "dst"), "isend": ("send", "dst"), "recv": ("recv", "src"), "irecv": ("recv", "src")}

_local = threading.local()
_ORIGINAL: dict = {}  # name -> the torch.distributed function traced() wraps


def _group_ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _op(kind: str, tensor, group, caller: str, **extra) -> dict:
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.empty(0)
    return {"kind": kind, "group": _group_ranks(group), "root": None, **extra, "shape": tuple(tensor.shape),
            "dtype": str(tensor.dtype), "numel": tensor.numel(), "nbytes": tensor.numel() * tensor.element_size(),
            "what": None, "layer": caller, "source": "outside", "caller": caller}


def _global(arguments: dict, name: str):
    """The global rank a src / dst parameter names (also when given as group_src / group_dst)."""
    if arguments.get(name) is not None:
        return arguments[name]
    group_rank = arguments.get(f"group_{name}")
    if group_rank is None:
        return None
    group = arguments.get("group")
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def _describe(name: str, arguments: dict, caller: str) -> dict:
    """arguments: the call's arguments bound to the function's parameter names."""
    if name in _P2P:
        direction, peer = _P2P[name]
        return _op("p2p", arguments.get("tensor"), arguments.get("group"), caller,
                   p2p=((direction, _global(arguments, peer)),), batched=False)
    if name == "batch_isend_irecv":
        ops = arguments["p2p_op_list"]
        links = tuple(("send" if o.op in (dist.isend, _ORIGINAL.get("isend")) else "recv", o.peer) for o in ops)
        return _op("p2p", ops[0].tensor, ops[0].group, caller, p2p=links, batched=True)
    kind, tensor, root = _COLLECTIVES[name]
    extra = {"root": _global(arguments, root)} if root else {}
    return _op(kind, arguments.get(tensor) if tensor else None, arguments.get("group"), caller, **extra)


def _caller(frame) -> str:
    """The first module up the stack that is not a torch.distributed / deepspeed.comm wrapper."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "?")
        if not name.startswith(_PASS_THROUGH):
            return name
        frame = frame.f_back
    return "?"


def _wrap(name: str, fn, ops: list):
    signature = inspect.signature(fn)

    @wraps(fn)
    def traced_call(*args, **kwargs):
        if getattr(_local, "depth", 0):
            return fn(*args, **kwargs)
        caller = _caller(sys._getframe(1))
        if caller != _TSP_COMM_MODULE:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:  # a wrong call: let torch raise its own error
                return fn(*args, **kwargs)
            ops.append(_describe(name, arguments, caller))
        _local.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = 0

    return traced_call


@contextmanager
def traced(ops: list):
    """While active, append every torch.distributed call made outside ds_tsp.core.comm.communicator to `ops` (post order)."""
    from torch.distributed import distributed_c10d as c10d

    names = [n for n in (*_COLLECTIVES, *_P2P, "batch_isend_irecv") if hasattr(c10d, n) or hasattr(dist, n)]
    patched = []  # (owner, attribute, original)
    wrappers = {}
    for name in names:
        original = getattr(dist, name, None) or getattr(c10d, name)
        _ORIGINAL[name] = original
        wrappers[original] = _wrap(name, original, ops)
        for owner in (dist, c10d):
            if getattr(owner, name, None) is original:
                patched.append((owner, name, original))
    try:  # DeepSpeed's TorchBackend keeps the all-gather / reduce-scatter functions it picked at start-up
        from deepspeed.comm import comm as ds_comm
        backend = ds_comm.cdb
    except Exception:  # noqa: BLE001 - no DeepSpeed, or not started
        backend = None
    for attr in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attr, None)
        if fn in wrappers:
            patched.append((backend, attr, fn))
    for owner, attr, original in patched:
        setattr(owner, attr, wrappers[original])
    try:
        yield ops
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
