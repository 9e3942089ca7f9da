"""ds_tsp.tools.hf_reference: transformers' own models as a float64 reference (per-instance patches, packed documents).

Every family of tests/helpers/hf_tiny.py is saved as a real checkpoint and loaded back with AutoModelForCausalLM.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/ is on sys.path: a helper module, not a test file)

from ds_tsp.tools.hf_reference import hf_logits, hf_loss_and_grads, load_hf_reference, patch_float64_  # noqa: E402

S = 24  # > sliding windows (5, 6) and > the rope scalings' original_max_position_embeddings (16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    saved = {}

    def get(name: str):
        if name not in saved:
            saved[name] = hf_tiny.save_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
        return saved[name]
    return get


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def plain_batch(vocab_size: int, seed: int = 1):
    """Two full rows; the second at positions 90.., so rope angles are large (float32 angles lose ~1e-5)."""
    batch = hf_tiny.packed_batch(vocab_size, [[S], [S]], seed=seed)
    shift_labels = hf_tiny.shift(batch["labels"])
    shift_labels[0, 3] = -100
    return batch["input_ids"], shift_labels, batch["position_ids"] + torch.tensor([[0], [90]])


def is_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def is_rotary(module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding")


def instance_patched(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


@pytest.mark.parametrize("name", hf_tiny.FAMILIES)
def test_family_float64_reference(name, checkpoint):
    cfg = hf_tiny.tiny_config(name)
    m64 = load_hf_reference(checkpoint(name), torch.float64)
    m32 = load_hf_reference(checkpoint(name), torch.float32)
    assert {p.dtype for p in m64.parameters()} == {torch.float64}
    assert m64.config._attn_implementation == "sdpa"

    # every RMSNorm (2 per layer, Gemma 3's 4, + final, + q_norm/k_norm per layer for Qwen3, Gemma 3 and OLMo 3;
    # Gemma 4: Gemma 3's 6, v_norm and post_per_layer_input_norm per layer, per_layer_projection_norm) and the
    # rotary embedding
    layers = cfg.num_hidden_layers
    gemma = cfg.model_type in ("gemma3_text", "gemma4_text")
    per_layer = (4 if gemma else 2) + (2 if cfg.model_type in ("qwen3", "olmo3") or gemma else 0)
    per_layer += 2 if cfg.model_type == "gemma4_text" else 0
    norms = per_layer * layers + 1 + (1 if cfg.model_type == "gemma4_text" else 0)
    norms -= 2 * getattr(cfg, "num_kv_shared_layers", 0)  # Gemma 4's KV-sharing layers: no k_norm, v_norm
    expected = sorted(n for n, m in m64.named_modules() if is_norm(m) or is_rotary(m))
    assert len(expected) == norms + 1
    assert sorted(instance_patched(m64)) == expected
    assert patch_float64_(m64) == norms + 1  # idempotent re-patch, same count
    assert instance_patched(m32) == []  # float32 is transformers' code path, untouched
    norm_cls = type(m64.model.norm)
    assert "forward" in vars(norm_cls) and m64.model.norm.forward.__func__ is not norm_cls.forward  # class intact

    if cfg.tie_word_embeddings:
        assert m64.lm_head.weight is m64.model.embed_tokens.weight
    input_ids, shift_labels, position_ids = plain_batch(cfg.vocab_size)
    loss64, grads64 = hf_loss_and_grads(m64, input_ids, shift_labels, position_ids=position_ids)
    loss32, grads32 = hf_loss_and_grads(m32, input_ids, shift_labels, position_ids=position_ids)
    assert loss64.dtype == torch.float64 and loss32.dtype == torch.float32
    buffers = {n for n, _ in m64.named_buffers()}  # Gemma 4's layer_scalar: in the state dict, never trained
    assert set(grads64) == set(m64.state_dict()) - buffers == set(grads32)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" in grads64
        assert torch.equal(grads64["lm_head.weight"], grads64["model.embed_tokens.weight"])
    assert rel(loss32, loss64) < 1e-5
    errors = {n: rel(grads32[n], g) for n, g in grads64.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])
    assert min(g.norm().item() for g in grads64.values()) > 0

    # the loss is the token mean over shift_labels != -100, computed in float64 from float64 logits
    logits64 = hf_logits(m64, input_ids, position_ids=position_ids)
    logits32 = hf_logits(m32, input_ids, position_ids=position_ids)
    assert logits64.dtype == torch.float64 and logits64.shape == (2, S, cfg.vocab_size)
    valid = shift_labels != -100
    torch.testing.assert_close(loss64, F.cross_entropy(logits64[valid], shift_labels[valid]), rtol=1e-13, atol=0)
    assert 1e-10 < rel(logits32, logits64) < 1e-5  # really float64, yet the same model


def _fresh_float64(directory, keep: str):
    """Unpatched float64 model, then patches applied to `keep` ("all", "none", "norm", "rope") only."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    if keep != "none":
        patch_float64_(model)
        for module in model.modules():
            if (is_norm(module) and keep == "rope") or (is_rotary(module) and keep == "norm"):
                del module.forward  # back to the class's float32-narrowing forward
    return model


