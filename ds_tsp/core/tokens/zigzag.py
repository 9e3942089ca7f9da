"""Zigzag token layout: the one place that decides which rank of a TSP group holds which tokens.

With D = tsp degree, a sequence is padded at the END to S_pad, a multiple of 2D, and cut into 2D chunks of
c = S_pad / (2D) tokens. Rank p holds chunk p followed by chunk 2D-1-p (local length S_pad / D). Under causal
attention chunk i costs ~(i+1) units, so every rank does (p+1) + (2D-p) = 2D+1 units: the work is balanced.

    S_pad = 8, D = 2, c = 2:   global  [0 1 | 2 3 | 4 5 | 6 7]
                               rank 0  [0 1 6 7]    rank 1  [2 3 4 5]

With a context-parallel axis of C TSP groups (tsp.cp_size, ds_tsp.core.layers.attention.cp_ring) the same zigzag is
applied twice: the sequence is padded to a multiple of 2*C*D and cut into 2C cp chunks of S_pad / (2C) tokens; cp group
i holds cp chunks i and 2C-1-i, concatenated (its "cp-local" sequence of S_pad / C tokens, in global order since
i < 2C-1-i); then TSP's zigzag above cuts that local sequence into 2D chunks of c = S_pad / (2CD) tokens and TSP
rank p of group i holds local chunks p and 2D-1-p. So of the 2CD global chunks of c tokens, rank (i, p) holds
global chunks i*D + p and (2C-1-i)*D + D-1-p: one piece of each of its group's two cp chunks.

    S_pad = 16, C = 2, D = 2, c = 2:   global    [0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10 11 | 12 13 | 14 15]
                                       cp group 0 holds [0 1 2 3 12 13 14 15], cp group 1 [4 5 6 7 8 9 10 11]
                                       (i=0, p=0) [0 1 14 15]   (i=0, p=1) [2 3 12 13]
                                       (i=1, p=0) [4 5 10 11]   (i=1, p=1) [6 7 8 9]

Under causal attention both levels balance: a cp group's K/V blocks are skipped by the queries they are in the
future of, and each group does the same number of block pairs (ds_tsp.core.layers.attention.cp_ring); inside the group
the work splits as above. `cp_shard` / `cp_unshard` / `cp_zigzag_positions` are the two-level forms; shard_batch takes
cp and cp_rank.

Everything here is pure tensor indexing (no process groups), so the library and the tests share one definition.
"rank order" is the concatenation of every rank's local shard, rank 0 first: what an all-gather along the
sequence dim produces. `rank_order_to_global_index` turns it back into global token order.

Padding at the end needs no attention mask under causal attention (real tokens never see later keys); padded
positions carry label `ignore_index` so they never enter the loss.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_tsp.core.errors import TSPConfigError

__all__ = [
    "padded_length",
    "zigzag_positions",
    "rank_order_to_global_index",
    "global_to_rank_order_index",
    "pad_to",
    "shard",
    "unshard",
    "shift_labels",
    "shard_batch",
    "cp_shard",
    "cp_unshard",
    "cp_zigzag_positions",
    "cp_global_chunks",
]


def _check_tsp(tsp: int) -> None:
    if isinstance(tsp, bool) or not isinstance(tsp, int) or tsp < 1:
        raise TSPConfigError(f"tsp={tsp!r}: the TSP degree must be an integer >= 1")


def _check_rank(rank: int, tsp: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tsp:
        raise TSPConfigError(f"rank={rank!r} is outside [0, tsp={tsp}): pass this process's index in its TSP group")


def _check_padded(padded_len: int, tsp: int, what: str = "padded_len") -> None:
    _check_tsp(tsp)
    if padded_len < 1 or padded_len % (2 * tsp):
        raise TSPConfigError(
            f"{what}={padded_len} is not a positive multiple of 2*tsp={2 * tsp}: zigzag cuts the sequence into "
            f"2*tsp equal chunks; pad it first with pad_to(x, padded_length(seq_len, tsp), ...)")


def padded_length(seq_len: int, tsp: int) -> int:
    """Smallest multiple of 2*tsp that is >= seq_len (the length every sequence is padded to)."""
    _check_tsp(tsp)
    if seq_len < 1:
        raise TSPConfigError(f"seq_len={seq_len}: empty sequence; every sample needs at least one token")
    step = 2 * tsp
    return -(-seq_len // step) * step


def zigzag_chunks(tsp: int, rank: int) -> tuple[int, int]:
    """The global chunk indices (of 2*tsp) that `rank` holds, in local order: (rank, 2*tsp-1-rank)."""
    _check_tsp(tsp)
    _check_rank(rank, tsp)
    return rank, 2 * tsp - 1 - rank


def zigzag_positions(padded_len: int, tsp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions held by `rank`, in local order: LongTensor [padded_len // tsp]."""
    _check_padded(padded_len, tsp)
    _check_rank(rank, tsp)
    c = padded_len // (2 * tsp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in zigzag_chunks(tsp, rank)])


