"""TSP Gated DeltaNet (ds_tsp.model.modules.gated_deltanet) against transformers' own layer, float64.

Reference: transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet with its float32 casts widened to float64
(ds_tsp.tools.gdn_reference), packed documents run one by one (what its kernels do with cu_seq_lens). Tolerance
1e-10 absolute on outputs of size ~1 (float64 agreement is ~1e-14: the gap is 4 orders of magnitude; a wrong halo,
a missed document reset or a transition composed out of order is off by > 1e-2, checked by the tests below that
break one thing on purpose).

One 4-rank spawn runs every multi-rank case: D=2 on ranks (0, 1) and (2, 3) at once (two different cases), then
D=4 on all four. Every case compares the output, dx and EVERY weight grad (unsharded) with the reference, and its
recorded collectives are replayed under NCCL's rules (tests/helpers/nccl_rules.py).
| case            | D | format     | S  | c | documents (per row)  | what it covers                                   |
|-----------------|---|------------|----|---|----------------------|--------------------------------------------------|
| docs_spanning   | 2 | qwen3_5    | 20 | 5 | (0,), (0, 3, 7, 16)  | documents across ranks, halo masked at a start   |
| short_chunks    | 2 | qwen3_next | 8  | 2 | (0, 5), (0,)         | chunks shorter than the halo (K-1 = 3); the      |
|                 |   |            |    |   |                      | per-key-head checkpoint layout                   |
| d4_short_chunks | 4 | qwen3_5    | 16 | 2 | (0, 7), (0, 1, 2, 9) | D=4, halos over several chunks and ranks, 1-token|
|                 |   |            |    |   |                      | documents, the weight channel                    |
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks
from nccl_rules import check

TOL = 1e-10

CASES = {
    "docs_spanning": dict(D=2, ranks=(0, 1), fmt="qwen3_5", S=20, docs=((0,), (0, 3, 7, 16)), nk=2, nv=4, seed=1),
    "short_chunks": dict(D=2, ranks=(2, 3), fmt="qwen3_next", S=8, docs=((0, 5), (0,)), nk=2, nv=4, seed=2),
    "d4_short_chunks": dict(D=4, ranks=(0, 1, 2, 3), fmt="qwen3_5", S=16, docs=((0, 7), (0, 1, 2, 9)), nk=4, nv=8,
                            seed=3, weight_channel=True),
}
HIDDEN, DK, DV, KERNEL = 16, 4, 4, 4


def hf_layer(fmt: str, nk: int, nv: int, seed: int, kernel: int = KERNEL, hidden: int = HIDDEN, dk: int = DK,
             dv: int = DV):
    """transformers' layer in float64 (casts widened), weights drawn from `seed` (A_log, dt_bias included)."""
    from ds_tsp.tools.gdn_reference import float64_gated_deltanet_

    common = dict(hidden_size=hidden, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                  linear_value_head_dim=dv, linear_conv_kernel_dim=kernel, num_hidden_layers=1,
                  layer_types=["linear_attention"])
    if fmt == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Layer
        config = Qwen3_5TextConfig(**common)
    else:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Layer
        config = Qwen3NextConfig(**common)
    torch.manual_seed(seed)
    layer = Layer(config, 0).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.4)
    return float64_gated_deltanet_(layer), config


def tsp_shape(nk: int, nv: int, fmt: str, eps: float, kernel: int = KERNEL, hidden: int = HIDDEN, dk: int = DK,
              dv: int = DV):
    from ds_tsp.core.shape.model_shape import ModelShape

    return ModelShape(vocab_size=8, hidden_size=hidden, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=2, layer_types=("linear_attention",), linear_num_key_heads=nk,
                      linear_num_value_heads=nv, linear_key_head_dim=dk, linear_value_head_dim=dv,
                      linear_conv_kernel_dim=kernel, rms_norm_eps=eps, hybrid_family=fmt)


