"""The model's input check: every rank's shard validated at once, and the packed-document layout found, in ONE
all-gather of a fixed-size payload and ONE host read per step.

A bad shard fails every rank (none hangs in a later collective), and the same gather tells every rank where packed
documents start. The payload's size never depends on the inputs, so ranks with different shapes meet in the same
gather and need no size agreement first:

    int64 [len(PayloadHead._fields) + LAYOUT_SLOTS]:
        PayloadHead: labelled tokens, bad ids, batch, local length, mask given, document breaks, bad mask values
        then the shard's document layout (ds_tsp.core.tokens.documents.shard_layout)

Only a rank with more document breaks than documents.LAYOUT_SLOTS costs a second gather and read (of the positions
themselves). On the meta device nothing is read: the checks are skipped and every row is one document.

With cp groups (tsp.cp_size > 1) the packed-document layout is a fact of the whole sequence, so the TSP group's
gathered payloads are all-gathered once more over the cp ring's group (`over_cp`) and decoded with the two-level
chunk map (`held_chunks`): every rank gets the GLOBAL DocumentLayout, which ds_tsp.core.layers.attention.cp_ring
maps to each group's buffers. One more small all-gather per step, no extra host read.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.tokens.documents import (
    OVERFLOW,
    DocumentLayout,
    decode_layout,
    document_layout,
    document_starts,
    shard_layout,
)
from ds_tsp.core.tokens.zigzag import cp_global_chunks, cp_unshard, unshard

__all__ = ["PayloadHead", "input_check_payload", "check_inputs", "over_cp", "held_chunks", "full_fields"]


class PayloadHead(NamedTuple):
    """The counts heading every rank's payload, in payload order (ds_tsp.tools.plan counts len(_fields))."""

    labelled: int  # tokens with a target
    bad_ids: int  # token ids outside [0, vocab_size)
    batch: int
    length: int  # local sequence length
    has_mask: int  # 1 when attention_mask is given
    breaks: int  # document breaks in the shard (more than LAYOUT_SLOTS: the layout overflows)
    bad_mask: int  # attention_mask values other than 0 and 1


CHECK_COUNTS = len(PayloadHead._fields)


