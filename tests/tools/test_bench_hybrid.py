"""`ds-tsp bench` on hybrid models (Qwen3.5 / Qwen3-Next): which layouts run them, the ZeRO-3 data-parallel peer
(transformers' own model) and `--max-seq --hf-config <hybrid> --tsp 2 4` end to end on a tiny config, its answer
checked against its own measurements (max_seq fits the budget, the next probe does not)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from hybrid_tiny import hybrid_config  # noqa: E402
from local_ranks import forked_ranks  # noqa: E402

from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.bench.cli import build_parser, configs_from_args  # noqa: E402
from ds_tsp.tools.bench.config import BenchConfig  # noqa: E402


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5")
    (directory / "config.json").write_text(hybrid_config(
        "qwen3_5", layer_types=("linear_attention", "full_attention", "linear_attention"),
        num_hidden_layers=3).to_json_string())
    return directory


def _layouts(*argv: str) -> list[str]:
    return [c.layout for c in configs_from_args(build_parser().parse_args([*argv, "--seq", "32"]))]


def test_hybrid_peer_is_in_all_for_hybrids_only_and_the_other_peers_are_refused_naming_why(hybrid_dir):
    assert "hf_zero3_dp" not in _layouts("--tsp", "2")  # the default Llama shape: "all" as before
    assert _layouts("--tsp", "2", "--layouts", "tsp,hf_zero3_dp") == ["tsp", "hf_zero3_dp"]  # named, it runs
    assert _layouts("--hf-config", str(hybrid_dir), "--tsp", "2", "4") == [
        "tsp", "tsp_speed", "hf_zero3_dp", "tsp", "tsp_speed", "hf_zero3_dp"]
    # transformers' model under torch FSDP2 data parallel: runs when named, for hybrids too, never in "all"
    assert _layouts("--hf-config", str(hybrid_dir), "--tsp", "2", "--layouts", "tsp,hf_fsdp2_dp") == [
        "tsp", "hf_fsdp2_dp"]
    assert "hf_fsdp2_dp" not in _layouts("--tsp", "2")
    for peer in ("ulysses_zero3", "ulysses_zero1", "dtensor_tp_sp", "autotp_zero1"):
        with pytest.raises(ValueError, match=rf"{peer}.*attention function only.*1/D of the sequence.*#8114"):
            _layouts("--hf-config", str(hybrid_dir), "--tsp", "2", "--layouts", f"tsp,{peer}")


def test_moe_hybrid_cut_by_layers_keeps_its_dense_layers_valid(tmp_path):
    (tmp_path / "config.json").write_text(hybrid_config(
        "qwen3_next_moe", layer_types=("linear_attention", "full_attention", "linear_attention"),
        num_hidden_layers=3, mlp_only_layers=[0, 2]).to_json_string())
    cfg = configs_from_args(build_parser().parse_args(
        ["--hf-config", str(tmp_path), "--tsp", "2", "--layers", "2", "--layouts", "tsp", "--seq", "32"]))[0]
    assert cfg.shape.num_layers == 2 and cfg.shape.dense_mlp_layers == (0,)
    assert [cfg.shape.is_moe_layer(i) for i in range(2)] == [False, True]


def test_the_peer_builds_transformers_own_hybrid_model_of_the_same_shape(hybrid_dir):
    """hf_zero3_dp's model (ds_tsp.tools.bench.common.build_hf_model) is transformers' Qwen3.5 of the --hf-config's
    shape: its config reads back into the same ModelShape (layer types, Gated DeltaNet heads, gated attention)."""
    from ds_tsp.tools.bench.common import build_hf_model
    from ds_tsp.tools.plan.shapes import shape_from_hf_config

    shape = shape_from_hf_config(hybrid_dir)
    model = build_hf_model(BenchConfig(layout="hf_zero3_dp", seqs=(32,), tsp=2, shape=shape))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert list(model.config.layer_types) == list(shape.layer_types)
    assert model.config.linear_num_value_heads == shape.linear_num_value_heads
    reference = ModelShape.from_hf_config(model.config.to_dict())
    assert reference == shape
    ids = torch.randint(0, shape.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss.detach()
    assert torch.isfinite(loss) and abs(float(loss) - torch.log(torch.tensor(75.0))) < 1.0  # near-uniform init


def _max_seq_rows(config_dir, out, budget_mib: float, degrees: list[str]) -> list[dict]:
    args = build_parser().parse_args(["--max-seq", "--budget-mib", str(budget_mib), "--hf-config", str(config_dir),
                                      "--tsp", *degrees, "--layouts", "tsp", "--timeout", "600", "--quiet",
                                      "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0
    rows = json.loads((out / "results.json").read_text())
    budget = int(budget_mib * 2 ** 20)
    assert [(r["tsp"], r["activation_checkpointing"]) for r in rows] == [
        (int(d), ac) for d in degrees for ac in (False, True)]
    for r in rows:  # the answer against its own measurements: max_seq fits, the next probe does not
        assert r["ok"] and r["shape"]["layer_types"] == ["linear_attention", "full_attention"]
        assert r["budget_bytes"] == budget and r["seq"] == r["max_seq"] and r["max_seq"] % (2 * r["tsp"]) == 0
        assert r["peak_bytes_per_rank"] <= budget < r["next_probe_peak_bytes"]
        assert r["next_probe_seq"] - r["max_seq"] <= max(2 * r["tsp"], 0.05 * r["max_seq"])
    return rows


@pytest.fixture(scope="module")
def two_layer_hybrid_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5_two_layers")
    (directory / "config.json").write_text(hybrid_config("qwen3_5").to_json_string())  # linear + full attention
    return directory


def test_max_seq_on_a_hybrid_config(two_layer_hybrid_dir, tmp_path):
    """D=2, a budget that stops the search below S=256 (short probes); D=2 and 4 under --runslow (below)."""
    _max_seq_rows(two_layer_hybrid_dir, tmp_path / "bench", 0.6, ["2"])


@pytest.mark.slow
def test_max_seq_on_a_hybrid_config_at_d2_and_d4(two_layer_hybrid_dir, tmp_path):
    """The hybrid max-seq command on a tiny config: `ds-tsp bench --max-seq --budget-mib 1 --hf-config DIR --tsp 2 4`
    (about 5 minutes of wall time on 2 loaded cores: the D=4 probes reach S=1024)."""
    rows = _max_seq_rows(two_layer_hybrid_dir, tmp_path / "bench", 1, ["2", "4"])
    by_degree = {(r["tsp"], r["activation_checkpointing"]): r["max_seq"] for r in rows}
    assert by_degree[4, False] > by_degree[2, False]  # 1/D of the tokens and weights per rank


def test_zero3_and_fsdp2_peers_and_tsp_step_the_same_hybrid_in_one_run(hybrid_dir, tmp_path, capsys):
    """One step of the hybrid under TSP, hf_zero3_dp and hf_fsdp2_dp at D=2, in one bench run (about 8 s
    unloaded)."""
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--hf-config", str(hybrid_dir), "--tsp", "2", "--seq", "64", "--steps", "1",
                                      "--layouts", "tsp,hf_zero3_dp,hf_fsdp2_dp", "--timeout", "300", "--quiet",
                                      "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["tsp"]["tokens_per_step"] == 64
    assert rows["hf_zero3_dp"]["tokens_per_step"] == rows["hf_fsdp2_dp"]["tokens_per_step"] == 2 * 64
    for r in rows.values():
        assert r["ok"] and abs(r["loss"] - float(torch.log(torch.tensor(75.0)))) < 1.0
    # whole sequence per rank against 1/D of it: the peers' activations are the larger at the same S
    for peer in ("hf_zero3_dp", "hf_fsdp2_dp"):
        assert rows[peer]["peak_breakdown"]["activations"] > rows["tsp"]["peak_breakdown"]["activations"]
    # FSDP2 shards the params: every decoder layer's weights all-gathered (forward and backward), grads
    # reduce-scattered
    assert {"all_gather", "reduce_scatter"} <= {op.split(".")[-1].removeprefix("_").removesuffix("_base")
                                                 .removesuffix("_tensor") for op in rows["hf_fsdp2_dp"]["comm_by_op"]}


def test_global_batch_gives_every_layout_the_same_sequences_per_step(hybrid_dir, tmp_path, capsys):
    """--global-batch N: TSP (its ranks share each sequence) runs N rows, ZeRO-3 data parallel N / D per rank, so
    both step the same tokens and move their weights once for them; bad N and the flags it excludes are refused
    naming the flag."""
    argv = ["--hf-config", str(hybrid_dir), "--tsp", "2", "--seq", "32", "--layouts", "tsp,hf_zero3_dp"]
    got = configs_from_args(build_parser().parse_args([*argv, "--global-batch", "4"]))
    assert [(c.layout, c.batch) for c in got] == [("tsp", 4), ("hf_zero3_dp", 2)]
    for bad, words in ((["--global-batch", "3"], "give a multiple of 2"), (["--global-batch", "2", "--batch", "2"],
                                                                        "give one")):
        with pytest.raises(ValueError, match=words):
            configs_from_args(build_parser().parse_args([*argv, *bad]))
    for flags in (["--max-seq", "--budget-mib", "64"], ["--layer-memory"]):
        args = build_parser().parse_args([*flags, "--global-batch", "2"])
        assert args.run(args) == 2 and "--global-batch: not with" in capsys.readouterr().err
    out = tmp_path / "bench"
    args = build_parser().parse_args([*argv, "--global-batch", "2", "--steps", "1", "--timeout", "300", "--quiet",
                                      "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["tsp"]["batch"] == 2 and rows["hf_zero3_dp"]["batch"] == 1
    assert rows["tsp"]["tokens_per_step"] == rows["hf_zero3_dp"]["tokens_per_step"] == 2 * 32
    assert "global batch 2 sequences per step" in (out / "results.md").read_text()


def test_profiled_hybrid_work_against_its_closed_form_floors(hybrid_dir, tmp_path, capsys):
    """--profile on a hybrid: the gated attention's projections and the dense MLP against
    ds_tsp.tools.bench.work's floors (forward + backward, nothing recomputed), exactly. Speed mode recomputes
    nothing: 1.0 each. The memory-optimal mode recomputes its q | gate, k, v projections (2 n h d (2 H + 2 H_kv)
    more than 6 n h d (3 H + 2 H_kv)) and the MLP's gate / up (22/18)."""
    from ds_tsp.tools.plan.shapes import shape_from_hf_config

    shape = shape_from_hf_config(hybrid_dir)
    out = tmp_path / "bench"
    args = build_parser().parse_args(["--hf-config", str(hybrid_dir), "--tsp", "2", "--seq", "32", "--steps", "1",
                                      "--warmup", "0", "--layouts", "tsp,tsp_speed", "--profile", "--timeout", "300",
                                      "--quiet", "--out", str(out)])
    with forked_ranks():
        assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    work = {r["layout"]: r["profile"]["work"] for r in json.loads((out / "results.json").read_text())}
    heads, kv = shape.num_heads, shape.num_kv_heads
    n, h, d = 32 // 2, shape.hidden_size, shape.dim_per_head
    attention_layers = shape.layer_types.count("full_attention")
    least = 2 * 6 * n * h * d * (3 * heads + 2 * kv) * attention_layers  # both ranks
    for layout, extra in (("tsp_speed", 0), ("tsp", 2 * 2 * n * h * d * (2 * heads + 2 * kv) * attention_layers)):
        attention, mlp = work[layout]["attention"], work[layout]["mlp"]
        assert attention["min_gemm_flops"] == least
        assert attention["gemm_flops"] == least + extra, layout
        assert mlp["min_gemm_flops"] == 2 * 18 * n * h * shape.intermediate_size * shape.num_layers
        assert mlp["gemm_flops"] * 18 == mlp["min_gemm_flops"] * (18 if layout == "tsp_speed" else 22)
    assert work["tsp"]["gdn"]["min_gemm_flops"] is None  # no closed form: counted, without a ratio
