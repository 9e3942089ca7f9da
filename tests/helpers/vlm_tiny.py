"""A tiny multimodal Qwen3.5 (transformers' Qwen3_5ForConditionalGeneration) and image batches for
tests/model/test_multimodal.py (a helper module: nothing collected).

Language model: hybrid_tiny's Qwen3.5 (a Gated DeltaNet layer, then gated attention; hidden 32, rotary dim 8 with
mrope_section [2, 1, 1], so the t, h and w rows each rotate a frequency of their own), dense or Qwen3.5-MoE (4
experts, top 2, a shared expert, the aux loss on). Vision tower: depth 2,
hidden 16, 2 heads, patch 2 px, temporal patch 2, spatial merge 2, a 4 x 4 learned position grid, out 32. An image
of grid (1, h, w) patches is h * w patch rows of 3 * 2 * 2 * 2 = 24 pixels and makes h * w / 4 tokens. Placeholder
ids inside the vocabulary (75): image 70, video 71, vision start 72, vision end 73.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hf_tiny import init_tiny_weights_, shift
from hybrid_tiny import hybrid_config

IMAGE, VIDEO, START, END = 70, 71, 72, 73
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=2, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, in_channels=3)
PATCH_PIXELS = 3 * 2 * 2 * 2


# Qwen3-VL: Qwen3's layer (q/k norms) under mrope (section [4, 2, 2] of rotary dim 16), both vision blocks feeding
# DeepStack features to the first two language layers
QWEN3_VL_TEXT = dict(vocab_size=75, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                      "mrope_interleaved": True})


def vlm_config(family: str = "qwen3_5", **text_overrides):
    """family "qwen3_5" (dense), "qwen3_5_moe" (hybrid_tiny.MOE's experts, the aux loss on) or "qwen3_vl"."""
    import transformers

    if family == "qwen3_vl_moe":  # hybrid_tiny.MOE's routed experts (no shared expert), the aux loss on
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, output_router_logits=True,
                   router_aux_loss_coef=0.05)
        return transformers.Qwen3VLMoeConfig(text_config={**QWEN3_VL_TEXT, **moe, **text_overrides},
                                             vision_config={**VISION, "deepstack_visual_indexes": [0, 1]},
                                             image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                             vision_end_token_id=END, tie_word_embeddings=False)
    if family == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config={**QWEN3_VL_TEXT, **text_overrides},
                                          vision_config={**VISION, "deepstack_visual_indexes": [0, 1]},
                                          image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                          vision_end_token_id=END, tie_word_embeddings=False)

    text = hybrid_config(family, **text_overrides).to_dict()
    config = transformers.Qwen3_5MoeConfig if family == "qwen3_5_moe" else transformers.Qwen3_5Config
    return config(text_config=text, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO,
                  vision_start_token_id=START, vision_end_token_id=END)