def tsp_layer(ref, config, fmt: str, comm, kernel: int = KERNEL, hidden: int = HIDDEN, dk: int = DK, dv: int = DV):
    """TSPGatedDeltaNet holding this rank's slices of `ref`'s weights."""
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.model.modules.gated_deltanet import TSPGatedDeltaNet

    shape = tsp_shape(config.linear_num_key_heads, config.linear_num_value_heads, fmt, config.rms_norm_eps, kernel,
                      hidden, dk, dv)
    layer = TSPGatedDeltaNet(shape, comm, TSPOptions(), torch.float64, "cpu", hf_format=fmt)
    full = {k: v.detach() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        layer.packed_shard.copy_(layer.shard_full(full))
        layer.norm.weight.copy_(full["norm.weight"])
    return layer


def _errors(ref, layer, x, dy, docs, y, dx, grad_shards, norm_grad) -> dict:
    """max |TSP - reference| of the output, dx and every weight grad (names as transformers')."""
    from ds_tsp.tools.gdn_reference import reference_with_documents

    x = x.clone().requires_grad_()
    y_ref = reference_with_documents(ref, x, docs)
    names, params = zip(*ref.named_parameters())
    grads = torch.autograd.grad(y_ref, (x, *params), dy)
    full = layer.unshard(grad_shards)
    full["norm.weight"] = norm_grad
    errors = {"y": (y - y_ref).abs().max().item(), "dx": (dx - grads[0]).abs().max().item()}
    errors.update({n: (full[n] - g).abs().max().item() for n, g in zip(names, grads[1:])})
    errors["scale"] = min(y_ref.abs().max().item(), grads[0].abs().max().item(),
                          *(g.abs().max().item() for g in grads[1:]))
    return errors


def _run_case(name: str, group, weight_group) -> dict:
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.tokens.zigzag import shard, unshard

    cfg = CASES[name]
    D = cfg["D"]
    comm = TSPComm(group, weight_group=weight_group)
    ref, config = hf_layer(cfg["fmt"], cfg["nk"], cfg["nv"], cfg["seed"])
    layer = tsp_layer(ref, config, cfg["fmt"], comm)
    g = torch.Generator().manual_seed(100 + cfg["seed"])
    x = torch.randn(2, cfg["S"], HIDDEN, dtype=torch.float64, generator=g)
    dy = torch.randn(2, cfg["S"], HIDDEN, dtype=torch.float64, generator=g)
    x_local = shard(x, D, comm.rank).requires_grad_()
    with comm.recording() as rec:
        y_local = layer(x_local, cfg["docs"])
        y_local.backward(shard(dy, D, comm.rank))
    gathered = [comm.gather_to(t.detach().contiguous()) for t in (y_local, x_local.grad, layer.packed_shard.grad)]
    out = {"ops": rec.ops, "rank": dist.get_rank()}
    if comm.rank == 0:
        y, dx, shards = gathered
        out["errors"] = _errors(ref, layer, x, dy, cfg["docs"], unshard(y), unshard(dx), shards,
                                layer.norm.weight.grad)
    return out


def _all_cases() -> dict:
    me = dist.get_rank()
    pairs = {ranks: (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
             for ranks in sorted({c["ranks"] for c in CASES.values()})}
    out = {}
    for name, cfg in CASES.items():
        if me in cfg["ranks"]:
            group, weights = pairs[cfg["ranks"]]
            out[name] = _run_case(name, group, weights if cfg.get("weight_channel") else None)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_on_local_ranks(_all_cases, 4, timeout_s=600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_and_every_grad_match_transformers(runs, name):
    cfg = CASES[name]
    errors = runs[cfg["ranks"][0]][name]["errors"]
    scale = errors.pop("scale")
    assert scale > 1e-3, f"{name}: a reference output or grad is ~0 ({scale}): the comparison would prove nothing"
    assert max(errors.values()) < TOL, f"{name}: {errors}"
    assert {"y", "dx", "in_proj_" + ("qkv" if cfg["fmt"] == "qwen3_5" else "qkvz") + ".weight", "conv1d.weight",
            "A_log", "dt_bias", "norm.weight", "out_proj.weight"} <= set(errors)


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_collectives_obey_nccl_rules(runs, name):
    cfg = CASES[name]
    ops = {r: runs[r][name]["ops"] for r in cfg["ranks"]}
    report = check(ops)
    assert report.ok and report.completed == report.total > 0, f"{name}:\n{report}"
    kinds = {o["kind"] for o in ops[cfg["ranks"][0]]}
    assert {"broadcast", "all_gather", "reduce_scatter", "reduce"} <= kinds, kinds
    sequences = [[(o["kind"], o["shape"], o["dtype"], o.get("root")) for o in rank_ops] for rank_ops in ops.values()]
    assert all(s == sequences[0] for s in sequences)
    want = "weights" if cfg.get("weight_channel") else "tsp"
    assert {o["channel"] for o in ops[cfg["ranks"][0]] if o["kind"] in ("broadcast", "reduce")} == {want}
