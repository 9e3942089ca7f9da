"""Multimodal RoPE (Qwen3.5's interleaved mrope): the 3-D position ids of a whole batch, and the RoPE tables of
three position rows (t, h, w).

Positions follow transformers' Qwen3_5Model.get_rope_index rule, computed here once per step for the WHOLE
sequence on the host (the caller shards them with the tokens):
* a text span continues one position per token on all three rows;
* an image (grid t, h, w patches, spatial merge m) occupies t * (h/m) * (w/m) tokens: row t = start (+ frame index
  for a frame of several), row h = start + its row in the merged grid, row w = start + its column; the text after it
  continues at start + max(h, w) / m;
* a video of t frames is t images of one frame each (its processor puts a timestamp between frames), so each frame
  restarts its rows h, w at the current position and advances it by max(h, w) / m.
Spans are runs of equal mm_token_type_ids (0 text, 1 image, 2 video), one item each, in the order the grids are
listed (a grid whose token count differs from its span is a ValueError naming the grid field); padding
(attention_mask 0) is skipped and keeps position 0, as transformers leaves it. Packed documents (text positions
restarting) each start again at 0, as each document alone would.

Tables: row j of the frequencies takes its angle from row t, h or w by mrope_section (transformers'
recomposition_frequencies: frequency index 1, 4, 7, ... below 3 * section[1] from h, 2, 5, 8, ... below
3 * section[2] from w, every other index from t), then cos and sin as the plain RoPE of ds_tsp.core.tokens.rope.
"""
from __future__ import annotations

import itertools

import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import RopeScaling
from ds_tsp.core.tokens.rope import attention_scaling, inv_freq

TEXT, IMAGE, VIDEO = 0, 1, 2


def frame_grids(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """[frames, 3]: every video split into its frames (t = 1 each), as the positions and the tokens see them."""
    if video_grid_thw is None:
        return None
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def mrope_positions(mm_token_type_ids: torch.Tensor, spatial_merge_size: int,
                    image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None,
                    documents: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [3, B, S] on the host: the batch's mrope positions (module docstring). Host tensors in (the loader's
    batch). documents: [B, S] text positions of packed documents (a new one wherever they do not continue by +1,
    transformers' packing rule): each document's positions restart at 0, its items taken from the grids in order.
    A grid that does not match its span, or a span crossing a document boundary, raises a ValueError naming the
    grid field."""
    types = mm_token_type_ids.cpu()
    batch, seq = types.shape
    mask = None if attention_mask is None else attention_mask.cpu().bool()
    if mask is not None and documents is not None:
        raise TSPConfigError("attention_mask with packed documents (position_ids restarting): pad the packed rows "
                             "with documents of their own, or leave attention_mask out")
    grids = {IMAGE: iter(image_grid_thw.cpu().tolist()) if image_grid_thw is not None else iter(()),
             VIDEO: iter(frame_grids(video_grid_thw.cpu()).tolist()) if video_grid_thw is not None else iter(())}
    out = torch.zeros((3, batch, seq), dtype=torch.long, device="cpu")
    for b in range(batch):
        row = types[b] if mask is None else types[b][mask[b]]
        if documents is None:
            positions = _document_positions(row.tolist(), grids, spatial_merge_size, b)
        else:
            text = documents[b].cpu()
            starts = [0, *((text[1:] != text[:-1] + 1).nonzero().flatten() + 1).tolist(), seq]
            for lo, hi in zip(starts[:-1], starts[1:]):
                if lo > 0 and row[lo] != TEXT and row[lo] == row[lo - 1]:
                    raise ValueError(f"{_FIELDS[int(row[lo])]}: a vision span crosses the document boundary at "
                                     f"token {lo} of row {b} (position_ids restart inside it)")
            positions = torch.cat([_document_positions(row[lo:hi].tolist(), grids, spatial_merge_size, b)
                                   for lo, hi in zip(starts[:-1], starts[1:])], dim=1)
        if mask is None:
            out[:, b] = positions
        else:
            out[:, b, mask[b]] = positions
    for kind, rest in grids.items():
        if next(rest, None) is not None:
            raise ValueError(f"{_FIELDS[kind]} lists more items than the batch's vision tokens use")
    return out


_FIELDS = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}


def _document_positions(types: list[int], grids: dict, m: int, b: int) -> torch.Tensor:
    """[3, len(types)]: one document's positions from 0, taking its items from the grid iterators."""
    pieces, current = [], 0
    for kind, group in itertools.groupby(types):
        n = len(list(group))
        if kind == TEXT:
            pieces.append(torch.arange(current, current + n, device="cpu").expand(3, n))
            current += n
            continue
        if kind not in grids:
            raise ValueError(f"mm_token_type_ids holds {kind}: only 0 (text), 1 (image) and 2 (video) exist")
        grid = next(grids[kind], None)  # one item per span, as transformers' rule takes them
        noun = "image" if kind == IMAGE else "video frame"
        if grid is None:
            raise ValueError(f"{_FIELDS[kind]} lists fewer items than the batch has {noun} spans (row {b})")
        t, h, w = grid[0], grid[1] // m, grid[2] // m
        if t * h * w != n:
            raise ValueError(f"{_FIELDS[kind]} item {grid} makes {t * h * w} tokens (spatial merge {m}) but its "
                             f"{noun} span in row {b} has {n}: the grid does not match the number of vision tokens")
        tt, hh, ww = torch.meshgrid(*(torch.arange(n, device="cpu") for n in (t, h, w)), indexing="ij")
        pieces.append(torch.stack((tt + current, hh + current, ww + current)).reshape(3, -1))
        current += max(h, w)
    return torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=torch.long, device="cpu")


def mrope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                  mrope_section: tuple[int, int, int], scaling: RopeScaling | None = None):
    """cos, sin: [B, L, rotary_dim] from the three position rows [3, B, L] (on their device; angles in float64 for
    a float64 model, float32 otherwise, as ds_tsp.core.tokens.rope.rope_cos_sin)."""
    if sum(mrope_section) != rotary_dim // 2:
        raise TSPConfigError(f"rope_parameters.mrope_section={list(mrope_section)} sums to {sum(mrope_section)}: "
                             f"it must cover the rotary frequencies, rotary dim {rotary_dim} // 2 = {rotary_dim // 2}")
    if scaling is not None and scaling.switches_with_length:
        raise TSPConfigError("rope_parameters.rope_type='longrope' with mrope: not supported")
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    freq = inv_freq(rotary_dim, theta, scaling, device=position_ids.device).to(angle_dtype)
    freqs = position_ids[..., None].to(angle_dtype) * freq  # [3, B, L, rotary_dim // 2]
    mixed = freqs[0].clone()
    for row, offset in ((1, 1), (2, 2)):
        index = slice(offset, mrope_section[row] * 3, 3)
        mixed[..., index] = freqs[row, ..., index]
    angles = torch.cat((mixed, mixed), dim=-1)
    mscale = attention_scaling(scaling)
    return (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype)
