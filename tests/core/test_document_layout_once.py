"""Packed-document starts are validated once per step, not by every kernel call.

Each layer runs its document-masked attention per chunk x head block x (forward, backward, recompute); before,
every one of those calls re-validated (and re-cut, and re-hashed) every document start. Now the model's input check
(or a pipeline stage's StepPositions) validates once into a frozen DocumentLayout, which the kernels take as it is.
A spy on the one validation pass counts them.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.layers.attention import masked as document_attention
from ds_tsp.core.layers.attention.masked import masked_attention_forward
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens import documents
from ds_tsp.core.tokens.documents import DocumentLayout, document_layout, documents_of_lengths
from ds_tsp.core.tokens.positions import StepPositions
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2)
LENGTHS = [[5, 7, 4], [9, 3, 4]]  # two rows of 16 tokens, three documents each


@pytest.fixture
def validations(monkeypatch):
    """Counts the validation passes over doc_starts (documents._layouts, the only one)."""
    count = [0]
    original = documents._layouts

    def spy(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(documents, "_layouts", spy)
    return count


def _batch():
    positions = torch.stack([documents_of_lengths(row) for row in LENGTHS])
    ids = torch.randint(0, SHAPE.vocab_size, positions.shape, generator=torch.Generator().manual_seed(0))
    return shard_batch(ids, tsp=1, rank=0, labels=ids, position_ids=positions)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_one_validation_per_step(validations, monkeypatch, checkpointing):
    kernel_calls = [0]
    check = document_attention._check_inputs
    monkeypatch.setattr(document_attention, "_check_inputs",
                        lambda *a: kernel_calls.__setitem__(0, kernel_calls[0] + 1) or check(*a))
    torch.manual_seed(0)
    model = ShardedCausalLM(SHAPE, TSPComm.single(), dtype=torch.float64,
                            options=TSPOptions(kernel="math", activation_checkpointing=checkpointing))
    batch = _batch()
    for step in range(1, 3):
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
        # 3 layers x 2 chunks x (forward, backward[, recompute]) kernel calls, one validation
        assert validations[0] == step
        assert kernel_calls[0] == step * 3 * 2 * (3 if checkpointing else 2)


def test_the_layout_from_one_validation_gives_the_same_numbers(validations):
    """The kernels' result with the pre-validated layout equals the one with the raw starts (validated there)."""
    q, k, v = (torch.randn(2, 6, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    starts = ((0, 2, 5), (0, 4))
    layout = document_layout(starts, 2)
    assert validations[0] == 1 and isinstance(layout, DocumentLayout) and layout.rows == starts
    with_layout = masked_attention_forward(q, k, v, q_start=0, doc_starts=layout, window=None, scale=0.5)
    assert validations[0] == 1  # taken as it is
    raw = masked_attention_forward(q, k, v, q_start=0, doc_starts=starts, window=None, scale=0.5)
    assert validations[0] == 2
    for a, b in zip(with_layout, raw):
        assert torch.equal(a, b)


def test_layout_is_frozen_and_checked_against_the_batch():
    layout = document_layout([[0, 3], (0,)])
    with pytest.raises(AttributeError, match="frozen"):
        layout.rows = ((0,),)
    assert layout.cut(3) is layout.cut(3) and layout.cut(3).rows == ((0,), (0,)) and layout.cut(4).multi
    with pytest.raises(ValueError, match=r"doc_starts has 2 rows, the batch has B=3"):
        document_layout(layout, 3)
    with pytest.raises(ValueError, match=r"doc_starts\[0\] must be strictly increasing"):
        document_layout([(0, 3, 3)])
    # it stands where per-row tuples stood: equal to them, and it pickles (a rank's result travels back pickled)
    again = pickle.loads(pickle.dumps(layout))
    assert isinstance(again, DocumentLayout) and again == layout == ((0, 3), (0,)) and layout[0] == (0, 3)


def test_pipeline_stage_positions_validate_once_per_micro_batch(validations):
    positions = StepPositions(SHAPE, TSPComm.single())
    ids = _batch()["position_ids"]
    _, doc_starts = positions(ids, torch.float64)
    assert isinstance(doc_starts, DocumentLayout) and validations[0] == 1
    assert doc_starts.rows == ((0, 5, 12), (0, 9, 12))
    for _ in range(SHAPE.num_layers):  # every layer of the stage asks again: the same object, no new pass
        assert positions(ids, torch.float64)[1] is doc_starts
    assert validations[0] == 1
