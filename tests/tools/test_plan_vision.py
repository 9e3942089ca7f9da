"""`ds-tsp plan --hf-config <multimodal> --images N --image-tokens T`: ds_tsp.tools.plan.vision against a measured
TSPForConditionalGeneration step of the tiny Qwen3.5 VLM at D=2 (fp32), per rank:
- the tower's parameter count EXACTLY transformers' (Qwen3.5 and Qwen3-VL with DeepStack mergers), and its
  params / grads bytes the rank's (the tower is whole on every rank);
- the all-to-all bytes EXACTLY the CommCounter's, on a batch where no vision token stays on the rank that encoded it
  (the plan's "at most" figure: image 0, encoded by rank 0, lies in rank 1's zigzag chunks and image 1 the other
  way), and the expected (D-1)/D figure half of it at D=2;
- the tower's saved activations plus the batch's pixel_values (whole on every rank) within 2% of what autograd
  keeps inside model.visual on the rank (saved-tensor hooks, deduped by storage, params excluded), the rank
  encoding its 1/D of the images (measured 0.3% apart); with activation checkpointing (the tower's blocks too)
  within 5%, one recomputed block's saves aside (they live in backward only, which the hooks do not see);
- the CLI: the JSON's "vision" object and the text lines; --images without a multimodal --hf-config, with a peer
  layout, or more vision tokens than the batch holds: one usage error naming the flag.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from local_ranks import run_on_local_ranks  # noqa: E402
from vlm_tiny import END, IMAGE, PATCH_PIXELS, START, save_vlm_checkpoint, vlm_config  # noqa: E402

from ds_tsp.tools.plan import PlanInput  # noqa: E402
from ds_tsp.tools.plan import cli as plan_cli  # noqa: E402
from ds_tsp.tools.plan.vision import block_elements_per_patch, plan_vision, tower_params, vision_config  # noqa: E402

SEQ = 72  # D=2: zigzag chunks of 18, rank 0 holds 0-17 and 54-71, rank 1 holds 18-53
TOKENS = 16  # per image: a grid of 1 x 8 x 8 patches


def _crossing_batch() -> dict:
    """Two 16-token images (grids 1 x 8 x 8): image 0 at 19-34 (rank 1's chunks), image 1 at 55-70 (rank 0's)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, IMAGE, (1, SEQ), generator=g)
    for start in (19, 55):
        ids[0, start - 1], ids[0, start:start + TOKENS], ids[0, start + TOKENS] = START, IMAGE, END
    return {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE, -100), "mm_token_type_ids": (ids == IMAGE).int(),
            "pixel_values": torch.randn(8 * TOKENS, PATCH_PIXELS, generator=g),
            "image_grid_thw": torch.tensor([[1, 8, 8]] * 2)}


def _measure(directory: str) -> dict:
    from ds_tsp.core.config import TSPOptions

    return {"plain": _measure_step(directory, TSPOptions()),
            "checkpointed": _measure_step(directory, TSPOptions(activation_checkpointing=True))}


