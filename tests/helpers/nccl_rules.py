"""Replay every rank's recorded ops (ds_tsp.core.comm.recorder.CommRecorder) under NCCL's rules: gloo runs each op
on its own threads and hides orders that hang NCCL, which a CPU-only project can check only this way. A helper
module.

The model (what NCCL guarantees, conservatively):
* one in-order queue per communicator, i.e. per (rank, group, channel): an op runs only at the head of its queue
  (TSPComm's weight channel is a second communicator over the TSP group's ranks: its own queue);
* communicators over the same ranks are launched in the same interleaving on every member (else their kernels
  can wait on each other across streams);
* a collective completes when every member of its group has it at the head of its queue for that group; the k-th
  collective of a group on one rank meets the k-th on every other member, which must agree on kind, shape, dtype
  and root;
* the k-th send from r to q on a group meets the k-th receive on q from r on that group (NCCL ignores tags);
* a batch (batch_isend_irecv) is atomic: it completes when every one of its ops meets its peer op at the head of
  the peer's queue, and a peer op inside a batch ties that whole batch in: the connected set completes together
  or not at all. An op posted alone is a batch of one;
* an unbatched send of more than `eager_bytes` blocks its queue until the receive is at the peer's head (NCCL
  buffers small sends; default 0: every send blocks); a smaller one completes at once and its receive needs
  only to reach the head.
Not modelled: order between communicators (a host wait on one before posting on another; stream dependencies),
so a cycle across groups passes here; and ops that bypass TSPComm (DeepSpeed / FSDP collectives, the loss
all-reduce for logging) are not recorded.
Ops are dicts as CommRecorder writes them: kind ("broadcast", "reduce", "gather", "all_gather", "reduce_scatter",
"all_reduce", or "p2p" with p2p=(("send" | "recv", peer[, numel]), ...) and batched), group (global ranks), root,
shape, dtype, numel, nbytes, what, layer, channel ("tsp" or "weights"). op(), p2p(), all_to_all() build them by hand.
An "all_to_all" op also has in_splits / out_splits (rows to / from each group rank); its shape is the rank's own
input, so only the row shape must agree between ranks, and the splits must match pairwise.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

ROOTED = ("broadcast", "reduce", "gather")


def op(kind: str, group, *, shape=(4,), dtype="torch.float32", root=None, what=None, layer="") -> dict:
    numel = 1
    for n in shape:
        numel *= n
    return {"kind": kind, "group": tuple(group), "root": root, "shape": tuple(shape), "dtype": dtype,
            "numel": numel, "nbytes": 4 * numel, "what": what, "layer": layer}


def p2p(group, *ops, batched: bool = True, shape=(4,), what=None, layer="") -> dict:
    return {**op("p2p", group, shape=shape, what=what, layer=layer), "p2p": tuple(ops), "batched": batched}


def all_to_all(group, in_splits, out_splits, *, row=(4,), what=None, layer="") -> dict:
    return {**op("all_to_all", group, shape=(sum(in_splits), *row), what=what, layer=layer),
            "in_splits": tuple(in_splits), "out_splits": tuple(out_splits)}


@dataclass
class Report:
    mismatches: list[str] = field(default_factory=list)
    deadlock: str | None = None
    completed: int = 0  # ops that ran
    total: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.deadlock is None

    def __str__(self) -> str:
        lines = [f"{self.completed}/{self.total} ops complete"] + self.mismatches
        return "\n".join(lines + ([self.deadlock] if self.deadlock else []))


@dataclass(eq=False)
class _Entry:
    rank: int
    index: int  # post order on its rank, over every group
    pos: int  # position in its (rank, group) queue
    op: dict
    links: list = field(default_factory=list)  # p2p: (direction, peer, seq, numel, dtype) per op

    def describe(self) -> str:
        o = self.op
        if o["kind"] == "p2p":
            arrows = ", ".join(f"{d} {'->' if d == 'send' else '<-'} {peer}" for d, peer, *_ in o["p2p"])
            body = f"p2p {'batch ' if o.get('batched') else ''}[{arrows}]"
        else:
            body = o["kind"] + (f" root {o['root']}" if o.get("root") is not None else "")
        what = f" ({o['what']})" if o.get("what") else ""
        return (f"{body}{what} {o['dtype']}{list(o['shape'])} on rank {self.rank}, group {list(o['group'])} "
                f"position {self.pos} (op #{self.index} of the rank); layer: {o.get('layer') or 'not labelled'}")


class _Comm(tuple):
    """One communicator: its member ranks (what iterating gives) and its channel; two communicators over the same
    ranks (TSPComm's weight_group beside the TSP group) are two queues."""

    def __new__(cls, o: dict):
        comm = super().__new__(cls, o["group"])
        comm.channel = o.get("channel", "tsp")
        return comm

    def _key(self):
        return tuple(self), self.channel

    def __eq__(self, other):
        return isinstance(other, _Comm) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __lt__(self, other):
        return self._key() < other._key()

    def __repr__(self):
        return f"{list(self)}" + ("" if self.channel == "tsp" else f" ({self.channel} channel)")


def _signature(o: dict) -> tuple:
    if o["kind"] == "all_to_all":  # rows per rank differ by design; _split_mismatch checks them pairwise
        return o["kind"], tuple(o["shape"][1:]), o["dtype"], len(o["in_splits"])
    return o["kind"], tuple(o["shape"]), o["dtype"], o["numel"], o.get("root")


def _split_mismatch(group, at: dict) -> str | None:
    """all_to_all: what group rank a sends to group rank b (in_splits[b]) must be what b expects from a
    (out_splits[a]); NCCL would hang or corrupt otherwise."""
    for a, ra in enumerate(group):
        for b, rb in enumerate(group):
            sent, expected = at[ra].op["in_splits"][b], at[rb].op["out_splits"][a]
            if sent != expected:
                return (f"all_to_all split sizes differ: rank {ra} sends {sent} rows to rank {rb}, which expects "
                        f"{expected}:\n  {at[ra].describe()}\n  {at[rb].describe()}")
    return None


def _queues(ops_by_rank) -> dict[tuple, deque]:
    ranks = ops_by_rank.items() if isinstance(ops_by_rank, dict) else enumerate(ops_by_rank)
    queues: dict[tuple, deque] = defaultdict(deque)
    seq: Counter = Counter()
    for rank, ops in ranks:
        for index, o in enumerate(ops):
            group = _Comm(o)
            if rank not in group:
                raise ValueError(f"rank {rank} posts op #{index} ({o['kind']}) on group {list(group)} without "
                                 "being a member")
            e = _Entry(rank, index, len(queues[rank, group]), o)
            for d, peer, *numel in o.get("p2p", ()):
                channel = (rank, peer, group) if d == "send" else (peer, rank, group)  # (src, dst, group)
                e.links.append((d, peer, seq[d, channel], numel[0] if numel else o["numel"], o["dtype"]))
                seq[d, channel] += 1
            queues[rank, group].append(e)
    return queues


def _collective_mismatches(queues: dict[tuple, deque]) -> list[str]:
    """The first position where the members of a group post different collectives (or one posts fewer)."""
    out = []
    groups = sorted({g for _, g in queues})
    for g in groups:
        seqs = {r: [e for e in queues.get((r, g), ()) if e.op["kind"] != "p2p"] for r in g}
        for i in range(max(len(s) for s in seqs.values())):
            at = {r: s[i] if i < len(s) else None for r, s in seqs.items()}
            sigs = {None if e is None else _signature(e.op) for e in at.values()}
            if len(sigs) > 1:
                lines = "\n  ".join(f"rank {r}: " + (e.describe() if e else "posts no such collective")
                                    for r, e in at.items())
                out.append(f"collective #{i} of group {list(g)} differs between ranks:\n  {lines}")
                break
            first = next(iter(at.values()))
            if first.op["kind"] == "all_to_all" and (bad := _split_mismatch(g, at)):
                out.append(f"collective #{i} of group {list(g)}: {bad}")
                break
    return out


def _launch_order_mismatches(queues: dict[tuple, deque]) -> list[str]:
    """Communicators over the same ranks (the weight channel beside the TSP group) run on separate streams, and NCCL
    kernels of different communicators can only make progress together when every rank launches them in one order:
    the first position where the members interleave the channels differently."""
    out = []
    by_ranks: dict[tuple, set] = defaultdict(set)
    for _, comm in queues:
        by_ranks[tuple(comm)].add(comm)
    for ranks, comms in sorted(by_ranks.items()):
        if len(comms) < 2:
            continue
        seqs = {r: sorted((e for c in comms for e in queues.get((r, c), ())), key=lambda e: e.index) for r in ranks}
        for i in range(max(len(s) for s in seqs.values())):
            at = {r: s[i] if i < len(s) else None for r, s in seqs.items()}
            if len({None if e is None else (_Comm(e.op).channel, e.op["kind"]) for e in at.values()}) > 1:
                lines = "\n  ".join(f"rank {r}: " + (e.describe() + f" [{_Comm(e.op).channel}]" if e else "nothing")
                                    for r, e in at.items())
                out.append(f"launch #{i} over ranks {list(ranks)} interleaves the channels differently:\n  {lines}")
                break
    return out


class _Replay:
    def __init__(self, queues: dict[tuple, deque], eager_bytes: int):
        self.queues, self.eager_bytes = queues, eager_bytes
        self.collective_seq = {k: 0 for k in queues}  # collectives done per queue
        self.delivered: set = set()  # (src, dst, group, seq) of eager sends that completed
        self.errors: list[str] = []
        self.completed = 0

    def head(self, rank: int, group: tuple) -> _Entry | None:
        q = self.queues.get((rank, group))
        return q[0] if q else None

    def pop(self, entries) -> None:
        for e in entries:
            self.queues[e.rank, _Comm(e.op)].popleft()
            self.completed += 1

    def try_collective(self, e: _Entry) -> bool:
        group = _Comm(e.op)
        heads = [self.head(r, group) for r in group]
        if any(h is None or h.op["kind"] == "p2p" for h in heads):
            return False
        self.pop(heads)  # a differing signature was reported before the replay; NCCL would hang or corrupt
        return True

    def try_p2p(self, e: _Entry) -> bool:
        o = e.op
        if not o.get("batched") and len(e.links) == 1 and e.links[0][0] == "send" and o["nbytes"] <= self.eager_bytes:
            _, peer, seq, _, _ = e.links[0]
            self.delivered.add((e.rank, peer, _Comm(o), seq))
            self.pop([e])
            return True
        closure, todo = {id(e): e}, [e]
        while todo:  # every batch tied in through a peer op must run now too
            cur = todo.pop()
            group = _Comm(cur.op)
            for d, peer, seq, numel, dtype in cur.links:
                if d == "recv" and (peer, cur.rank, group, seq) in self.delivered:
                    continue
                other = self.head(peer, group)
                want = ("recv" if d == "send" else "send", cur.rank, seq)
                match = None if other is None else next((lk for lk in other.links if lk[:3] == want), None)
                if match is None:
                    return False
                if (match[3], match[4]) != (numel, dtype):
                    self.errors.append(f"p2p sizes differ: {cur.describe()} ({numel} x {dtype}) meets "
                                       f"{other.describe()} ({match[3]} x {match[4]})")
                if id(other) not in closure:
                    closure[id(other)] = other
                    todo.append(other)
        self.pop(closure.values())
        return True

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for key in sorted(self.queues):
                e = self.queues[key][0] if self.queues[key] else None
                if e is not None and (self.try_p2p(e) if e.op["kind"] == "p2p" else self.try_collective(e)):
                    progress = True

    def stuck(self) -> str | None:
        heads = [q[0] for _, q in sorted(self.queues.items()) if q]
        if not heads:
            return None
        left = sum(len(q) for q in self.queues.values())
        lines = "\n  ".join(f"{h.describe()}: {self.waiting_for(h)}" for h in heads[:12])
        return (f"deadlock: {left} ops can never run; first blocked: {heads[0].describe()}\n"
                f"  every queue head:\n  {lines}")

    def waiting_for(self, e: _Entry) -> str:
        group = _Comm(e.op)
        if e.op["kind"] != "p2p":
            late = [r for r in group if (h := self.head(r, group)) is None or h.op["kind"] == "p2p"]
            return f"waits for ranks {late} to reach it"
        for d, peer, seq, *_ in e.links:
            other = self.head(peer, group)
            want = ("recv" if d == "send" else "send", e.rank, seq)
            if other is None or not any(lk[:3] == want for lk in other.links):
                return (f"its {d} #{seq} {'to' if d == 'send' else 'from'} rank {peer} is not at the head of "
                        f"rank {peer}'s queue" + (f" (head: {other.describe()})" if other else " (queue empty)"))
        return "a peer batch it is tied to waits for another rank"


def check(ops_by_rank, eager_bytes: int = 0) -> Report:
    """ops_by_rank: every rank's recorded ops (a list indexed by global rank, or {rank: ops})."""
    queues = _queues(ops_by_rank)
    report = Report(total=sum(len(q) for q in queues.values()))
    report.mismatches += _collective_mismatches(queues)
    report.mismatches += _launch_order_mismatches(queues)
    replay = _Replay(queues, eager_bytes)
    replay.run()
    report.mismatches += replay.errors
    report.completed = replay.completed
    report.deadlock = replay.stuck()
    return report


def unbatched(ops: list[dict]) -> list[dict]:
    """The same ops with every batch posted as bare isend / irecv in batch order (what ring_exchange once did)."""
    out = []
    for o in ops:
        if o["kind"] == "p2p" and o.get("batched"):
            out += [{**o, "p2p": (one,), "batched": False} for one in o["p2p"]]
        else:
            out.append(o)
    return out
