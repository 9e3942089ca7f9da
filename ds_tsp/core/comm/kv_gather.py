"""Gathered K/V straight into global token order, and dK/dV straight into rank order: no reorder copies.

Zigzag (ds_tsp.core.tokens.zigzag): of 2D chunks of c tokens, rank r holds chunks r and 2D-1-r. A rank's K/V are laid
out chunk-major, `[2 (zigzag half), c, B, 2 (k, v), nkv, d]` (local_kv), so:
- all-gathering every rank's FIRST half in rank order lays down global chunks 0 .. D-1, in order;
- all-gathering the SECOND halves lays down chunks 2D-1 .. D, reversed; swapping chunk pairs in place (one chunk
  of scratch) puts them in order.
The buffer, `[S, B, 2, nkv, d]` token-major, is in global order; K and V of a key prefix are strided views
`[B, end, nkv, d]` (last dim contiguous: all the fused kernels need). One buffer per kv group, plus one chunk.

Backward goes the other way: the kernels' dK/dV `[B, end, nkv, d]` are added chunk by chunk into
`[D, 2, c, B, 2, nkv, d]` (RankOrderedKVGrad), where rank r's two chunks are contiguous, as reduce-scatter takes
them: no zero-filled global buffer, no reorder copy, no cat. Chunks no query of this rank sees are zeroed alone.

Causal attention reads less than the whole sequence: rank p's last query is in global chunk 2D-1-p, so it never
reads chunks 2D-p .. 2D-1, the second halves of ranks 0 .. p-1, and sends them no dK/dV (every rank reads every
first half). With `causal=True` on CPU tensors both directions skip those pieces (TSPComm.exchange: one batch of
point-to-point ops): the second halves arrive straight into global order (no swap) in a buffer of the
(2D-p) c tokens rank p reads, and the dK/dV scatter sends rank q's second half only from ranks p < q. That is
D(D-1)/2 of the 2D(D-1) chunks each direction moved, a quarter of the K/V traffic; rank p sends D-1+p chunks in the
gather and 2D-2-p in the scatter, and receives 2D-2-p and D-1+p. On CUDA tensors NCCL's all-gather and
reduce-scatter move every chunk as before: a collective takes as long as the rank that moves the most (rank 0
receives every chunk of the gather here as well); the buffer is returned as the same prefix.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import KV_GRAD_TAG, KV_LATE_HALF_TAG, Handle, TSPComm


def local_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [B, L, nkv, d] of this rank's two zigzag chunks -> [2, c, B, 2, nkv, d] (one copy)."""
    B, L, n, d = k.shape
    out = k.new_empty((2, L // 2, B, 2, n, d))
    for slot, t in enumerate((k, v)):
        out[:, :, :, slot].copy_(t.view(B, 2, L // 2, n, d).permute(1, 2, 0, 3, 4))
    return out


def local_from_chunks(kv_chunks: torch.Tensor, slot: int) -> torch.Tensor:
    """[2, c, B, 2, nkv, d] -> k (slot 0) or v (slot 1) as [B, L, nkv, d] (a copy: GEMMs read it row-major)."""
    two, c, B, _, n, d = kv_chunks.shape
    return kv_chunks[:, :, :, slot].permute(2, 0, 1, 3, 4).reshape(B, two * c, n, d)


def kv_prefix(kv_global: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views k, v [B, end, nkv, d] of the first `end` tokens of a [S, B, 2, nkv, d] global-order buffer."""
    keys = kv_global[:end]
    return keys[:, :, 0].transpose(0, 1), keys[:, :, 1].transpose(0, 1)


class GlobalKVGather:
    """All-gather of every rank's local_kv into one global-order buffer: two collectives (one per zigzag half)
    posted at construction; wait() returns the [S, B, 2, nkv, d] buffer. causal: only the keys this rank's queries
    read arrive, wait() returns the [(2D-p) c, B, 2, nkv, d] prefix (module doc; what moves less on CPU tensors)."""

    def __init__(self, comm: TSPComm, kv_chunks: torch.Tensor, what: str = "K/V", causal: bool = False):
        D, p = comm.size, comm.rank
        self.tsp = D
        two, c, B, _, n, d = kv_chunks.shape
        self.chunk = c
        self.reads = (2 * D - p) * c if causal else 2 * D * c  # the keys this rank's queries read
        self.in_order = causal and kv_chunks.device.type == "cpu" and D > 1  # second halves straight into order
        half = D * c
        self.buffer = kv_chunks.new_empty((self.reads if self.in_order else 2 * half, B, 2, n, d))
        first = comm.all_gather(self.buffer[:half], kv_chunks[0], what=f"{what} gather, first zigzag half")
        if not self.in_order:
            second = comm.all_gather(self.buffer[half:], kv_chunks[1], what=f"{what} gather, second zigzag half")
        else:  # rank q's second half is global chunk 2D-1-q, read by ranks 0 .. q
            self.buffer[(2 * D - 1 - p) * c:(2 * D - p) * c].copy_(kv_chunks[1])
            second = comm.exchange(
                sends=[(q, kv_chunks[1]) for q in range(p)],
                recvs=[(q, self.buffer[(2 * D - 1 - q) * c:(2 * D - q) * c]) for q in range(p + 1, D)],
                kind="all_gather", tag=KV_LATE_HALF_TAG, about=kv_chunks[1],
                what=f"{what} gather, second zigzag half")
        self._handles: list[Handle] = [first, second]

    def wait(self) -> torch.Tensor:
        for handle in self._handles:
            handle.wait()
        if not self._handles or self.in_order:
            self._handles = []
            return self.buffer[:self.reads]
        self._handles = []
        D, c = self.tsp, self.chunk
        second = self.buffer[D * c:].view(D, c, *self.buffer.shape[1:])
        for i in range(D // 2):  # rank r's second chunk is global chunk 2D-1-r: reverse the half in place
            a, b = second[i], second[D - 1 - i]
            scratch = a.clone()
            a.copy_(b)
            b.copy_(scratch)
        return self.buffer[:self.reads]


def _owner(g: int, tsp: int) -> tuple[int, int]:
    """(rank, zigzag half) holding global chunk g."""
    return (g, 0) if g < tsp else (2 * tsp - 1 - g, 1)


class RankOrderedKVGrad:
    """dK/dV of one kv group in rank order, [D, 2, c, B, 2, nkv, d]; add() takes the kernels' key-prefix grads."""

    def __init__(self, kv_global: torch.Tensor, tsp: int, chunk: int | None = None, causal: bool = False):
        """kv_global: the gathered K/V (GlobalKVGather.wait(): the whole sequence, or with causal its prefix, so
        give `chunk` then); causal: scatter() sends no rank the dK/dV of keys none of its own queries read."""
        S, B, _, n, d = kv_global.shape
        self.tsp, self.chunk, self.causal = tsp, chunk if chunk is not None else S // (2 * tsp), causal
        self.buffer = kv_global.new_empty((tsp, 2, self.chunk, B, 2, n, d))
        self._written = 0  # global chunks 0 .. _written-1 hold a value; the rest are uninitialised

    def add(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """dk, dv [B, end, nkv, d]: grads of the keys 0 .. end-1 (end a multiple of the chunk length)."""
        self.take(0, dk, dv)

    def take(self, start: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """dk, dv [B, n, nkv, d]: grads of the keys start .. start+n-1, both multiples of the chunk length, and no
        key after the ones added so far (the kernels hand their key blocks over in order: a take_kv of
        kernels.attention_backward_pieces)."""
        c = self.chunk
        if start % c or dk.shape[1] % c or start > self._written * c:
            raise ValueError(f"RankOrderedKVGrad.take(start={start}, {dk.shape[1]} keys): whole chunks of {c} keys "
                             f"from at most key {self._written * c} (the keys added so far)")
        first = start // c
        for g in range(first, first + dk.shape[1] // c):
            r, half = _owner(g, self.tsp)
            dst = self.buffer[r, half]
            for slot, grad in enumerate((dk, dv)):
                src = grad[:, (g - first) * c:(g - first + 1) * c].transpose(0, 1)
                if g < self._written:
                    dst[:, :, slot].add_(src)
                else:
                    dst[:, :, slot].copy_(src)
        self._written = max(self._written, first + dk.shape[1] // c)

    def scatter(self, comm: TSPComm) -> tuple[torch.Tensor, Handle]:
        """Post the reduce-scatter: returns (this rank's summed [2, c, B, 2, nkv, d], handle)."""
        if self.causal and self.buffer.device.type == "cpu" and comm.size > 1:
            return self._scatter_read_chunks(comm)
        for g in range(self._written, 2 * self.tsp):  # keys after every query of this rank: no grad from here
            r, half = _owner(g, self.tsp)
            self.buffer[r, half].zero_()
        out = self.buffer.new_empty(self.buffer.shape[1:])
        return out, comm.reduce_scatter(out, self.buffer, what="dK/dV scatter")

    def _scatter_read_chunks(self, comm: TSPComm) -> tuple[torch.Tensor, Handle]:
        """The causal reduce-scatter (module doc): rank q's first half gets every rank's grads, its second half
        (global chunk 2D-1-q) those of ranks p < q only. The first piece received lands in `out` itself, the
        others in buffers the size of what they are; the sum (own piece first, then rank order) runs at wait()."""
        D, p = self.tsp, comm.rank
        if self._written < 2 * D - p:
            raise RuntimeError(f"RankOrderedKVGrad: rank {p} scattered before its keys up to global chunk "
                               f"{2 * D - p - 1} were added")
        out = self.buffer.new_empty(self.buffer.shape[1:])
        sends = [(q, self.buffer[q] if q > p else self.buffer[q, 0]) for q in range(D) if q != p]
        # from ranks q < p both halves ([2, c, ...]), from q > p the first half only
        both, first_only = list(range(p)), list(range(p + 1, D))
        if both:  # the first into out itself
            into_both = [out, *out.new_empty((len(both) - 1, *out.shape))]
            into_first = list(out.new_empty((len(first_only), *out.shape[1:])))
        else:  # rank 0: nothing for its second half; the first of the first halves into out[0]
            into_both = []
            into_first = [out[0], *out.new_empty((len(first_only) - 1, *out.shape[1:]))]
        own = self.buffer[p]

        def add_pieces():
            if both:
                out.add_(own)
                for piece in into_both[1:]:
                    out.add_(piece)
                extra_first = into_first
            else:
                out[0].add_(own[0])
                out[1].copy_(own[1])
                extra_first = into_first[1:]
            for piece in extra_first:
                out[0].add_(piece)

        return out, comm.exchange(sends, list(zip(both, into_both)) + list(zip(first_only, into_first)),
                                  kind="reduce_scatter", tag=KV_GRAD_TAG, about=out, what="dK/dV scatter",
                                  finish=add_pieces)

    def add_share(self, rank: int, grad: torch.Tensor) -> None:
        """grad [2, c, B, 2, nkv, d]: more grads of rank `rank`'s two chunks (local_kv's layout), added after an
        add() that reached both (its second chunk, global 2D-1-rank, is the later)."""
        if self._written < 2 * self.tsp - rank:
            raise RuntimeError(f"RankOrderedKVGrad.add_share(rank={rank}): its chunks hold no grads yet; add() the "
                               "key prefix covering them first")
        self.buffer[rank].add_(grad)
