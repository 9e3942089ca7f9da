"""Communication on the TSP axis: async collectives that return handles, with byte counters.

The three TSP primitives built on them (shard broadcast, weight ring, sequence all-gather) and the replicated-
parameter all-reduce are in ds_tsp.core.comm.primitives.

Byte accounting (`CommCounter`) follows the algorithm's logical volume per rank: a broadcast counts on receivers,
a reduce on senders, all-gather counts the (D-1)/D of its output that arrives, reduce-scatter the (D-1)/D of its
input that leaves, a ring hop and an `exchange` count what is sent. Summed over a full head-block loop every rank
counts the same, but for the causal K/V gather and dK/dV scatter on CPU tensors (ds_tsp.core.comm.kv_gather), which
move only the chunks their receivers read: rank p sends D-1+p chunks in the gather, 2D-2-p in the scatter.

Every blocking wait is bounded by `TSPComm.timeout_s` (ds_tsp.core.reliability.watchdog): a dead or stalled peer ends
the rank with one stderr line naming the collective, the layer (`comm.context`, kept by
ds_tsp.core.reliability.watchdog.label_modules) and the rank waited for, and exit code
ds_tsp.core.reliability.watchdog.EXIT_CODE. Blocking torch.distributed calls made elsewhere are bounded the same way
inside `with comm.guard("what"):`.

`with comm.recording() as rec:` lists, in post order, every op this comm posts (ds_tsp.core.comm.recorder): what a
replay under NCCL's queueing rules checks (tests/helpers/nccl_rules.py), since gloo's threads hide orders that hang
NCCL.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ds_tsp.core.comm.recorder import CommRecorder
from ds_tsp.core.reliability import clean_exit as finalize
from ds_tsp.core.reliability.watchdog import Blocked, Guard, TSPCommError, guard, post_failed, watched_wait  # noqa: F401

# torch >= 2.10 renamed all_gather_into_tensor; the old name warns on every call.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# point-to-point tag of the CPU reduce-scatter's pieces (TSPComm._reduce_scatter_by_exchange): apart from the weight
# ring's hops (ds_tsp.core.comm.primitives), which may be in flight between the same ranks at the same time
REDUCE_SCATTER_TAG = 7103
ALL_GATHER_TAG = 7104  # the CPU all-gather's (TSPComm._all_gather_by_exchange)
# the causal K/V gather's and dK/dV scatter's pieces (ds_tsp.core.comm.kv_gather, through TSPComm.exchange): apart
# from the all-gather of the first zigzag half posted just before them between the same ranks
KV_LATE_HALF_TAG = 7105
KV_GRAD_TAG = 7106
_NUMBER = re.compile(r"\d+")  # block, hop and layer numbers in a wait's label (CommCounter.wait_by_collective)

# torch.profiler range around every blocked wait: lets a profile charge waiting to the layer that waits
COMM_WAIT_RANGE = "ds_tsp::comm_wait"


class CommCounter:
    """Bytes moved per primitive kind, and seconds spent blocked on handles, in all and per collective (one instance
    per model)."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.wait_s = 0.0
        self._waits: dict[tuple[str, str | None], float] = defaultdict(float)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def add_wait(self, seconds: float, blocked: Blocked | None) -> None:
        """Charge `seconds` blocked on a handle to the total and to the collective waited for (its kind and what it
        moves; None: an unlabelled handle)."""
        self.wait_s += seconds
        self._waits[(blocked.kind, blocked.what) if blocked is not None else ("unlabelled", None)] += seconds

    def wait_by_collective(self) -> dict[str, float]:
        """Seconds blocked per collective, labelled "kind: what" with every number written # ("ring: grad hop #/#"),
        so the blocks, hops and layers of one collective add up."""
        out: dict[str, float] = defaultdict(float)
        for (kind, what), seconds in self._waits.items():
            out[kind if what is None else f"{kind}: {_NUMBER.sub('#', what)}"] += seconds
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.wait_s = 0.0
        self._waits.clear()

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls), "total_bytes": self.total_bytes,
                "wait_s": self.wait_s, "wait_by": self.wait_by_collective()}