def test_patches_are_needed_and_deterministic(checkpoint):
    directory = checkpoint("qwen3")  # q_norm/k_norm too
    input_ids, shift_labels, position_ids = plain_batch(hf_tiny.FAMILIES["qwen3"]["vocab_size"])
    runs = {keep: hf_loss_and_grads(_fresh_float64(directory, keep), input_ids, shift_labels, position_ids)
            for keep in ("all", "none", "norm", "rope")}
    again = hf_loss_and_grads(load_hf_reference(directory, torch.float64), input_ids, shift_labels, position_ids)
    loss, grads = runs["all"]
    assert torch.equal(again[0], loss) and all(torch.equal(again[1][n], g) for n, g in grads.items())
    assert rel(runs["none"][0], loss) > 1e-12
    for keep in ("none", "norm", "rope"):  # each patch alone still leaves float32-sized gradient errors
        assert max(rel(runs[keep][1][n], g) for n, g in grads.items()) > 1e-9, keep
    assert instance_patched(_fresh_float64(directory, "none")) == []  # loading a patched model changed nothing


DOCS = [[5, 9, 1, 9], [12, 12]]  # includes a one-token document


@pytest.mark.parametrize("name", ["llama3_tied", "qwen2_sliding"])
def test_documents_equal_running_each_document_by_hand(name, checkpoint):
    model = load_hf_reference(checkpoint(name), torch.float64)
    batch = hf_tiny.packed_batch(model.config.vocab_size, DOCS, seed=3)
    input_ids, shift_labels = batch["input_ids"], hf_tiny.shift(batch["labels"])
    for b, row in enumerate(DOCS):  # the last target of every document is -100 (the next one's first label)
        ends = torch.tensor(row).cumsum(0) - 1
        assert (shift_labels[b, ends] == -100).all() and (shift_labels[b] == -100).sum() == len(row)
    loss, grads = hf_loss_and_grads(model, input_ids, shift_labels, documents=batch["documents"])

    model.zero_grad(set_to_none=True)
    total, count = 0.0, (shift_labels != -100).sum()
    for b, row in enumerate(DOCS):
        start = 0
        for n in row:
            ids, labels = input_ids[b:b + 1, start:start + n], shift_labels[b:b + 1, start:start + n]
            logits = model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False).logits
            total = total + F.cross_entropy(logits[0], labels[0], reduction="sum", ignore_index=-100)
            start += n
    (total / count).backward()
    assert rel(loss, total / count) < 1e-14
    named = dict(model.named_parameters(remove_duplicate=False))
    assert max(rel(g, named[n].grad) for n, g in grads.items()) < 1e-13


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_sliding"])
def test_transformers_packed_masking_equals_per_document(name, checkpoint):
    """Packed rows (positions restart at 0, attention_mask None, use_cache=False): transformers masks each
    document itself (masking_utils.find_packed_sequence_indices), sliding windows included."""
    model = load_hf_reference(checkpoint(name), torch.float64)
    batch = hf_tiny.packed_batch(model.config.vocab_size, DOCS, seed=4)
    input_ids, shift_labels = batch["input_ids"], hf_tiny.shift(batch["labels"])
    loss, grads = hf_loss_and_grads(model, input_ids, shift_labels, position_ids=batch["position_ids"])
    ref_loss, ref_grads = hf_loss_and_grads(model, input_ids, shift_labels, documents=batch["documents"])
    assert rel(loss, ref_loss) < 1e-10
    assert max(rel(g, ref_grads[n]) for n, g in grads.items()) < 1e-10
    # the documents really matter: one sequence over the packed row is a different loss
    assert rel(hf_loss_and_grads(model, input_ids, shift_labels)[0], ref_loss) > 1e-6


