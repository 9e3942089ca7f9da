"""Property-based tests (hypothesis): the zigzag partitioner, document packing and random model shapes.

Every hypothesis run here is derandomized with a fixed example count and no deadline, so CI sees the same
examples on every run (for a given hypothesis version) and the time budget is fixed.

Partitioner and packing (pure tensor code, one process; strategies over D in 1..8, S in 1..60, B in 1..3):
- shard / unshard round trip on coordinate-encoded data along any dim: rank p holds exactly the tokens of chunks p
  and 2D-1-p (checked against an independent formula), and unshard / rank_order_to_global_index undo it;
- every padded position is held by exactly one rank, each real token exactly once, and the causal work of every
  rank (sum of position + 1 over its tokens) is EXACTLY equal (zigzag balance);
- shard_batch: target of global position t is labels[t + 1] (no target lost at a chunk edge), the multiset of
  targets over all ranks is the original one, padding gets the pad id / ignore_index / continuing positions,
  labels_are_shifted gives the same shards as shifting outside;
- attention_mask: a target is kept iff both tokens are real and the label is not ignored; the mask is sharded with
  0 on the tail; document_starts rejects exactly the masks with padding between real tokens;
- document_starts recovers the documents from restarting position_ids (also after shard -> all-gather order ->
  unshard, as the model does it, with the zigzag tail), and the attention_mask adds the padding edges even when
  the padding's positions continue a document.

Model (`test_model_matches_reference`, one spawned gloo group per D, all of that degree's configurations inside):
hypothesis draws CASES_PER_DEGREE configurations per D in the parent (tests/property_cases.model_cases):
heads / kv heads that check_tsp_degree accepts (kv < D: replicated kv heads), explicit or implied head_dim, free
hidden (<= 48), intermediate a multiple of D, vocab 3..64 (often not a multiple of D, sometimes so small that
the last ranks' vocab shards are all padding: PADDING_SHARD_CASES pins the bug these tests found there), 1-2 layers, qkv_bias, qk_norm,
tied embeddings, per-layer sliding windows (1 .. S+2) or none, rope theta / linear scaling, S never a multiple of
2D (sometimes < 2D), batch 1..3 (rows sharing a layout or not), 1..4 documents per row with boundaries anywhere or
on chunk edges, first documents continued at a position offset, left/right padding by attention_mask, ignore
fractions, both CPU kernel backends, and every TSPOptions flag and comm overlap. Loss and every gradient in
float64 against the per-document single-device reference: norm-wise relative error < 1e-10 (ds_tsp.tools.verify's
float64 tolerance; measured worst 1.2e-14 over 62 configurations: 20/18/12/12 at D=1/2/3/4); every rank must
report the same loss. A failure lists every failing configuration (smallest first) with its repr, which is its
reproduction (see tests/helpers/property_cases.py). The draw is not shrunk (the checks run after it, in the spawned
group); showing the smallest failing configuration first stands in for shrinking. Measured: ~65 s for this file
on 2 busy cores (the four gloo groups ~4 / 11 / 15 / 23 s).
"""
from __future__ import annotations

import functools
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import ModelCase, Row, compare, draw_cases, model_cases, profile_scale, run_cases_on_ranks

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.documents import document_starts, documents_of_lengths
from ds_tsp.core.tokens.zigzag import (
    global_to_rank_order_index,
    pad_to,
    padded_length,
    rank_order_to_global_index,
    shard,
    shard_batch,
    shift_labels,
    unshard,
    zigzag_positions,
)

IGNORE = -100
FAST = settings(max_examples=150, derandomize=True, deadline=None, database=None)
TOLERANCE = 1e-10
CASES_PER_DEGREE = {1: 20, 2: 18, 3: 12, 4: 12}  # 62 configurations


def expected_position(tsp: int, padded: int, rank: int, j: int) -> int:
    """Global position of local slot j of `rank` (the zigzag rule, written independently of ds_tsp)."""
    c = padded // (2 * tsp)
    return rank * c + j if j < c else (2 * tsp - 1 - rank) * c + (j - c)


