"""`ds-tsp verify --hf-model DIR --images N --videos M` on a tiny multimodal Qwen3.5 (tests/helpers/vlm_tiny.py):
the same JSON report as for a text checkpoint, TSPForConditionalGeneration against transformers'
Qwen3_5ForConditionalGeneration (loss and every gradient, the vision tower's included; float64 within 1e-10,
measured ~1e-14); bad flags exit 2 naming the flag. (The model's own proofs at D = 1, 2, 4:
tests/model/test_multimodal.py.)"""
from __future__ import annotations

import json

import pytest
from local_ranks import forked_ranks

from ds_tsp.tools.cli import main

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _not_under_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # else verify would join the launcher's group


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vlm_tiny import save_vlm_checkpoint

    return save_vlm_checkpoint(tmp_path_factory.mktemp("verify_vlm") / "tiny")


def test_verify_images_and_videos_d2_float64(capsys, checkpoint):
    with forked_ranks():
        code = main(["verify", "--hf-model", checkpoint, "--images", "3", "--videos", "1", "--tsp", "2",
                     "--dtype", "float64", "--seq", "22", "--batch", "3", "--timeout", "300"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    report = json.loads(lines[-1])
    assert code == 0 and report["ok"] and (report["images"], report["videos"], report["tsp"]) == (3, 1, 2), report
    assert report["grad_rel_err"] < 1e-10 and report["loss_rel_err"] < 1e-10, report


def test_verify_images_refuses_by_name(capsys, checkpoint, tmp_path):
    assert main(["verify", "--images", "2"]) == 2
    assert "--hf-model" in capsys.readouterr().err
    assert main(["verify", "--videos", "1"]) == 2
    assert "--hf-model" in capsys.readouterr().err
    assert main(["verify", "--hf-model", checkpoint, "--images", "2", "--cp", "2"]) == 2
    assert "--cp" in capsys.readouterr().err
    assert main(["verify", "--hf-model", checkpoint, "--images", "4", "--seq", "13", "--batch", "2"]) == 2
    assert "--seq" in capsys.readouterr().err
    text = json.loads(open(f"{checkpoint}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**text, "model_type": "llava"}))
    assert main(["verify", "--hf-model", str(tmp_path), "--images", "2"]) == 2
    assert "llava" in capsys.readouterr().err