def save_vlm_checkpoint(directory, family: str = "qwen3_5") -> str:
    """The tiny VLM, deterministic float64 weights (norms 1 + 0.1 N; Gated DeltaNet decays spread), saved."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_config(vlm_config(family), attn_implementation="sdpa")
    init_tiny_weights_(model.to(torch.float64), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel(), dtype=p.dtype))
            elif name.endswith("dt_bias"):
                p.add_(1.0)
    model.save_pretrained(directory)
    return str(directory)


# a batch with both: row 0 two images and a 2-frame video whose frames land on different ranks, row 1 a 3-frame
# video only, row 2 text only (S = 29: at D = 4 chunks of 4 tokens)
MIXED = dict(rows=(((4, (1, 4, 4)), (11, (1, 2, 4))), (), ()), seq=29,
             videos=(((17, (2, 4, 4)),), ((2, (3, 4, 2)),), ()))


def image_batch(rows=(((4, (1, 4, 4)), (11, (1, 4, 6))), (), ((2, (1, 2, 4)),)), seq: int = 21,
                seed: int = 0, pad_right=None, videos=None) -> dict:
    """Rows of random text with images placed at given starts: rows[b] lists (start, grid) per image (the
    placeholders run from start, framed by vision start / end tokens). Labels: the ids, -100 on image tokens.
    pad_right[b]: right padding of row b (attention_mask 0, labels -100). At the default S = 21 the images cross
    the zigzag chunk boundaries at D = 2 (chunks of 6) and D = 4 (chunks of 3), a row has none, and three images
    leave one of four ranks with nothing to encode. videos[b] lists (start, grid) per video of row b: frame f of t
    runs from start + f * (frame tokens + 3), framed by vision start / end, a timestamp (text) token between frames.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE, (len(rows), seq), generator=g)
    grids, pixels = [], []
    for b, images in enumerate(rows):
        for start, (t, h, w) in images:
            n = t * h * w // 4
            ids[b, start - 1], ids[b, start:start + n], ids[b, start + n] = START, IMAGE, END
            grids.append((t, h, w))
            pixels.append(torch.randn(t * h * w, PATCH_PIXELS, dtype=torch.float64, generator=g))
    video_grids, video_pixels = [], []
    for b, clips in enumerate(videos or ()):
        for start, (t, h, w) in clips:  # frame f: [start - 1] vision start, frame tokens, vision end, a timestamp
            n = h * w // 4
            for f in range(t):
                at = start + f * (n + 3)
                ids[b, at - 1], ids[b, at:at + n], ids[b, at + n] = START, VIDEO, END
            video_grids.append((t, h, w))
            video_pixels.append(torch.randn(t * h * w, PATCH_PIXELS, dtype=torch.float64, generator=g))
    labels = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)
    batch = {"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == VIDEO).int()}
    if grids:
        batch.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    if video_grids:
        batch.update(pixel_values_videos=torch.cat(video_pixels), video_grid_thw=torch.tensor(video_grids))
    if pad_right is not None:
        mask = torch.ones_like(ids)
        for b, n in enumerate(pad_right):
            if n:
                mask[b, -n:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = labels.masked_fill(mask == 0, -100)
    return batch


def reference_loss_and_grads(model, batch: dict):
    """transformers' own Qwen3_5ForConditionalGeneration (float64, patched): the token-mean cross entropy of its
    logits over labels != -100 (shifted), taken in the logits' dtype (its loss_function upcasts to float32), and
    the gradient of every parameter, HF-named."""
    text = model.config.text_config
    aux = bool(getattr(text, "num_experts", 0)) and text.output_router_logits
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift(batch["labels"]).reshape(-1))
        if aux:  # transformers' load-balancing loss of the whole batch, accumulated in float64
            from types import SimpleNamespace

            from ds_tsp.tools.hf_reference import load_balancing_loss

            loss = loss + text.router_aux_loss_coef * load_balancing_loss(
                SimpleNamespace(config=text), out.router_logits, batch.get("attention_mask"))
        loss.backward()
    return loss.detach(), _grads(model)


def _grads(model) -> dict:
    """Every parameter's grad, HF-named, transformers' fused experts under their checkpoint (per-expert) names."""
    from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict

    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return canonical_state_dict(grads, "qwen3_moe")


def tsp_vlm_step(source, batch: dict, group=None, syncs: list | None = None, ops: list | None = None):
    """(model, (loss, HF-named grads)) of one float64 TSPForConditionalGeneration step on `group`; `syncs` (a list)
    receives the step's host syncs as (kind, op, region, where) (tests/helpers/sync_counter.py), `ops` the TSP
    group's recorded collectives (ds_tsp.core.comm.recorder, for tests/helpers/nccl_rules.py)."""
    import contextlib

    from sync_counter import SyncCounter

    from ds_tsp.hf import TSPForConditionalGeneration

    model = TSPForConditionalGeneration.from_pretrained(source, group, dtype=torch.float64)
    recording = model.tsp.comm.recording() if ops is not None else contextlib.nullcontext()
    with SyncCounter() as counter, recording as recorder:
        out = model(**batch)
        out.loss.backward()
    if ops is not None:
        ops += recorder.ops
    if syncs is not None:
        syncs += [(e.kind, e.op, e.region, e.where) for e in counter.events]
    return model, (out.loss.detach(), model.full_state_dict(grads=True))


def packed_documents():
    """Two rows of two packed documents each (lengths 9 + 7 and 10 + 6): an image document then a text one, a
    video document then an image one; at D = 4 (chunks of 2 tokens) every vision span is cut by rank boundaries."""
    return [[image_batch(rows=(((3, (1, 4, 4)),),), seq=9, seed=1), image_batch(rows=((),), seq=7, seed=2)],
            [image_batch(rows=((),), seq=10, seed=3, videos=(((2, (2, 2, 4)),),)),
             image_batch(rows=(((2, (1, 2, 4)),),), seq=6, seed=4)]]


def packed_batch(documents) -> dict:
    """The documents packed row by row as DataCollatorWithFlattening packs them: position_ids counting from 0 per
    document, each document's first label -100; pixels and grids in the batch's row-major order."""
    rows = {key: [] for key in ("input_ids", "labels", "mm_token_type_ids", "position_ids")}
    vision = {key: [] for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    for docs in documents:
        for key in rows:
            parts = []
            for doc in docs:
                n = doc["input_ids"].shape[1]
                part = torch.arange(n)[None] if key == "position_ids" else doc[key].clone()
                if key == "labels":
                    part[:, 0] = -100
                parts.append(part)
            rows[key].append(torch.cat(parts, dim=1))
        for doc in docs:
            for key in vision:
                if key in doc:
                    vision[key].append(doc[key])
    batch = {key: torch.cat(parts) for key, parts in rows.items()}
    batch.update({key: torch.cat(parts) for key, parts in vision.items() if parts})
    return batch


def reference_packed(model, documents):
    """Every document run alone through transformers (its own pixels and grids): the token-mean loss over all of
    them and the summed gradients."""
    count = sum(int((shift(doc["labels"]) != -100).sum()) for docs in documents for doc in docs)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for docs in documents:
        for doc in docs:
            batch = {k: v for k, v in doc.items() if k != "labels"}
            logits = model(**batch, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift(doc["labels"]).reshape(-1),
                                   reduction="sum") / count
            loss.backward()
            total = total + loss.detach()
    return total, _grads(model)
