"""`ds-tsp bench --hf-config <multimodal> --videos M --video-tokens F`: a step of the tiny Qwen3.5 VLM
(tests/helpers/vlm_tiny.py) under TSP and transformers' own model under DeepSpeed ZeRO-3 data parallel at D=2, the
vision tower's share of each rank's peak from MemTracker, and the flags refused by name."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from local_ranks import forked_ranks  # noqa: E402
from vlm_tiny import VISION, vlm_config  # noqa: E402

from ds_tsp.tools.bench.cli import build_parser, configs_from_args  # noqa: E402
from ds_tsp.tools.bench.vision import vlm_batch  # noqa: E402
from ds_tsp.tools.plan.vision import tower_params  # noqa: E402

TOWER = ("params_bytes", "ran", "entry_bytes", "after_forward_bytes", "peak_bytes", "activation_bytes",
         "peak_rise_bytes")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5_vl")
    (directory / "config.json").write_text(vlm_config().to_json_string())
    return directory


def _configs(*argv: str):
    return configs_from_args(build_parser().parse_args(list(argv)))


def test_vision_flags_build_the_batch_and_refuse_what_they_cannot_run(vlm_dir, tmp_path):
    (cfg,) = _configs("--hf-config", str(vlm_dir), "--videos", "2", "--video-tokens", "600", "--images", "1",
                      "--image-tokens", "8", "--seq", "1264", "--tsp", "2", "--layouts", "tsp")
    batch = vlm_batch(cfg.vision, 1, 1264, seed=0)
    # 600 tokens: 3 frames of 200 (10 x 20 merged tokens, 20 x 40 patches); the image one frame of 2 x 4
    assert batch["video_grid_thw"].tolist() == [[3, 20, 40]] * 2 and batch["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert int((batch["input_ids"] == 71).sum()) == 1200 and int((batch["input_ids"] == 70).sum()) == 8
    assert batch["pixel_values_videos"].shape[0] == 2 * 3 * 20 * 40
    assert (batch["labels"][batch["mm_token_type_ids"] > 0] == -100).all()
    for argv, message in ((("--layouts", "single"), r"--layouts \['single'\]: with --images"),
                          (("--seq", "64"), r"--seq \[64\]: the images and videos .* need S >= 1219"),
                          (("--video-tokens", "0"), "--video-tokens: the vision tokens per item")):
        base = {"--layouts": "tsp", "--seq": "1264", "--video-tokens": "600"}
        base.update(dict(zip(argv[::2], argv[1::2])))
        with pytest.raises(ValueError, match=message):
            _configs("--hf-config", str(vlm_dir), "--videos", "2", "--tsp", "2",
                     *[x for kv in base.items() for x in kv])
    text_only = tmp_path / "config.json"
    text_only.write_text(json.dumps(vlm_config().text_config.to_dict()))
    with pytest.raises(ValueError, match="--hf-config has no vision_config"):
        _configs("--hf-config", str(text_only), "--videos", "1", "--video-tokens", "8", "--seq", "64")


def test_tsp_against_zero3_dp_with_videos_reports_the_vision_towers_share(vlm_dir, tmp_path, capsys):
    """One video of 512 tokens (2 frames of 256) at D=2: each TSP rank encodes one frame, each ZeRO-3 rank both
    (its own batch)."""
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--hf-config", str(vlm_dir), "--tsp", "2", "--seq", "560", "--steps", "1",
                                      "--videos", "1", "--video-tokens", "512", "--layouts", "tsp,hf_zero3_dp",
                                      "--timeout", "300", "--quiet", "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "results.json").read_text())}
    tsp, zero3 = rows["tsp"], rows["hf_zero3_dp"]
    assert tsp["ok"] and zero3["ok"] and tsp["video_grid_thw"] == [[2, 32, 32]]
    tower_bytes = 4 * tower_params(VISION)  # fp32: the plan's count of the tower's parameters
    for row, held in ((tsp, tower_bytes), (zero3, tower_bytes // 2)):  # TSP replicates it, ZeRO-3 halves it
        assert len(row["vision_tower_ranks"]) == 2 and row["vision_tower"] in row["vision_tower_ranks"]
        for share in row["vision_tower_ranks"]:
            assert set(share) == set(TOWER) and share["ran"] and share["params_bytes"] == held
            assert 0 < share["activation_bytes"] <= share["peak_rise_bytes"] + share["activation_bytes"]
            assert share["entry_bytes"] < share["after_forward_bytes"] <= row["peak_bytes_per_rank"]
    # a TSP rank encodes half the patches (one frame of the video) a ZeRO-3 rank does: its tower keeps less for
    # backward, and its peak is the lower
    assert tsp["vision_tower"]["activation_bytes"] < 0.6 * zero3["vision_tower"]["activation_bytes"]
    assert tsp["peak_bytes_per_rank"] < zero3["peak_bytes_per_rank"]
