"""What one attention layer costs across nodes under each cp schedule, and tsp.cp_comm "auto"'s choice.

Both schedules move only the cp communicator's bytes across nodes (the TSP group's traffic stays inside a node), so
the choice weighs one rank's cp bytes per attention layer, forward + backward, counted exactly as the cp
communicator's CommCounter counts them (ds-tsp plan's cp figures are these x the attention layers, plus the input
check's fixed gather, which both schedules pay alike):

- ring (cp_ring): D (C-1) hops of this rank's 1/D share of a head block's K/V of the group's S/C tokens forward,
  the same K/V again and their dK/dV (float32 accumulators under bf16 / fp16) backward, the forward's hops again
  under activation checkpointing;
- all_to_all (cp_all_to_all): (C-1)/C of each all-to-all's input: per kv group the local K/V (x the kv replication
  r), per head block q, out and the lse forward; backward the K/V re-gather (not with keep_gathered_kv), q, out,
  dout, the lse, dq and dK/dV; the forward again under activation checkpointing.

The cost "auto" minimises is the EXPOSED inter-node time per layer at the plan's hardware defaults (INTER_NODE_GBPS
per GPU, GPU_TFLOPS of attention; ds-tsp plan uses the same): the ring's hops run behind the attention of the block
before them (D (C-1) hops of c = S/(2CD) queries x S/C keys x nq_b heads, 4 c (S/C) nq_b d FLOPs each forward, 2.5x
that backward, once more recomputed), so only its transfer time beyond that attention shows; the all-to-alls are
pipelined one block ahead (cp_all_to_all), so per pass their fill and drain show in full and the rest only where it
outlasts D-1 of the D blocks' attention (ds-tsp plan's cp_all_to_all_exposed_seconds_per_step alike). Ties take
the ring. Bytes grow with
B S for both schedules and the ring's cover with B S^2, so the batch cancels and the answer depends on the sequence
length: "auto" is resolved per forward from the batch's shape (the same on every rank, shapes and config only),
and `ring_from_seq` gives the length from which the ring is chosen (the model logs it once at build).

Layers the all-to-all cannot split (check_all_to_all_heads) take the ring, and so do sliding-window layers: their
ring sends only the keys a window reaches (cp_window), a fraction of the full ring these figures count.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.errors import TSPConfigError

SCHEDULES = ("ring", "all_to_all")
CP_COMMS = ("auto",) + SCHEDULES  # tsp.cp_comm's values
INTER_NODE_GBPS = 400.0  # per GPU (one 400 Gb/s NIC per H100/H200, e.g. ConnectX-7 / InfiniBand NDR)
GPU_TFLOPS = 400.0  # dense attention throughput of one GPU (bf16 flash attention on an H100/H200)
ATTENTION_BACKWARD_FLOPS = 2.5  # flash backward: 5 matmuls of the forward's 2


@dataclass(frozen=True)
class CPLayerShape:
    """What an attention layer's cp traffic depends on besides the batch: its head block (query heads, kv heads
    and head_dim per TSP rank; kv_replicas consecutive blocks read one kv head), the TSP degree D, the cp degree C,
    the bytes of an element sent, and the schedule options that change the bytes."""

    heads_per_block: int
    kv_heads_per_block: int
    kv_replicas: int
    head_dim: int
    tsp: int
    cp: int
    dtype_bytes: int
    activation_checkpointing: bool = False
    keep_gathered_kv: bool = False

    def splits_over_cp(self) -> bool:
        """The all-to-all can scatter the block's heads over cp (cp_all_to_all.check_all_to_all_heads)."""
        nq, nkv, C = self.heads_per_block, self.kv_heads_per_block, self.cp
        return nq % C == 0 and (nkv % C == 0 or C % nkv == 0)


def _gather(full: int, n: int) -> int:
    """What one rank sends of an all-to-all / all-gather of `full` bytes over n ranks."""
    return full * (n - 1) // n if n > 1 else 0