def encoded(batch: int, seq: int, extra: int, dim: int) -> torch.Tensor:
    """value = position * 1000 + batch * 10 + extra index; the sequence axis moved to `dim` (0, 1 or 2)."""
    x = (torch.arange(seq).view(1, seq, 1) * 1000 + torch.arange(batch).view(batch, 1, 1) * 10
         + torch.arange(extra).view(1, 1, extra))
    return x.movedim(1, dim).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# partitioner


@FAST
@given(tsp=st.integers(1, 8), seq=st.integers(1, 60), batch=st.integers(1, 3), extra=st.integers(1, 3),
       dim=st.integers(0, 2))
def test_shard_unshard_round_trip(tsp, seq, batch, extra, dim):
    x = encoded(batch, seq, extra, dim)
    padded = padded_length(seq, tsp)
    xp = pad_to(x, padded, -1, dim=dim)
    assert xp.size(dim) == padded and torch.equal(xp.narrow(dim, 0, seq), x)
    shards = [shard(xp, tsp, p, dim=dim) for p in range(tsp)]
    for p, s in enumerate(shards):
        assert s.size(dim) == padded // tsp
        for j in range(padded // tsp):
            g = expected_position(tsp, padded, p, j)
            want = xp.narrow(dim, g, 1)
            assert torch.equal(s.narrow(dim, j, 1), want), (tsp, seq, p, j, g)
        assert zigzag_positions(padded, tsp, p).tolist() == [expected_position(tsp, padded, p, j)
                                                             for j in range(padded // tsp)]
    assert torch.equal(unshard(shards, dim=dim), xp)
    gathered = torch.cat(shards, dim=dim)  # what an all-gather along the sequence produces
    assert torch.equal(gathered.index_select(dim, rank_order_to_global_index(padded, tsp)), xp)
    assert torch.equal(xp.index_select(dim, global_to_rank_order_index(padded, tsp)), gathered)


@FAST
@given(tsp=st.integers(1, 8), seq=st.integers(1, 200))
def test_every_token_once_and_zigzag_balance(tsp, seq):
    padded = padded_length(seq, tsp)
    assert padded % (2 * tsp) == 0 and seq <= padded < seq + 2 * tsp
    held = [zigzag_positions(padded, tsp, p) for p in range(tsp)]
    flat = torch.cat(held).tolist()
    assert sorted(flat) == list(range(padded))  # every position exactly once
    assert sorted(t for t in flat if t < seq) == list(range(seq))  # every real token exactly once
    assert {len(h) for h in held} == {padded // tsp}
    work = {int((h + 1).sum()) for h in held}  # causal attention: token t attends to t + 1 keys
    assert len(work) == 1, (tsp, seq, work)


@st.composite
def label_batches(draw):
    tsp, seq, batch = draw(st.integers(1, 6)), draw(st.integers(2, 50)), draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    labels = torch.randint(0, 1000, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < draw(st.sampled_from([0.0, 0.2, 0.9]))] = IGNORE
    kind = draw(st.sampled_from(["none", "full", "broadcast"]))
    positions = {"none": None, "full": torch.randint(0, 100, (batch, seq), generator=g),
                 "broadcast": torch.randint(0, 100, (1, seq), generator=g)}[kind]
    return tsp, ids, labels, positions, draw(st.integers(0, 5))


@FAST
@given(label_batches(), st.booleans())
def test_shard_batch_targets_and_positions(data, with_labels):
    tsp, ids, labels, positions, pad_id = data
    batch, seq = ids.shape
    labels = labels if with_labels else None
    parts = [shard_batch(ids, tsp=tsp, rank=p, labels=labels, position_ids=positions, pad_token_id=pad_id)
             for p in range(tsp)]
    padded = padded_length(seq, tsp)
    full_labels = ids if labels is None else labels
    full_pos = torch.arange(seq).expand(batch, seq) if positions is None else positions.expand(batch, seq)
    for p, part in enumerate(parts):
        assert part["seq_len"] == seq and part["padded_len"] == padded
        for j in range(padded // tsp):
            g = expected_position(tsp, padded, p, j)
            for b in range(batch):
                if g < seq:
                    assert part["input_ids"][b, j] == ids[b, g]
                    assert part["position_ids"][b, j] == full_pos[b, g]
                    want = full_labels[b, g + 1] if g + 1 < seq else IGNORE
                else:
                    assert part["input_ids"][b, j] == pad_id and part["position_ids"][b, j] == g
                    want = IGNORE
                assert part["shift_labels"][b, j] == want, (tsp, seq, p, j, g)
    # no target lost or duplicated at the chunk edges: the multiset over all ranks is the original one
    targets = torch.cat([part["shift_labels"] for part in parts], dim=1)
    for b in range(batch):
        got = sorted(t for t in targets[b].tolist() if t != IGNORE)
        assert got == sorted(t for t in full_labels[b, 1:].tolist() if t != IGNORE)
    if labels is not None:  # pre-shifted labels give the same shards
        for p, part in enumerate(parts):
            pre = shard_batch(ids, tsp=tsp, rank=p, labels=shift_labels(labels), labels_are_shifted=True,
                              position_ids=positions, pad_token_id=pad_id)
            assert torch.equal(pre["shift_labels"], part["shift_labels"])


@st.composite
def padded_rows(draw):
    """(tsp, ids, labels, attention_mask): every row (0*)(1+)(0*)."""
    tsp, seq, batch = draw(st.integers(1, 6)), draw(st.integers(2, 40)), draw(st.integers(1, 3))
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        left = draw(st.integers(0, seq - 1))
        right = draw(st.integers(0, seq - 1 - left))
        mask[b, left:seq - right] = 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=g) < 0.2] = IGNORE
    return tsp, ids, labels, mask


@FAST
@given(padded_rows())
def test_attention_mask_drops_padded_targets(data):
    tsp, ids, labels, mask = data
    batch, seq = ids.shape
    padded = padded_length(seq, tsp)
    parts = [shard_batch(ids, tsp=tsp, rank=p, labels=labels, attention_mask=mask) for p in range(tsp)]
    for p, part in enumerate(parts):
        for j in range(padded // tsp):
            g = expected_position(tsp, padded, p, j)
            for b in range(batch):
                real = g < seq and bool(mask[b, g])
                assert part["attention_mask"][b, j] == int(real)
                keep = real and g + 1 < seq and bool(mask[b, g + 1]) and labels[b, g + 1] != IGNORE
                assert part["shift_labels"][b, j] == (labels[b, g + 1] if keep else IGNORE), (tsp, b, g)
    assert torch.equal(unshard([part["attention_mask"] for part in parts])[:, :seq], mask)
    document_starts(torch.arange(seq).expand(batch, seq), mask)  # contiguous padding is accepted


@FAST
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=12), min_size=1, max_size=3).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_document_starts_rejects_padding_between_real_tokens(rows):
    mask = torch.tensor(rows)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    holes = any(re.search("10+1", "".join(map(str, r))) for r in rows)
    if holes:
        with pytest.raises(TSPConfigError, match="attention_mask row"):
            document_starts(positions, mask)
    else:
        document_starts(positions, mask)


@st.composite
def packed_rows(draw):
    """Rows of documents: (tsp, per row (left pad, doc lengths, right pad, first offset)), same length S."""
    tsp, seq, batch = draw(st.integers(1, 6)), draw(st.integers(2, 48)), draw(st.integers(1, 3))
    rows = []
    for _ in range(batch):
        left = draw(st.integers(0, min(4, seq - 1)))
        right = draw(st.integers(0, min(4, seq - 1 - left)))
        n = seq - left - right
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=6))) if n > 1 else []
        docs = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        rows.append((left, docs, right, left + draw(st.integers(0, 5))))
    return tsp, seq, rows


