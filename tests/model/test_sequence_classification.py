"""TSPForSequenceClassification (a reward model's form) against transformers' own ...ForSequenceClassification.

Tiny Llama (GQA, 3 labels, single-label cross entropy) and Qwen3 (q/k norms, 1 label: regression) classifiers with
a pad token, rows right-padded, left-padded and unpadded, so the pooled token (the rightmost non-pad token) falls on
different TSP ranks' zigzag chunks. TSP loads the checkpoint by slices in float64; logits, loss and every gradient
must agree to 1e-10 at D=1, 2 and 4 (one spawn of 4 ranks: D=4 on the world, D=2 on both halves). The D=4 model
saves a checkpoint that transformers' AutoModelForSequenceClassification reloads with identical tensors.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import init_tiny_weights_, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp import TSPConfigError  # noqa: E402
from ds_tsp.tools.hf_reference import patch_float64_  # noqa: E402

CASES = {"llama": dict(num_labels=3), "qwen3": dict(num_labels=1)}
PAD = 5


def _batch(vocab: int, num_labels: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(PAD + 1, vocab, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    ids[0, 14:], mask[0, 14:] = PAD, 0  # right padding: the pooled token mid-sequence
    ids[1, :6], mask[1, :6] = PAD, 0  # left padding: the last token
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    labels = (torch.tensor([0, 2, 1]) if num_labels > 1 else torch.randn(3, generator=g, dtype=torch.float64))
    return dict(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels)


def _save(root, name: str) -> str:
    config = tiny_config(name, pad_token_id=PAD, **CASES[name])
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    init_tiny_weights_(model.to(torch.float64)).save_pretrained(root / name)
    return str(root / name)


def _tsp(directories: dict, save_root: str):
    import torch.distributed as dist

    from ds_tsp.hf import TSPForSequenceClassification

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for name, directory in directories.items():
        for degree, group in ((4, dist.group.WORLD), (2, halves[rank // 2])):
            model = TSPForSequenceClassification.from_pretrained(directory, group, dtype=torch.float64)
            out = model(**_batch(model.config.vocab_size, model.config.num_labels))
            out.loss.backward()
            grads = model.tsp.full_state_dict(grads=True)
            results[(name, degree)] = (out.logits.detach(), out.loss.detach(), grads)
            if degree == 4:
                model.save_pretrained(f"{save_root}/{name}")
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq_cls")
    directories = {name: _save(root, name) for name in CASES}
    return directories, run_on_local_ranks(_tsp, 4, directories, str(root / "saved")), root / "saved"


def _reference(directory: str):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float64,
                                                                            attn_implementation="sdpa")
    patch_float64_(model)
    out = model(**_batch(model.config.vocab_size, model.config.num_labels))
    out.loss.backward()
    return model, out


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("name", sorted(CASES))
def test_scores_loss_and_every_gradient_equal_transformers(runs, name):
    from ds_tsp.hf import TSPForSequenceClassification

    directories, per_rank, _ = runs
    reference, out = _reference(directories[name])
    want = {n: p.grad for n, p in reference.named_parameters()}
    local = TSPForSequenceClassification.from_pretrained(directories[name], dtype=torch.float64)
    mine = local(**_batch(local.config.vocab_size, local.config.num_labels))
    mine.loss.backward()
    results = {1: (mine.logits.detach(), mine.loss.detach(), local.tsp.full_state_dict(grads=True))}
    for rank, result in enumerate(per_rank):  # every rank of each group holds the same scores and loss
        for degree in (2, 4):
            logits, loss, grads = result[(name, degree)]
            assert _rel(logits, out.logits) < 1e-12 and _rel(loss, out.loss) < 1e-12, (name, degree, rank)
            if rank == 0:
                results[degree] = result[(name, degree)]
    for degree, (_, _, grads) in results.items():
        assert set(grads) == set(want), degree
        worst = max(want, key=lambda n: _rel(grads[n], want[n]))
        assert _rel(grads[worst], want[worst]) < 1e-10, (name, degree, worst)
    assert float(want["score.weight"].norm()) > 0 and float(want["model.embed_tokens.weight"].norm()) > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_save_reloads_in_transformers(runs, name):
    directories, _, saved = runs
    original = transformers.AutoModelForSequenceClassification.from_pretrained(directories[name])
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(saved / name)
    assert type(reloaded) is type(original) and reloaded.config.num_labels == original.config.num_labels
    want, got = original.state_dict(), reloaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key].to(value.dtype), value), key


def test_a_batch_without_pad_token_is_refused_as_transformers_does(tmp_path):
    from ds_tsp.hf import TSPForSequenceClassification

    config = tiny_config("llama", num_labels=2, pad_token_id=None)
    model = TSPForSequenceClassification(config, dtype=torch.float64)
    with pytest.raises(TSPConfigError, match="pad_token_id is None with a batch of more than one row"):
        model(input_ids=torch.randint(0, 70, (2, 8)))
    assert model(input_ids=torch.randint(0, 70, (1, 8))).logits.shape == (1, 2)
