"""The vision tower of a multimodal Qwen3.5 / Qwen3-VL config under TSP, per rank (`ds-tsp plan --images N
--image-tokens T [--videos M --video-tokens F]`); torch-free.

What TSPForConditionalGeneration does (ds_tsp.core.layers.vision): the tower's weights are whole on every TSP rank
(replicated: small beside the language model), each rank encodes a contiguous 1/D of the images / videos, and one
all-to-all per modality brings every vision token's embedding (plus Qwen3-VL's DeepStack features: more columns of
the same rows) to the rank whose zigzag chunks hold it; backward sends the gradients back the same way.
- params / grads / optimizer: the tower's exact parameter count (transformers' Qwen3VL vision model: patch
  embedding, learned position grid, `depth` blocks, the merger and the DeepStack mergers), in the plan's dtype,
  AdamW states (+ fp32 masters under bf16 / fp16), ZeRO over dp as the language model's;
- pixel_values: the batch's pixels, whole on every rank (the model takes the full batch; the tower reads its
  rank's run as a view of them and keeps it for the patch embedding's backward), in the plan's dtype;
- activations: what autograd saves inside the tower for this rank's 1/D of the patches (vision tokens x
  spatial_merge_size^2), per patch: the embedding and its position sum, per block the layer norms'
  inputs and outputs, q / k / v after rotary, the attention output and its projection input, the MLP's hidden (in,
  activation out, down-projection in) and the residual, the mergers' inputs and hidden; the attention's own
  buffers are the flash / efficient kernel's (no S x S matrix); activation checkpointing recomputes the language
  model's layers and the tower's blocks (TSPForConditionalGeneration.gradient_checkpointing_enable, as transformers'
  own), and then the tower keeps each block's input and, in backward, one recomputed block's saves;
- all-to-all: each rank sends the rows it encoded for other ranks (forward) and the gradients of the rows it holds
  from other ranks (backward): at most 2 x V/D rows of out_hidden_size x (1 + DeepStack) columns, where no vision
  token stays on the rank that encoded it; (D-1)/D of that when the vision tokens' places are independent of the
  encoding order (the expected figure).
"""
from __future__ import annotations

import json
from pathlib import Path

from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.memory import optimizer_bytes_per_param, zero_divs


def vision_config(path_or_dict) -> dict | None:
    """The vision_config of a multimodal config.json (or its directory), None for a text-only one."""
    if isinstance(path_or_dict, dict):
        return path_or_dict.get("vision_config")
    path = Path(path_or_dict)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text()).get("vision_config")


def tower_params(v: dict) -> int:
    """Parameters of transformers' Qwen3VL / Qwen3.5 vision model (Qwen3VLVisionModel's modules)."""
    h, inter, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    merged = h * v["spatial_merge_size"] ** 2
    out = v["out_hidden_size"]
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + h
    position = v["num_position_embeddings"] * h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (inter * h + inter) + (h * inter + h)
    merger = merged * merged + merged + out * merged + out
    deepstack = len(v.get("deepstack_visual_indexes") or ())
    return patch + position + depth * block + (2 * h + merger) + deepstack * (2 * merged + merger)


def pixels_per_patch(v: dict) -> int:
    return v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2


def block_elements_per_patch(v: dict) -> int:
    """Elements one vision block keeps per patch (module docstring's list)."""
    return 9 * v["hidden_size"] + 3 * v["intermediate_size"]


def saved_elements_per_patch(v: dict, checkpointed: bool = False) -> int:
    """Elements autograd keeps per patch inside the tower (module docstring's list), the pixels aside; checkpointed
    (the tower's blocks recomputed in backward): each block's input, and one block's saves while it is recomputed."""
    h, m2 = v["hidden_size"], v["spatial_merge_size"] ** 2
    block = block_elements_per_patch(v)
    merger = 2 * h + 2 * h + v["out_hidden_size"] // m2  # norm in / out, fc1 in / activation, fc2 in (per patch)
    # a DeepStack merger normalises after the shuffle: its input is a block's output, already kept
    deepstack = len(v.get("deepstack_visual_indexes") or ()) * 3 * h
    if checkpointed:
        return v["depth"] * h + block + merger + deepstack
    return 2 * h + v["depth"] * block + merger + deepstack


def plan_vision(inp: PlanInput, v: dict, images: int, image_tokens: int, videos: int = 0,
                video_tokens: int = 0) -> dict:
    """The tower's bytes per TSP rank for `images` images of `image_tokens` vision tokens each (and videos of
    `video_tokens` tokens each, all frames), in the plan's batch."""
    vision_tokens = images * image_tokens + videos * video_tokens
    if vision_tokens > inp.seq * inp.batch:
        raise PlanInputError("images", f"{vision_tokens} vision tokens do not fit seq {inp.seq} x batch {inp.batch}")
    if vision_tokens == 0:
        raise PlanInputError("images", "--images N --image-tokens T (or --videos M --video-tokens F) with N x T > 0")
    d, b = inp.degree, inp.dtype_bytes
    params = tower_params(v)
    divs = zero_divs(inp)
    per_rank_tokens = -(-vision_tokens // d)
    patches = per_rank_tokens * v["spatial_merge_size"] ** 2
    columns = v["out_hidden_size"] * (1 + len(v.get("deepstack_visual_indexes") or ()))
    bound = 2 * per_rank_tokens * columns * b
    out = {"vision_tokens": vision_tokens, "tokens_encoded_per_rank": per_rank_tokens,
           "patches_encoded_per_rank": patches, "params": params, "params_bytes": params * b,
           "grads_bytes": -(-params // divs["grads_div"]) * b,
           "optimizer_bytes": -(-params // divs["opt_div"]) * optimizer_bytes_per_param(inp),
           "activations_bytes": patches * saved_elements_per_patch(v, inp.activation_checkpointing) * b,
           "pixel_values_bytes": vision_tokens * v["spatial_merge_size"] ** 2 * pixels_per_patch(v) * b,
           "all_to_all_bytes_per_step": bound * (d - 1) // d, "all_to_all_bytes_per_step_max": bound}
    out["memory_bytes_per_rank"] = (out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
                                    + out["activations_bytes"] + out["pixel_values_bytes"])
    return out
