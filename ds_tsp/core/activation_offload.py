"""Offload of checkpointed decoder-layer inputs to host memory ("tsp": {"activation_checkpointing": true,
"offload_activations": true}).

With activation checkpointing a decoder layer keeps only its input [B, S/D, h] for backward, but over L layers those
inputs are the largest thing left on the device at long sequences (Llama-3-8B at 4M tokens, D=8: 32 x 2 GiB x ...).
Here each checkpointed layer's saved input waits in host memory instead, and comes back one layer ahead of its
recompute:

    forward, layer i:  the input h_i is saved by torch.utils.checkpoint; its pack hook (below) starts the copy
                       device -> host buffer on a side stream, after the compute stream's work so far (wait_stream),
                       and returns a handle; h_i.record_stream(side) keeps its device memory out of reuse until that
                       copy ran, with no host wait, so the device frees h_i while layer i+1 computes.
    backward, layer i: the recompute unpacks the handle: the compute stream waits on the event of h_i's host ->
                       device copy (started when layer i+1's recompute unpacked), then the copy of h_{i-1} starts on
                       the side stream, so it overlaps layer i's recompute and backward.
The last layer's input is not offloaded: backward needs it first, a round trip would only stall; its recompute
starts the copy back of h_{L-2}. So the device holds at most two layer inputs (the one being copied and the last
layer's in forward; the one in use and the one being prefetched in backward), the host holds L-1.

Host buffers come from a pool: taken at pack, given back when autograd frees the saved input (after its backward,
or with the graph), reused by the next step, so pinned memory is allocated once and every step after the first
allocates none. Two properties keep it at what `ds-tsp plan --offload-activations` counts ((L-1) layer inputs at the
longest sequence seen, ds_tsp.tools.plan.offload.host_bytes_per_rank):
- exact sizes: torch's pinned allocator (pin_memory=True) rounds every block up to a power of two (a 160 MiB layer
  input at hidden 5120 takes 256 MiB, up to 2x), so a CUDA pool buffer is a plain host tensor of the exact size
  page-locked with cudaHostRegister (`_HostBuffer`; its page-aligned span, at most two pages more per buffer);
- bounded under varying lengths: every buffer has the size of the longest input seen (`_slot_bytes`); a longer
  input retires the smaller free buffers (and the smaller ones still in use when they come back), so a new maximum
  replaces the set instead of adding L-1 buffers to it. On CUDA a retired buffer is released only after the side
  stream passed the copies that used it (an event, queried without blocking).
Device copies come from the caching allocator, which reuses the same blocks each step. Events and stream waits
order everything: no host sync, no `.item()`, no synchronize.

On a device without streams (CPU, meta, fake tensors) the same code runs with every copy synchronous into the same
kind of pool (a separate set of host tensors), so the schedule, the pool and the numerics are tested without a GPU:
a copy is exact, so losses and gradients match the run without offload bit for bit.
"""
from __future__ import annotations

import contextlib
import mmap
import weakref

import torch

__all__ = ["ActivationOffload"]


PAGE = mmap.PAGESIZE


