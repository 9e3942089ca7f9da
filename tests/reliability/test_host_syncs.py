"""Host syncs of one training step (forward + backward) of ShardedCausalLM, at D=1 and D=2 (gloo).

Counted on the CPU by what runs (tests/helpers/sync_counter.py), so a CPU test sees what a GPU step would stall on. The
budget: NOTHING inside the decoder layers, kernels, document attention, embedding or loss; ONE device-to-host
read per step in the input checks (ShardedCausalLM._check_inputs gathers a fixed-size payload and reads it once).
Packed documents, left padding and a sliding-window layer make document attention run its blocked path, with
batch rows of the same layout that are not adjacent (an index tensor, built once on the device). A rank with more
document breaks than documents.LAYOUT_SLOTS falls back to gathering the positions: exactly one more read, same loss.
"""
from __future__ import annotations

import random

import pytest
import torch
from local_ranks import run_on_local_ranks
from sync_counter import SyncCounter

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens import documents
from ds_tsp.core.tokens.zigzag import shard, shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

# every mechanism a step can take at once: q/k/v bias, q/k norms, a window, position-scaled queries (Ministral 3),
# an embedding padding row, Gemma 3's sandwich norms, GeGLU, scaled embeddings, softmax scale and sliding-layer RoPE,
# GPT-OSS's attention sinks and o_proj bias (its experts: tests/cp/test_cp_moe.py counts a GPT-OSS step's reads),
# Gemma 4's full layers' head_dim and kv heads with keys as values, v norms, layer scalars, per-layer inputs and
# soft-capped logits
SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   qkv_bias=True, qk_norm=True, attention_windows=(None, 5), query_scale_beta=0.1,
                   query_scale_period=8, pad_token_id=0, sandwich_norms=True, mlp_activation="gelu_tanh",
                   embedding_scale=5.5, attention_scale=0.3, sliding_rope_theta=500.0, attention_sinks=True,
                   attention_out_bias=True, full_head_dim=12, full_num_kv_heads=1, full_values_from_keys=True,
                   value_norm=True, layer_scalars=True, per_layer_input_size=4, per_layer_input_vocab_size=63,
                   final_logit_softcapping=0.5)
# what cannot join the shape above: OLMo 3's q/k norms over the whole projection (two more shard streams) and
# post-norms
OLMO3_SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, attention_windows=(5, None), pad_token_id=1, projection_qk_norm=True,
                         post_norms=True, sliding_rope_theta=500.0)
# Gemma 4's KV sharing (the last layer reads layer 1's K/V; no q/k/v bias there) with a double-wide MLP
GEMMA4_KV_SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                             num_kv_heads=2, attention_windows=(5, None, None), qk_norm=True, sandwich_norms=True,
                             mlp_activation="gelu_tanh", attention_scale=1.0, sliding_rope_theta=500.0,
                             full_head_dim=12, full_num_kv_heads=1, full_values_from_keys=True, value_norm=True,
                             layer_scalars=True, per_layer_input_size=4, per_layer_input_vocab_size=61,
                             kv_shared_layers=1, double_wide_shared_mlp=True)
B, S = 3, 24
DOCS = [(7, 9, 8), (24,), (7, 9, 8)]  # rows 0 and 2 share a layout, row 1 does not: a non-contiguous row group
LEFT_PAD = 3  # row 1


def _batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE.vocab_size, (B, S), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
    batch = {"input_ids": ids, "labels": labels}
    if kind == "packed":
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, :LEFT_PAD] = 0
        batch["attention_mask"] = mask
    return batch


