"""Attention sinks (ds_tsp.core.layers.attention.sinks) on every attention path's (out, lse), against a plain
softmax over [scores, sink] with the sink's column dropped (transformers' GPT-OSS eager attention), float64.

Paths: the causal kernels (a chunk with a key prefix, q_start > 0), the masked decomposition (packed documents and a
sliding window, both CPU backends) and the varlen entry point (its fakes from test_varlen, through both adapter
kinds). Each applies the sinks to its merged (out, lse); its backward gets out = o', dout = dO' * g and the ORIGINAL
lse. out, dq, dk, dv and d sinks must equal autograd through the reference to 1e-12; and sinks must matter (the
output without them is far off). The cp ring merges by lse before the sinks too: the model tests run it
(tests/cp/test_cp.py's GPT-OSS case).
"""
from __future__ import annotations

import pytest
import torch
from test_document_attention import SCALE, dense_mask, make_inputs
from test_varlen import packed_math  # noqa: F401 - the fixture routing backend "math" through a varlen adapter

from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.masked import masked_attention_backward, masked_attention_forward
from ds_tsp.core.layers.attention.sinks import sinks_backward, sinks_forward

HQ, HKV = 4, 2


def sinked_reference(q, k, v, sinks, doc_starts, window, q_start):
    """transformers' GPT-OSS eager attention: softmax over [scores, sink], the sink's column dropped."""
    B, Lq = q.shape[:2]
    Lk = k.shape[1]
    kk, vv = (x.repeat_interleave(HQ // HKV, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * SCALE
    mask = torch.stack([dense_mask(doc_starts[b], window, q_start, Lk) for b in range(B)])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    logits = torch.cat((scores, sinks.view(1, HQ, 1, 1).expand(B, HQ, Lq, 1)), dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv)


def run(forward, backward, doc_starts, window, q_start, Lq):
    q, k, v, dout = make_inputs(len(doc_starts), Lq, q_start, HQ, HKV, seed=3)
    sinks = torch.tensor([-1.0, 0.3, 1.7, 4.0], dtype=torch.float64)  # from a light to a dominant sink
    out, lse = forward(q, k, v)
    sinked = sinks_forward(out, lse, sinks)
    dout_kernel, dsinks = sinks_backward(dout, sinked, lse, sinks)
    dq, dk, dv = backward(dout_kernel, q, k, v, sinked, lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = sinked_reference(*leaves, doc_starts, window, q_start)
    want.backward(dout)
    for name, got, ref in (("out", sinked, want.detach()), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                           ("dv", dv, leaves[2].grad), ("dsinks", dsinks, leaves[3].grad)):
        assert float((got - ref).norm() / ref.norm()) < 1e-12, name
    assert float((out - sinked).norm() / sinked.norm()) > 0.1  # the sinks change the output


CASES = [([(0,)], None, 8, 8),                          # a chunk over its key prefix, one document
         ([(0, 5, 11), (0, 9)], 3, 0, 16),               # documents and a window, two layouts
         ([(0, 10, 30, 33, 40)], 7, 32, 16)]             # a zigzag-like chunk, pieces starting mid-tile


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_causal_kernels(backend):
    kw = dict(q_start=8, scale=SCALE, backend=backend)
    run(lambda q, k, v: kernels.attention_forward(q, k, v, **kw),
        lambda do, q, k, v, o, lse: kernels.attention_backward(do, q, k, v, o, lse, **kw), *CASES[0])


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("case", CASES[1:], ids=["documents-window", "zigzag-chunk"])
def test_masked_documents_and_windows(backend, case):
    kw = dict(q_start=case[2], doc_starts=case[0], window=case[1], scale=SCALE, backend=backend)
    run(lambda q, k, v: masked_attention_forward(q, k, v, **kw),
        lambda do, q, k, v, o, lse: masked_attention_backward(do, q, k, v, o, lse, **kw), *case)


@pytest.mark.parametrize("adapter", ["aten", "flash_attn_2.5"])
def test_varlen(packed_math, adapter):  # noqa: F811 - the fixture
    packed_math(adapter)
    doc_starts, window, q_start, Lq = CASES[2]
    kw = dict(q_start=q_start, doc_starts=doc_starts, window=window, scale=SCALE, backend="math")
    run(lambda q, k, v: masked_attention_forward(q, k, v, **kw),
        lambda do, q, k, v, o, lse: masked_attention_backward(do, q, k, v, o, lse, **kw), *CASES[2])