class _HostBuffer:
    """One pool buffer: `nbytes` usable host bytes (`data`), page-locked when `pinned` by cudaHostRegister on the
    page-aligned span of a plain host tensor (exact size: no power-of-two rounding), unregistered when released or
    collected. `allocated` counts what it holds of host memory."""

    __slots__ = ("data", "nbytes", "allocated", "_ptr", "__weakref__")

    def __init__(self, nbytes: int, device: str, pinned: bool):
        self._ptr = None
        if not pinned:
            self.data = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.nbytes = self.allocated = nbytes
            return
        span = -(-nbytes // PAGE) * PAGE  # whole pages: two registered buffers never share a page
        raw = torch.empty(span + PAGE, dtype=torch.uint8, device=device)
        offset = -raw.data_ptr() % PAGE
        self.data = raw[offset:offset + span]
        self.nbytes, self.allocated = nbytes, span + PAGE
        err = int(_cudart().cudaHostRegister(self.data.data_ptr(), span, 1))  # 1: cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {span} bytes for the activation offload pool failed with CUDA "
                               f"error {err}: the host may be out of page-lockable memory (ulimit -l); use "
                               "offload_activations=false or a shorter sequence (ds-tsp plan --offload-activations "
                               "shows the pool per rank and node)")
        self._ptr = self.data.data_ptr()

    def release(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _cudart().cudaHostUnregister(ptr)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the process frees it anyway
            pass


def _cudart():
    return torch.cuda.cudart()


class _Offloaded:
    """A saved layer input living in a host buffer (what autograd holds instead of the device tensor)."""

    __slots__ = ("owner", "layer", "buffer", "host", "shape", "dtype", "device", "on_device", "fetched", "__weakref__")

    def __init__(self, owner: "ActivationOffload", layer: int, buffer: _HostBuffer, host: torch.Tensor,
                 like: torch.Tensor):
        self.owner, self.layer, self.buffer, self.host = owner, layer, buffer, host
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.on_device: torch.Tensor | None = None  # the prefetched copy, until its unpack takes it
        self.fetched = None  # CUDA event: the host -> device copy of on_device has run

    def __del__(self):  # autograd freed the saved input: its host buffer goes back to the pool
        owner = self.owner
        if owner is not None:
            owner._give_back(self.buffer)


class _Kept:
    """The last layer's saved input, kept on the device: its unpack only starts the prefetch below it."""

    __slots__ = ("tensor", "layer")

    def __init__(self, tensor: torch.Tensor, layer: int):
        self.tensor, self.layer = tensor, layer


class ActivationOffload:
    """The host pool and copy schedule of one model's checkpointed layer inputs.

        offload = ActivationOffload()
        for i, layer in enumerate(layers):
            with offload.saved_input(h, layer=i, last=i == len(layers) - 1):
                h = torch.utils.checkpoint.checkpoint(layer, h, ..., use_reentrant=False)

    Only the tensor `h` itself is offloaded; the checkpoint's other inputs (cos/sin, shared by every layer) are kept
    as they are. Counters for tests and the bench: `host_bytes` (host bytes the pool holds now), `host_allocations`
    (buffers allocated so far), `host_in_use()` (the buffers holding saved inputs now).
    """

    def __init__(self, host_device: str | None = None):
        # host_device: where the pool lives; None = host memory ("cpu", pinned for CUDA inputs; "meta" for meta
        # inputs). A measurement may put it on "meta" to count it apart from the device (ds-tsp bench).
        self._host_device = host_device
        self._free: list[_HostBuffer] = []  # buffers not holding anything, each of _slot_bytes
        self._slot_bytes = 0  # the longest input seen: every buffer taken from now on has this size
        self._retired: list[tuple[_HostBuffer, object]] = []  # (buffer, side-stream event) until its copies ran
        self._in_use: "weakref.WeakSet[_Offloaded]" = weakref.WeakSet()
        self._waiting: dict[int, weakref.ref] = {}  # layer -> handle offloaded and not yet unpacked
        self._stream = None  # the side CUDA stream, created on first CUDA use
        self.host_bytes = 0
        self.host_allocations = 0

    def __reduce__(self):  # copies of a model (deepcopy, pickle) start with an empty pool of their own
        return ActivationOffload, (self._host_device,)

    # --- forward ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saved_input(self, h: torch.Tensor, *, layer: int, last: bool):
        """Around one checkpoint(...) call: `h`, when autograd saves it, goes to the host. The last layer's stays on
        the device (backward needs it first); its unpack starts the copy back of the layer below's."""
        # a weak reference: autograd keeps the pack hook alive beyond this block, and a closure over h would keep
        # the device copy of every offloaded input alive with it
        target = weakref.ref(h)

        def pack(t: torch.Tensor):
            if t is not target():
                return t
            return _Kept(t, layer) if last else self._offload(t, layer)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._restore):
            yield

    def _offload(self, t: torch.Tensor, layer: int) -> _Offloaded:
        buffer = self._take(t.numel() * t.element_size(), t.device)
        host = buffer.data[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        if t.device.type == "cuda":
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # h_i is written by the compute stream
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its device memory is not reused before this copy ran
        else:
            host.copy_(t)
        handle = _Offloaded(self, layer, buffer, host, t)
        self._in_use.add(handle)
        self._waiting[layer] = weakref.ref(handle)
        return handle

    # --- backward -----------------------------------------------------------------------------------------------
    def _restore(self, saved):
        if isinstance(saved, _Kept):  # the last layer's recompute starts: fetch the layer below's input meanwhile
            self._prefetch_before(saved.layer)
            return saved.tensor
        if not isinstance(saved, _Offloaded):
            return saved
        if saved.on_device is None:  # not prefetched (the first offloaded layer backward reaches): fetch now
            self._fetch(saved)
        t, event = saved.on_device, saved.fetched
        saved.on_device = saved.fetched = None  # a second unpack (retain_graph) fetches again
        if event is not None:
            torch.cuda.current_stream(t.device).wait_event(event)
        if self._waiting.get(saved.layer, lambda: None)() is saved:
            del self._waiting[saved.layer]
        self._prefetch_before(saved.layer)
        return t

    def _prefetch_before(self, layer: int) -> None:
        """Start the host -> device copy of the closest earlier offloaded layer: its recompute comes next."""
        earlier = [i for i in self._waiting if i < layer]
        if not earlier:
            return
        handle = self._waiting[max(earlier)]()
        if handle is not None and handle.on_device is None:
            self._fetch(handle)

    def _fetch(self, saved: _Offloaded) -> None:
        # allocated on the compute stream, which uses it; the side stream first waits for the compute stream's
        # earlier work on whatever block the allocator hands out
        t = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        if saved.device.type == "cuda":
            stream = self._side_stream(saved.device)
            stream.wait_stream(torch.cuda.current_stream(saved.device))
            with torch.cuda.stream(stream):
                t.copy_(saved.host, non_blocking=True)
                saved.fetched = torch.cuda.Event()
                saved.fetched.record(stream)
            # a prefetched copy whose unpack never comes (a backward abandoned mid-way) is freed from the compute
            # stream while the side stream may still write it: its block is not reused before that write ran
            t.record_stream(stream)
        else:
            t.copy_(saved.host)
        saved.on_device = t

    # --- the pool -----------------------------------------------------------------------------------------------
    def host_in_use(self) -> list[torch.Tensor]:
        """The host tensors holding saved layer inputs now (views of the pool's buffers), by layer."""
        return [h.host for h in sorted(self._in_use, key=lambda h: h.layer)]

    def _take(self, nbytes: int, device: torch.device) -> _HostBuffer:
        pool_device = self._host_device or ("meta" if device.type == "meta" else "cpu")
        self._release_retired()
        if nbytes > self._slot_bytes:  # a new longest input: the smaller buffers will never be taken again
            self._slot_bytes = nbytes
            for buffer in [b for b in self._free if b.nbytes < nbytes]:
                self._free.remove(buffer)
                self._retire(buffer)
        fits = [b for b in self._free if b.nbytes >= nbytes and b.data.device.type == pool_device]
        if fits:
            buffer = min(fits, key=lambda b: b.nbytes)
            self._free.remove(buffer)
            return buffer
        buffer = _HostBuffer(self._slot_bytes, pool_device, pinned=device.type == "cuda" and pool_device == "cpu")
        self.host_allocations += 1
        self.host_bytes += buffer.allocated
        return buffer

    def _give_back(self, buffer: _HostBuffer) -> None:
        if buffer.nbytes < self._slot_bytes:  # taken before the longest input came: too small from now on
            self._retire(buffer)
        else:
            self._free.append(buffer)

    def _retire(self, buffer: _HostBuffer) -> None:
        """Drop a buffer from the pool. On CUDA the side stream may still copy from or into it: it is released once
        an event recorded on that stream now has passed (checked without blocking at the next take)."""
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        self._retired.append((buffer, event))
        self._release_retired()

    def _release_retired(self) -> None:
        keep = []
        for buffer, event in self._retired:
            if event is None or event.query():
                self.host_bytes -= buffer.allocated
                buffer.release()
            else:
                keep.append((buffer, event))
        self._retired = keep

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
