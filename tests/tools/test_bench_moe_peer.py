"""`ds-tsp bench --hf-config <Qwen3-MoE config>`: TSP against transformers' own Qwen3-MoE under ZeRO-3 / FSDP2 data
parallelism (hf_zero3_dp, hf_fsdp2_dp), the peers that build a dense Llama refused, and `--profile`'s work per
layer type against the minimum (ds_tsp.tools.bench.work) on the MoE layers of both dispatch schedules."""
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


def test_tsp_and_the_zero3_moe_peer_step_in_one_run_with_the_work_profile(tiny_moe_dir, tmp_path, capsys):
    """One step of a tiny Qwen3-MoE under TSP (both schedules, profiled) and under transformers' own model with
    ZeRO-3 data parallelism, D=2, in one bench run."""
    out = tmp_path / "bench"
    rows = _one_step(tiny_moe_dir, out, "tsp,hf_zero3_dp", capsys)
    assert set(rows) == {"tsp[ring]", "tsp[all_to_all]", "hf_zero3_dp"}
    layers, tokens, k, h, f = 2, 32, 2, 32, 16
    for label in ("tsp[ring]", "tsp[all_to_all]"):
        moe = rows[label]["profile"]["work"]["moe"]
        # the whole group's expert GEMMs: forward + backward + the memory-optimal gate/up recompute, exactly
        assert moe["gemm_flops"] * 18 == moe["min_gemm_flops"] * 22 == 22 * 18 * layers * tokens * k * h * f
        assert moe["comm_bytes"] > 0
    # the ring moves exactly (3D - 2) packed expert shards per layer and rank; all_to_all its real rows, which the
    # minimum takes at even routing
    assert rows["tsp[ring]"]["profile"]["work"]["moe"]["bytes_over_min"] == 1.0
    assert 0.5 < rows["tsp[all_to_all]"]["profile"]["work"]["moe"]["bytes_over_min"] < 1.5
    assert "hf_zero3_dp" not in {r["layout"] for r in json.loads((out / "moe.json").read_text())}
    assert "work per layer type against the minimum" in (out / "results.md").read_text()


@pytest.mark.slow
def test_the_fsdp2_moe_peer_steps(tiny_moe_dir, tmp_path, capsys):
    rows = _one_step(tiny_moe_dir, tmp_path / "bench", "hf_fsdp2_dp", capsys)
    assert set(rows) == {"hf_fsdp2_dp"}
