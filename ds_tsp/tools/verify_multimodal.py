"""`ds-tsp verify --hf-model DIR --images N`: the numerics self-check of a multimodal checkpoint (Qwen3.5 /
Qwen3.5-MoE ForConditionalGeneration) with images, TSPForConditionalGeneration against transformers' own model.

The batch: case.batch rows of case.seq random text tokens with N images spread over the rows (image i in row
i % batch), each a grid of (1, 2m, 2m) patches (m = the tower's spatial merge: 4 tokens), framed by the vision start
/ end tokens, random pixels from the seed; labels are the ids, -100 on the image tokens. TSP loads DIR by slices
(the tower whole, replicated); the reference runs on TSP rank 0. The report is `ds-tsp verify`'s JSON (loss and
worst gradient, the vision tower's included, norm-wise relative), plus "images".
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


def multimodal_batch(case, config: dict) -> dict:
    """The verify batch (module docstring) from the checkpoint's config.json values."""
    vision = config["vision_config"]
    m = vision.get("spatial_merge_size", 2)
    pixels_per_patch = (vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2)
                        * vision.get("patch_size", 16) ** 2)
    vocab = config["text_config"]["vocab_size"]
    special = {config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id") if k in config}
    per_row = -(-case.images // case.batch)
    if per_row * 7 > case.seq:
        raise TSPConfigError(f"--images {case.images} over --batch {case.batch} rows needs {per_row} images of 4 "
                             f"tokens (+ start, end and a text token) per row: --seq must be at least {per_row * 7}")
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    for token in special:  # random text never looks like a placeholder
        ids[ids == token] = min(set(range(vocab)) - special)
    placed = [0] * case.batch
    for i in range(case.images):
        b = i % case.batch
        start = 2 + placed[b] * 7  # [text] [start] 4 x [image] [end] [text] ...
        ids[b, start - 1], ids[b, start:start + 4], ids[b, start + 4] = (config["vision_start_token_id"],
                                                                         config["image_token_id"],
                                                                         config["vision_end_token_id"])
        placed[b] += 1
    images = ids == config["image_token_id"]
    # the processor's order: images as they appear in the batch, row-major
    grid = torch.tensor([[1, 2 * m, 2 * m]] * case.images)
    pixels = torch.randn(case.images * 4 * m * m, pixels_per_patch, generator=g, dtype=torch.float64)
    return {"input_ids": ids, "labels": ids.masked_fill(images, -100), "mm_token_type_ids": images.int(),
            "pixel_values": pixels, "image_grid_thw": grid}


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
    inputs = {k: v.to(dtype) if k == "pixel_values" else v for k, v in batch.items() if k != "labels"}
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
              "images": case.images}
    report["ok"] = report["loss_rel_err"] <= case.tolerance and report["grad_rel_err"] <= case.tolerance
    return report


def run_multimodal_case_on_world(case) -> dict | None:
    """Entry for an initialised default group (torchrun) or a spawned one: the whole world is one TSP group."""
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return run_multimodal_case(case, group)