def _measure_step(directory: str, options) -> dict:
    from ds_tsp.hf import TSPForConditionalGeneration

    model = TSPForConditionalGeneration.from_pretrained(directory, dtype=torch.float32, options=options)
    seen: dict = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    forward = model.visual.forward

    def hooked(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kwargs)

    model.visual.forward = hooked
    model(**_crossing_batch()).loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.visual.parameters()}
    return {"a2a": model.tsp.comm.counter.bytes["all_to_all"],
            "saved": sum(b for ptr, b in seen.items() if ptr not in params),
            "tower_params": sum(p.numel() for p in model.visual.parameters()),
            "tower_grads": sum(p.grad.numel() for p in model.visual.parameters() if p.grad is not None)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_vlm_checkpoint(tmp_path_factory.mktemp("plan_vlm") / "tiny")


@pytest.fixture(scope="module")
def measured(checkpoint) -> list[dict]:
    return run_on_local_ranks(_measure, 2, checkpoint, timeout_s=240)


def _plan(checkpoint, checkpointed: bool = False) -> dict:
    inp = PlanInput(model=plan_cli._shape(_args(checkpoint))[0], seq=SEQ, batch=1, degree=2, dtype="fp32",
                    activation_checkpointing=checkpointed)
    return plan_vision(inp, vision_config(checkpoint), images=2, image_tokens=TOKENS)


def _args(checkpoint, **flags):
    import argparse

    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    argv = ["plan", "--hf-config", str(checkpoint)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


def test_tower_params_equal_transformers():
    import transformers

    for family in ("qwen3_5", "qwen3_vl"):
        config = vlm_config(family)
        tower = transformers.AutoModel.from_config(config.vision_config)
        assert tower_params(config.vision_config.to_dict()) == sum(p.numel() for p in tower.parameters()), family


def test_vision_bytes_equal_the_measured_step(checkpoint, measured):
    plan = _plan(checkpoint)
    for rank, both in enumerate(measured):
        m = both["plain"]
        assert m["tower_params"] == m["tower_grads"] == plan["params"], (rank, m, plan)
        assert plan["params_bytes"] == plan["grads_bytes"] == 4 * m["tower_params"]
        assert m["a2a"] == plan["all_to_all_bytes_per_step_max"] == 2 * TOKENS * 32 * 4, (rank, m, plan)
        assert plan["all_to_all_bytes_per_step"] == plan["all_to_all_bytes_per_step_max"] // 2
        # the rank's pixels are a view of the whole batch's pixel_values: the hooks see that storage whole
        tower = plan["activations_bytes"] + plan["pixel_values_bytes"]
        assert abs(tower - m["saved"]) <= 0.02 * m["saved"], (rank, m, plan)
        # checkpointed: the blocks' inputs stay; one block's saves live only while it is recomputed in backward
        # (the hooks see the forward's): 5% (the layer norms' statistics weigh more beside h = 16)
        checkpointed, m = _plan(checkpoint, True), both["checkpointed"]
        assert checkpointed["all_to_all_bytes_per_step_max"] == m["a2a"]
        recomputed = checkpointed["patches_encoded_per_rank"] * block_elements_per_patch(vision_config(checkpoint)) * 4
        tower = checkpointed["activations_bytes"] - recomputed + checkpointed["pixel_values_bytes"]
        assert abs(tower - m["saved"]) <= 0.05 * m["saved"], (rank, m, checkpointed)
        assert m["saved"] < 0.3 * both["plain"]["saved"]
    assert plan["memory_bytes_per_rank"] == sum(plan[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                                    "activations_bytes", "pixel_values_bytes"))


def test_cli_reports_the_tower_and_refuses_what_it_cannot_plan(checkpoint, capsys, tmp_path):
    flags = dict(images=2, image_tokens=TOKENS, seq=SEQ, tsp=2, dtype="fp32")
    assert plan_cli.run(_args(checkpoint, **flags, json=True)) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["layout"] == "tsp" and line["vision"] == _plan(checkpoint)
    assert plan_cli.run(_args(checkpoint, **flags)) == 0
    assert "vision tower memory per rank" in capsys.readouterr().out
    text_only = tmp_path / "config.json"
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    text_only.write_text(json.dumps({k: v for k, v in config.items() if k != "vision_config"}))
    for args, match in ((_args(checkpoint, **flags, layout="tsp,tp"), "--layout: --images / --videos plan the tsp"),
                        (_args(checkpoint, images=100, image_tokens=4, seq=SEQ, tsp=2), "--images: 400 vision"),
                        (_args(text_only, **flags), "has no vision_config"),
                        (_args(checkpoint, **flags, max_seq=True, gpu_mem_gib=80), "--max-seq does not plan the vi"),
                        (_args(checkpoint, **flags, cp=2), "--images: --cp does not plan the vision tower")):
        assert plan_cli.run(args) == 2
        assert match in capsys.readouterr().err
