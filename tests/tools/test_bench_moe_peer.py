"""`ds-tsp bench --hf-config <Qwen3-MoE config>`: TSP against transformers' own Qwen3-MoE under ZeRO-3 / FSDP2 data
parallelism (hf_zero3_dp, hf_fsdp2_dp), and the peers that build a dense Llama refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from local_ranks import forked_ranks  # noqa: E402

from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.bench.cli import build_parser, configs_from_args  # noqa: E402

DOCS_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "bench" / "moe" / "config.json"


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("qwen3_moe")
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                         tie_word_embeddings=False)
    (directory / "config.json").write_text(config.to_json_string())
    return directory


def _configs(*argv: str):
    return [(c.layout, c.tsp, c.moe_dispatch, c.label)
            for c in configs_from_args(build_parser().parse_args([*argv, "--seq", "64"]))]


def test_moe_config_runs_tsp_per_schedule_and_each_hf_peer_once():
    base = ("--hf-config", str(DOCS_CONFIG), "--moe-dispatch", "ring,all_to_all")
    assert _configs(*base, "--tsp", "2", "4", "--layouts", "tsp,hf_zero3_dp,hf_fsdp2_dp") == [
        (layout, d, dispatch, label) for d in (2, 4) for layout, dispatch, label in (
            ("tsp", "ring", "tsp[ring]"), ("tsp", "all_to_all", "tsp[all_to_all]"),
            ("hf_zero3_dp", "auto", "hf_zero3_dp"), ("hf_fsdp2_dp", "auto", "hf_fsdp2_dp"))]
    assert {c[0] for c in _configs(*base, "--tsp", "2")} == {"tsp", "tsp_speed"}  # "all": the TSP layouts
    for peer in ("ulysses_zero3", "dtensor_tp_sp", "autotp_zero1"):  # they would build a dense HF Llama
        with pytest.raises(ValueError, match=rf"{peer}.*hf_zero3_dp, hf_fsdp2_dp and single.*no experts"):
            _configs(*base, "--tsp", "2", "--layouts", f"tsp,{peer}")


def test_the_peer_config_is_transformers_own_qwen3_moe_of_the_same_shape():
    """hf_config (what build_hf_model builds) of the docs' MoE config: Qwen3-MoE with the shape's experts, not a
    dense Llama; the run below builds and steps such a model."""
    from ds_tsp.tools.bench.common import hf_config
    from ds_tsp.tools.plan.shapes import shape_from_hf_config

    shape = shape_from_hf_config(DOCS_CONFIG)
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size, shape.num_layers) == (
        8, 2, 256, 4)
    config = hf_config(shape, 8192)
    assert type(config).__name__ == "Qwen3MoeConfig" and config._attn_implementation == "sdpa"
    assert ModelShape.from_hf_config(config.to_dict()) == shape


def _one_step(config_dir, out, layouts: str, capsys) -> dict:
    args = build_parser().parse_args(["--hf-config", str(config_dir), "--tsp", "2", "--seq", "32", "--steps", "1",
                                      "--warmup", "0", "--layouts", layouts, "--profile", "--moe-dispatch",
                                      "ring,all_to_all", "--timeout", "300", "--quiet", "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = {r.get("label") or r["layout"]: r for r in json.loads((out / "results.json").read_text())}
    for r in rows.values():
        assert r["ok"] and abs(r["loss"] - float(torch.log(torch.tensor(96.0)))) < 1.0
        if r["layout"].startswith("hf_"):
            assert r["tokens_per_step"] == 2 * 32  # a whole sequence per rank
    return rows


@pytest.mark.slow
def test_both_hf_moe_peers_step_in_one_run(tiny_moe_dir, tmp_path, capsys):
    """One step of a tiny Qwen3-MoE under transformers' own model with ZeRO-3 and FSDP2 data parallelism at D=2
    (about 30 s on 2 loaded cores; TSP's MoE rows with --profile are tests/tools/test_bench.py's)."""
    rows = _one_step(tiny_moe_dir, tmp_path / "bench", "hf_zero3_dp,hf_fsdp2_dp", capsys)
    assert set(rows) == {"hf_zero3_dp", "hf_fsdp2_dp"}
    assert all("work" not in r["profile"] for r in rows.values())  # the work figure is TSP's
