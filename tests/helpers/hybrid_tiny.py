"""Tiny Qwen3.5 / Qwen3-Next checkpoints and batches for tests/hybrid/test_hybrid_*.py (a helper module: nothing collected).

Every config has hidden 32, 4 query heads (2 kv), head_dim 16, partial rotary 0.5, vocab 75 (not a multiple of 4:
vocab padding runs) and, where a layer is linear_attention, 4 key / 8 value Gated DeltaNet heads of dim 4 with a
conv kernel of 4, so D = 1, 2, 4 all divide every sharded dimension. Weights: tests/hf_tiny.init_tiny_weights_
(norms 1 + 0.1 N, so (1 + w) scales ~2 and norm grads are non-trivial) plus A_log spread over [-1, 1] and
dt_bias + 1, so the Gated DeltaNet decays differ per head.
"""
from __future__ import annotations

import torch
from hf_tiny import init_tiny_weights_, packed_batch

VOCAB = 75
LINEAR_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=4,
                    linear_conv_kernel_dim=4)
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=128)


# MoE hybrids: 4 experts (top-2, width 8), a shared expert of width 16, the aux loss on (coefficient large enough
# to move the gradients visibly); Qwen3-Next keeps layer 0 dense (mlp_only_layers), Qwen3.5-MoE has no dense layer.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16,
           output_router_logits=True, router_aux_loss_coef=0.05)


def hybrid_config(family: str = "qwen3_5", layer_types=("linear_attention", "full_attention"), **overrides):
    """A tiny transformers config: Qwen3.5 text ("qwen3_5"), dense Qwen3-Next ("qwen3_next"), or the MoE hybrids
    "qwen3_next_moe" (Qwen3-Next with experts) and "qwen3_5_moe" (Qwen3.5-MoE text)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    mrope = {**rope, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    kwargs = {**_COMMON, **LINEAR_HEADS, "layer_types": list(layer_types), **overrides}
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**{"rope_parameters": mrope, **kwargs})
    if family == "qwen3_5_moe":
        kwargs.pop("intermediate_size")
        return transformers.Qwen3_5MoeTextConfig(**{"rope_parameters": mrope, **MOE, **kwargs})
    if family == "qwen3_next_moe":
        return transformers.Qwen3NextConfig(**{"rope_parameters": rope, **MOE, "mlp_only_layers": [0],
                                               "norm_topk_prob": False, **kwargs})
    return transformers.Qwen3NextConfig(**{"rope_parameters": rope, "num_experts": 0, **kwargs})


def save_checkpoint(directory, config) -> str:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    init_tiny_weights_(model.to(torch.float64), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel(), dtype=p.dtype))
            elif name.endswith("dt_bias"):
                p.add_(1.0)
    model.save_pretrained(directory)
    return str(directory)


def plain_inputs(batch: int = 2, seq: int = 29) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)  # 29: not a multiple of 2D, the zigzag padding runs
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.15] = -100
    return {"input_ids": ids, "labels": labels}


def packed_inputs(documents=((5, 11, 8), (13, 1, 10))) -> dict:
    """S = 24 by default: at D=4 chunks of 3 tokens (shorter than the conv kernel), documents cross ranks."""
    return packed_batch(VOCAB, documents, seed=1)


def padding_inputs(pads=((0, 0), (5, 0), (0, 7)), seq: int = 14) -> tuple[torch.Tensor, dict]:
    """(the unpadded rows, the batch padded (left, right) per row with attention_mask and labels -100 on pads)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (len(pads), seq), generator=g)
    width = seq + max(left + right for left, right in pads)
    rows, masks, labels = [], [], []
    for b, (left, right) in enumerate(pads):
        right += width - (seq + left + right)
        rows.append(torch.cat((torch.randint(0, VOCAB, (left,), generator=g), ids[b],
                               torch.randint(0, VOCAB, (right,), generator=g))))
        masks.append(torch.cat((torch.zeros(left), torch.ones(seq), torch.zeros(right))).long())
        labels.append(torch.cat((torch.full((left,), -100), ids[b], torch.full((right,), -100))))
    return ids, {"input_ids": torch.stack(rows), "attention_mask": torch.stack(masks), "labels": torch.stack(labels)}


def tsp_step(directory: str, inputs: dict, group=None, syncs: list | None = None, options=None):
    """(model, (loss, HF-named grads, this rank's parameter count)) of one float64 TSP step on `group`; `syncs` (a
    list) receives the step's host syncs as (kind, op, region, where) (tests/helpers/sync_counter.py); options: the
    TSPOptions (default TSPOptions())."""
    from sync_counter import SyncCounter

    from ds_tsp.hf import TSPForCausalLM

    extra = {} if options is None else {"options": options}
    model = TSPForCausalLM.from_pretrained(directory, group, dtype=torch.float64, **extra)
    batch = {k: v for k, v in inputs.items() if k != "documents"}
    with SyncCounter() as counter:
        out = model(**batch)
        out.loss.backward()
    if syncs is not None:
        syncs += [(e.kind, e.op, e.region, e.where) for e in counter.events]
    per_rank = sum(p.numel() for p in model.parameters())
    return model, (out.loss.detach(), model.tsp.full_state_dict(grads=True), per_rank)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def assert_matches(got, ref, what, tol: float = 1e-10):
    """Loss and EVERY gradient within tol (norm-wise relative) of the reference's."""
    loss, grads, _ = got
    ref_loss, ref_grads = ref
    assert set(grads) == set(ref_grads), what
    assert rel(loss, ref_loss) < tol, (what, float(loss), float(ref_loss))
    errors = {n: rel(grads[n], g) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, (what, worst, errors[worst])


def expected_per_rank_parameters(reference, degree: int, num_kv_heads: int = 2) -> int:
    """This rank's parameter count under TSP, from transformers' own tensors: norms (decoder, final, q/k, the Gated
    DeltaNet's gated norm), MoE routers and shared-expert gates whole; vocab tables ceil(V/D) rows; k/v
    1/min(D, kv heads) (fewer kv heads than ranks: one kv head per rank); every other tensor (q_proj with its gate rows, o, MLP, every Gated DeltaNet
    projection, conv1d, A_log, dt_bias, the experts [E, ...] and the shared expert) exactly 1/D."""
    expected = 0
    for name, p in reference.named_parameters():
        if name.endswith(("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")):  # + MoE routers, gates
            expected += p.numel()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected += -(-VOCAB // degree) * p.shape[1]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            expected += p.numel() // min(degree, num_kv_heads)
        else:
            assert p.numel() % degree == 0, name
            expected += p.numel() // degree
    return expected