def input_check_payload(input_ids: torch.Tensor, shift_labels: torch.Tensor | None, position_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """What this rank sends in the input check's one all-gather: int64 [CHECK_COUNTS + LAYOUT_SLOTS] (PayloadHead,
    then the shard's document layout), a size that never depends on the inputs. No host read."""
    B, local_len = input_ids.shape
    dev = input_ids.device

    def fill(value: int) -> torch.Tensor:  # a fill kernel; torch.tensor(value, device=) copies from the host
        return torch.full((), value, dtype=torch.int64, device=dev)

    n_bad = ((input_ids < 0) | (input_ids >= vocab_size)).sum()
    n_valid = (shift_labels != -100).sum() if shift_labels is not None else fill(0)
    n_bad_mask = (((attention_mask != 0) & (attention_mask != 1)).sum() if attention_mask is not None
                  else fill(0))
    n_breaks, layout = shard_layout(position_ids, attention_mask)
    head = PayloadHead(labelled=n_valid, bad_ids=n_bad, batch=fill(B), length=fill(local_len),
                       has_mask=fill(int(attention_mask is not None)), breaks=n_breaks, bad_mask=n_bad_mask)
    return torch.cat((torch.stack(list(head)), layout))


def check_inputs(comm: TSPComm, vocab_size: int, input_ids: torch.Tensor, shift_labels: torch.Tensor | None,
                 position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, DocumentLayout | None]:
    """Validate every rank's shard at once (collective over the TSP group, and cp) and find the document layout.

    Returns (labelled tokens of the whole TSP group or None without labels, document starts or None). The starts
    are validated here, once per step, into a DocumentLayout every layer's kernels take as it is."""
    if position_ids is None:
        raise TSPConfigError(
            "position_ids is missing: TSP ranks hold non-contiguous zigzag chunks, so RoPE needs the GLOBAL "
            "position of every local token; build the batch with ds_tsp.shard_batch")
    if input_ids.dim() != 2:
        raise TSPConfigError(f"input_ids must be [batch, local_seq], got shape {tuple(input_ids.shape)}")
    for name, t in (("shift_labels", shift_labels), ("position_ids", position_ids),
                    ("attention_mask", attention_mask)):
        if t is not None and t.shape != input_ids.shape:
            raise TSPConfigError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}: "
                                 "pass the same zigzag shard of every field")
    B, local_len = input_ids.shape
    dev = input_ids.device
    local = input_check_payload(input_ids, shift_labels, position_ids, attention_mask, vocab_size)
    if comm.size > 1:
        everyone = torch.empty(comm.size, local.numel(), dtype=torch.int64, device=dev)
        comm.all_gather(everyone, local).wait()
    else:
        everyone = local[None]
    total = everyone[:, 0].sum() if shift_labels is not None else None
    if comm.cp is not None:  # the whole sequence's payloads; total stays the group's
        everyone = over_cp(comm, everyone)
    if dev.type == "meta":
        return total, None
    rows = everyone.tolist()  # the one device-to-host read: everything below works on host ints
    heads = [PayloadHead(*row[:CHECK_COUNTS]) for row in rows]
    shapes = [[h.batch, h.length, h.has_mask] for h in heads]
    if any(s != shapes[0] for s in shapes):
        raise TSPConfigError(
            f"local shapes [batch, seq] differ across TSP ranks, or attention_mask is given on some ranks "
            f"only ([batch, seq, has mask] per rank: {shapes}): every rank must hold its zigzag shard (two equal "
            "chunks) of the same batch: use ds_tsp.shard_batch")
    n_bad_total = sum(h.bad_ids for h in heads)
    if n_bad_total > 0:
        raise TSPConfigError(
            f"input_ids: {n_bad_total} token id(s) are outside [0, vocab_size={vocab_size}):"
            " check the tokenizer matches the model's vocab_size")
    if any(h.bad_mask for h in heads):
        raise TSPConfigError("attention_mask must hold only 0 (padding) and 1 (real token)")
    if local_len % 2 or local_len == 0:
        raise TSPConfigError(
            f"local shapes [batch, seq] differ across TSP ranks or are odd: {[s[:2] for s in shapes]}; every "
            "rank must hold its zigzag shard (two equal chunks) of the same batch: use ds_tsp.shard_batch")
    if shift_labels is not None and sum(h.labelled for h in heads) == 0:
        raise TSPConfigError("shift_labels: no token has a target (all -100) in the whole TSP group; "
                             "a batch needs at least one labelled token")
    doc_starts = decode_layout([row[CHECK_COUNTS:] for row in rows], [h.breaks for h in heads], B, local_len,
                               held_chunks=held_chunks(comm) if comm.cp is not None else None)
    if doc_starts is OVERFLOW:  # more document breaks than slots on some rank: gather the positions themselves
        fields = [position_ids] + ([attention_mask] if attention_mask is not None else [])
        data = torch.stack([f.to(device=dev, dtype=torch.int64) for f in fields])  # [fields, B, L]
        if comm.size > 1:
            gathered = torch.empty((comm.size, *data.shape), dtype=torch.int64, device=dev)
            comm.all_gather(gathered, data).wait()
        else:
            gathered = data[None]
        full = (unshard(list(gathered.unbind(0)), dim=2) if comm.cp is None
                else full_fields(comm, gathered))  # [fields, B, S]
        # at most every rank's breaks inside its chunks plus one at each chunk's first token: a read of that
        # many positions, not of all B * S
        bound = sum(h.breaks for h in heads) + B * 2 * len(heads)
        doc_starts = document_starts(full[0], full[1] if attention_mask is not None else None, max_breaks=bound)
    return total, (None if doc_starts is None else document_layout(doc_starts, B))


def over_cp(comm: TSPComm, gathered: torch.Tensor) -> torch.Tensor:
    """The TSP group's gathered [D, ...] tensor, all-gathered over the cp ring's group: [C * D, ...], cp-major."""
    cp = comm.cp_axis()
    out = torch.empty((cp.size, *gathered.shape), dtype=gathered.dtype, device=gathered.device)
    cp.all_gather(out, gathered.contiguous(), what="input check over cp").wait()
    return out.reshape(cp.size * gathered.shape[0], *gathered.shape[1:])


def held_chunks(comm: TSPComm) -> list[tuple[int, int]]:
    """The two global chunks (of 2 * C * D) of every rank of the sequence, cp-major (what over_cp returns)."""
    C, D = comm.cp.size, comm.size
    return [cp_global_chunks(D, p, C, i) for i in range(C) for p in range(D)]


def full_fields(comm: TSPComm, gathered: torch.Tensor) -> torch.Tensor:
    """Every rank's [fields, B, L] gathered over TSP ([D, fields, B, L]) and cp, back in global order:
    [fields, B, S_pad]."""
    everyone = over_cp(comm, gathered).view(comm.cp.size, comm.size, *gathered.shape[1:])
    return cp_unshard([list(group.unbind(0)) for group in everyone.unbind(0)], dim=2)


def check_cp_integration(cp_size: int, where: str) -> None:
    """An integration that does not split sequences over cp groups yet refuses cp_size > 1 before any group is built
    (its batches, token counts and metrics would be cut for TSP alone)."""
    if cp_size > 1:
        raise TSPConfigError(
            f"tsp.cp_size={cp_size} with {where}: its batches, token counts and metrics are not split over cp "
            "groups yet; train with TSPTrainer or TSPAccelerator (plain, FSDP2 or DeepSpeed), ds_tsp.initialize "
            "(DeepSpeed ZeRO 0-3 over data x cp) or ds_tsp.shard_with_fsdp2 (FSDP2 over data x cp), or set cp_size "
            "to 1")
