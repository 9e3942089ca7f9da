"""TSPForCausalLM's HF call surface: global loss on every rank, full or pre-sharded batches, logits_to_keep
(values and gradients) against transformers' own model, and clear errors for what it does not do.

float64 throughout; tolerance 1e-10 norm-wise relative (a correct schedule measures ~1e-15).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint, shift  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.hf import TSPForCausalLM  # noqa: E402
from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference  # noqa: E402

B, S, KEEP = 2, 26, 5


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def score(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """An answer-scoring loss from the last KEEP logits: log-likelihood of the next tokens (last one: token 0)."""
    targets = torch.cat((ids[:, S - KEEP + 1:], torch.zeros_like(ids[:, :1])), dim=1)
    return -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).sum()


def _tsp_outputs(directory: str) -> dict:
    import torch.distributed as dist

    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    ids, labels = batch(model.config.vocab_size)
    out = model(input_ids=ids, labels=labels, logits_to_keep=KEEP)
    (out.loss + score(out.logits, ids)).backward()
    grads = model.tsp.full_state_dict(grads=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out.loss.item())
    no_logits = model(input_ids=ids, labels=labels).logits
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads, "losses": everyone,
            "no_logits": no_logits}


@pytest.mark.parametrize("degree", [2, 4])
def test_loss_and_last_logits_match_transformers(tmp_path, degree):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama3_tied")
    got = run_on_local_ranks(_tsp_outputs, degree, str(directory), timeout_s=120)[0]
    ref = load_hf_reference(directory, torch.float64)
    ids, labels = batch(ref.config.vocab_size)
    ref.zero_grad()
    out = ref(input_ids=ids, use_cache=False)
    logits = out.logits
    valid = shift(labels) != -100
    ce = torch.nn.functional.cross_entropy(logits[valid], shift(labels)[valid])
    (ce + score(logits[:, -KEEP:], ids)).backward()
    assert len(set(got["losses"])) == 1, "every rank returns the same global loss"
    assert _rel(got["loss"], ce) < 1e-10
    assert got["logits"].shape == (B, KEEP, ref.config.vocab_size)
    assert _rel(got["logits"], logits[:, -KEEP:]) < 1e-10
    assert got["no_logits"] is None, "logits of every position are never built unless asked for"
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in ref_grads.items():
        assert _rel(got["grads"][name], p.grad) < 1e-10, name


def _full_vs_sharded(directory: str) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.core.tokens.loader import TSPDataLoader

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    model = TSPForCausalLM.from_pretrained(directory, groups.tsp_group, dtype=torch.float64)
    model.tsp.set_data_parallel_group(groups.data_group)
    ids, labels = batch(model.config.vocab_size)
    samples = [{"input_ids": ids[i], "labels": labels[i]} for i in range(B)]
    loader = TSPDataLoader(samples, groups, micro_batch_size=B, shuffle=False)
    sharded = next(iter(loader))
    assert sharded["tsp_shard"] == (groups.tsp_rank, 2)
    out_sharded = model(**sharded, logits_to_keep=KEEP)
    out_full = model(input_ids=ids, labels=labels, logits_to_keep=KEEP)
    return {"sharded": out_sharded.loss.item(), "full": out_full.loss.item(),
            "logits": torch.equal(out_sharded.logits, out_full.logits)}


def test_presharded_batches_from_the_loader_equal_full_batches(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "qwen3")
    for r in run_on_local_ranks(_full_vs_sharded, 2, str(directory), timeout_s=120):
        assert r["sharded"] == r["full"] and r["logits"], r


def test_errors_name_the_argument(tmp_path):
    model = TSPForCausalLM.from_pretrained(save_tiny_checkpoint(tmp_path / "ck", "llama"))
    ids, labels = batch(model.config.vocab_size)
    with pytest.raises(TSPConfigError, match="logits_to_keep"):
        model(input_ids=ids)  # no labels, no logits asked for
    with pytest.raises(TSPConfigError, match="use_cache=True"):
        model(input_ids=ids, labels=labels, use_cache=True)
    with pytest.raises(TSPConfigError, match="foo="):
        model(input_ids=ids, labels=labels, foo=1)
    with pytest.raises(TSPConfigError, match="not both"):
        model(input_ids=ids, labels=labels, shift_labels=shift(labels))
    with pytest.raises(TSPConfigError, match="tsp_shard"):
        model(input_ids=ids, shift_labels=labels, position_ids=ids, tsp_shard=(1, 2))
    with pytest.raises(TSPConfigError, match="logits_to_keep=27"):
        model(input_ids=ids, logits_to_keep=S + 1)
    with pytest.raises(TSPConfigError, match="padding between real tokens"):
        mask = torch.ones_like(ids)
        mask[0, 5] = 0
        model(input_ids=ids, labels=labels, attention_mask=mask)
    # A plain forward (use_cache=False, return_dict) is accepted, as HF code passes it
    assert model(input_ids=ids, labels=labels, use_cache=False, return_dict=True).loss is not None


def test_shift_labels_convention_equals_labels(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "mistral")
    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    ids, labels = batch(model.config.vocab_size)
    a = model(input_ids=ids, labels=labels).loss
    b = model(input_ids=ids, shift_labels=shift(labels)).loss
    ref = load_hf_reference(directory, torch.float64)
    ref_loss, _ = hf_loss_and_grads(ref, ids, shift(labels))
    assert a.item() == b.item() and _rel(a, ref_loss) < 1e-10
