"""What one rank posts through a TSPComm, in post order: `with comm.recording() as rec:` fills a CommRecorder.

A replay under NCCL's queueing rules checks these lists (tests/helpers/nccl_rules.py), since gloo's threads hide orders
that hang NCCL.
"""
from __future__ import annotations

import torch


class CommRecorder:
    """The ops one rank posts through a TSPComm, in post order: metadata only (no copy, no sync, numerics unchanged).

    Each op is a plain dict, picklable and comparable across ranks: kind, group (global ranks), root (global rank;
    broadcast / reduce / gather), p2p (("send" | "recv", global peer), ...) and batched (one batch_isend_irecv) for
    point-to-point, shape / dtype / numel / nbytes of the tensor whose count NCCL sees, tag, what, and layer (the
    watchdog's comm.context when the op was posted).
    """

    def __init__(self):
        self.ops: list[dict] = []

    def add(self, kind: str, group: tuple, t: torch.Tensor, what: str | None, layer: str, **extra) -> None:
        self.ops.append({"kind": kind, "group": group, **extra, "shape": tuple(t.shape), "dtype": str(t.dtype),
                         "numel": t.numel(), "nbytes": t.numel() * t.element_size(), "what": what, "layer": layer})