def ring_bytes_per_layer(s: CPLayerShape, seq: int, batch: int = 1) -> int:
    """One rank's cp-ring bytes per layer, forward + backward (seq: the padded sequence, a multiple of 2CD)."""
    D, C, b = s.tsp, s.cp, s.dtype_bytes
    if C == 1:
        return 0
    kv_block = batch * (seq // C) * 2 * s.kv_heads_per_block * s.head_dim * b  # a head block's K/V of a group
    share, grad_share = kv_block // D, kv_block // b * max(b, 4) // D
    hops = D * (C - 1)
    fwd = hops * share
    return fwd * (2 if s.activation_checkpointing else 1) + hops * (share + grad_share)


def _all_to_all_calls(s: CPLayerShape, seq: int, batch: int) -> tuple[tuple, tuple]:
    """(forward, backward) of one layer's cp all-to-alls as (bytes one rank sends per call, calls, calls of them
    that wait in full: the pipeline's fill and drain) per exchange; the heads must split over cp."""
    D, C, b, d = s.tsp, s.cp, s.dtype_bytes, s.head_dim
    nq, nkv = s.heads_per_block // C, max(s.kv_heads_per_block // C, 1)
    L, groups = seq // (C * D), D // s.kv_replicas  # L: tokens per rank
    kv = _gather(C * batch * L * 2 * nkv * d * b, C)  # the K/V all-to-all's input [C, 2, c, B, 2, nkv', d]
    q = _gather(C * batch * L * nq * d * b, C)  # one [C, B, L, nq', d] all-to-all (q, out or dq)
    q3 = _gather(3 * C * batch * L * nq * d * b, C)  # backward's q, out and dout in one
    lse = _gather(C * batch * nq * L * (8 if b == 8 else 4), C)  # the kernels' lse: float32 (float64 in float64)
    regather = 0 if s.keep_gathered_kv else groups
    forward = ((kv, groups, 1), (q, 2 * D, 2), (lse, D, 1))
    backward = ((kv, regather, 1), (q3, D, 1), (lse, D, 1), (q, D, 1), (kv, groups, 1))
    return forward, backward


def all_to_all_bytes_per_layer(s: CPLayerShape, seq: int, batch: int = 1) -> int | None:
    """One rank's cp all-to-all bytes per layer, forward + backward; None where the heads do not split over cp."""
    if s.cp == 1:
        return 0
    if not s.splits_over_cp():
        return None
    forward, backward = _all_to_all_calls(s, seq, batch)
    fwd, bwd = (sum(size * calls for size, calls, _ in terms) for terms in (forward, backward))
    return fwd * (2 if s.activation_checkpointing else 1) + bwd


def all_to_all_exposed_seconds_per_layer(s: CPLayerShape, seq: int, batch: int = 1, *,
                                         inter_node_gbps: float = INTER_NODE_GBPS,
                                         gpu_tflops: float = GPU_TFLOPS) -> float | None:
    """One rank's cp all-to-all seconds per layer not hidden behind attention (forward + backward, the forward
    again under activation checkpointing); None where the heads do not split over cp. Per pass, each exchange's
    first call (the q + out exchange's first two: the pipeline's fill and drain) waits in full; the others travel
    behind the blocks' attention and show only where they outlast D-1 of its D blocks."""
    D, C = s.tsp, s.cp
    if C == 1:
        return 0.0
    if not s.splits_over_cp():
        return None
    forward, backward = _all_to_all_calls(s, seq, batch)
    per_s = inter_node_gbps * 1e9 / 8
    forward_attention = 2 * batch * seq * seq * s.heads_per_block * s.head_dim / C / (gpu_tflops * 1e12)

    def exposed(terms, attention: float) -> float:
        waiting = sum(size * min(k, calls) for size, calls, k in terms)
        behind = sum(size * (calls - min(k, calls)) for size, calls, k in terms)
        return waiting / per_s + max(behind / per_s - attention * (D - 1) / D, 0.0)

    once = exposed(forward, forward_attention)
    return (once * (2 if s.activation_checkpointing else 1)
            + exposed(backward, forward_attention * ATTENTION_BACKWARD_FLOPS))


def ring_cover_flops_per_layer(s: CPLayerShape, seq: int, batch: int = 1) -> int:
    """Attention FLOPs per layer (forward + backward) the ring's hops run behind: D (C-1) hops, each behind one
    block's c = S/(2CD) queries x S/C keys."""
    D, C = s.tsp, s.cp
    group_tokens = seq // C
    hop_flops = 4 * batch * (group_tokens // (2 * D)) * group_tokens * s.heads_per_block * s.head_dim
    passes = 1 + ATTENTION_BACKWARD_FLOPS + (1 if s.activation_checkpointing else 0)
    return int(D * (C - 1) * hop_flops * passes)


def cp_costs(s: CPLayerShape, seq: int, batch: int = 1, *, inter_node_gbps: float = INTER_NODE_GBPS,
             gpu_tflops: float = GPU_TFLOPS) -> dict:
    """Per attention layer and rank: each schedule's bytes, transfer seconds and exposed seconds (the cost "auto"
    minimises), and the attention seconds the ring hides behind. The all-to-all's entries are None where its
    heads do not split over cp."""
    per_s = inter_node_gbps * 1e9 / 8
    ring, a2a = ring_bytes_per_layer(s, seq, batch), all_to_all_bytes_per_layer(s, seq, batch)
    cover = ring_cover_flops_per_layer(s, seq, batch) / (gpu_tflops * 1e12)
    a2a_exposed = all_to_all_exposed_seconds_per_layer(s, seq, batch, inter_node_gbps=inter_node_gbps,
                                                       gpu_tflops=gpu_tflops)
    return {"ring": {"bytes": ring, "seconds": ring / per_s, "exposed_seconds": max(ring / per_s - cover, 0.0)},
            "all_to_all": (None if a2a is None else
                           {"bytes": a2a, "seconds": a2a / per_s, "exposed_seconds": a2a_exposed}),
            "attention_seconds": cover, "inter_node_gbps": inter_node_gbps, "gpu_tflops": gpu_tflops}


def choose_cp_comm(requested: str, s: CPLayerShape, seq: int, *, window: int | None = None) -> str:
    """"ring" / "all_to_all" as given; "auto": the schedule with the less exposed inter-node time per layer at the
    plan's hardware defaults (module docstring; ties: the ring), the ring for sliding-window layers and head
    blocks the all-to-all cannot split. Depends only on shapes and config: the same on every rank."""
    if requested in SCHEDULES:
        return requested
    if requested != "auto":
        raise TSPConfigError(f'tsp.cp_comm={requested!r}: use "auto", "ring" or "all_to_all"')
    if s.cp == 1 or window is not None or not s.splits_over_cp():
        return "ring"
    cost = cp_costs(s, seq)
    return "ring" if cost["ring"]["exposed_seconds"] <= cost["all_to_all"]["exposed_seconds"] else "all_to_all"


def ring_from_seq(s: CPLayerShape, *, window: int | None = None, limit: int = 1 << 40) -> int:
    """The shortest padded sequence from which "auto" takes the ring (the ring's exposed time shrinks as attention
    grows with S^2, the all-to-all's grows with S, so it keeps the ring beyond): 0 where it always takes the ring,
    `limit` where it never does below it."""
    step = 2 * s.cp * s.tsp
    if choose_cp_comm("auto", s, step, window=window) == "ring":
        return 0
    lo, hi = 1, max(limit // step, 1)  # in multiples of 2CD: lo takes the all-to-all
    if choose_cp_comm("auto", s, hi * step, window=window) != "ring":
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if choose_cp_comm("auto", s, mid * step, window=window) == "ring" else (mid, hi)
    return hi * step


def describe_choice(requested: str, s: CPLayerShape, *, window: int | None = None) -> str:
    """One line saying which schedule a layer runs and why (the model's build log, ds-tsp plan)."""
    if requested != "auto":
        return f"{requested} (tsp.cp_comm={requested!r})"
    if window is not None:
        return "ring (auto: a sliding-window layer's ring sends only the keys its window reaches)"
    if not s.splits_over_cp():
        return (f"ring (auto: a head block of {s.heads_per_block} query / {s.kv_heads_per_block} kv heads does not "
                f"split over cp_size={s.cp})")
    start = ring_from_seq(s)
    if start == 0:
        return "ring (auto: its exposed inter-node time is the lesser at every length)"
    return (f"all_to_all below {start} tokens per sequence, ring from {start} (auto: where attention hides the "
            f"ring's hops at {INTER_NODE_GBPS:g} Gb/s and {GPU_TFLOPS:g} TFLOP/s)")
