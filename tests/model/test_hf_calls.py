"""Call forms of the model and of the DeepSpeed engine: no call is silently wrong.

- TSPForCausalLM takes only input_ids positionally (anything more: one TSPConfigError listing the keywords);
- a TSPDataLoader batch is never sharded twice: whole (`engine(**batch)`) it is used as it is, without its
  tsp_shard marker (positionally, or a dict that lost it) it is refused at D > 1;
- ShardedCausalLM (what the engine wraps for a ModelShape / config / in-memory HF model) takes the same batch by
  keyword, and its positional call keeps its documented meaning (this rank's shard);
- generate() and the text-generation pipeline raise one TSPConfigError saying how to sample.

One 2-rank launch (DeepSpeed engines of all three kinds); the rest runs in this process at D=1.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.hf import TSPForCausalLM  # noqa: E402

SEQ = 24


def _source(directory) -> str:
    """A tiny Llama-3-style checkpoint with token ids and a non-default max_position_embeddings (and so a
    generation_config.json)."""
    config = tiny_config("llama3_tied", max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return str(save_tiny_checkpoint(directory, config))


def _error(fn) -> str:
    try:
        fn()
    except TSPConfigError as exc:
        return str(exc)
    return "no error"


def _engine_call_forms(source: str, consolidated: str) -> dict:
    import ds_tsp
    from ds_tsp.checkpoint.consolidated import save_consolidated
    from ds_tsp.tools.synthetic import RepeatingPatterns

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "tsp": {"size": 2}}
    data = RepeatingPatterns(vocab_size=96, seq_len=SEQ, num_samples=8)
    out = {}
    # 1. a checkpoint path: the engine wraps TSPForCausalLM (the HF call)
    engine, _, loader, _ = ds_tsp.initialize(model=source, config=config, training_data=data)
    batch = next(iter(loader))
    ids = torch.stack([data[i]["input_ids"] for i in next(iter(loader.batches))])  # the same samples, full length
    with torch.no_grad():
        out["path_kw"] = engine(**batch).loss.item()
        out["path_full"] = engine(input_ids=ids, labels=ids).loss.item()  # the model shards a full batch itself
        out["path_positional"] = _error(lambda: engine(batch["input_ids"], batch["shift_labels"],
                                                       batch["position_ids"]))
        unmarked = {k: v for k, v in batch.items() if k != "tsp_shard"}
        out["path_unmarked"] = _error(lambda: engine(**unmarked))
        out["path_full_shifted"] = _error(lambda: engine(input_ids=ids, shift_labels=ids))
    # 2. an in-memory HF model: the engine wraps ShardedCausalLM (this rank's shard; it returns its loss share)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    engine2, _, loader2, _ = ds_tsp.initialize(model=hf, config=config, training_data=data)
    batch2 = next(iter(loader2))
    with torch.no_grad():
        share_kw = engine2(**batch2)
        share_pos = engine2(batch2["input_ids"], batch2["shift_labels"], batch2["position_ids"])
        out["core_kw"] = engine2.tsp_model.loss_for_logging(share_kw).item()
        out["core_equal"] = torch.equal(share_kw, share_pos)
        out["core_labels"] = _error(lambda: engine2(input_ids=ids, labels=ids))
        out["core_wrong_rank"] = _error(lambda: engine2(**{**batch2, "tsp_shard": (1 - batch2["tsp_shard"][0], 2)}))
    save_consolidated(engine2.tsp_model, consolidated)  # config.json from the HF model's own config
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("calls")
    source = _source(root / "src")
    results = run_on_local_ranks(_engine_call_forms, 2, source, str(root / "consolidated"), timeout_s=180,
                                 env={"DS_ACCELERATOR": "cpu"})
    return results, root


def test_engine_keyword_call_equals_the_full_batch_and_never_reshards(engines):
    results, _ = engines
    for r in results:
        # the loader's shard, passed whole, gives exactly what the model computes from the full batch
        assert r["path_kw"] == r["path_full"], r
        assert abs(r["core_kw"] - r["path_full"]) < 1e-5 * abs(r["path_full"]), r
        assert r["core_equal"], "ShardedCausalLM: engine(**batch) is its positional call"
        for key in ("path_positional",):
            assert "only input_ids is taken positionally" in r[key] and "shift_labels=" in r[key], r[key]
        for key in ("path_unmarked", "path_full_shifted"):  # a shard without its marker is never sharded again
            assert "shift_labels without tsp_shard at tsp=2" in r[key], r[key]
        assert "labels=" in r["core_labels"] and "TSPForCausalLM" in r["core_labels"], r["core_labels"]
        assert "tsp_shard=" in r["core_wrong_rank"], r["core_wrong_rank"]


def test_engine_from_an_hf_model_saves_its_config(engines):
    _, root = engines
    for name in ("config.json", "generation_config.json"):
        source = json.loads((root / "src" / name).read_text())
        saved = json.loads((root / "consolidated" / name).read_text())
        assert {k: v for k, v in saved.items() if k in source} == source, name


def test_model_takes_only_input_ids_positionally(tmp_path):
    model = TSPForCausalLM.from_pretrained(_source(tmp_path / "src"))
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TSPConfigError) as err:
        model(ids, ids)  # transformers' positional order would make this attention_mask
    for keyword in ("input_ids=", "labels=", "shift_labels=", "position_ids=", "attention_mask="):
        assert keyword in str(err.value)
    loss = model(ids, labels=ids).loss  # input_ids alone positionally, as transformers' models take it
    assert torch.equal(loss, model(input_ids=ids, labels=ids).loss)


def test_generate_and_pipeline_say_how_to_sample(tmp_path):
    model = TSPForCausalLM.from_pretrained(_source(tmp_path / "src"))
    assert model.can_generate() is False and TSPForCausalLM.can_generate() is False
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TSPConfigError, match="save_pretrained.*logits_to_keep=1"):
        model.generate(ids, max_new_tokens=2)
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(96)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w3")), unk_token="w3")
    with pytest.raises(TSPConfigError, match="does not generate"):
        transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)("w5 w6", max_new_tokens=2)
