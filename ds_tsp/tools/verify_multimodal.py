"""`ds-tsp verify --hf-model DIR --images N --videos M`: the numerics self-check of a multimodal checkpoint
(Qwen3.5, Qwen3.5-MoE, Qwen3-VL, Qwen3-VL-MoE ForConditionalGeneration) with images and videos,
TSPForConditionalGeneration against transformers' own model.

The batch: case.batch rows of case.seq random text tokens with N images then M videos dealt round-robin over the
rows; an image is a grid of (1, 2m, 2m) patches (m = the tower's spatial merge: 4 tokens), a video 2 such frames
with a timestamp (text) token between them, each framed by the vision start / end tokens; random pixels from the
seed; labels are the ids, -100 on the vision tokens. TSP loads DIR by slices
(the tower whole, replicated); the reference runs on TSP rank 0. The report is `ds-tsp verify`'s JSON (loss and
worst gradient, the vision tower's included, norm-wise relative), plus "images" and "videos".
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.launch import local_device
from ds_tsp.core.tokens.zigzag import shift_labels as shift

# tokens an item takes in a row, its trailing text token included: an image [start] 4 x [image] [end] [text]; a
# video of 2 frames [start] 4 x [video] [end] [timestamp] [start] 4 x [video] [end] [text]
WIDTH = {"image": 7, "video": 14}


def row_layout(images: int, videos: int, batch: int) -> list[list[str]]:
    """Which items each row holds: images then videos, dealt round-robin over the rows."""
    rows: list[list[str]] = [[] for _ in range(batch)]
    for i, kind in enumerate(["image"] * images + ["video"] * videos):
        rows[i % batch].append(kind)
    return rows


def tokens_needed(images: int, videos: int, batch: int) -> int:
    """The shortest --seq that holds the layout (one leading text token per row)."""
    return 1 + max(sum(WIDTH[k] for k in row) for row in row_layout(images, videos, batch))


def multimodal_batch(case, config: dict) -> dict:
    """The verify batch (module docstring) from the checkpoint's config.json values."""
    vision = config["vision_config"]
    m = vision.get("spatial_merge_size", 2)
    pixels_per_patch = (vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2)
                        * vision.get("patch_size", 16) ** 2)
    vocab = config["text_config"]["vocab_size"]
    special = {config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id") if k in config}
    if tokens_needed(case.images, case.videos, case.batch) > case.seq:
        raise TSPConfigError(f"--images {case.images} --videos {case.videos} over --batch {case.batch} rows need "
                             f"--seq {tokens_needed(case.images, case.videos, case.batch)} at least")
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    for token in special:  # random text never looks like a placeholder
        ids[ids == token] = min(set(range(vocab)) - special)
    start, end = config["vision_start_token_id"], config["vision_end_token_id"]
    for b, row in enumerate(row_layout(case.images, case.videos, case.batch)):
        at = 1
        for kind in row:
            for _ in range(1 if kind == "image" else 2):  # frames
                ids[b, at], ids[b, at + 1:at + 5], ids[b, at + 5] = start, config[f"{kind}_token_id"], end
                at += 7
    images, videos = ids == config["image_token_id"], ids == config["video_token_id"]
    batch = {"input_ids": ids, "labels": ids.masked_fill(images | videos, -100),
             "mm_token_type_ids": images.int() + 2 * videos.int()}
    # the processor's order: items as they appear in the batch, row-major (all items of a kind share one grid)
    if case.images:
        batch["image_grid_thw"] = torch.tensor([[1, 2 * m, 2 * m]] * case.images)
        batch["pixel_values"] = torch.randn(case.images * 4 * m * m, pixels_per_patch, generator=g,
                                            dtype=torch.float64)
    if case.videos:
        batch["video_grid_thw"] = torch.tensor([[2, 2 * m, 2 * m]] * case.videos)
        batch["pixel_values_videos"] = torch.randn(case.videos * 8 * m * m, pixels_per_patch, generator=g,
                                                   dtype=torch.float64)
    return batch


def reference_loss_and_grads(directory: str, dtype: torch.dtype, batch: dict):
    """transformers' own ForConditionalGeneration from `directory`: the token-mean cross entropy in the logits'
    dtype (+ router_aux_loss_coef x the load-balancing loss for an MoE config that asks for it) and every
    gradient, experts under their checkpoint names."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict
    from ds_tsp.tools.hf_reference import load_balancing_loss, load_hf_reference

    model = load_hf_reference(directory, dtype, image_text=True)
    text = model.config.text_config
    inputs = {k: v.to(dtype) if k.startswith("pixel_values") else v for k, v in batch.items() if k != "labels"}
    with torch.enable_grad():
        out = model(**inputs, use_cache=False, **({"output_router_logits": True}
                                                  if getattr(text, "num_experts", 0) else {}))
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift(batch["labels"]).reshape(-1))
        if getattr(text, "num_experts", 0) and text.output_router_logits:
            loss = loss + text.router_aux_loss_coef * load_balancing_loss(SimpleNamespace(config=text),
                                                                          out.router_logits)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), canonical_state_dict(grads, "qwen3_moe")


def run_multimodal_case(case, group: dist.ProcessGroup | None) -> dict | None:
    """Collective over `group` (one TSP group). The report on TSP rank 0, None elsewhere."""
    from ds_tsp.model.hf_conditional_generation import TSPForConditionalGeneration
    from ds_tsp.tools.verify import DTYPES, _rel_err

    comm = TSPComm(group)
    dtype, device = DTYPES[case.dtype], local_device()
    config = json.loads((Path(case.hf_model) / "config.json").read_text())
    batch = multimodal_batch(case, config)
    model = TSPForConditionalGeneration.from_pretrained(case.hf_model, comm, dtype=dtype, device=device)
    out = model(**{k: v.to(device) for k, v in batch.items()})
    out.loss.backward()
    grads = {name: g.cpu() for name, g in model.full_state_dict(grads=True).items()}
    loss = out.loss.detach().cpu()
    if comm.rank != 0:
        return None
    ref_loss, ref_grads = reference_loss_and_grads(case.hf_model, dtype, batch)
    errors = {name: _rel_err(grads[name], g) for name, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    report = {"loss_rel_err": _rel_err(loss, ref_loss), "grad_rel_err": errors[worst], "worst_grad": worst,
              "tsp": comm.size, "dtype": case.dtype, "loss": float(loss), "ref_loss": float(ref_loss),
              "tolerance": case.tolerance, "documents": case.documents, "reference": "transformers",
              "images": case.images, "videos": case.videos}
    report["ok"] = report["loss_rel_err"] <= case.tolerance and report["grad_rel_err"] <= case.tolerance
    return report


def run_multimodal_case_on_world(case) -> dict | None:
    """Entry for an initialised default group (torchrun) or a spawned one: the whole world is one TSP group."""
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return run_multimodal_case(case, group)