def test_packed_masking_needs_no_mask_and_no_cache(checkpoint):
    """Recorded transformers 5.x behaviour: an all-ones attention_mask, or the config's default use_cache=True,
    silently turns packed-document masking off (documents then attend to each other)."""
    model = load_hf_reference(checkpoint("llama"), torch.float64)
    batch = hf_tiny.packed_batch(model.config.vocab_size, DOCS, seed=4)
    ids, pos = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        packed = hf_logits(model, ids, position_ids=pos)
        with_cache = model(input_ids=ids, position_ids=pos).logits
        with_mask = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).logits
    first = model(input_ids=ids[:1, :5], position_ids=pos[:1, :5], use_cache=False).logits
    assert model.config.use_cache
    torch.testing.assert_close(packed[:1, :5], first, rtol=0, atol=1e-13)
    assert not torch.allclose(packed, with_cache, atol=1e-6)
    assert not torch.allclose(packed, with_mask, atol=1e-6)


@pytest.mark.parametrize("name", ["mistral", "qwen2_sliding"])
def test_sliding_window_convention(name, tmp_path):
    """kv_idx > q_idx - sliding_window: positions < window see everything, position `window` loses token 0."""
    cfg = hf_tiny.tiny_config(name)
    window = cfg.sliding_window
    if name == "qwen2_sliding":
        assert cfg.layer_types == ["full_attention", "sliding_attention"]
        full_cfg = hf_tiny.tiny_config(name, use_sliding_window=False)
        assert full_cfg.sliding_window is None and full_cfg.layer_types == ["full_attention"] * 2
    else:
        full_cfg = hf_tiny.tiny_config(name, sliding_window=None)
    sliding = load_hf_reference(hf_tiny.save_tiny_checkpoint(tmp_path / "s", cfg), torch.float64)
    full = load_hf_reference(hf_tiny.save_tiny_checkpoint(tmp_path / "f", full_cfg), torch.float64)
    assert sliding.config.sliding_window == window
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = hf_logits(sliding, ids), hf_logits(full, ids)
    torch.testing.assert_close(a[:, :window], b[:, :window], rtol=0, atol=1e-13)
    assert (a[0, window] - b[0, window]).abs().max() > 1e-6


def test_padding_is_masked_and_checked(checkpoint):
    model = load_hf_reference(checkpoint("mistral"), torch.float64)
    g = torch.Generator().manual_seed(6)
    real = torch.randint(0, model.config.vocab_size, (1, 10), generator=g)
    alone = torch.cat((real[:, 1:], torch.full((1, 1), -100)), dim=1)
    loss, grads = hf_loss_and_grads(model, real, alone)
    pad, ones = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)
    ignore = torch.full((1, 4), -100)
    cases = {"left": (torch.cat((pad, real), 1), torch.cat((pad, ones), 1), torch.cat((ignore, alone), 1)),
             "right": (torch.cat((real, pad), 1), torch.cat((ones, pad), 1), torch.cat((alone, ignore), 1))}
    for side, (ids, mask, labels) in cases.items():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        padded_loss, padded_grads = hf_loss_and_grads(model, ids, labels, position_ids=positions, attention_mask=mask)
        assert rel(padded_loss, loss) < 1e-13, side
        assert max(rel(g, grads[n]) for n, g in padded_grads.items()) < 1e-12, side
        assert torch.isfinite(hf_logits(model, ids, positions, mask)).all(), side
    bad = cases["left"][2].clone()
    bad[0, 0] = 1
    with pytest.raises(ValueError, match="padded"):
        hf_loss_and_grads(model, cases["left"][0], bad, attention_mask=cases["left"][1])


