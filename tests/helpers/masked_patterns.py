"""Test data shared by the data-parallel tests (a helper module, not a test file)."""
from __future__ import annotations

import torch

from ds_tsp.tools.synthetic import RepeatingPatterns


class MaskedPatterns(RepeatingPatterns):
    """Labels with a sample-dependent share of -100, so data replicas hold different numbers of targets."""

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        labels = sample["input_ids"].clone()
        g = torch.Generator().manual_seed(index)
        labels[torch.rand(labels.shape, generator=g) < 0.3 * (index % 3)] = -100
        return {**sample, "labels": labels}
