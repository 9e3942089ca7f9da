"""Attention across the context-parallel (cp) axis by all-to-all (tsp.cp_comm "all_to_all", Ulysses-style).

The sequence is split over C TSP groups as for the ring (ds_tsp.core.layers.attention.cp_ring's module doc): TSP rank
p of cp group i holds TSP zigzag chunks p and 2D-1-p of cp chunks i and 2C-1-i, L = 2c tokens. The cp communicator
joins TSP rank p of every group. Instead of passing K/V around it, per head block this schedule scatters the
block's heads over the C cp ranks:

1. K/V (once per kv group): each rank sends its OWN tokens' K/V (local_kv, L tokens) to every cp peer, each the kv
   heads that peer's query heads read (one all-to-all on comm.cp); every rank then holds C L tokens (TSP rank p's
   chunks of every group) of its kv heads, and one all-gather over the TSP group (the fast link; every TSP rank of
   a group has the same cp rank, so the same heads) gives the whole sequence's K/V of those heads, reordered into
   global order (`_global_order`: views plus one cat).
2. q (per block, posted a block ahead: Pipelining below): each rank sends each peer that peer's nq / C query heads
   of its own tokens (one all-to-all);
   every rank then attends the 2C query chunks it holds (global positions known: `query_chunks`) to the whole
   sequence's keys with the kernels TSP uses alone (masked: causal, packed documents and sliding windows exact at
   global positions; no ring merge, no window path).
3. out and its log-sum-exp go back by the inverse all-to-all, so the caller (tsp_attention: gate, sinks, wo) sees
   its usual [B, L, nq, d] and per-chunk lse.

Backward: q, out and dout go out again (one all-to-all; lse beside them), the kernels' backward runs per chunk, dq
comes back by the inverse all-to-all; the whole-sequence dK/dV of the kv group (summed over its blocks) are put
back in rank order, reduce-scattered over the TSP group and returned to their tokens' owners by the inverse K/V
all-to-all, where the replicas of a kv head are summed (A2AKVGrad).

Pipelining (tsp_attention's head-block loop; one in-order stream per communicator, so what is posted first on cp
arrives first). Forward: block j+1's q is projected and its all-to-all posted (post_queries) before block j's
attention (a2a_attention_forward waits block j's, attends, posts its out and lse back: SentOutputs), and block j's
output is waited, for its wo, after block j+1's attention. Backward alike: block j+1's dout (through wo, the gate
and the sinks) and q / out / dout / lse all-to-alls posted (post_grad_inputs) before block j's attention backward,
block j's dq (SentDq) waited after block j+1's; a kv group's dK/dV all-to-all is posted once its TSP reduce-scatter
is in (after the next block's attention backward) and waited after the block after that. The K/V all-to-all of
the next kv group is posted a block ahead (A2AKVGather, with the ring's and TSP's gathers). Exposed per layer and
pass: the pipeline's fill and drain only (block 0's q and the first K/V, the last block's output or dq, the last
group's dK/dV). In flight beside the block computing: one block ahead (its q, or q / out / dout, sent and received)
and one behind (its output and lse, or dq, on the way back), plus a second kv group's dK/dV: a few [B, L, nq, d]
of one block, never more.

Heads (`HeadSplit`): the block's nq query heads must split evenly over C. Its nkv kv heads either split too (nkv a
multiple of C: each peer gets nkv / C of them, GQA groups intact) or are replicated (C a multiple of nkv, GQA and
MQA with few kv heads per block: each peer's query heads all read one kv head, which is sent to each of the
C / nkv peers that read it; its grads are summed on the way back). Anything else is refused by name (TSPConfigError
at model build): a ragged split would need per-peer head counts, and the ring handles those shapes.

Inter-node bytes per head block and rank (the cp communicator's counter): (C-1)/C of the rank's own q, out (and
its lse) forward; backward (C-1)/C of q, out, dout, lse and dq; per kv group (C-1)/C x r of its local K/V
forward and the same of dK/dV back (r = the replication factor, C / nkv or 1), again in backward for the re-gather
(none with keep_gathered_kv). Independent of D in total per node: each token's K/V crosses the inter-node link
r (C-1)/C times, not D (C-1) times as on the ring.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import Handle, TSPComm
from ds_tsp.core.comm.kv_gather import kv_prefix
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.masked import masked_attention_backward_pieces, masked_attention_forward
from ds_tsp.core.tokens.documents import DocumentLayout
from ds_tsp.core.tokens.zigzag import zigzag_chunks

__all__ = ["HeadSplit", "A2AKVGather", "A2AKVGrad", "a2a_attention_forward", "a2a_attention_backward",
           "check_all_to_all_heads", "post_queries", "post_grad_inputs", "SentQueries", "SentOutputs",
           "SentGradInputs", "SentDq"]


class HeadSplit:
    """Which of a head block's heads cp rank c attends: query heads [c nq', (c+1) nq'), kv heads
    [kv_start(c), kv_start(c) + nkv'); `replicas` peers read each kv head (1 when the kv heads split)."""

    def __init__(self, heads: int, kv_heads: int, cp: int):
        check_all_to_all_heads(heads, kv_heads, cp)
        self.cp, self.heads, self.kv_heads = cp, heads // cp, max(kv_heads // cp, 1)
        self.replicas = cp // kv_heads if kv_heads < cp else 1

    def kv_start(self, c: int) -> int:
        return (c // self.replicas) * self.kv_heads


def check_all_to_all_heads(heads: int, kv_heads: int, cp: int, where: str = "") -> None:
    """TSPConfigError unless a head block of `heads` query and `kv_heads` kv heads splits evenly over cp ranks."""
    if heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0):
        return
    raise TSPConfigError(
        f"tsp.cp_comm='all_to_all' with tsp.cp_size={cp}{where}: a head block of {heads} query heads and {kv_heads} "
        f"kv heads (num_heads / tsp.size, num_kv_heads / tsp.size) does not split evenly over {cp} cp groups (the "
        "query heads must be a multiple of cp_size, and the kv heads a multiple or a divisor of it); set "
        "tsp.cp_comm to 'ring', or a cp_size that divides the block's heads")


def query_chunks(cp: int, tsp: int, tsp_rank: int) -> list[tuple[int, int, int]]:
    """(source cp group i, half, global start in units of c) of the 2C query chunks a rank holds after the q
    all-to-all: TSP rank p's chunks of every cp group."""
    first, second = zigzag_chunks(tsp, tsp_rank)
    out = []
    for i in range(cp):
        out.append((i, 0, i * tsp + first))
        out.append((i, 1, (2 * cp - 1 - i) * tsp + (second - tsp)))
    return out


def _to_peers(t: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, L, H, d] -> [C, B, L, H/C, d]: row c holds peer c's heads (a copy, contiguous for the all-to-all)."""
    B, L, H, d = t.shape
    return t.view(B, L, cp, H // cp, d).permute(2, 0, 1, 3, 4).contiguous()


def _from_peers(t: torch.Tensor) -> torch.Tensor:
    """[C, B, L, H', d] (row c: heads of peer c) -> [B, L, C H', d]."""
    C, B, L, H, d = t.shape
    return t.permute(1, 2, 0, 3, 4).reshape(B, L, C * H, d)


class _Exchange:
    """One all-to-all posted on the cp communicator: row c of `send` to cp rank c; wait() gives the rows received
    (row i from cp rank i). The send buffer lives until then (the handle keeps it)."""

    def __init__(self, cp: TSPComm, send: torch.Tensor, what: str):
        self.recv = torch.empty_like(send)
        rows = [1] * cp.size
        self.handle = cp.all_to_all(self.recv, send, rows, rows, what=what)

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        recv, self.recv = self.recv, None
        return recv


def _exchange(cp: TSPComm, send: torch.Tensor, what: str) -> torch.Tensor:
    """One all-to-all on the cp communicator, waited at once."""
    return _Exchange(cp, send, what).wait()


def _global_order(gathered: torch.Tensor) -> torch.Tensor:
    """[D, C, 2, c, ...] (TSP rank p's zigzag halves of cp group i) -> [2 C D c, ...] in global token order.

    Global chunk (units of c) of group i's TSP chunk k: i D + k for k < D, (2C-1-i) D + k - D after; rank p holds
    k = p (half 0) and k = 2D-1-p (half 1). So the first half of the sequence is groups 0..C-1, ranks 0..D-1, half
    0; the second half groups C-1..0, ranks D-1..0, half 1."""
    D, C = gathered.shape[:2]
    first = gathered[:, :, 0].transpose(0, 1)  # [C, D, c, ...]
    second = gathered[:, :, 1].transpose(0, 1).flip((0, 1))
    rest = gathered.shape[3:]
    return torch.cat((first.reshape(-1, *rest[1:]), second.reshape(-1, *rest[1:])))


def _rank_order(full: torch.Tensor, tsp: int, cp: int) -> torch.Tensor:
    """Inverse of _global_order: [2 C D c, ...] -> [D, C, 2, c, ...] (a copy, contiguous for the reduce-scatter)."""
    halves = full.view(2, cp, tsp, full.shape[0] // (2 * cp * tsp), *full.shape[1:])
    first = halves[0].transpose(0, 1)
    second = halves[1].flip((0, 1)).transpose(0, 1)
    return torch.stack((first, second), dim=2)


class A2AKVGather:
    """The whole sequence's K/V of this rank's kv heads (HeadSplit) for one kv group, in global order: the cp
    all-to-all of the local K/V is posted at construction (it overlaps what runs until wait()); wait() waits it,
    all-gathers over the TSP group and returns [S_pad, B, 2, nkv', d]."""

    def __init__(self, comm: TSPComm, kv_chunks: torch.Tensor, heads: HeadSplit, what: str = "K/V"):
        self.comm, self.cp, self.what = comm, comm.cp_axis(), what
        n = heads.kv_heads
        self.send = torch.stack([kv_chunks[..., heads.kv_start(c):heads.kv_start(c) + n, :]
                                 for c in range(self.cp.size)])  # [C, 2, c, B, 2, nkv', d]
        self.recv = torch.empty_like(self.send)
        rows = [1] * self.cp.size
        self.handle = self.cp.all_to_all(self.recv, self.send, rows, rows, what=f"{what} cp all-to-all")

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        D = self.comm.size
        gathered = self.recv.new_empty((D, *self.recv.shape))
        self.comm.all_gather(gathered, self.recv, what=f"{self.what} gather of the cp heads").wait()
        self.send = self.recv = None
        return _global_order(gathered)


class _ScatterBack:
    """Handle of A2AKVGrad.scatter: post() waits the TSP reduce-scatter and posts the inverse cp all-to-all; wait()
    (posting first if post() was not called) waits that and writes this rank's dK/dV of all its kv heads into
    `out` (the replicas of a kv head summed)."""

    def __init__(self, scatter: Handle, part: torch.Tensor, out: torch.Tensor, cp: TSPComm, heads: HeadSplit):
        self.scatter, self.part, self.out, self.cp, self.heads = scatter, part, out, cp, heads
        self.sent: _Exchange | None = None
        self.done = False

    def post(self) -> None:
        if self.sent is not None or self.done:
            return
        self.scatter.wait()
        self.sent, self.part = _Exchange(self.cp, self.part, "dK/dV cp all-to-all"), None

    def wait(self) -> None:
        if self.done:
            return
        self.post()
        recv = self.sent.wait()  # [C (head holder), 2, c, B, 2, nkv', d]
        r, C = self.heads.replicas, self.cp.size
        summed = recv.view(C // r, r, *recv.shape[1:]).sum(1)  # [kv head blocks, 2, c, B, 2, nkv', d]
        self.out.copy_(summed.permute(1, 2, 3, 4, 0, 5, 6).reshape(self.out.shape))
        self.sent, self.done = None, True


class A2AKVGrad:
    """dK/dV of one kv group over the whole sequence (this rank's kv heads), in global order; add() takes the
    kernels' key-prefix grads, scatter() sends them back to their tokens' owners (the interface of
    kv_gather.RankOrderedKVGrad)."""

    def __init__(self, kv_full: torch.Tensor, comm: TSPComm, heads: HeadSplit, kv_heads: int):
        self.comm, self.heads, self.kv_heads, self.dtype = comm, heads, kv_heads, kv_full.dtype
        # summed over the 2C query chunks and the group's blocks: float32 under half precision
        self.buffer = torch.zeros_like(kv_full, dtype=kernels.accumulation_dtype(kv_full.dtype))

    def add(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """dk, dv [B, end, nkv', d]: grads of the keys 0 .. end-1."""
        self.take(0, dk, dv)

    def take(self, start: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """dk, dv [B, n, nkv', d]: grads of the keys start .. start+n-1 (a take_kv of
        kernels.attention_backward_pieces: each kernel call's as it returns)."""
        end = start + dk.shape[1]
        self.buffer[start:end, :, 0] += dk.transpose(0, 1)
        self.buffer[start:end, :, 1] += dv.transpose(0, 1)

    def scatter(self, comm: TSPComm) -> tuple[torch.Tensor, _ScatterBack]:
        """Post the reduce-scatter over the TSP group: returns (this rank's [2, c, B, 2, nkv, d], filled by the
        handle's wait())."""
        cp = comm.cp_axis()
        ordered = _rank_order(self.buffer.to(self.dtype), comm.size, cp.size)  # [D, C, 2, c, B, 2, nkv', d]
        self.buffer = None
        part = ordered.new_empty(ordered.shape[1:])
        handle = comm.reduce_scatter(part, ordered, what="dK/dV scatter of the cp heads")
        two, c, B, _, _, d = ordered.shape[2:]
        out = part.new_empty((two, c, B, 2, self.kv_heads, d))
        return out, _ScatterBack(handle, part, out, cp, self.heads)


class SentQueries:
    """A block's q on its way to the cp ranks (posted by post_queries, a block ahead of its attention)."""

    def __init__(self, q: torch.Tensor, comm: TSPComm):
        self.exchange = _Exchange(comm.cp_axis(), _to_peers(q, comm.cp_size), "q cp all-to-all")


def post_queries(q: torch.Tensor, comm: TSPComm) -> SentQueries:
    """Post the all-to-all of q [B, L, nq, d]: each cp peer gets its nq / C heads of this rank's tokens."""
    return SentQueries(q, comm)


class SentOutputs:
    """A block's attention output and lse on their way back (posted by a2a_attention_forward); wait() gives what
    the caller's wo reads: (out [B, L, nq, d], [lse of chunk 1, lse of chunk 2])."""

    def __init__(self, cp: TSPComm, out: torch.Tensor, lse: torch.Tensor):
        self.out = _Exchange(cp, out, "attention output cp all-to-all")
        self.lse = _Exchange(cp, lse, "log-sum-exp cp all-to-all")

    def wait(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = _from_peers(self.out.wait())
        B, L = out.shape[:2]
        lse = self.lse.wait().transpose(0, 1).reshape(B, -1, L)
        return out, [lse[..., :L // 2], lse[..., L // 2:]]


def a2a_attention_forward(sent: SentQueries, kv_full: torch.Tensor, comm: TSPComm, heads: HeadSplit, *,
                          doc_starts: DocumentLayout, window: int | None, scale: float, backend: str | None
                          ) -> SentOutputs:
    """Attention of this rank's queries (sent by post_queries) over the whole sequence, the heads scattered over
    the cp ranks: kv_full is A2AKVGather's. Waits the q all-to-all, attends, and posts the output's way back: the
    returned SentOutputs' wait() gives (out [B, L, nq, d], [lse of chunk 1, lse of chunk 2]) like
    cp_ring.cp_attention_forward."""
    cp = comm.cp_axis()
    qs = sent.exchange.wait()  # [C (source group), B, L, nq', d]
    B, L = qs.shape[1:3]
    c = L // 2
    out = torch.empty_like(qs)
    lse = None
    for i, half, g in query_chunks(cp.size, comm.size, comm.rank):
        local = slice(half * c, (half + 1) * c)
        k, v = kv_prefix(kv_full, (g + 1) * c)
        o, lse_c = masked_attention_forward(qs[i][:, local], k, v, q_start=g * c, doc_starts=doc_starts,
                                            window=window, scale=scale, backend=backend)
        if lse is None:
            lse = lse_c.new_empty((cp.size, B, heads.heads, L))
        out[i][:, local] = o
        lse[i][:, :, local] = lse_c
    return SentOutputs(cp, out, lse)


class SentGradInputs:
    """A block's q, out, dout (one all-to-all) and lse (a second) on their way to the cp ranks (posted by
    post_grad_inputs, a block ahead of its attention backward)."""

    def __init__(self, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lses: list[torch.Tensor],
                 comm: TSPComm, heads: HeadSplit):
        cp = comm.cp_axis()
        B, L = q.shape[:2]
        self.q_dtype = q.dtype
        dtype = torch.promote_types(torch.promote_types(q.dtype, out.dtype), dout.dtype)
        three = torch.stack([_to_peers(t.to(dtype), cp.size) for t in (q, out, dout)], dim=1)  # [C, 3, B, L, nq', d]
        self.three = _Exchange(cp, three, "q / out / dout cp all-to-all")
        lse = torch.cat(lses, dim=2)  # [B, nq, L]
        self.lse = _Exchange(cp, lse.view(B, cp.size, heads.heads, L).transpose(0, 1).contiguous(),
                             "log-sum-exp cp all-to-all (backward)")


def post_grad_inputs(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lses: list[torch.Tensor],
                     comm: TSPComm, heads: HeadSplit) -> SentGradInputs:
    """Post the all-to-alls a2a_attention_backward reads: q, out, dout [B, L, nq, d] and the lse per chunk."""
    return SentGradInputs(dout, q, out, lses, comm, heads)


class SentDq:
    """A block's dq on its way back to its tokens' owners (posted by a2a_attention_backward); wait() gives dq of
    the two query chunks."""

    def __init__(self, cp: TSPComm, dq: torch.Tensor, dtype: torch.dtype):
        self.exchange, self.dtype = _Exchange(cp, dq, "dq cp all-to-all"), dtype

    def wait(self) -> list[torch.Tensor]:
        dq = _from_peers(self.exchange.wait()).to(self.dtype)
        c = dq.shape[1] // 2
        return [dq[:, :c], dq[:, c:]]


def a2a_attention_backward(sent: SentGradInputs, kv_full: torch.Tensor, kv_grad: A2AKVGrad, comm: TSPComm, *,
                           doc_starts: DocumentLayout, window: int | None, scale: float, backend: str | None
                           ) -> SentDq:
    """Backward of a2a_attention_forward: waits the block's q / out / dout / lse (post_grad_inputs), adds the whole
    sequence's dK/dV of this rank's kv heads into kv_grad (A2AKVGrad, scattered back by the caller) and posts dq's
    way back (the returned SentDq's wait() gives dq of the two query chunks)."""
    cp = comm.cp_axis()
    qs, outs, douts = sent.three.wait().unbind(1)
    lse = sent.lse.wait()
    L = qs.shape[2]
    c = L // 2
    dq = torch.empty_like(qs)
    for i, half, g in query_chunks(cp.size, comm.size, comm.rank):
        local = slice(half * c, (half + 1) * c)
        k, v = kv_prefix(kv_full, (g + 1) * c)
        dq[i][:, local] = masked_attention_backward_pieces(
            douts[i][:, local], qs[i][:, local], k, v, outs[i][:, local], lse[i][:, :, local], q_start=g * c,
            doc_starts=doc_starts, window=window, scale=scale, backend=backend, take_kv=kv_grad.take)
    return SentDq(cp, dq, sent.q_dtype)