class Handle:
    """Pending communication; `wait()` blocks (at most `timeout_s`, see ds_tsp.core.reliability.watchdog) and charges
    the blocked time to the counter."""

    @classmethod
    def started(cls, works: list, counter: CommCounter, keep_alive: tuple, overlap: bool,
                blocked: Blocked | None = None, timeout_s: float | None = None,
                finish: Callable[[], None] | None = None) -> "Handle":
        handle = cls(works, counter, keep_alive, blocked, timeout_s, finish)
        if not overlap:
            handle.wait()
        return handle

    def __init__(self, works: list, counter: CommCounter, keep_alive: tuple = (), blocked: Blocked | None = None,
                 timeout_s: float | None = None, finish: Callable[[], None] | None = None):
        self._works = [w for w in works if w is not None]
        self._counter = counter
        self._keep_alive = keep_alive  # buffers a pending op reads or writes must outlive it
        self._blocked = blocked  # what to report if the wait fails or outlives timeout_s
        self._timeout_s = timeout_s
        self._finish = finish  # local work that completes the op once the transfer is in (a reduce-scatter's sum)

    def wait(self) -> None:
        if not self._works:
            self._run_finish()
            return
        start = time.perf_counter()
        with record_function(COMM_WAIT_RANGE) if torch.autograd._profiler_enabled() else nullcontext():
            if self._blocked is None:
                for work in self._works:
                    work.wait()
            else:
                # device tensors (NCCL): wait() only orders the stream, so the watchdog polls an event recorded
                # after it (never the Works: a WorkNCCL keeps its outputs until the GPU is done with them)
                device = self._keep_alive[0].device if self._keep_alive else None
                watched_wait(self._works, self._blocked, self._timeout_s,
                             poll=device if device is not None and device.type != "cpu" else None)
        self._counter.add_wait(time.perf_counter() - start, self._blocked)
        self._run_finish()
        self._works = []
        self._keep_alive = ()

    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class TSPComm:
    """The TSP process group plus its counter. Passed explicitly to every layer; no module-global state.

    timeout_s bounds every blocking wait (None: unbounded, and a failed collective raises TSPCommError instead of
    ending the process). `context` names what runs now ("model.layers.3.self_attn forward"): any code may set it
    (a plain attribute store); ds_tsp.core.reliability.watchdog.label_modules(model) keeps it current from module names.
    """

    group: dist.ProcessGroup | None
    counter: CommCounter = field(default_factory=CommCounter)
    overlap: bool = True  # False: every transfer completes before compute resumes (to measure what overlap hides)
    timeout_s: float | None = 1800
    context: str = field(default="", compare=False)
    # The open ds_tsp.core.grads.replicated.ReplicatedGradBucket (one model forward), or None: replicated_param asks it
    # first so the grads of replicated weights are summed in one all-reduce per backward.
    grad_bucket: object = field(default=None, compare=False, repr=False)
    recorder: CommRecorder | None = field(default=None, compare=False, repr=False)  # see recording()
    # A second communicator over the same ranks for weights (shard broadcasts, weight-grad reduces, ring hops):
    # NCCL runs one in-order stream per communicator, so on the TSP group alone a prefetch broadcast would queue
    # ahead of the K/V gather the next kernel waits for. None: weights share `group` (one stream).
    weight_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    # The context-parallel axis (ds_tsp.core.layers.attention.cp_ring): a TSPComm over this rank's peers at the same TSP
    # index in the other cp groups of its sequence, whose ring passes gathered K/V. None: cp = 1 (the sequence is this
    # group's).
    cp: "TSPComm | None" = field(default=None, compare=False, repr=False)

    @property
    def cp_size(self) -> int:
        """The cp groups sharing this rank's sequence (tsp.cp_size; 1 without a cp axis)."""
        return self.cp.size if self.cp is not None else 1

    @property
    def cp_rank(self) -> int:
        """This group's place among them (0 without a cp axis)."""
        return self.cp.rank if self.cp is not None else 0

    def cp_axis(self) -> "TSPComm":
        """self.cp, labelled and recorded like self: its waits report this layer's context, its ops join this
        comm's recording (the NCCL-rules replay and the byte counters see both axes in one order)."""
        cp = self.cp
        cp.context, cp.recorder = self.context, self.recorder
        return cp

    def __post_init__(self):
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not self.timeout_s > 0):
            raise ValueError(f"TSPComm(timeout_s={self.timeout_s!r}): must be a number of seconds > 0, or None to "
                             "wait without bound")
        if self.group is None or not dist.is_initialized():
            self.rank, self.size = 0, 1
            self._ranks = [dist.get_rank() if dist.is_initialized() else 0]
        else:
            self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
            self._ranks = dist.get_process_group_ranks(self.group)  # global rank of each TSP rank
            finalize.install()  # a script that returns normally exits cleanly (no abort in gloo's teardown)
            if self.weight_group is not None and dist.get_process_group_ranks(self.weight_group) != self._ranks:
                raise ValueError("TSPComm(weight_group=...): must span the same ranks as group, in the same order "
                                 "(ProcessGroups.build makes it as tsp_weight_group)")

    @classmethod
    def single(cls) -> "TSPComm":
        """A degree-1 group: every primitive is a local no-op (D=1 runs without torch.distributed)."""
        return cls(group=None)

    def _global(self, group_rank: int) -> int:
        return self._ranks[group_rank]

    def guard(self, what: str, group: dist.ProcessGroup | None = None, context: str | None = None,
              poll: torch.device | None = None, comm_errors_only: bool = False) -> Guard:
        """`with comm.guard("loss all_reduce"): dist.all_reduce(t, group=comm.group)`: the block's blocking
        torch.distributed calls get this comm's timeout_s and one-message report. group: the group they talk to
        (its other ranks are the waited-for peers; default the TSP group); context: default comm.context; poll:
        the device of the block's tensors, watched after the block where collectives do not block the host;
        comm_errors_only: other errors of the block propagate as they are (watchdog.Guard)."""
        return guard(what, timeout_s=self.timeout_s, group=group, comm=self, context=context, poll=poll,
                     comm_errors_only=comm_errors_only)

    @contextmanager
    def recording(self, recorder: CommRecorder | None = None) -> Iterator[CommRecorder]:
        """`with comm.recording() as rec:` ... then rec.ops lists what this comm posted meanwhile, in order."""
        prev, self.recorder = self.recorder, recorder if recorder is not None else CommRecorder()
        try:
            yield self.recorder
        finally:
            self.recorder = prev

    @property
    def weight_channel(self) -> dist.ProcessGroup | None:
        """The group weights travel on: weight_group when given, else the TSP group itself."""
        return self.weight_group if self.weight_group is not None else self.group

    def _record(self, kind: str, t: torch.Tensor, what: str | None, context: str | None = None, *,
                weights: bool = False, **extra) -> None:
        if self.recorder is not None:
            channel = "weights" if weights and self.weight_group is not None else "tsp"
            self.recorder.add(kind, tuple(self._ranks), t, what, self.context if context is None else context,
                              channel=channel, **extra)

    def _started(self, works: list, keep_alive: tuple, kind: str, peer: tuple, what: str | None,
                 finish: Callable[[], None] | None = None) -> Handle:
        return Handle.started(works, self.counter, keep_alive, self.overlap, Blocked(self, kind, peer, what),
                              self.timeout_s, finish)

    def _post_failed(self, err: RuntimeError, kind: str, peer: tuple, what: str | None):
        post_failed(Blocked(self, kind, peer, what), err, self.timeout_s)
        raise err  # not reached: post_failed exits the process or raises TSPCommError

    def _post_batch(self, ops: list, kind: str, peer: tuple, what: str | None) -> list:
        """dist.batch_isend_irecv(ops), a failed post reported like any collective's (kind, peer, what)."""
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as err:
            self._post_failed(err, kind, peer, what)

    # --- raw async collectives ---------------------------------------------------------------------------
    # `what` (optional) says what moves, for the report of a failed or stalled wait: "shard of head block 2".
    # broadcast, reduce and ring_exchange carry weights and weight grads: they run on weight_channel; the sequence
    # collectives (all_gather, reduce_scatter, all_reduce, gather_to) on the TSP group.
    def broadcast(self, tensor: torch.Tensor, src: int, what: str | None = None) -> Handle:
        if self.size == 1:
            return Handle([], self.counter)
        if self.rank != src:
            self.counter.add("broadcast", _nbytes(tensor))
        self._record("broadcast", tensor, what, root=self._global(src), weights=True)
        try:
            work = dist.broadcast(tensor, src=self._global(src), group=self.weight_channel, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "broadcast", ("src", src), what)
        return self._started([work], (tensor,), "broadcast", ("src", src), what)

    def reduce(self, tensor: torch.Tensor, dst: int, what: str | None = None) -> Handle:
        """Sum into `tensor` on dst. The buffer is clobbered elsewhere by some backends: never reuse it there."""
        if self.size == 1:
            return Handle([], self.counter)
        if self.rank != dst:
            self.counter.add("reduce", _nbytes(tensor))
        self._record("reduce", tensor, what, root=self._global(dst), weights=True)
        try:
            work = dist.reduce(tensor, dst=self._global(dst), op=dist.ReduceOp.SUM, group=self.weight_channel,
                               async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "reduce", ("dst", dst), what)
        return self._started([work], (tensor,), "reduce", ("dst", dst), what)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, what: str | None = None) -> Handle:
        """out: D * local.numel() elements (any shape, contiguous), filled in rank order."""
        if self.size == 1:
            out.copy_(local.reshape(out.shape))
            return Handle([], self.counter)
        self.counter.add("all_gather", _nbytes(out) * (self.size - 1) // self.size)
        self._record("all_gather", local, what)
        local = local.contiguous().view(-1)
        if local.device.type == "cpu":
            return self._all_gather_by_exchange(out.view(-1), local, what)
        try:
            work = _all_gather_single(out.view(-1), local, group=self.group, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "all_gather", ("group",), what)
        return self._started([work], (out, local), "all_gather", ("group",), what)

    def _all_gather_by_exchange(self, out: torch.Tensor, local: torch.Tensor, what: str | None) -> Handle:
        """CPU tensors (gloo): `local` sent to every other rank and each rank's piece received straight into its
        slot of `out`, in one batch_isend_irecv (the bytes of an all-gather, no buffer on top); this rank's slot is
        a local copy. Gloo's own all-gather took 0.97-1.32x as long at D=2 and 1.5-5.2x at D=4, 96 KiB to 16 MiB
        gathered (benchmarks/gloo_collectives.py, docs/benchmarks.md)."""
        n, p = local.numel(), self.rank
        ops = []
        for r in range(self.size):
            if r != p:
                ops.append(dist.P2POp(dist.isend, local, peer=self._global(r), group=self.group, tag=ALL_GATHER_TAG))
                ops.append(dist.P2POp(dist.irecv, out[r * n:(r + 1) * n], peer=self._global(r), group=self.group,
                                      tag=ALL_GATHER_TAG))
        works = self._post_batch(ops, "all_gather", ("group",), what)
        out[p * n:(p + 1) * n].copy_(local)
        return self._started(works, (out, local), "all_gather", ("group",), what)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, what: str | None = None) -> Handle:
        """full in rank order (chunk r goes to rank r); out receives the sum of every rank's chunk `self.rank`."""
        if self.size == 1:
            out.copy_(full.reshape(out.shape))
            return Handle([], self.counter)
        self.counter.add("reduce_scatter", _nbytes(full) * (self.size - 1) // self.size)
        self._record("reduce_scatter", out, what)
        full = full.contiguous().view(-1)
        if full.device.type == "cpu":
            return self._reduce_scatter_by_exchange(out, full, what)
        try:
            work = _reduce_scatter_single(out.view(-1), full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "reduce_scatter", ("group",), what)
        return self._started([work], (out, full), "reduce_scatter", ("group",), what)

    def _reduce_scatter_by_exchange(self, out: torch.Tensor, full: torch.Tensor, what: str | None) -> Handle:
        """CPU tensors (gloo): every rank sends piece r of `full` to rank r and receives the D-1 pieces addressed to
        it, all in one batch_isend_irecv (the bytes of a reduce-scatter): the first into `out` itself, the others
        into (D-2)/D of full's size on top (nothing at D=2); its own piece and those are added onto it, in a fixed
        order, when the handle is waited. Gloo's own reduce-scatter took 1.7-6.7x as long at D=2 and 2.7-5.2x at
        D=4, 96 KiB to 16 MiB (benchmarks/gloo_collectives.py, docs/benchmarks.md)."""
        n, p = out.numel(), self.rank
        others = [r for r in range(self.size) if r != p]
        received = [out.view(-1), *full.new_empty(len(others) - 1, n)]
        ops = []
        for r, buf in zip(others, received):
            ops.append(dist.P2POp(dist.isend, full[r * n:(r + 1) * n], peer=self._global(r), group=self.group,
                                  tag=REDUCE_SCATTER_TAG))
            ops.append(dist.P2POp(dist.irecv, buf, peer=self._global(r), group=self.group, tag=REDUCE_SCATTER_TAG))
        works = self._post_batch(ops, "reduce_scatter", ("group",), what)

        def add_pieces():
            first, *rest = received
            first.add_(full[p * n:(p + 1) * n])
            for piece in rest:
                first.add_(piece)

        return self._started(works, (out, full, *received[1:]), "reduce_scatter", ("group",), what, add_pieces)

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], kind: str,
                 tag: int, about: torch.Tensor, what: str | None = None,
                 finish: Callable[[], None] | None = None) -> Handle:
        """Point-to-point on the TSP group, in one batch_isend_irecv: each (group rank, tensor) of `sends` sent to
        that rank, each of `recvs` received into. For collectives whose pieces not every rank reads: every rank
        derives its pairs from the same static rule, so each send meets its peer's receive of the same size (a rank
        with neither posts nothing). Counted under `kind` as the bytes sent, as a ring hop is (and as torch's
        dispatcher charges point-to-point: ds_tsp.tools.bench.comm_count), so an exchange that replaces a symmetric
        all-gather or reduce-scatter counts what that collective would where every piece travels. finish: local work
        run once the transfers are in (when the handle is waited), e.g. a sum of the received pieces. about: what
        the recording shows as the op's tensor, the same shape on every rank (the pieces' sizes are in its links)."""
        sends = [(r, t.contiguous()) for r, t in sends]
        for r, t in (*sends, *recvs):
            if not (0 <= r < self.size) or r == self.rank:
                raise ValueError(f"TSPComm.exchange: peer {r} is not another rank of this group of {self.size}")
        self.counter.add(kind, sum(_nbytes(t) for _, t in sends))
        if not sends and not recvs:
            return Handle.started([], self.counter, (), self.overlap, finish=finish)
        links = tuple((d, self._global(r), t.numel()) for d, pairs in (("send", sends), ("recv", recvs))
                      for r, t in pairs)
        self._record("p2p", about, what, p2p=links, batched=True, tag=tag)
        ops = ([dist.P2POp(dist.isend, t, peer=self._global(r), group=self.group, tag=tag) for r, t in sends]
               + [dist.P2POp(dist.irecv, t, peer=self._global(r), group=self.group, tag=tag) for r, t in recvs])
        works = self._post_batch(ops, kind, ("group",), what)
        return self._started(works, tuple(t for _, t in (*sends, *recvs)), kind, ("group",), what, finish)

    def all_reduce(self, tensor: torch.Tensor, kind: str = "all_reduce", what: str | None = None,
                   context: str | None = None) -> Handle:
        if self.size == 1:
            return Handle([], self.counter)
        self.counter.add(kind, 2 * _nbytes(tensor) * (self.size - 1) // self.size)
        name = "all_reduce" if kind == "all_reduce" else f"all_reduce[{kind}]"
        self._record("all_reduce", tensor, what, context)
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, name, ("group",), what)
        return Handle.started([work], self.counter, (tensor,), self.overlap,
                              Blocked(self, name, ("group",), what, context), self.timeout_s)

    def gather_to(self, local: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Blocking: every rank's `local` (same shape) on group rank `dst`, in rank order; None elsewhere.

        Unlike all_gather only the destination holds D copies: what a checkpoint writer needs.
        """
        if self.size == 1:
            return [local]
        local = local.contiguous()
        out = [torch.empty_like(local) for _ in range(self.size)] if self.rank == dst else None
        if self.rank != dst:
            self.counter.add("gather", _nbytes(local))
        self._record("gather", local, None, root=self._global(dst))
        try:
            work = dist.gather(local, out, dst=self._global(dst), group=self.group, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "gather", ("dst", dst), None)
        Handle([work], self.counter, (local,), Blocked(self, "gather", ("dst", dst)), self.timeout_s).wait()
        return out

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, what: str | None = None) -> Handle:
        """Send to rank p+1 and receive from rank p-1 (the ring order of the weight ring).

        One batch_isend_irecv per hop: NCCL runs a batch's send and receive together, whereas a bare isend posted
        first on every rank blocks each rank's queue until its peer's receive, which never comes (a ring deadlock
        above NCCL's eager size; tests/helpers/nccl_rules.py). NCCL ignores `tag`: hops match because every rank posts
        them in the same order.
        """
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.counter.add("ring", _nbytes(send))
        peer = ("ring", prv, nxt)
        self._record("p2p", send, what, p2p=(("send", self._global(nxt)), ("recv", self._global(prv))), batched=True,
                     tag=tag, weights=True)
        ops = [dist.P2POp(dist.isend, send, peer=self._global(nxt), group=self.weight_channel, tag=tag),
               dist.P2POp(dist.irecv, recv, peer=self._global(prv), group=self.weight_channel, tag=tag)]
        works = self._post_batch(ops, "ring", peer, what)
        return self._started(works, (send, recv), "ring", peer, what)

    def shift_exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, shift: int, tag: int,
                       what: str | None = None) -> Handle:
        """Send to rank p+shift and receive from rank p-shift (mod size), in one batch_isend_irecv like
        ring_exchange; either side may be None (this pair moves nothing: the peer posts no matching op either, by
        the same static rule). Counted under "ring" as the bytes sent."""
        nxt, prv = (self.rank + shift) % self.size, (self.rank - shift) % self.size
        ops, links = [], []
        if send is not None:
            self.counter.add("ring", _nbytes(send))
            ops.append(dist.P2POp(dist.isend, send, peer=self._global(nxt), group=self.weight_channel, tag=tag))
            links.append(("send", self._global(nxt), send.numel()))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, peer=self._global(prv), group=self.weight_channel, tag=tag))
            links.append(("recv", self._global(prv), recv.numel()))
        if not ops:
            return Handle([], self.counter)
        peer = ("ring", prv, nxt)
        self._record("p2p", send if send is not None else recv, what, p2p=tuple(links), batched=True, tag=tag,
                     weights=True)
        works = self._post_batch(ops, "ring", peer, what)
        return self._started(works, tuple(t for t in (send, recv) if t is not None), "ring", peer, what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   what: str | None = None) -> Handle:
        """Rows of `inp` (dim 0) split by in_splits go to group ranks 0..D-1; out receives out_splits[r] rows from
        rank r, in rank order (dist.all_to_all_single, on the TSP group: token rows, not weights). Splits are host
        ints (NCCL sizes the transfer from them); rank p's in_splits[q] must equal rank q's out_splits[p].
        Counted under "all_to_all" as the bytes that leave the rank (rows sent to the other ranks)."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return Handle([], self.counter)
        row_bytes = inp.shape[1:].numel() * inp.element_size()
        self.counter.add("all_to_all", row_bytes * (sum(in_splits) - in_splits[self.rank]))
        self._record("all_to_all", inp, what, in_splits=tuple(in_splits), out_splits=tuple(out_splits))
        try:
            work = dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=list(out_splits),
                                          input_split_sizes=list(in_splits), group=self.group, async_op=True)
        except RuntimeError as err:
            self._post_failed(err, "all_to_all", ("group",), what)
        return self._started([work], (out, inp), "all_to_all", ("group",), what)
