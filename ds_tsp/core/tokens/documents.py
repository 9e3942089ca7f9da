"""Where packed documents start: the one rule TSP attention, its tests and the data path share.

transformers' convention (DataCollatorWithFlattening, and masking_utils.find_packed_sequence_indices): a new
document starts wherever position_ids do not continue by +1, e.g. [0 1 2 0 1 0 1 2 3] holds documents of 3, 2
and 4 tokens. Padding (attention_mask == 0) is cut off as documents of its own, so real tokens never attend to
padded keys; only left or right padding is accepted (a zero between ones would hide keys INSIDE a document, which
documents cannot express). Nothing here builds an [S, S] mask: the attention kernels take the start indices.
"""
from __future__ import annotations

import bisect
import functools
import operator

import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.tokens.zigzag import zigzag_chunks

DocStarts = tuple[tuple[int, ...], ...]  # per batch row: sorted global token indices, the first is 0


def document_starts(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    max_breaks: int | None = None) -> DocStarts | None:
    """Document starts of global [B, S] position_ids (and 0/1 attention_mask); None when every row is one document.

    ONE device-to-host read per call (the kernels slice by python ints). The meta device has no values to read:
    there every row is taken as one document (None) and the padding check is skipped. max_breaks: an upper bound
    on the breaks (document starts after column 0, padding edges) known on the host, e.g. from the input check's
    per-rank counts: the read is then 1 + B + max_breaks ints instead of 1 + B + B S.
    """
    if position_ids.dim() != 2:
        raise TSPConfigError(f"position_ids has shape {list(position_ids.shape)}: expected [batch, seq]")
    B, S = position_ids.shape
    breaks = torch.zeros_like(position_ids, dtype=torch.bool)
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    rises = torch.zeros(0, dtype=torch.int64, device=position_ids.device)
    if attention_mask is not None:
        mask = attention_mask.to(device=position_ids.device, dtype=torch.bool)
        rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()
        breaks[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    if position_ids.device.type == "meta":
        return None
    # nonzero_static has a size known without reading the data, so the count, the padding check and the break
    # positions all come back in one read (nonzero would sync once by itself, then again for tolist)
    size = breaks.numel() if max_breaks is None else min(breaks.numel(), max_breaks)
    flat = torch.nonzero_static(breaks.reshape(-1), size=size, fill_value=-1).reshape(-1)
    host = torch.cat((breaks.sum().reshape(1), rises, flat)).tolist()
    n_breaks, row_rises, indices = host[0], host[1:1 + len(rises)], host[1 + len(rises):]
    if n_breaks > size:  # a wrong bound would drop starts silently: never return a truncated layout
        raise RuntimeError(f"document_starts: {n_breaks} document breaks, more than max_breaks={max_breaks}")
    holes = [b for b, r in enumerate(row_rises) if r > 1]
    if holes:
        raise padding_holes_error(holes[0])
    if not n_breaks:
        return None
    starts: list[list[int]] = [[0] for _ in range(B)]
    for i in indices[:n_breaks]:  # row-major: each row's starts come out sorted
        r, c = divmod(i, S)
        starts[r].append(c)
    return tuple(tuple(s) for s in starts)


def padding_holes_error(row: int) -> TSPConfigError:
    """The error for a mask row that is not (0*)(1+)(0*) (left padding, right padding, or both)."""
    return TSPConfigError(
        f"attention_mask row {row} has padding between real tokens: only left or right padding is supported; "
        "to pack several documents in one row, concatenate them without padding and let position_ids restart at "
        "0 for each (transformers' DataCollatorWithFlattening does this)")


# --- one rank's zigzag shard, summarised in a payload of fixed size ------------------------------------------
# The input check gathers this payload from every rank. Its size is a constant, never a function of the inputs,
# so ranks holding shards of different shapes still take part in the same gather (and all fail together after
# ONE host read) instead of needing a size agreement, and its read, first. What fits: per batch row and local
# chunk the edge values (positions and mask of the chunk's first and last token, and the mask rises inside),
# then the break indices inside the chunks. A rank with more breaks than slots sets nothing apart: decode_layout
# then returns OVERFLOW and the caller gathers the positions themselves (a second read, only then).
LAYOUT_SLOTS = 1024
_EDGE = 5  # first position, last position, first mask, last mask, mask rises inside the chunk
OVERFLOW = "overflow"


def shard_layout(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of breaks inside the chunks (0-dim int64), int64 [slots]) of a zigzag shard [B, L]; no host read."""
    slots = LAYOUT_SLOTS if slots is None else slots
    B, L = position_ids.shape
    c, dev = L // 2, position_ids.device
    pos = position_ids.to(torch.int64)
    mask = (attention_mask.to(device=dev, dtype=torch.bool) if attention_mask is not None
            else torch.ones((B, L), dtype=torch.bool, device=dev))
    inner = torch.zeros((B, L), dtype=torch.bool, device=dev)
    rise = torch.zeros((B, L), dtype=torch.bool, device=dev)
    if L > 1:
        inner[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1) | (mask[:, 1:] != mask[:, :-1])
        rise[:, 1:] = mask[:, 1:] & ~mask[:, :-1]
    if c == 0 or _EDGE * 2 * B > slots:  # no chunk to describe (the shape check rejects it) or no room
        return inner.sum(), torch.full((slots,), -1, dtype=torch.int64, device=dev)
    # a chunk's first token: whether it starts a document depends on the previous chunk, held by another rank
    inner[:, ::c] = False
    rise[:, ::c] = False
    m = mask.to(torch.int64)
    edges = torch.stack((pos[:, 0:2 * c:c], pos[:, c - 1:2 * c:c], m[:, 0:2 * c:c], m[:, c - 1:2 * c:c],
                         rise[:, :2 * c].reshape(B, 2, c).sum(-1)), dim=-1)  # [B, 2, _EDGE], slicing: no index copy
    events = torch.nonzero_static(inner.reshape(-1), size=slots - edges.numel(), fill_value=-1).reshape(-1)
    return inner.sum(), torch.cat((edges.reshape(-1), events))


def decode_layout(rank_slots: list[list[int]], rank_breaks: list[int], batch: int, local_len: int,
                  slots: int | None = None, held_chunks: list[tuple[int, int]] | None = None):
    """Document starts of the global batch from every rank's shard_layout (host lists, rank order): DocStarts,
    None (one document per row), or OVERFLOW. Raises the padding error for a mask with holes.
    held_chunks: the two global chunks (of 2 * len(rank_slots)) each rank holds; default TSP's zigzag (with a cp
    axis: ds_tsp.core.tokens.zigzag.cp_global_chunks of every rank, cp-major)."""
    slots = LAYOUT_SLOTS if slots is None else slots
    tsp, c, n_edge = len(rank_slots), local_len // 2, _EDGE * 2 * batch
    if n_edge + max(rank_breaks) > slots:
        return OVERFLOW
    chunk_edges: list = [None] * (2 * tsp)  # global chunk -> per row (first, last, mfirst, mlast, rises)
    breaks: list[list[int]] = [[] for _ in range(batch)]
    for rank, (values, n) in enumerate(zip(rank_slots, rank_breaks)):
        held = zigzag_chunks(tsp, rank) if held_chunks is None else held_chunks[rank]
        for i, g in enumerate(held):
            chunk_edges[g] = [values[(b * 2 + i) * _EDGE:(b * 2 + i + 1) * _EDGE] for b in range(batch)]
        for index in values[n_edge:n_edge + n]:
            b, t = divmod(index, local_len)
            i, x = divmod(t, c)
            breaks[b].append(held[i] * c + x)
    for b in range(batch):
        rises = 0
        for g in range(2 * tsp):
            first, _, m_first, _, inner_rises = chunk_edges[g][b]
            previous = chunk_edges[g - 1][b] if g else None
            if previous is not None and (first != previous[1] + 1 or m_first != previous[3]):
                breaks[b].append(g * c)
            rises += inner_rises + (m_first == 1 and (previous is None or previous[3] == 0))
        if rises > 1:
            raise padding_holes_error(b)
    if not any(breaks):
        return None
    return tuple((0, *sorted(row)) for row in breaks)


def documents_of_lengths(lengths: list[int], device=None) -> torch.Tensor:
    """position_ids [sum(lengths)] of documents of these lengths packed back to back (restarting at 0)."""
    if not lengths or any(n < 1 for n in lengths):
        raise TSPConfigError(f"document lengths {lengths}: every document needs at least one token")
    return torch.cat([torch.arange(n, device=device) for n in lengths])


# ----------------------------------------------------------------------------------------------------------------
# the validated layout every attention kernel and the linear-attention scan take


class DocumentLayout:
    """doc_starts validated once (per step): per batch row a tuple of strictly increasing ints beginning with 0.

    Frozen. Build it with `document_layout` (the one validation pass); the kernels then take it as it is, and what
    they derive per chunk (the starts cut to the chunk's keys, the row groups, the varlen plan) is computed once
    per chunk length and kept here, not re-derived by every layer, head block and phase.
    """

    __slots__ = ("rows", "_cuts", "_hash")

    def __init__(self, rows: tuple[tuple[int, ...], ...]):  # trusted: rows already validated
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "_cuts", {})
        # hashed once: the per-step caches keyed by a layout (cp ring runs, local layouts) look it up per layer and
        # head block, and hashing the rows anew walks every document start
        object.__setattr__(self, "_hash", hash(rows))

    def __setattr__(self, name, value):
        raise AttributeError(f"DocumentLayout is frozen (cannot set {name})")

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, b):
        return self.rows[b]

    def __eq__(self, other):  # equal to its rows: it stands where a tuple of per-row starts stood
        if isinstance(other, DocumentLayout):
            return self.rows == other.rows
        if isinstance(other, (tuple, list)):
            return self.rows == tuple(tuple(r) for r in other)
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # pickles as its rows (the caches are rebuilt on use)
        return DocumentLayout, (self.rows,)

    def __repr__(self) -> str:
        return f"DocumentLayout({', '.join(_short(r) for r in self.rows[:4])}{', ...' if len(self.rows) > 4 else ''})"

    def cut(self, key_len: int) -> LayoutCut:
        """The rows cut to the starts < key_len (a chunk's causal prefix), derived once per key_len."""
        cut = self._cuts.get(key_len)
        if cut is None:
            if len(self._cuts) >= 64:  # a long-lived layout (single_documents) seeing ever new lengths stays bounded
                self._cuts.clear()
            cut = self._cuts[key_len] = LayoutCut(tuple(r[:bisect.bisect_left(r, key_len)] for r in self.rows))
        return cut


class LayoutCut:
    """A DocumentLayout cut to one key length, with what the kernels derive from it (lazily, once)."""

    __slots__ = ("rows", "multi", "_groups", "plans")

    def __init__(self, rows):
        self.rows = rows
        self.multi = any(len(starts) > 1 for starts in rows)  # some row holds two documents
        self._groups = None  # [(row indices, starts)] per distinct layout
        self.plans: dict = {}  # (window, q_start, device) -> varlen plan or None

    def masked(self, window, key_len: int) -> bool:
        return self.multi or (window is not None and window < key_len)

    def groups(self):
        if self._groups is None:
            by_layout: dict[tuple, list[int]] = {}
            for b, starts in enumerate(self.rows):
                by_layout.setdefault(starts, []).append(b)
            self._groups = [(tuple(rows), starts) for starts, rows in by_layout.items()]
        return self._groups


def document_layout(doc_starts, batch: int | None = None) -> DocumentLayout:
    """doc_starts as a validated DocumentLayout: returned as it is when it is one already, else validated
    (ValueError naming the row). `batch`: the rows it must have."""
    layout = doc_starts if isinstance(doc_starts, DocumentLayout) else DocumentLayout(_layouts(doc_starts))
    if batch is not None and len(layout) != batch:
        raise ValueError(f"doc_starts has {len(layout)} rows, the batch has B={batch}")
    return layout


@functools.lru_cache(maxsize=64)
def single_documents(batch: int) -> DocumentLayout:
    """One document per row (built once per batch size: no validation pass per step)."""
    return DocumentLayout(((0,),) * batch)


def _layouts(doc_starts):
    """doc_starts validated, each row as a tuple of ints: the one pass over every start (see DocumentLayout)."""
    if doc_starts is None or isinstance(doc_starts, (str, bytes)):
        raise ValueError(f"doc_starts must be a sequence of B sorted tuples of ints, got {doc_starts!r}")
    layouts = []
    for b, row in enumerate(doc_starts):
        try:
            starts = tuple(operator.index(s) for s in row)
        except TypeError:
            raise ValueError(f"doc_starts[{b}] must be a sequence of ints, got {row!r}") from None
        if not starts or starts[0] != 0:
            raise ValueError(f"doc_starts[{b}] must begin with 0, got {_short(starts)}")
        if any(s1 <= s0 for s0, s1 in zip(starts, starts[1:])):
            raise ValueError(f"doc_starts[{b}] must be strictly increasing, got {_short(starts)}")
        layouts.append(starts)
    return tuple(layouts)


def _short(starts):
    return str(starts) if len(starts) <= 8 else f"({', '.join(map(str, starts[:8]))}, ...)"