@FAST
@given(packed_rows())
def test_document_starts_from_restarting_positions(data):
    tsp, seq, rows = data
    batch = len(rows)
    positions = torch.zeros(batch, seq, dtype=torch.long)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    doc_only, with_mask = [], []
    for b, (left, docs, right, offset) in enumerate(rows):
        n = sum(docs)
        pos = documents_of_lengths(docs)
        assert pos.tolist() == [i for d in docs for i in range(d)]
        pos[:docs[0]] += offset  # the first document continues one that began earlier
        # padding positions CONTINUE the neighbouring documents: only the mask can separate them
        positions[b] = torch.cat((torch.arange(offset - left, offset), pos,
                                  torch.arange(right) + int(pos[-1]) + 1))
        mask[b, left:left + n] = 1
        starts = [left + s for s in torch.tensor([0, *docs]).cumsum(0)[:-1].tolist()]
        doc_only.append(tuple(sorted({0, *starts[1:]})))  # positions alone: the padding joins its neighbour
        with_mask.append(tuple(sorted({0, *starts, *([left + n] if right else [])})))
        # the rows' documents come back from the position ids
        assert [e - s for s, e in zip(starts, [*starts[1:], left + n])] == docs
    got = document_starts(positions)
    assert got == (None if all(r == (0,) for r in doc_only) else tuple(doc_only))
    got_masked = document_starts(positions, mask)
    assert got_masked == (None if all(r == (0,) for r in with_mask) else tuple(with_mask))

    # the model's path: every rank's sharded positions, gathered in rank order and unsharded, zigzag tail included
    parts = [shard_batch(torch.zeros(batch, seq, dtype=torch.long), tsp=tsp, rank=p, position_ids=positions,
                         attention_mask=mask) for p in range(tsp)]
    full_pos = unshard([part["position_ids"] for part in parts])
    full_mask = unshard([part["attention_mask"] for part in parts])
    assert torch.equal(full_pos[:, :seq], positions) and torch.equal(full_mask[:, :seq], mask)
    tail = document_starts(full_pos, full_mask)
    want = got_masked or ((0,),) * batch
    if tail is None:
        assert all(r == (0,) for r in want)
    else:
        assert tuple(tuple(s for s in r if s < seq) for r in tail) == tuple(want)