def _classifier_step(comm: TSPComm) -> dict:
    """A sequence classifier's step: left-padded rows, the pooled token found over the group (one all-gather, no
    read), the score summed over it."""
    from ds_tsp.model.sequence_classifier import ShardedSequenceClassifier

    batch = _batch("packed")
    b = shard_batch(tsp=comm.size, rank=comm.rank, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model = ShardedSequenceClassifier(SHAPE, comm, num_labels=2, pad_token_id=0, dtype=torch.float64).init_weights_(0)
    labels = torch.tensor([0, 1, 1])
    with SyncCounter() as syncs:
        h, _ = model.final_hidden(b["input_ids"], b["position_ids"], b["attention_mask"])
        logits = model.pooled_logits(h, b["input_ids"], b["seq_len"])
        torch.nn.functional.cross_entropy(logits, labels).backward()
    return {"events": [(e.kind, e.op, e.region, e.where) for e in syncs.events], "loss": float(logits.sum()),
            "doc_starts": None}


def _step(comm: TSPComm, kind: str, slots: int | None, shape: ModelShape = SHAPE) -> dict:
    """One forward + backward under the counter; events as plain tuples (they cross process boundaries)."""
    if kind == "classifier":
        return _classifier_step(comm)
    b = shard_batch(tsp=comm.size, rank=comm.rank, **_batch(kind))
    args = (b["input_ids"], b["shift_labels"], b["position_ids"], b.get("attention_mask"))
    model = ShardedCausalLM(shape, comm, dtype=torch.float64).init_weights_(0)
    default = documents.LAYOUT_SLOTS
    documents.LAYOUT_SLOTS = slots or default
    try:
        doc_starts = model._check_inputs(*args)[1]
        with SyncCounter() as syncs:
            loss = model(*args)
            logged = model.loss_for_logging(loss)
            loss.backward()
    finally:
        documents.LAYOUT_SLOTS = default
    return {"events": [(e.kind, e.op, e.region, e.where) for e in syncs.events], "loss": float(logged),
            "doc_starts": doc_starts}


# 31 slots: the edges fit, the breaks do not; classifier: TSPForSequenceClassification's step
CASES = [("plain", None, SHAPE), ("packed", None, SHAPE), ("packed", 31, SHAPE), ("packed", None, OLMO3_SHAPE),
         ("classifier", None, SHAPE), ("packed", None, GEMMA4_KV_SHAPE)]


def _all_cases(world: bool) -> list[dict]:
    import torch.distributed as dist

    comm = TSPComm(dist.group.WORLD) if world else TSPComm.single()
    return [_step(comm, kind, slots, shape) for kind, slots, shape in CASES]


@pytest.fixture(scope="module")
def runs() -> dict[int, list[list[dict]]]:
    """{D: per rank, per case: result}."""
    return {1: [_all_cases(False)], 2: run_on_local_ranks(_all_cases, 2, True, timeout_s=120)}


@pytest.mark.parametrize("tsp", [1, 2])
def test_no_sync_outside_the_input_check(runs, tsp):
    for rank, results in enumerate(runs[tsp]):
        for (kind, slots, _), result in zip(CASES, results):
            elsewhere = [e for e in result["events"] if e[2] != "input_checks"]
            assert not elsewhere, (tsp, rank, kind, slots, elsewhere)


@pytest.mark.parametrize("tsp", [1, 2])
def test_one_read_per_step_in_the_input_check(runs, tsp):
    for rank, results in enumerate(runs[tsp]):
        for (kind, slots, _), result in zip(CASES, results):
            checks = [e for e in result["events"] if e[2] == "input_checks"]
            assert len(checks) == (2 if slots else 1), (tsp, rank, kind, slots, checks)
            assert all(e[:2] == ("read", "tolist") for e in checks), checks


@pytest.mark.parametrize("tsp", [1, 2])
def test_packed_step_runs_document_attention_and_the_fallback_agrees(runs, tsp):
    starts = ((0, 7, 16), (0, LEFT_PAD), (0, 7, 16))
    for results in runs[tsp]:
        plain, packed, fallback = results[:3]
        assert plain["doc_starts"] is None
        assert packed["doc_starts"] == fallback["doc_starts"] == starts
        assert packed["loss"] == pytest.approx(fallback["loss"], rel=1e-13)
        assert abs(packed["loss"] - plain["loss"]) > 1e-6  # the layout changed the computation (near-uniform init)
    for case in (1, 4):  # loss_for_logging, the classifier's summed scores: the same on every rank
        values = {round(r[case]["loss"], 12) for r in runs[tsp]}
        assert len(values) == 1, (case, values)


def test_a_sync_inside_a_layer_is_caught(monkeypatch):
    from ds_tsp.core.layers.attention import kernels

    merge = kernels._merge

    def reading_merge(*args):
        out = merge(*args)
        float(out[1].max())  # what an innocent-looking check inside a kernel would cost on a GPU
        return out

    monkeypatch.setattr(kernels, "_merge", reading_merge)
    result = _step(TSPComm.single(), "packed", None)
    layers = [e for e in result["events"] if e[2] == "layers"]
    assert layers and all("kernels.py" in e[3] or "masked.py" in e[3] for e in layers), layers


# --- the fixed-size layout payload decodes to exactly what document_starts finds on the global batch ------------

def _random_layout(rng: random.Random, tsp: int):
    batch, c = rng.randint(1, 3), rng.randint(1, 5)
    seq = 2 * tsp * c
    positions = torch.empty(batch, seq, dtype=torch.long)
    for b in range(batch):
        t = 0
        while t < seq:
            n = min(rng.randint(1, seq), seq - t)
            positions[b, t:t + n] = torch.arange(n) + (rng.randint(1, 3) if rng.random() < 0.2 else 0)
            t += n
    mask = None
    if rng.random() < 0.5:
        mask = torch.ones(batch, seq, dtype=torch.long)
        for b in range(batch):
            mask[b, :rng.randint(0, seq // 3)] = 0
            mask[b, seq - rng.randint(0, seq // 3):] = 0
            if rng.random() < 0.15:
                mask[b, rng.randrange(seq)] ^= 1  # usually a hole
    return positions, mask


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as err:  # noqa: BLE001 - the error itself is compared
        return type(err).__name__, str(err)


@pytest.mark.parametrize("tsp", [1, 2, 3, 4])
def test_layout_payload_matches_document_starts(tsp):
    rng = random.Random(tsp)
    decoded = overflowed = 0
    for _ in range(150):
        positions, mask = _random_layout(rng, tsp)
        slots = rng.choice([None, 24, 40])
        shards = [documents.shard_layout(shard(positions, tsp, p), None if mask is None else shard(mask, tsp, p),
                                         slots=slots) for p in range(tsp)]
        got = _outcome(lambda: documents.decode_layout([s.tolist() for _, s in shards], [int(n) for n, _ in shards],
                                                       positions.shape[0], positions.shape[1] // tsp, slots=slots))
        if got == ("ok", documents.OVERFLOW):  # the input check's fallback: a read bounded by the break counts
            overflowed += 1
            bound = sum(int(n) for n, _ in shards) + positions.shape[0] * 2 * tsp
            assert _outcome(lambda: documents.document_starts(positions, mask, max_breaks=bound)) == \
                _outcome(lambda: documents.document_starts(positions, mask)), (positions, mask)
            continue
        decoded += 1
        assert got == _outcome(lambda: documents.document_starts(positions, mask)), (positions, mask)
    assert decoded > 100 and overflowed > 0


def test_shard_then_step_reads_once_and_still_checks_the_mask():
    """shard_batch(check_values=False) leaves the value checks to the model's one read, mask values included."""
    from ds_tsp.core.errors import TSPConfigError

    model = ShardedCausalLM(SHAPE, TSPComm.single(), dtype=torch.float64)
    batch = _batch("packed")
    batch["attention_mask"][0, 5] = 2
    with SyncCounter() as syncs, pytest.raises(TSPConfigError, match=r"only 0 \(padding\) and 1"):
        b = shard_batch(tsp=1, rank=0, check_values=False, **batch)
        model(b["input_ids"], b["shift_labels"], b["position_ids"], b["attention_mask"])
    assert [e.op for e in syncs.events] == ["tolist"], syncs.events


# --- MoE MLP (ds_tsp.core.layers.moe.layer): at most ONE read per MoE layer forward, none in backward ----------------
MOE_LAYERS = 2


def _moe_syncs(world: bool) -> dict:
    """{(dispatch, path, routing): (forward events, backward events)} of MOE_LAYERS MoE layers, forced expert-GEMM
    path (grouped runs on this torch's CPU kernels in float32); routing: softmax top-k, and GLM-4.5's grouped sigmoid
    routing with its correction bias."""
    import dataclasses

    import torch.distributed as dist
    from moe_reference import MoECase, hf_block, inputs, spec_of

    import ds_tsp.core.layers.moe.layer as moe
    from ds_tsp.core.layers.moe.experts import _grouped_mm_fn

    comm = TSPComm(dist.group.WORLD) if world else TSPComm.single()
    case = MoECase(skew=(2,), seed=9, hidden=16, ffn=8)
    softmax = spec_of(case, comm.size)
    grouped = dataclasses.replace(softmax, routing="sigmoid_grouped", groups=4, topk_groups=2, scaling=2.5)
    bias = 0.3 * torch.randn(case.num_experts, generator=torch.Generator().manual_seed(4))
    block = hf_block(case)
    e_r = softmax.experts_per_rank
    own = slice(comm.rank * e_r, (comm.rank + 1) * e_r)
    packed = softmax.layout.pack({"gate_up": block.experts.gate_up_proj[own], "down": block.experts.down_proj[own]})
    packed = packed.detach().float().requires_grad_(True)
    router = block.gate.weight.detach().float().requires_grad_(True)
    x = shard(inputs(case, comm.size)["x"], comm.size, comm.rank).float().requires_grad_(True)
    select, out = moe.select_expert_gemm, {}
    try:
        for path in ("loop", "grouped") if _grouped_mm_fn() is not None else ("loop",):
            moe.select_expert_gemm = lambda device, dtype, *_, path=path: path
            for dispatch, spec in (("ring", softmax), ("all_to_all", softmax), ("ring", grouped),
                                   ("all_to_all", grouped)):
                with SyncCounter() as fwd:
                    h, logits = x, []
                    choice = bias if spec is grouped else None
                    for _ in range(MOE_LAYERS):
                        h, lg = moe.tsp_moe_mlp(h, router, packed, spec, comm, dispatch=dispatch,
                                                correction_bias=choice)
                        logits.append(lg)
                    aux = 0 if spec is grouped else moe.moe_aux_loss_share(logits, case.num_experts, case.top_k, comm)
                    loss = h.square().sum() + aux
                with SyncCounter() as bwd:
                    loss.backward()
                out[dispatch, path, spec.routing] = ([(e.kind, e.op, e.region, e.where) for e in fwd.events],
                                                     [(e.kind, e.op, e.region, e.where) for e in bwd.events])
    finally:
        moe.select_expert_gemm = select
    return out


@pytest.fixture(scope="module")
def moe_runs() -> dict[int, list[dict]]:
    return {1: [_moe_syncs(False)], 2: run_on_local_ranks(_moe_syncs, 2, True, timeout_s=120)}


@pytest.mark.parametrize("tsp", [1, 2])
def test_moe_layer_reads_the_counts_once_per_forward(moe_runs, tsp):
    """all_to_all: the split sizes (one .tolist() per layer forward); ring, on both expert-GEMM paths: the
    per-expert counts that bound each step's owner rows, the same one read. Backward and the aux loss: nothing."""
    for rank, results in enumerate(moe_runs[tsp]):
        assert ("ring", "loop", "softmax_topk") in results and ("all_to_all", "loop", "sigmoid_grouped") in results
        for (dispatch, path, _), (fwd, bwd) in results.items():
            assert len(fwd) == MOE_LAYERS, (tsp, rank, dispatch, path, fwd)
            assert all(e[:3] == ("read", "tolist", "layers") and "core/layers/moe/" in e[3] for e in fwd), fwd
            assert not bwd, (tsp, rank, dispatch, path, bwd)
