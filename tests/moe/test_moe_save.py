"""save_pretrained of a Qwen3-MoE / Mixtral model: every TSP rank of the writing data replica writes ITS experts
itself (ds_tsp.checkpoint.hf.owned_tensors), no expert byte crosses a process boundary, and the result is the standard
HF layout (`model-0000k-of-0000N.safetensors` + index) that plain transformers loads with identical tensors and
logits (float64: bit-identical tensors, the weights are only copied; logits equal to a few ulps, see the test).

One spawn of 4 ranks: each family loaded at D=4 (the world) and at D=2 (two TSP groups [0, 1] and [2, 3]: the
second is a data replica that writes nothing), saved with max_shard_size 8KB (several files per rank) while every
torch.distributed collective is recorded (tensor shape, dtype, group, root), and the files each rank wrote. Then a
second save into the same target where TSP rank 1 fails writing its experts (disk full): every rank raises the same
error, nothing is left behind and the first checkpoint is untouched. The recorded collectives are also replayed
under NCCL's rules (tests/helpers/nccl_rules.py): the same collectives in the same order on every member of every group.
"""
from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MOE_FAMILIES as ALL_MOE_FAMILIES  # noqa: E402
from hf_tiny import save_tiny_checkpoint  # noqa: E402

# the per-expert layouts, whose tensors each have one owner; GPT-OSS's fused [E, ...] experts are shared by every
# rank (a slice each), so they are gathered per module like the dense weights (its round trip: tests/moe/test_hf_moe.py)
MOE_FAMILIES = {name: config for name, config in ALL_MOE_FAMILIES.items() if name != "gpt_oss"}
from local_ranks import run_on_local_ranks  # noqa: E402
from nccl_rules import check  # noqa: E402

from ds_tsp.tools.hf_reference import hf_logits, load_hf_reference  # noqa: E402

DEGREES = (4, 2)
SHARD = 8000  # max_shard_size "8KB": an expert tensor is 3 KB (Qwen3-MoE 12x32) / 4 KB (Mixtral 16x32) in float64
_KINDS = ("broadcast", "gather", "all_gather", "all_gather_into_tensor", "reduce", "all_reduce", "scatter",
          "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")


# --- recording, inside the ranks ---------------------------------------------------------------------------------
def _tensor_of(kind: str, args, kwargs):
    if kind == "batch_isend_irecv":
        return None
    if kind == "all_gather":
        return args[1] if len(args) > 1 else kwargs["tensor"]
    if kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return args[1] if len(args) > 1 else kwargs["input"]
    return args[0] if args else kwargs["tensor"]