# ----------------------------------------------------------------------------------------------------------------
# model


@functools.lru_cache(maxsize=None)
def cases_for(tsp: int) -> tuple:
    cases = draw_cases(model_cases(tsp), CASES_PER_DEGREE[tsp])
    assert len(cases) == CASES_PER_DEGREE[tsp] * profile_scale(), \
        f"hypothesis drew {len(cases)} distinct configurations"
    return tuple(cases)


def test_model_configurations_cover_the_space():
    """The derandomized draw really exercises what the model test claims (guards against a hypothesis update
    that would quietly narrow it): >= 60 configurations, and each feature in some of them."""
    cases = [c for d in sorted(CASES_PER_DEGREE) for c in cases_for(d)]
    assert len(cases) >= 60
    s = [c.shape for c in cases]
    features = {
        "qkv_bias": sum(x.qkv_bias for x in s), "qk_norm": sum(x.qk_norm for x in s),
        "tied": sum(x.tie_word_embeddings for x in s),
        "window": sum(x.attention_windows is not None and any(w is not None for w in x.attention_windows) for x in s),
        "window_below_seq": sum(any(w is not None and w < c.seq for w in (x.attention_windows or ()))
                                for x, c in zip(s, cases)),
        "gqa": sum(1 < x.num_kv_heads < x.num_heads for x in s),
        "kv_replicated": sum(x.num_kv_heads < c.tsp for x, c in zip(s, cases)),
        "explicit_head_dim": sum(x.head_dim is not None for x in s),
        "rope_scaling": sum(x.rope_scaling is not None for x in s),
        "two_layers": sum(x.num_layers == 2 for x in s),
        "vocab_not_multiple": sum(x.vocab_size % c.tsp != 0 for x, c in zip(s, cases) if c.tsp > 1),
        "seq_below_2D": sum(c.seq < 2 * c.tsp for c in cases if c.tsp > 1),
        "batch>1": sum(c.batch > 1 for c in cases),
        "packed": sum(any(len(r.docs) > 1 for r in c.rows) for c in cases),
        "padded": sum(any(r.left or r.right for r in c.rows) for c in cases),
        "offset": sum(any(r.offset for r in c.rows) for c in cases),
        "math_backend": sum(c.options.kernel == "math" for c in cases),
        "checkpointing": sum(c.options.activation_checkpointing for c in cases),
        "keep_kv": sum(c.options.keep_gathered_kv for c in cases),
        "no_overlap": sum(not c.overlap for c in cases),
    }
    assert all(c.seq % (2 * c.tsp) for c in cases)
    thin = {k: v for k, v in features.items() if v < 3}
    assert not thin, f"features drawn fewer than 3 times: {thin} (all: {features})"


