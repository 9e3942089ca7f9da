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
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import Handle, TSPComm


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
    posted at construction; wait() returns the [S, B, 2, nkv, d] buffer."""

    def __init__(self, comm: TSPComm, kv_chunks: torch.Tensor, what: str = "K/V"):
        self.tsp = comm.size
        two, c, B, _, n, d = kv_chunks.shape
        self.chunk = c
        self.buffer = kv_chunks.new_empty((2 * self.tsp * c, B, 2, n, d))
        half = self.tsp * c
        self._handles: list[Handle] = [
            comm.all_gather(self.buffer[:half], kv_chunks[0], what=f"{what} gather, first zigzag half"),
            comm.all_gather(self.buffer[half:], kv_chunks[1], what=f"{what} gather, second zigzag half")]

    def wait(self) -> torch.Tensor:
        for handle in self._handles:
            handle.wait()
        self._handles = []
        D, c = self.tsp, self.chunk
        second = self.buffer[D * c:].view(D, c, *self.buffer.shape[1:])
        for i in range(D // 2):  # rank r's second chunk is global chunk 2D-1-r: reverse the half in place
            a, b = second[i], second[D - 1 - i]
            scratch = a.clone()
            a.copy_(b)
            b.copy_(scratch)
        return self.buffer


def _owner(g: int, tsp: int) -> tuple[int, int]:
    """(rank, zigzag half) holding global chunk g."""
    return (g, 0) if g < tsp else (2 * tsp - 1 - g, 1)


class RankOrderedKVGrad:
    """dK/dV of one kv group in rank order, [D, 2, c, B, 2, nkv, d]; add() takes the kernels' key-prefix grads."""

    def __init__(self, kv_global: torch.Tensor, tsp: int):
        S, B, _, n, d = kv_global.shape
        self.tsp, self.chunk = tsp, S // (2 * tsp)
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
        for g in range(self._written, 2 * self.tsp):  # keys after every query of this rank: no grad from here
            r, half = _owner(g, self.tsp)
            self.buffer[r, half].zero_()
        out = self.buffer.new_empty(self.buffer.shape[1:])
        return out, comm.reduce_scatter(out, self.buffer, what="dK/dV scatter")

    def add_share(self, rank: int, grad: torch.Tensor) -> None:
        """grad [2, c, B, 2, nkv, d]: more grads of rank `rank`'s two chunks (local_kv's layout), added after an
        add() that reached both (its second chunk, global 2D-1-rank, is the later)."""
        if self._written < 2 * self.tsp - rank:
            raise RuntimeError(f"RankOrderedKVGrad.add_share(rank={rank}): its chunks hold no grads yet; add() the "
                               "key prefix covering them first")
        self.buffer[rank].add_(grad)
