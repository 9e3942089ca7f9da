"""The Gated DeltaNet's depthwise causal conv (ds_tsp.core.layers.linear_attention.causal_conv), float64.

Reference: each output token summed tap by tap from the concatenated [halo | chunk] sequence by index (no shifted
slices, no in-place adds), grads by autograd through it; and torch's gradcheck of the written-out backward. Chunks
shorter than the halo (c < K-1) and document masks with taps cut at random are covered.
"""
from __future__ import annotations

import pytest
import torch

from ds_tsp.core.layers.linear_attention.causal_conv import causal_conv

TOL = 1e-12


def reference(chunks, halo, weight, tap_mask):
    B, _, c, C = chunks.shape
    K = weight.shape[1]
    ext = torch.cat([halo, chunks], dim=2)
    rows = []
    for t in range(c):
        total = torch.zeros(B, 2, C, dtype=chunks.dtype)
        for s in range(K):
            term = ext[:, :, K - 1 + t - s] * weight[:, K - 1 - s]
            if tap_mask is not None:
                term = term * tap_mask[:, :, t, s, None]
            total = total + term
        rows.append(total)
    return torch.stack(rows, dim=2)


def inputs(c: int, K: int, masked: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    B, C = 2, 3
    chunks = torch.randn(B, 2, c, C, dtype=torch.float64, generator=g, requires_grad=True)
    halo = torch.randn(B, 2, K - 1, C, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(C, K, dtype=torch.float64, generator=g, requires_grad=True)
    mask = None
    if masked:
        mask = (torch.rand(B, 2, c, K, generator=g) < 0.7).to(torch.float64)
        mask[..., 0] = 1  # tap 0 reads the token itself
    return chunks, halo, weight, mask


@pytest.mark.parametrize("c,K,masked", [(6, 4, False), (6, 4, True), (2, 4, True), (1, 4, False), (3, 2, True)])
def test_conv_and_its_grads_match_the_tap_by_tap_sum(c, K, masked):
    chunks, halo, weight, mask = inputs(c, K, masked, seed=c * 10 + K + masked)
    dy = torch.randn(2, 2, c, 3, dtype=torch.float64)
    got = causal_conv(chunks, halo, weight, mask)
    want = reference(chunks, halo, weight, mask)
    assert (got - want).abs().max() < TOL
    for a, b in zip(torch.autograd.grad(got, (chunks, halo, weight), dy),
                    torch.autograd.grad(want, (chunks, halo, weight), dy)):
        assert (a - b).abs().max() < TOL


def test_gradcheck_with_a_mask_and_chunks_shorter_than_the_halo():
    chunks, halo, weight, mask = inputs(2, 4, True, seed=3)
    assert torch.autograd.gradcheck(lambda x, h, w: causal_conv(x, h, w, mask), (chunks, halo, weight))


def test_the_reference_catches_a_tap_off_by_one():
    """The comparison above would see a tap reading the wrong token."""
    chunks, halo, weight, _ = inputs(6, 4, False, seed=5)
    shifted = torch.cat([halo[:, :, 1:], chunks[:, :, :1]], dim=2)  # every halo token one step later
    assert (causal_conv(chunks, shifted, weight, None) - reference(chunks, halo, weight, None)).abs().max() > 1e-3
