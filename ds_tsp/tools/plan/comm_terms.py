"""Communication arithmetic shared by every layout: bytes per rank of each collective, and the step-level terms.

Accounting (ds_tsp.core.comm.communicator.CommCounter's): bytes per rank, logical volume -- broadcast counts on
receivers, reduce on senders, all-gather (n-1)/n of its output, reduce-scatter (n-1)/n of its input, all-to-all (n-1)/n
of its input, all-reduce 2(n-1)/n of its payload (a ring all-reduce; the textbook "2x" is its n -> infinity limit), a
ring or pipeline hop what it sends. Integer floor as CommCounter does it.
"""
from __future__ import annotations

from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.result import CommTerm
from ds_tsp.tools.plan.shape_terms import Stage


def all_reduce_bytes(payload: int, n: int) -> int:
    """All-reduce bytes per rank (ring): 2 (n-1)/n of the payload."""
    return 2 * payload * (n - 1) // n if n > 1 else 0


def gather_bytes(full: int, n: int) -> int:
    """All-gather / reduce-scatter / all-to-all bytes per rank: (n-1)/n of the full buffer."""
    return full * (n - 1) // n if n > 1 else 0


def term(name, kind, payload, calls, nbytes) -> CommTerm:
    return CommTerm(name, kind, int(payload), int(calls), int(nbytes))


def nonzero(terms) -> tuple[CommTerm, ...]:
    return tuple(t for t in terms if t.bytes)


def total(terms) -> int:
    return sum(t.bytes for t in terms)


def dp_sync(inp: PlanInput, grad_elems: int, group: int) -> list[CommTerm]:
    """Gradient synchronisation over `group` ranks: all-reduce, or reduce-scatter + param all-gather (ZeRO-1/2):
    the same 2 (n-1)/n volume either way."""
    payload = grad_elems * inp.dtype_bytes
    return [term("grad sync over dp (all-reduce or ZeRO reduce-scatter + all-gather)", "all_reduce", payload,
                 1 if group > 1 else 0, all_reduce_bytes(payload, group))]


def pipeline_hops(inp: PlanInput, stage: Stage, tokens_per_rank: int) -> list[CommTerm]:
    """Pipeline hops of one micro-batch sent by one rank: activations forward (all stages but the last), grads
    backward (all but the first); a middle stage (pp > 2) sends both."""
    if inp.pp == 1:
        return []
    payload = tokens_per_rank * inp.model.hidden_size * inp.dtype_bytes
    sends = 2 if inp.pp > 2 else 1
    return [term("pipeline send (activations fwd / grads bwd)", "p2p", payload, sends, sends * payload)]


def sharded_weight_terms(inp: PlanInput, elems: int, group: int, what: str):
    """ZeRO-3 / FSDP over `group` ranks: all-gather of the weights forward; all-gather again and reduce-scatter of
    the grads backward (one gather serves the recompute and the backward under activation checkpointing)."""
    full = elems * inp.dtype_bytes
    n = 1 if group > 1 else 0
    fwd = [term(f"{what} weight all-gather", "all_gather", full, n, gather_bytes(full, group))]
    bwd = [term(f"{what} weight re-gather", "all_gather", full, n, gather_bytes(full, group)),
           term(f"{what} grad reduce-scatter", "reduce_scatter", full, n, gather_bytes(full, group))]
    return fwd, bwd


def recompute(fwd: list[CommTerm]) -> list[CommTerm]:
    """Activation checkpointing replays the layer's forward inside backward: its forward traffic once more."""
    from dataclasses import replace

    return [replace(t, name="recompute: " + t.name) for t in fwd]