def global_to_rank_order_index(padded_len: int, tsp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """idx [padded_len] with x_rank_order = x_global.index_select(dim, idx) (every rank's positions, rank order)."""
    _check_padded(padded_len, tsp)
    return torch.cat([zigzag_positions(padded_len, tsp, p, device=device) for p in range(tsp)])


def rank_order_to_global_index(padded_len: int, tsp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """idx [padded_len] with x_global = x_rank_order.index_select(dim, idx): undoes an all-gather's rank order."""
    forward = global_to_rank_order_index(padded_len, tsp, device=device)
    inverse = torch.empty_like(forward)
    inverse[forward] = torch.arange(padded_len, device=forward.device)
    return inverse


def pad_to(x: torch.Tensor, padded_len: int, value: float | int | bool, dim: int = 1) -> torch.Tensor:
    """Append `value` along `dim` up to `padded_len` (padding goes at the END; returns x itself if already there)."""
    length = x.size(dim)
    if length > padded_len:
        raise TSPConfigError(
            f"padded_len={padded_len} is shorter than the tensor's length {length} along dim {dim}: "
            "pass padded_length(seq_len, tsp)")
    if length == padded_len:
        return x
    shape = list(x.shape)
    shape[dim] = padded_len - length
    return torch.cat((x, x.new_full(shape, value)), dim=dim)


def shard(x: torch.Tensor, tsp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of an already padded `x`: chunks rank and 2*tsp-1-rank along `dim`."""
    _check_padded(x.size(dim), tsp, what=f"x.size({dim})")
    _check_rank(rank, tsp)
    c = x.size(dim) // (2 * tsp)
    mirror = 2 * tsp - 1 - rank
    return torch.cat((x.narrow(dim, rank * c, c), x.narrow(dim, mirror * c, c)), dim=dim)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: every rank's shard, in rank order, back to the padded global tensor."""
    if len(shards) == 0:
        raise TSPConfigError("shards=[]: pass one shard per rank of the TSP group, in rank order")
    local = shards[0].size(dim)
    if local % 2 or any(s.size(dim) != local for s in shards):
        raise TSPConfigError(
            f"shards have lengths {[s.size(dim) for s in shards]} along dim {dim}: every rank's zigzag shard has the "
            "same even length (two equal chunks); pass the outputs of shard() for one tensor")
    tsp = len(shards)
    rank_order = torch.cat(list(shards), dim=dim)
    index = rank_order_to_global_index(rank_order.size(dim), tsp, device=rank_order.device)
    return rank_order.index_select(dim, index)


def cp_global_chunks(tsp: int, rank: int, cp: int, cp_rank: int) -> tuple[int, int]:
    """The global chunks (of 2*cp*tsp) TSP rank `rank` of cp group `cp_rank` holds, in local order."""
    _check_tsp(cp)
    _check_rank(cp_rank, cp)
    first, second = zigzag_chunks(tsp, rank)  # second >= tsp: it lies in the group's second cp chunk
    return cp_rank * tsp + first, (2 * cp - 1 - cp_rank) * tsp + second - tsp


def cp_zigzag_positions(padded_len: int, tsp: int, rank: int, cp: int, cp_rank: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions held by TSP rank `rank` of cp group `cp_rank`, in local order: [padded_len // (cp*tsp)]."""
    _check_padded(padded_len, tsp * cp)
    group_positions = zigzag_positions(padded_len, cp, cp_rank, device=device)
    return group_positions[zigzag_positions(padded_len // cp, tsp, rank, device=device)]


def cp_shard(x: torch.Tensor, tsp: int, rank: int, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The shard of TSP rank `rank` in cp group `cp_rank` of an already padded `x` (multiple of 2*cp*tsp)."""
    _check_padded(x.size(dim), tsp * cp, what=f"x.size({dim})")
    return shard(shard(x, cp, cp_rank, dim=dim), tsp, rank, dim=dim)


def cp_unshard(shards: Sequence[Sequence[torch.Tensor]], dim: int = 1) -> torch.Tensor:
    """Inverse of `cp_shard`: shards[cp_rank][tsp_rank] back to the padded global tensor."""
    if len(shards) == 0:
        raise TSPConfigError("shards=[]: pass one list of TSP shards per cp group, in cp rank order")
    return unshard([unshard(group, dim=dim) for group in shards], dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """ALST convention: the target of position t is labels[t+1]; the last position gets `ignore_index`.

    Shifts along the last dim ([B, S] or [S]). Shifting BEFORE the sequence is cut is what keeps the target of the
    last token of every chunk: after cutting, that target lives on another rank.
    """
    shifted = labels.new_full(labels.shape, ignore_index)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def _check_ids(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TSPConfigError(f"{name} is a {type(t).__name__}: pass a tensor of shape [batch, seq]")
    if t.shape != shape:
        raise TSPConfigError(
            f"{name} has shape {list(t.shape)} but input_ids has shape {list(shape)}: {name} needs one entry per "
            "token, shape [batch, seq]")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TSPConfigError(f"{name} has dtype {t.dtype}: pass an integer tensor (torch.long)")


def _check_values(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Token ids >= 0 and a 0/1 mask, read from the device in ONE read (none on meta, which has no values)."""
    if not input_ids.numel() or input_ids.device.type == "meta":
        return
    stats = [input_ids.min().to(torch.int64)]
    if attention_mask is not None and attention_mask.device.type != "meta":
        stats.append(((attention_mask != 0) & (attention_mask != 1)).any().to(device=input_ids.device,
                                                                                dtype=torch.int64))
    min_id, *bad_mask = torch.stack(stats).tolist()
    if min_id < 0:
        raise TSPConfigError(
            f"input_ids contains the negative token id {min_id}: token ids index the embedding and "
            "must be >= 0; use ignore_index only in labels")
    if bad_mask and bad_mask[0]:
        raise TSPConfigError("attention_mask must hold only 0 (padding) and 1 (real token)")


def shard_batch(
    input_ids: torch.Tensor,
    *,
    tsp: int,
    rank: int,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    labels_are_shifted: bool = False,
    attention_mask: torch.Tensor | None = None,
    check_values: bool = True,
    cp: int = 1,
    cp_rank: int = 0,
) -> dict:
    """This rank's part of a causal-LM batch, ready for the TSP model.

    Args:
        input_ids: [B, S] token ids (global sequence).
        labels: [B, S]; None means causal LM on input_ids. Unless `labels_are_shifted`, they are shifted here
            (target of t is labels[t+1]) BEFORE padding and cutting, so no target is lost at a shard edge.
        position_ids: [B, S] (or [1, S], broadcast over the batch); default arange(S). RoPE uses these GLOBAL
            positions, so they are sharded with the tokens. Where they do not continue by +1 a new packed
            document starts (transformers' convention); attention then stays inside documents.
        attention_mask: [B, S] with 1 for real tokens, 0 for left or right padding: padded tokens get no target
            and are not the target of any token (their labels become ignore_index), and the model keeps them
            out of attention. Returned sharded when given.
        check_values: read the token ids and mask values to check them (one device-to-host read). False for
            callers that hand the shard straight to ShardedCausalLM, whose input check reads the same facts anyway.
        cp, cp_rank: the context-parallel degree and this rank's cp group (tsp.cp_size): the sequence is padded to
            a multiple of 2*cp*tsp and cut in two levels (module doc); the shards are [B, S_pad/(cp*tsp)].

    Returns a dict: input_ids, shift_labels, position_ids (each [B, S_pad/tsp], on input_ids' device),
    attention_mask (when given), seq_len (S) and padded_len (S_pad). Padded slots get `pad_token_id`, label
    `ignore_index`, and positions continuing the sequence (S, S+1, ...).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TSPConfigError(f"input_ids has shape {got}: expected a 2-D tensor [batch, seq]; add a batch dim with "
                             "input_ids.unsqueeze(0)")
    _check_tsp(tsp)
    _check_rank(rank, tsp)
    _check_tsp(cp)
    _check_rank(cp_rank, cp)
    batch, seq_len = input_ids.shape
    if seq_len < 1:
        raise TSPConfigError(f"input_ids has shape {[batch, seq_len]}: empty sequence")
    if seq_len < 2 and not labels_are_shifted:
        raise TSPConfigError(
            f"input_ids has seq_len={seq_len}: a causal LM needs at least 2 tokens so that some token has a "
            "target (or pass pre-shifted labels with labels_are_shifted=True)")
    _check_ids("input_ids", input_ids, input_ids.shape)
    if pad_token_id < 0:
        raise TSPConfigError(f"pad_token_id={pad_token_id}: must be a valid token id >= 0")
    if labels is None and labels_are_shifted:
        raise TSPConfigError("labels_are_shifted=True but labels=None: pass the pre-shifted labels, or drop the flag")
    if position_ids is not None and isinstance(position_ids, torch.Tensor) and position_ids.shape == (1, seq_len):
        position_ids = position_ids.expand(batch, seq_len)
    _check_ids("labels", labels, input_ids.shape)
    _check_ids("position_ids", position_ids, input_ids.shape)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise TSPConfigError(f"attention_mask has shape {got} but input_ids has {list(input_ids.shape)}: pass "
                                 "one 0/1 entry per token")
    if check_values:
        _check_values(input_ids, attention_mask)

    device = input_ids.device
    if labels is None:
        labels = input_ids
    targets = labels.to(device) if labels_are_shifted else shift_labels(labels.to(device), ignore_index)
    if attention_mask is not None:  # a padded token is neither a query with a target nor anyone's target
        real = attention_mask.to(device=device, dtype=torch.bool)
        next_real = torch.cat((real[:, 1:], real.new_zeros(batch, 1)), dim=1)
        targets = targets.masked_fill(~(real & next_real), ignore_index)
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
    padded_len = padded_length(seq_len, tsp * cp)
    pad_positions = torch.arange(seq_len, padded_len, device=device).expand(batch, padded_len - seq_len)
    positions = torch.cat((position_ids.to(device=device, dtype=torch.long), pad_positions), dim=1)

    def cut(x: torch.Tensor) -> torch.Tensor:
        return cp_shard(x, tsp, rank, cp, cp_rank)

    out = {
        "input_ids": cut(pad_to(input_ids, padded_len, pad_token_id)),
        "shift_labels": cut(pad_to(targets, padded_len, ignore_index)),
        "position_ids": cut(positions),
        "seq_len": seq_len,
        "padded_len": padded_len,
    }
    if attention_mask is not None:
        out["attention_mask"] = cut(pad_to(attention_mask.to(device=device, dtype=torch.long), padded_len, 0))
    return out
