"""The attention's GEMM work per mode, counted op by op: every projection weight W [out, in] costs 2 n |W| forward
and 4 n |W| backward (n local tokens); the memory-optimal mode adds exactly one re-projection of q, k and v (the
backward K/V re-gather and the q its kernels read), never a second one for the raw projection a q / k norm's
backward reads; with the projections saved (speed mode, or recompute_projections off alone) nothing is projected
twice: the raw k / v those norms read are saved with them (AttentionSpec.saved_per_kv_group). OLMo's
whole-projection norm adds its two documented [wq, wk] passes (ds_tsp.core.layers.attention.projection_norm) in
every mode. One rank (D=1): the count is per block and does not depend on D."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers.attention.tsp_attention import AttentionSpec, tsp_attention
from ds_tsp.core.tokens.rope import rope_cos_sin

_GEMMS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.addmm: (1, 2), torch.ops.aten.addmm_: (1, 2)}


class _GemmFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        which = _GEMMS.get(func.overloadpacket)
        if which is not None:
            a, b = args[which[0]], args[which[1]]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


H, HKV, DH, HID, B, L = 4, 2, 8, 16, 2, 12

CASES = {  # name -> (AttentionSpec fields, q norm, k norm)
    "plain": ({}, False, False),
    "qk_norm": ({"qk_norm_eps": 1e-6}, True, True),
    "qk_norm_gated": ({"qk_norm_eps": 1e-6, "output_gate": True, "qkv_bias": True}, True, True),
    "projection_norm": ({"qk_norm_eps": 1e-6, "projection_norm": True}, True, True),
    "value_norm_k_eq_v": ({"qk_norm_eps": 1e-6, "value_norm_eps": 1e-6, "values_from_keys": True}, True, True),
    # no k norm: the v norm alone reads k's raw projection (as v)
    "value_norm_k_eq_v_no_qk_norm": ({"value_norm_eps": 1e-6, "values_from_keys": True}, False, False),
}


def _run(fields: dict, recompute: bool, keep_kv: bool, grads: list | None = None) -> tuple[int, dict]:
    spec = AttentionSpec(**{"hidden": HID, "heads_per_block": H, "kv_heads_per_block": HKV, "head_dim": DH,
                            "qkv_bias": False, "recompute_projections": recompute, "keep_gathered_kv": keep_kv,
                            **fields})
    gen = torch.Generator().manual_seed(0)
    shard = torch.randn(spec.layout.numel, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(B, L, HID, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(L)[None].expand(B, L), DH, 10000.0, torch.float64)
    qk_norm = None
    if spec.qk_norm_eps is not None:
        width = (H * DH, HKV * DH) if spec.projection_norm else (DH, DH)
        qk_norm = tuple(torch.randn(n, generator=gen, dtype=torch.float64, requires_grad=True) for n in width)
    with _GemmFlops() as counted:
        tsp_attention(x, shard, cos, sin, spec, TSPComm(None), qk_norm=qk_norm).pow(2).sum().backward()
    if grads is not None:
        grads += [x.grad, shard.grad, *(w.grad for w in qk_norm or ())]
    return counted.flops, {name: shape[0] * shape[1] for name, shape in spec.layout.pieces if name.startswith("w")}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["memory", "save_projections", "speed"])
def test_gemm_flops_are_the_minimum_plus_the_modes_recompute(name, mode):
    fields, q_norm, k_norm = CASES[name]
    recompute, keep_kv = {"memory": (True, False), "save_projections": (False, False), "speed": (False, True)}[mode]
    flops, sizes = _run(fields, recompute, keep_kv)
    n = B * L
    minimum = 6 * n * sum(sizes.values())
    kv = [w for w in ("wk", "wv") if w in sizes]
    if recompute:  # q for its kernels; k and v for the re-gather (kept K/V: only the raw k the k norm reads)
        extra = ["wq"] + (kv if not keep_kv else (["wk"] if k_norm else []))
    else:  # the saved q is its raw projection when a q norm reads that; the raw k / v the norms read are saved
        extra = []
    if fields.get("projection_norm"):  # the sums of squares before the blocks, the raw grads after them
        extra += ["wq", "wk"] * 2
    assert flops == minimum + sum(2 * n * sizes[w] for w in extra), (flops, minimum, extra)


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_projections_give_the_memory_modes_grads(name):
    """What the modes save instead of projecting again (q, the local K/V, the raw k / v the norms read) gives the
    same grads as projecting again (float64; x, the packed shard and the q / k norm weights)."""
    fields = CASES[name][0]
    reference: list = []
    _run(fields, True, False, reference)
    for recompute, keep_kv in ((False, False), (False, True), (True, True)):
        got: list = []
        _run(fields, recompute, keep_kv, got)
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

