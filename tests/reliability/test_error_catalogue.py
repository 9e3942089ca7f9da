"""The error catalogue: every bad input in docs/errors.md raises ONE clear error naming the field and the fix.

Each row of docs/errors.md is produced by one case below (id, field, how to trigger it), and the test checks that
the message the code raises today is exactly the one the catalogue shows, so the docs cannot drift. Regenerate
the table with `python tests/reliability/test_error_catalogue.py > docs/errors.md`. Runtime input errors are also checked to
fail EVERY rank when only one rank's shard is bad (before any collective could deadlock).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # run as the docs' generator script too
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.errors import TSPConfigError, TSPNonFiniteError
from ds_tsp.core.parallel.topology import ParallelLayout
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
SHAPE = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
HF = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2}


def _model():
    return ShardedCausalLM(ModelShape(**SHAPE), TSPComm.single())


def _ids(n=8):
    return torch.zeros(1, n, dtype=torch.long)


def _forward(**changes):
    ids = _ids()
    args = {"input_ids": ids, "shift_labels": ids.clone(), "position_ids": torch.arange(8)[None], **changes}
    _model()(args["input_ids"], args["shift_labels"], args["position_ids"], args.get("attention_mask"))


def _deepspeed_check(ds: dict, tsp: dict):
    from ds_tsp.core.config import check_deepspeed_compatible

    check_deepspeed_compatible(ds, parse_tsp_config(tsp))


def _offload_request(ds: dict, tsp: dict):
    from ds_tsp.core.offload_config import with_deepspeed_activation_checkpointing

    with_deepspeed_activation_checkpointing(parse_tsp_config(tsp), ds)


def _across_nodes():
    from ds_tsp.core.parallel.placement import tsp_node_placement_error

    # what every rank raises at setup for 2 nodes x 2 processes and tsp.size 4 (tests/reliability/test_node_placement.py)
    raise TSPConfigError(tsp_node_placement_error(ParallelLayout.from_world_size(4, tsp=4), [0, 0, 1, 1]))


def _hf_model():
    pytest.importorskip("transformers")
    import transformers

    from ds_tsp.hf import TSPForCausalLM

    return TSPForCausalLM.from_config(transformers.LlamaConfig(**{k: v for k, v in HF.items() if k != "model_type"}))


def _hf_forward(**kwargs):
    _hf_model()(input_ids=_ids(), **kwargs)


def _nonfinite():
    from ds_tsp.core.reliability.nonfinite import NonFiniteGuard

    model = _model().init_weights_(0)
    guard = NonFiniteGuard(model)
    ids = _ids()
    loss = model(ids, ids.clone(), torch.arange(8)[None]) * float("nan")
    loss.backward()
    guard.check(loss, step=7)


def _accelerate_env(**env):
    from ds_tsp.integrations.accelerate.launch_config import resolve_setup

    resolve_setup({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                   "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "WORLD_SIZE": "4", **env})


def _checkpoint(tmp, edit):
    """A tiny saved checkpoint, then `edit(directory)`, then a sharded load."""
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny_checkpoint

    from ds_tsp.hf import TSPForCausalLM

    directory = save_tiny_checkpoint(tmp / "ck", "llama", max_shard_size="16KB")
    edit(directory)
    TSPForCausalLM.from_pretrained(directory)


def _edit_config(**changes):
    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def _drop_second_shard(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    (directory / sorted(set(index["weight_map"].values()))[1]).unlink()


def _only_bin(directory):
    for f in directory.glob("*.safetensors*"):
        f.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"")


def _foreign_manifest(tmp):
    from ds_tsp.checkpoint.training import Manifest

    (tmp / "manifest.json").write_text(json.dumps({"format": "deepspeed", "step": 1}))
    Manifest.read(tmp)


def _damaged_file(tmp, truncate: bool):
    import hashlib

    from ds_tsp.checkpoint.training.manifest import FileEntry, verify_file

    data = b"0123456789" * 10
    (tmp / "tsp00-00001.safetensors").write_bytes(data[:50] if truncate else data[::-1])
    verify_file(tmp, "tsp00-00001.safetensors", FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)))


# (id, field, trigger(tmp_path)); the message is whatever the code raises (docs/errors.md shows it)
CASES = [
    ("tsp-unknown-key", "tsp.<key>", lambda t: parse_tsp_config({"sise": 2})),
    ("ds-tsp-key-typo", "tps", lambda t: _deepspeed_check({"tps": {"size": 2}}, {})),
    ("tsp-size", "tsp.size", lambda t: parse_tsp_config({"size": 0})),
    ("tsp-type", "tsp.overlap", lambda t: parse_tsp_config({"overlap": "yes"})),
    ("tsp-kernel", "tsp.kernel", lambda t: parse_tsp_config({"kernel": "triton"})),
    ("tsp-nonfinite-policy", "tsp.on_nonfinite", lambda t: parse_tsp_config({"on_nonfinite": "ignore"})),
    ("ds-autotp", "tensor_parallel.autotp_size",
     lambda t: _deepspeed_check({"tensor_parallel": {"autotp_size": 2}}, {"size": 2})),
    ("ds-ulysses", "sequence_parallel_size", lambda t: _deepspeed_check({"sequence_parallel_size": 2}, {"size": 2})),
    ("ds-pipeline-zero", "zero_optimization.stage",
     lambda t: _deepspeed_check({"zero_optimization": {"stage": 2}}, {"size": 2, "pipeline_stages": 2})),
    ("layout-world", "tsp", lambda t: ParallelLayout.from_world_size(6, tsp=4)),
    ("tsp-offload-needs-checkpointing", "tsp.offload_activations",
     lambda t: parse_tsp_config({"offload_activations": True})),
    ("ds-cpu-checkpointing", "activation_checkpointing.cpu_checkpointing",
     lambda t: _offload_request({"activation_checkpointing": {"cpu_checkpointing": True}}, {})),
    ("ds-partition-activations", "activation_checkpointing.partition_activations",
     lambda t: _offload_request({"activation_checkpointing": {"partition_activations": True}},
                                {"activation_checkpointing": True})),
    ("tsp-across-nodes", "tsp.size", lambda t: _across_nodes()),
    ("heads-degree", "num_heads", lambda t: ModelShape(**{**SHAPE, "num_heads": 6, "hidden_size": 36,
                                                          "num_kv_heads": 6}).check_tsp_degree(4)),
    ("kv-heads-degree", "num_kv_heads", lambda t: ModelShape(**{**SHAPE, "num_heads": 12, "hidden_size": 48,
                                                                "num_kv_heads": 3}).check_tsp_degree(2)),
    ("ffn-degree", "intermediate_size", lambda t: ModelShape(**{**SHAPE, "intermediate_size": 66}).check_tsp_degree(4)),
    ("hidden-heads", "hidden_size", lambda t: ModelShape(**{**SHAPE, "hidden_size": 30})),
    ("gqa-groups", "num_heads", lambda t: ModelShape(**{**SHAPE, "num_kv_heads": 3})),
    ("head-dim-odd", "head_dim", lambda t: ModelShape(**{**SHAPE, "head_dim": 7})),
    ("hf-model-type", "model_type", lambda t: ModelShape.from_hf_config({**HF, "model_type": "gpt2"})),
    ("hf-o-proj-bias", "attention_bias", lambda t: ModelShape.from_hf_config({**HF, "attention_bias": True})),
    ("hf-moe", "num_local_experts", lambda t: ModelShape.from_hf_config({**HF, "num_local_experts": 8})),
    ("hf-rope-type", "rope_parameters.rope_type",
     lambda t: ModelShape.from_hf_config({**HF, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})),
    ("hf-activation", "hidden_act", lambda t: ModelShape.from_hf_config({**HF, "hidden_act": "gelu"})),
    ("batch-dims", "input_ids", lambda t: shard_batch(torch.zeros(8, dtype=torch.long), tsp=2, rank=0)),
    ("batch-negative-id", "input_ids", lambda t: shard_batch(torch.full((1, 8), -1), tsp=2, rank=0)),
    ("batch-short", "input_ids", lambda t: shard_batch(_ids(1), tsp=2, rank=0)),
    ("token-out-of-vocab", "input_ids", lambda t: _forward(input_ids=torch.full((1, 8), 40))),
    ("position-ids-missing", "position_ids", lambda t: _forward(position_ids=None)),
    ("position-ids-shape", "position_ids", lambda t: _forward(position_ids=torch.arange(6)[None])),
    ("no-labels", "shift_labels", lambda t: _forward(shift_labels=torch.full((1, 8), -100))),
    ("mask-holes", "attention_mask", lambda t: _forward(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]]))),
    ("documents-longer-than-seq", "--documents", lambda t: __import__("ds_tsp.tools.verify", fromlist=["x"])
     .document_lengths(__import__("ds_tsp.tools.verify", fromlist=["x"]).VerifyCase(ModelShape(**SHAPE), seq=4,
                                                                               documents=5))),
    ("hf-logits-to-keep", "logits_to_keep", lambda t: _hf_forward(logits_to_keep=0)),
    ("hf-unknown-kwarg", "use_cache", lambda t: _hf_forward(labels=_ids(), use_cache=True)),
    ("hf-positional-args", "input_ids", lambda t: _hf_model()(_ids(), _ids())),
    ("hf-generate", "generate", lambda t: _hf_model().generate(_ids())),
    ("ckpt-shape", "config.json", lambda t: _checkpoint(t, _edit_config(intermediate_size=96))),
    ("ckpt-missing-shard", "model.safetensors.index.json", lambda t: _checkpoint(t, _drop_second_shard)),
    ("ckpt-foreign-tensors", "config.json", lambda t: _checkpoint(t, _edit_config(num_hidden_layers=1))),
    ("ckpt-pickle-only", "pytorch_model.bin", lambda t: _checkpoint(t, _only_bin)),
    ("fsdp-version", "fsdp_version", lambda t: _accelerate_env(FSDP_VERSION="1")),
    ("fsdp-sp", "parallelism_config_sp_size", lambda t: _accelerate_env(PARALLELISM_CONFIG_SP_SIZE="2")),
    ("shard-size", "max_shard_size", lambda t: __import__("ds_tsp.checkpoint.safetensors.writer", fromlist=["x"])
     .parse_size("lots")),
    ("nonfinite", "on_nonfinite", lambda t: _nonfinite()),
    ("train-ckpt-keep-last", "keep_last", lambda t: __import__("ds_tsp.checkpoint.training", fromlist=["x"])
     .CheckpointStore(t, keep_last=0)),
    ("train-ckpt-foreign", "format", lambda t: _foreign_manifest(t)),
    ("train-ckpt-corrupted", "sha256", lambda t: _damaged_file(t, truncate=False)),
    ("train-ckpt-truncated", "bytes", lambda t: _damaged_file(t, truncate=True)),
    ("train-ckpt-not-json", "lr_scheduler", lambda t: __import__("ds_tsp.checkpoint.training.access", fromlist=["x"])
     .jsonable({"lr_lambdas": [object()]}, "lr_scheduler.state_dict()")),
]


def _message(case, tmp_path) -> str:
    _, _, trigger = case
    with pytest.raises((TSPConfigError, TSPNonFiniteError)) as err:
        trigger(tmp_path)
    return " ".join(str(err.value).split())


def _documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells[2].replace("\\|", "|")
    return rows


def test_catalogue_has_enough_distinct_errors():
    assert len({case[0] for case in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_error_is_the_documented_one(case, tmp_path):
    message = _message(case, tmp_path)
    assert case[1].split(".")[-1].strip("<>-") in message or case[1] in message, (case[1], message)
    documented = _documented()
    assert case[0] in documented, f"docs/errors.md has no row {case[0]}: regenerate it"
    assert documented[case[0]] == _normalise(message, tmp_path), (documented[case[0]], message)


def _normalise(message: str, tmp_path) -> str:
    """Paths differ per run: the catalogue shows them as <dir>."""
    return message.replace(str(tmp_path / "ck"), "<dir>").replace(str(tmp_path), "<tmp>")


# --- runtime errors fail every rank, even when one rank's input is bad ------------------------------------------

def _one_rank_bad(kind: str):
    import torch.distributed as dist

    comm = TSPComm(dist.group.WORLD)
    model = ShardedCausalLM(ModelShape(**SHAPE), comm)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=comm.size, rank=comm.rank)
    mask = None
    if comm.rank == 1:
        if kind == "shape":
            b = {k: v[:1] for k, v in b.items() if torch.is_tensor(v)}
        elif kind == "mask_on_one_rank":
            mask = torch.ones_like(b["input_ids"])
    try:
        model(b["input_ids"], b["shift_labels"], b["position_ids"], mask)
    except TSPConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", ["shape", "mask_on_one_rank"])
def test_one_bad_rank_fails_every_rank(kind):
    messages = run_on_local_ranks(_one_rank_bad, 2, kind, timeout_s=60)
    assert all(m is not None and "differ across TSP ranks" in m for m in messages), messages


if __name__ == "__main__":  # python tests/reliability/test_error_catalogue.py > docs/errors.md
    import os
    import tempfile

    # DeepSpeed, imported by a case, logs "Setting accelerator to CPU" to STDOUT when it has to guess: it would
    # land in the table. The catalogue needs no accelerator, so tell it (a set value, e.g. cuda, is kept).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print("# Error catalogue\n")
    print("Every bad input below gives ONE error (ds_tsp.core.errors.TSPConfigError, or TSPNonFiniteError) naming the "
          "field and the fix.\nInput errors found while training (token ids, shapes, labels, masks) are detected "
          "by one small all-gather\nbefore any other collective, so they fail EVERY rank of the TSP group, also "
          "when only one rank's shard is bad.\nGenerated by `python tests/reliability/test_error_catalogue.py > docs/errors.md`; "
          "tests/reliability/test_error_catalogue.py checks\nthat each message is still exactly this one.\n")
    print("| id | field | message |")
    print("|---|---|---|")
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            try:
                case[2](tmp_path)
                raise SystemExit(f"{case[0]} raised nothing")
            except (TSPConfigError, TSPNonFiniteError) as err:
                message = _normalise(" ".join(str(err).split()), tmp_path)
        print(f"| `{case[0]}` | {case[1]} | {message.replace('|', chr(92) + '|')} |")
