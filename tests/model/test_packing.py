"""Packed documents and padding under TSP, against transformers' own model running every document on its own.

- Packing (position_ids restarting at 0, the first label of each document -100, like DataCollatorWithFlattening)
  at D=3 with documents that the zigzag chunk edges cut in the middle, on both CPU kernel backends, with and
  without a sliding window: loss and every gradient equal the per-document reference (float64, 1e-10).
- The same packed batch with attention allowed to cross documents (what sdpa does with a plain mask) differs
  from it by far more than the tolerance, so the equality above would fail if TSP attention crossed a boundary.
- Left and right padding via attention_mask equal the unpadded run; padding and packing combine (Gemma 4 too, at D=2:
  with per-layer inputs and keys as values, and without either).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import packed_batch, save_tiny_checkpoint, shift, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.config import TSPOptions  # noqa: E402
from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference  # noqa: E402

SIX_HEADS = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
# S = 60 at D=3: chunks of 10 tokens; every document boundary below falls inside a chunk
DOCS = [[7, 23, 30], [25, 1, 13, 21]]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _tsp_loss_and_grads(directory: str, inputs: dict, backend: str | None) -> tuple:
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64, options=TSPOptions(kernel=backend or "auto"))
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), model.tsp.full_state_dict(grads=True)


def _run_cases(cases: dict) -> dict:
    """Every case {key: (directory, inputs, backend)} on the same ranks (one start-up for all)."""
    return {key: _tsp_loss_and_grads(*case) for key, case in cases.items()}


def _padded(data: dict, pads: list[tuple[int, int]], vocab: int) -> dict:
    """Rows of `data` padded (left, right) by the given amounts with random pad ids; labels -100 there."""
    g = torch.Generator().manual_seed(9)
    rows, masks, labels, positions = [], [], [], []
    width = max(data["input_ids"].shape[1] + left + right for left, right in pads)
    for b, (left, right) in enumerate(pads):
        n = data["input_ids"].shape[1]
        right += width - (n + left + right)
        rows.append(torch.cat((torch.randint(0, vocab, (left,), generator=g), data["input_ids"][b],
                               torch.randint(0, vocab, (right,), generator=g))))
        masks.append(torch.cat((torch.zeros(left), torch.ones(n), torch.zeros(right))).long())
        labels.append(torch.cat((torch.full((left,), -100), data["labels"][b], torch.full((right,), -100))))
        positions.append(torch.cat((torch.zeros(left, dtype=torch.long), data["position_ids"][b],
                                    torch.zeros(right, dtype=torch.long))))
    return {"input_ids": torch.stack(rows), "attention_mask": torch.stack(masks), "labels": torch.stack(labels),
            "position_ids": torch.stack(positions)}


def _packed_inputs(family: str) -> tuple[dict, dict]:
    data = packed_batch(tiny_config(family).vocab_size, DOCS, seed=1)
    return data, {k: data[k] for k in ("input_ids", "labels", "position_ids")}


def _combined_inputs(family: str = "llama") -> tuple[dict, dict]:
    vocab = tiny_config(family).vocab_size
    data = packed_batch(vocab, [[9, 14, 7], [20, 10]], seed=4)
    return data, _padded(data, [(0, 6), (6, 0)], vocab)


def _padding_inputs(family: str) -> tuple[torch.Tensor, dict]:
    vocab = tiny_config(family).vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (3, 18), generator=g)
    unpadded = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(18).expand(3, 18)}
    padded = _padded(unpadded, [(0, 0), (5, 0), (0, 7)], vocab)  # none, left, right
    padded.pop("position_ids")  # transformers' default: positions 0..S-1 (RoPE is relative, so pads shift nothing)
    return ids, padded


def _assert_matches(got, ref, what):
    loss, grads = got
    ref_loss, ref_grads = ref
    assert _rel(loss, ref_loss) < 1e-10, (what, float(loss), float(ref_loss))
    errors = {n: _rel(grads[n], g) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, (what, worst, errors[worst])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return {"llama": save_tiny_checkpoint(root / "llama", tiny_config("llama", **SIX_HEADS)),
            "mistral": save_tiny_checkpoint(root / "mistral", tiny_config("mistral", sliding_window=4, **SIX_HEADS)),
            "qwen3": save_tiny_checkpoint(root / "qwen3", "qwen3"),
            "olmo3": save_tiny_checkpoint(root / "olmo3", "olmo3"),  # its norms span every head block
            "gemma4": save_tiny_checkpoint(root / "gemma4", "gemma4"),
            "gemma4_kv_shared": save_tiny_checkpoint(root / "gemma4_kv_shared", "gemma4_kv_shared"),
            # no per-layer inputs, the full layer with its own v_proj
            "gemma4_plain": save_tiny_checkpoint(root / "gemma4_plain", tiny_config(
                "gemma4", hidden_size_per_layer_input=0, attention_k_eq_v=False))}


@pytest.fixture(scope="module")
def tsp_results(checkpoints):
    """All TSP runs of this file: D=3 (6-head checkpoints) in one start-up, D=2 (qwen3, olmo3, gemma4: 4 heads) in
    another."""
    d3 = {("packed", family, backend): (str(checkpoints[family]), _packed_inputs(family)[1], backend)
          for family in ("llama", "mistral") for backend in ("cpu_flash", "math")}
    d3[("padding", "mistral")] = (str(checkpoints["mistral"]), _padding_inputs("mistral")[1], None)
    d3[("combined",)] = (str(checkpoints["llama"]), _combined_inputs()[1], None)
    d2 = {("padding", family): (str(checkpoints[family]), _padding_inputs(family.removesuffix("_plain"))[1], None)
          for family in ("qwen3", "olmo3", "gemma4_plain")}
    for family in ("gemma4", "gemma4_kv_shared"):
        d2[("combined", family)] = (str(checkpoints[family]), _combined_inputs(family)[1], None)
    results = run_on_local_ranks(_run_cases, 3, d3, timeout_s=300)[0]
    results.update(run_on_local_ranks(_run_cases, 2, d2, timeout_s=300)[0])
    return results


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_packed_documents_at_d3_equal_each_document_alone(checkpoints, tsp_results, family, backend):
    data, _ = _packed_inputs(family)
    ref = load_hf_reference(checkpoints[family], torch.float64)
    per_document = hf_loss_and_grads(ref, data["input_ids"], shift(data["labels"]), documents=data["documents"])
    _assert_matches(tsp_results[("packed", family, backend)], per_document, (family, backend))
    # Attention across documents (same positions, same targets): an all-ones mask turns transformers' packed
    # masking off. It is far from the per-document result, so TSP crossing a boundary could not pass above.
    crossing = hf_loss_and_grads(ref, data["input_ids"], shift(data["labels"]), position_ids=data["position_ids"],
                                 attention_mask=torch.ones_like(data["input_ids"]))
    assert _rel(crossing[0], per_document[0]) > 1e-4


@pytest.mark.parametrize("family", ["qwen3", "mistral", "olmo3", "gemma4_plain"])
def test_left_and_right_padding_equal_the_unpadded_run(checkpoints, tsp_results, family):
    ids, _ = _padding_inputs(family.removesuffix("_plain"))
    ref = load_hf_reference(checkpoints[family], torch.float64)
    alone = hf_loss_and_grads(ref, ids, shift(ids.clone()))
    _assert_matches(tsp_results[("padding", family)], alone, (family, "padding"))


# Gemma 4 at D=2: per-layer inputs of padded tokens; the KV-sharing layers read their source's padded, packed K/V
@pytest.mark.parametrize("family", ["llama", "gemma4", "gemma4_kv_shared"])
def test_padding_and_packing_combine(checkpoints, tsp_results, family):
    data, _ = _combined_inputs(family)
    ref = load_hf_reference(checkpoints[family], torch.float64)
    per_document = hf_loss_and_grads(ref, data["input_ids"], shift(data["labels"]), documents=data["documents"])
    _assert_matches(tsp_results[("combined",) if family == "llama" else ("combined", family)], per_document,
                    (family, "padding + packing"))