# Found by these tests (fixed in ds_tsp/core/layers/vocab/loss.py): when a rank's vocab shard holds no real row,
# V <= (D-1) * ceil(V/D), the padding mask started at a NEGATIVE index (loss silently wrong: V=5, D=4 gave 1.79
# vs 1.61) and an all-padding shard started the running log-sum-exp with exp(-inf - -inf) = NaN. These cases pin
# it; the strategy draws such vocab sizes too.
PADDING_SHARD_CASES = {4: tuple(
    ModelCase(tsp=4, shape=ModelShape(vocab_size=v, hidden_size=16, intermediate_size=12, num_layers=1,
                                      num_heads=4, num_kv_heads=1, head_dim=4), rows=(Row(docs=(12,)),))
    for v in (5, 3))}


@functools.lru_cache(maxsize=None)
def group_results(tsp: int) -> tuple:
    """(drawn cases' results, known-bug cases' results, seconds): ONE gloo group per D for all of them."""
    cases = list(cases_for(tsp)) + list(PADDING_SHARD_CASES.get(tsp, ()))
    t0 = time.perf_counter()
    results = run_cases_on_ranks(cases, timeout_s=300)
    n = len(cases_for(tsp))
    return results[:n], results[n:], time.perf_counter() - t0


@pytest.mark.parametrize("tsp", sorted(CASES_PER_DEGREE))
def test_model_matches_reference(tsp, capsys):
    cases = cases_for(tsp)
    results, _, seconds = group_results(tsp)
    failures, worst = [], (0.0, "", None)
    for case, result in zip(cases, results):
        try:
            errs = compare(case, result)
        except AssertionError as e:
            failures.append((case, str(e)))
            continue
        losses = result["rank_losses"]
        name = max(errs, key=errs.get)
        if errs[name] > worst[0]:
            worst = (errs[name], name, case)
        bad = {k: v for k, v in errs.items() if not v < TOLERANCE}  # `not <` also catches NaN
        if any(not abs(x - losses[0]) <= 1e-12 * abs(losses[0]) for x in losses):
            bad["rank_losses"] = losses
        if bad:
            top = sorted(bad.items(), key=lambda kv: -float(kv[1]) if not isinstance(kv[1], list) else 0)[:4]
            failures.append((case, f"{case.summary()}\n  errors {top}\n  {case!r}"))
    with capsys.disabled():
        print(f"\n[D={tsp}] {len(cases)} configurations in one gloo group: {seconds:.1f} s; worst error "
              f"{worst[0]:.2e} ({worst[1]}; {worst[2].summary() if worst[2] else ''})")
    if failures:
        failures.sort(key=lambda f: (f[0].seq * f[0].batch * f[0].shape.num_layers, f[0].shape.hidden_size))
        raise AssertionError(f"{len(failures)} of {len(cases)} configurations at D={tsp} exceed {TOLERANCE} "
                             f"(smallest first):\n" + "\n".join(msg for _, msg in failures))


@pytest.mark.parametrize("tsp", sorted(PADDING_SHARD_CASES))
def test_vocab_shard_of_pure_padding(tsp):
    _, results, _ = group_results(tsp)
    for case, result in zip(PADDING_SHARD_CASES[tsp], results):
        errs = compare(case, result)
        assert max(errs.values()) < TOLERANCE, (case.summary(), errs["loss"], result["rank_losses"])
