"""Autocast (torch.amp) for the custom autograd Functions, on whatever device type their input lives.

torch.amp.custom_fwd / custom_bwd fix the device type (and the cast dtype) when they decorate, but the same
Function runs on cpu, cuda and meta. `autocast_function(fn_cls, device_type)` therefore returns, when autocast is
enabled for that device type, a subclass of fn_cls (built once per (class, device type, cast dtype) and memoised)
whose forward is `torch.amp.custom_fwd(device_type=..., cast_inputs=...)` and whose backward is
`torch.amp.custom_bwd(device_type=...)`; with autocast off (or a device type autocast does not know, e.g. meta) it
returns fn_cls itself, so a step without autocast runs exactly the code it ran before.

Each Function declares what autocast would do to its eager equivalent, as the class attribute AUTOCAST:

    AUTOCAST_LOW_PRECISION  GEMM-heavy (gated MLP, the LM head GEMMs): every floating-point tensor argument is cast
                            to the active autocast dtype ONCE on entry, then forward runs with autocast off and
                            backward likewise (custom_fwd(cast_inputs=<autocast dtype>)). A packed weight shard is
                            thus cast locally before it travels the ring: the ring moves half the bytes of fp32
                            master weights, and the weight grad rides the ring in that dtype too (autograd casts it
                            back to the fp32 parameter's dtype when the Function returns it). float64 tensors are
                            never cast (autocast leaves them alone too). Keep exactness-critical float arguments
                            (a normaliser, a count) OUT of such a Function: they would be rounded as well.
    AUTOCAST_KEEP_DTYPE     norms, softmax / cross-entropy, the embedding lookup, pure data movement: autocast's
                            fp32 list, or ops autocast does not touch. Nothing is cast (custom_fwd(cast_inputs=None)):
                            the autocast state of forward is recorded and restored in backward, which otherwise
                            would run with whatever state the backward() call happens to have.

Use (a public wrapper of a Function in ds_tsp/core/layers/):

    class _MyFunction(torch.autograd.Function):
        AUTOCAST = AUTOCAST_LOW_PRECISION    # or AUTOCAST_KEEP_DTYPE
        ...

    def my_layer(x, shard, comm):
        return apply_autocast(_MyFunction, x.device.type, x, shard, comm)   # instead of _MyFunction.apply(...)

The memo is a pure function of its key (a class, a device type string, a dtype): it holds no state that changes
what a call computes, only spares rebuilding the same subclass every call.
"""
from __future__ import annotations

import functools

import torch

AUTOCAST_LOW_PRECISION = "low_precision"
AUTOCAST_KEEP_DTYPE = "keep_dtype"
_POLICIES = (AUTOCAST_LOW_PRECISION, AUTOCAST_KEEP_DTYPE)


def autocast_function(fn_cls: type[torch.autograd.Function], device_type: str) -> type[torch.autograd.Function]:
    """fn_cls, or its custom_fwd/custom_bwd subclass for `device_type` when autocast is enabled there."""
    policy = getattr(fn_cls, "AUTOCAST", None)
    if policy not in _POLICIES:
        raise TypeError(f"{fn_cls.__name__}.AUTOCAST is {policy!r}: set it to ds_tsp.core.layers.amp."
                        "AUTOCAST_LOW_PRECISION (GEMM-heavy) or AUTOCAST_KEEP_DTYPE (fp32-list ops, data movement)")
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return fn_cls
    cast = torch.get_autocast_dtype(device_type) if policy == AUTOCAST_LOW_PRECISION else None
    return _autocast_variant(fn_cls, device_type, cast)


def apply_autocast(fn_cls: type[torch.autograd.Function], device_type: str, *args):
    """fn_cls.apply(*args), under the autocast policy fn_cls.AUTOCAST when autocast is on for `device_type`."""
    return autocast_function(fn_cls, device_type).apply(*args)


def dtype_inside(fn_cls: type[torch.autograd.Function], device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating-point tensor argument of `dtype` on `device_type` has inside fn_cls's forward, as
    apply_autocast would run it now (custom_fwd's own rule: float64 and other devices are never cast). Callers that
    pick a kernel or count bytes before the Function runs (the MoE expert GEMM path, its dispatch cost) use it, so
    they decide on the dtype the kernels will really see."""
    cls = autocast_function(fn_cls, device_type)
    if cls is fn_cls or fn_cls.AUTOCAST != AUTOCAST_LOW_PRECISION:
        return dtype
    if not dtype.is_floating_point or dtype == torch.float64:
        return dtype
    return torch.get_autocast_dtype(device_type)


@functools.lru_cache(maxsize=None)
def _autocast_variant(fn_cls, device_type: str, cast_inputs: torch.dtype | None):
    forward = torch.amp.custom_fwd(fn_cls.forward, device_type=device_type, cast_inputs=cast_inputs)
    backward = torch.amp.custom_bwd(fn_cls.backward, device_type=device_type)
    suffix = "" if cast_inputs is None else f"_{str(cast_inputs).removeprefix('torch.')}"
    return type(f"{fn_cls.__name__}_autocast_{device_type}{suffix}", (fn_cls,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward),
                 "__module__": fn_cls.__module__, "__doc__": fn_cls.__doc__})
