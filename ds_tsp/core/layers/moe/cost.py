"""Bytes one rank sends per MoE layer (forward + backward) under each dispatch schedule, and the "auto" choice.

Counted exactly as TSPComm's CommCounter counts them (tests/moe/test_moe_core.py asserts it):
- ring: the dense MLP's weight ring over the packed experts (E_r x 3 x F x h, + E_r x (2F + h) biases for GPT-OSS):
  D-1 weight hops forward, D-1 weight hops and D-1 grad hops backward (ds_tsp.core.comm.primitives.ring_forward /
  ring_backward); trainable experts.
- all_to_all (ds_tsp.core.layers.moe.all_to_all): R = tokens x top_k x (D-1) / D rows leave the rank per
  direction when routing spreads rows evenly over the owners (the expected value; the counter counts the real
  rows). Forward: the [D] per-expert counts (E_r int64 to each other rank), x rows out (h), expert outputs
  back (h). Backward: x rows again with dy and the routing weight out (2h + 1; x is re-sent rather than kept, the
  memory-optimal choice), d x rows with the routing-weight grad back (h + 1). R x (5h + 2) elements + counts.
"""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError

SCHEDULES = ("ring", "all_to_all")
COUNT_BYTES = 8  # the per-expert counts travel as int64


def moe_bytes_per_layer(tokens_per_rank: int, hidden: int, moe_ffn: int, num_experts: int, top_k: int, tsp: int,
                        dtype_bytes: int, biases: bool = False) -> dict[str, int]:
    """{"all_to_all": ..., "ring": ...}: bytes one rank sends per MoE layer, forward + backward, as TSPComm's
    CommCounter counts them (memory-optimal schedule). biases: the experts carry gate_up / down biases (GPT-OSS),
    which travel with the ring's shards."""
    if tsp < 1 or num_experts % tsp:
        raise TSPConfigError(f"num_experts={num_experts} on tsp={tsp}: every rank must own num_experts / tsp experts")
    if tsp == 1:
        return {"all_to_all": 0, "ring": 0}
    experts_per_rank = num_experts // tsp
    shard = experts_per_rank * (3 * moe_ffn * hidden + ((2 * moe_ffn + hidden) if biases else 0)) * dtype_bytes
    rows = tokens_per_rank * top_k * (tsp - 1) // tsp
    counts = (tsp - 1) * experts_per_rank * COUNT_BYTES
    return {"all_to_all": rows * (5 * hidden + 2) * dtype_bytes + counts, "ring": 3 * (tsp - 1) * shard}


def choose_moe_dispatch(requested: str, tokens_per_rank: int, hidden: int, moe_ffn: int, num_experts: int,
                        top_k: int, tsp: int, dtype_bytes: int, biases: bool = False) -> str:
    """"ring" / "all_to_all" as given; "auto": the one with fewer bytes per layer (ties: "ring", its bytes do not
    grow with the tokens). Both make the same one host read per layer forward, so syncs do not weigh in the choice.
    Same answer on every rank for the same batch shape."""
    if requested in SCHEDULES:
        return requested
    if requested != "auto":
        raise TSPConfigError(f'moe_dispatch={requested!r}: use "auto", "ring" or "all_to_all"')
    cost = moe_bytes_per_layer(tokens_per_rank, hidden, moe_ffn, num_experts, top_k, tsp, dtype_bytes, biases)
    return "ring" if cost["ring"] <= cost["all_to_all"] else "all_to_all"