def test_rope_scaling_changes_inv_freq(checkpoint):
    for name in ("llama3_tied", "llama_yarn", "llama_linear"):
        rotary = load_hf_reference(checkpoint(name), torch.float64).model.rotary_emb
        rope = hf_tiny.FAMILIES[name]["rope_parameters"]
        default_cfg = hf_tiny.tiny_config(name, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": rope["rope_theta"]})
        default = transformers.AutoModelForCausalLM.from_config(default_cfg).model.rotary_emb
        assert rotary.rope_type == rope["rope_type"] and default.rope_type == "default"
        assert rotary.inv_freq.shape == default.inv_freq.shape and rotary.inv_freq.dtype == torch.float32
        assert not torch.allclose(rotary.inv_freq, default.inv_freq), name
        if name == "llama_linear":
            torch.testing.assert_close(rotary.inv_freq, default.inv_freq / 2)
        if name == "llama3_tied":  # wavelengths beyond original_max_position_embeddings / low_freq_factor: / 8
            long = 2 * torch.pi / default.inv_freq > 16
            assert long.sum() >= 4
            torch.testing.assert_close(rotary.inv_freq[long], default.inv_freq[long] / 8)
        if name == "llama_yarn":
            assert rotary.attention_scaling > 1.1  # 0.1 ln(4) + 1
        else:
            assert rotary.attention_scaling == 1.0


def test_tiny_families_and_checkpoints(tmp_path):
    for name, kw in hf_tiny.FAMILIES.items():
        cfg = hf_tiny.tiny_config(name)
        raw = cfg.to_dict()  # Gemma 4's config refuses global reads of its per-layer fields (num_key_value_heads)
        assert raw["num_attention_heads"] % 4 == 0 and raw["num_key_value_heads"] in (2, 4), name
        # Gemma 4's KV sharing needs a third layer: the one that attends over an earlier layer's K/V
        layers = 3 if raw.get("num_kv_shared_layers") else 2
        assert raw["intermediate_size"] % 4 == 0 and raw["num_hidden_layers"] == layers, name
        assert 60 <= raw["vocab_size"] <= 100 and cfg._attn_implementation == "sdpa", name
    assert any(kw["vocab_size"] % 4 for kw in hf_tiny.FAMILIES.values())
    assert hf_tiny.tiny_config("qwen3").head_dim * 4 != 32 and hf_tiny.tiny_config("llama_head_dim").head_dim == 12

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = hf_tiny.build_tiny_model("qwen2", dtype=torch.float64).state_dict()
        torch.set_num_threads(2)
        two = hf_tiny.build_tiny_model("qwen2", dtype=torch.float64).state_dict()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one[n], two[n]) for n in one)
    norm = one["model.layers.0.input_layernorm.weight"]
    assert norm.std() > 0.03 and (norm - 1).abs().max() < 0.6
    assert one["model.layers.1.self_attn.k_proj.bias"].abs().min() > 0

    sharded = hf_tiny.save_tiny_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="20KB", seed=0)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_hf_reference(sharded, torch.float32).state_dict()
    built = hf_tiny.build_tiny_model("qwen3").state_dict()
    assert set(loaded) == set(built) and all(torch.equal(loaded[n], built[n]) for n in built)


def test_eager_attention_is_refused(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint("llama"), dtype=torch.float64,
                                                              attn_implementation="eager")
    with pytest.raises(ValueError, match="sdpa"):
        patch_float64_(model)
