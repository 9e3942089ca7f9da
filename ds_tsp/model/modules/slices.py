"""The slice types of the sharded-piece checkpoint protocol (ds_tsp.model.modules.decoder), in a module of their own
so every piece (the Gated DeltaNet's included) can name them without importing the other pieces."""
from __future__ import annotations

HFSlice = tuple[int, int, int]  # (dim, start, length) of a full HF tensor


class HFRanges(tuple):
    """A tensor this rank owns several ranges of (a tuple of HFSlice, e.g. the q, k and v rows of a fused in_proj):
    hf_targets gives a tuple of views in the same order, and load_slices reads each range into its view."""