def _root(kind: str, group, kwargs) -> int | None:
    import torch.distributed as dist

    for key in ("src", "dst"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    for key in ("group_src", "group_dst"):
        if kwargs.get(key) is not None:
            return dist.get_global_rank(group or dist.group.WORLD, kwargs[key])
    return 0 if kind in ("broadcast", "gather", "reduce", "scatter") else None


@contextlib.contextmanager
def _record_collectives():
    """Every torch.distributed collective this process posts (TSPComm's and the object collectives' own), as
    nccl_rules op dicts."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    ops, saved = [], {}

    def wrap(kind, original):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            t = _tensor_of(kind, args, kwargs)
            ops.append({"kind": "p2p" if kind in ("send", "recv", "isend", "irecv", "batch_isend_irecv") else kind,
                        "group": tuple(dist.get_process_group_ranks(group or dist.group.WORLD)),
                        "root": _root(kind, group, kwargs), "shape": tuple(t.shape) if t is not None else (),
                        "dtype": str(t.dtype) if t is not None else "", "numel": t.numel() if t is not None else 0,
                        "nbytes": t.nbytes if t is not None else 0, "what": None, "layer": "save"})
            return original(*args, **kwargs)
        return recorded

    for kind in _KINDS:
        saved[kind] = (getattr(c10d, kind), getattr(dist, kind))
        fn = wrap(kind, saved[kind][0])
        setattr(c10d, kind, fn)
        setattr(dist, kind, fn)
    try:
        yield ops
    finally:
        for kind, (c, d) in saved.items():
            setattr(c10d, kind, c)
            setattr(dist, kind, d)


@contextlib.contextmanager
def _record_parts(fail_after: int | None = None):
    """(part file, {tensor name: nbytes}) of every safetensors part this process writes; with fail_after=k the
    (k+1)-th part fails as a full disk would."""
    from ds_tsp.checkpoint.safetensors.shard_stream import ShardStream

    parts, original = [], ShardStream._write_shard

    def write(self, tensors):
        if fail_after is not None and len(parts) == fail_after:
            raise OSError("No space left on device (simulated on this TSP rank)")
        original(self, tensors)
        parts.append((self._shards[-1][0], {n: t.nbytes for n, t in tensors.items()}))

    ShardStream._write_shard = write
    try:
        yield parts
    finally:
        ShardStream._write_shard = original


def _save_runs(checkpoints: dict[str, str], out: str) -> dict:
    import torch.distributed as dist

    from ds_tsp.checkpoint.hf.owned_tensors import saved_by_owner
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPForCausalLM

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for name, directory in checkpoints.items():
        for degree in DEGREES:
            group = dist.group.WORLD if degree == 4 else halves[rank // 2]
            model = TSPForCausalLM.from_pretrained(directory, group, dtype=torch.float64)
            sharded = model.tsp.sharded_modules()
            with _record_collectives() as ops, _record_parts() as parts:
                model.save_pretrained(f"{out}/{name}-d{degree}", max_shard_size=SHARD)
            experts = [(prefix, m, p) for prefix, m, p in sharded if any(".experts." in n for n in m.hf_shapes())]
            assert experts and all(saved_by_owner(m, degree) for _, m, _ in experts)
            results[name, degree] = {
                "ops": ops, "parts": parts,
                "dense_numels": [p.numel() for _, m, p in sharded if all(m is not e for _, e, _ in experts)],
                "owned": sorted(prefix + n for prefix, m, p in experts for n in m.hf_targets(p.data))}
    # a failing non-zero writer: TSP rank 1 runs out of disk after its first expert file
    model = TSPForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dist.group.WORLD, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the failed save would have written other weights
    with _record_parts(fail_after=1 if rank == 1 else None):
        try:
            model.save_pretrained(f"{out}/qwen3_moe-d4", max_shard_size=SHARD)
            results["failure"] = "no error"
        except TSPConfigError as exc:
            results["failure"] = str(exc)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_save")
    checkpoints = {name: str(save_tiny_checkpoint(root / "in" / name, name)) for name in MOE_FAMILIES}
    (root / "out").mkdir()
    results = run_on_local_ranks(_save_runs, 4, checkpoints, str(root / "out"), timeout_s=600)
    return checkpoints, results, root / "out"


CASES = [(name, degree) for name in sorted(MOE_FAMILIES) for degree in DEGREES]


# --- the tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, degree", CASES)
def test_transformers_loads_identical_tensors_and_logits(saved, name, degree):
    checkpoints, _, out = saved
    original = load_hf_reference(checkpoints[name], torch.float64)
    reloaded = load_hf_reference(out / f"{name}-d{degree}", torch.float64)  # plain transformers, float64
    assert type(reloaded) is type(original)
    want, got = original.state_dict(), reloaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    ids = torch.randint(0, original.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    # Same weights (bit-equal, above), same code, but not bit-identical logits: where the loaded tensors sit in
    # memory (their alignment) picks the kernels' vector blocking, hence the summation order, so a reload can move
    # a float64 logit by an ulp or so (measured 1 ulp, 8.3e-17, in a clone whose memory layout differed). A few ulps
    # (16) of the largest logit is still many orders of magnitude below what one wrong weight would move.
    got_logits, want_logits = hf_logits(reloaded, ids), hf_logits(original, ids)
    ulps = 16 * torch.finfo(torch.float64).eps * want_logits.abs().max().item()
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=ulps)


@pytest.mark.parametrize("name, degree", CASES)
def test_standard_index_and_file_names(saved, name, degree):
    from safetensors import safe_open

    from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

    checkpoints, results, out = saved
    directory = out / f"{name}-d{degree}"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(CheckpointReader(checkpoints[name]).names())  # transformers' names, one each
    files = sorted(set(weight_map.values()))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    on_disk = sorted(p.name for p in directory.iterdir() if p.name.endswith((".safetensors", ".part")))
    assert on_disk == files  # every file indexed, no part file left under its temporary name
    total = 0
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == file}, file
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"]["total_size"] == total
    parts = [p for r in range(4) for p in results[r][name, degree]["parts"]]
    assert len(parts) == n  # each part written once, by one rank
    for _, sizes in parts:  # max_shard_size holds for every rank's files
        assert len(sizes) == 1 or sum(sizes.values()) <= SHARD, sizes


@pytest.mark.parametrize("name, degree", CASES)
def test_each_rank_writes_exactly_its_experts(saved, name, degree):
    _, results, _ = saved
    family = MOE_FAMILIES[name]
    experts = family.get("num_experts") or family.get("num_local_experts") or family["n_routed_experts"]
    everything = set()
    for rank in range(4):
        run = results[rank][name, degree]
        wrote = {n for _, sizes in run["parts"] for n in sizes}
        everything |= wrote
        if rank >= degree:  # the second data replica (D=2): no file at all
            assert wrote == set(), (rank, wrote)
            continue
        mine = {str(i) for i in range(rank * experts // degree, (rank + 1) * experts // degree)}
        owned = set(run["owned"])
        assert owned and {n.split(".experts.")[1].split(".")[0] for n in owned} == mine
        wrote_experts = {n for n in wrote if ".experts." in n}
        assert wrote_experts == owned, (rank, sorted(wrote_experts ^ owned))
        if rank:
            assert wrote == owned  # a non-writer rank writes its experts and nothing else
    assert len(everything) == len(json.loads((saved[2] / f"{name}-d{degree}" / "model.safetensors.index.json")
                                             .read_text())["weight_map"])


@pytest.mark.parametrize("name, degree", CASES)
def test_no_expert_byte_is_communicated(saved, name, degree):
    """The model-dtype (float64) tensors in ALL the collectives of the save are the gathered dense modules' packed
    shards, one each in module order, and nothing else: the experts never travel. The rest is the small object
    collectives (int64 sizes, uint8 pickles of paths / file lists / outcomes)."""
    _, results, _ = saved
    for rank in range(4):
        run = results[rank][name, degree]
        floats = [o["numel"] for o in run["ops"] if o["dtype"] == "torch.float64"]
        assert floats == run["dense_numels"], rank
        assert not [o for o in run["ops"] if o["kind"] == "p2p"]
        other = sum(o["nbytes"] for o in run["ops"] if o["dtype"] not in ("torch.float64",))
        assert other < 16_000, (rank, other)
        assert {o["dtype"] for o in run["ops"]} <= {"torch.float64", "torch.int64", "torch.uint8"}


@pytest.mark.parametrize("name, degree", CASES)
def test_save_collectives_pass_nccl_rules(saved, name, degree):
    _, results, _ = saved
    report = check([results[r][name, degree]["ops"] for r in range(4)])
    assert report.ok and report.completed == report.total, str(report)
    gathers = [o for o in results[1][name, degree]["ops"] if o["kind"] == "gather" and o["dtype"] == "torch.uint8"]
    assert len(gathers) == 1 and gathers[0]["group"] == tuple(range(degree))  # the rendezvous: over the TSP group


def test_failing_non_zero_writer_fails_every_rank_and_keeps_the_checkpoint(saved):
    checkpoints, results, out = saved
    for rank in range(4):
        message = results[rank]["failure"]
        assert "No space left on device" in message and "global rank 1" in message and "untouched" in message, (
            rank, message)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # rank 1's and rank 0's files both gone
    directory = out / "qwen3_moe-d4"
    assert not [p for p in directory.iterdir() if re.search(r"\.part$|tsp\d", p.name)]
    original = load_hf_reference(checkpoints["qwen3_moe"], torch.float64).state_dict()
    kept = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()
    for key, value in original.items():
        assert torch.equal(kept[key], value), key  # the first save, not a mix with the failed second one
