"""Safetensors checkpoint I/O at scale: sliced reads equal the narrowed full tensors (ours and transformers'
checkpoints, fp32/bf16/fp16), the streaming writer's shards load in plain transformers with identical logits, saves
are atomic (an exception or a SIGKILL mid-save never leaves a partial checkpoint), reader errors name the thing,
and, measured with HostMemoryPeak, a slice read keeps only the slice resident while load_file keeps the file."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import host_memory
import pytest
import torch
from host_memory import HostMemoryPeak, current_rss_bytes
from safetensors.torch import load_file, save_file

from ds_tsp.checkpoint.safetensors.reader import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, CheckpointReader
from ds_tsp.checkpoint.safetensors.writer import StreamingCheckpointWriter, parse_size
from ds_tsp.core.errors import TSPConfigError

REPO = Path(__file__).resolve().parents[2]
MB = 10**6


def siblings(directory: Path) -> list[str]:
    """Temporary / aside directories the writer leaves next to `directory` (none after a clean save)."""
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}."))


def write_all(directory: Path, tensors: dict[str, torch.Tensor], **kwargs) -> None:
    with StreamingCheckpointWriter(directory, **kwargs) as w:
        for name, t in tensors.items():
            w.add(name, t)


def assert_checkpoint_equals(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    r = CheckpointReader(directory)
    assert sorted(r.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(r.read(name), t), name


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_state_dict(model, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ parse_size


@pytest.mark.parametrize(
    "size, expected",
    [(123, 123), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("100KB", 100_000),
     ("1.5gb", 1_500_000_000), (" 40 KiB ", 40 * 1024), ("4096", 4096)],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("bad", ["5 GBs", "GB", "-1GB", 0, -5, True, 2.5, "5XB", None])
def test_parse_size_rejects(bad):
    with pytest.raises(TSPConfigError, match="max_shard_size"):
        parse_size(bad)


# ------------------------------------------------------------------------------------------------ reader


def test_reader_single_file_headers_slices_casts(tmp_path):
    torch.manual_seed(1)
    tensors = {
        "f32": torch.randn(37, 23),
        "bf16": torch.randn(16, 9, 5).bfloat16(),
        "f16": torch.randn(11, 40).half(),
        "vec": torch.arange(1000, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
    }
    save_file(tensors, tmp_path / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    r = CheckpointReader(tmp_path, chunk_bytes=256)  # tiny chunks: every read below spans several
    assert sorted(r.names()) == sorted(tensors) and len(r) == 5 and "f32" in r and "nope" not in r
    for name, t in tensors.items():
        assert r.shape(name) == tuple(t.shape) and r.dtype(name) == t.dtype
        full = r.read(name)
        assert torch.equal(full, t) and full.is_contiguous()
        # A new tensor that owns its memory, not a view into the file's mmap.
        assert full.untyped_storage().nbytes() == full.nbytes
        for dim in range(t.dim()):
            n = t.shape[dim]
            for start, length in [(0, n // 3), (n // 3, n - n // 3), (n - 1, 1), (n, 0)]:
                got = r.read(name, dim, start, length)
                assert torch.equal(got, t.narrow(dim, start, length)), (name, dim, start, length)
        assert torch.equal(r.read(name, dtype=torch.float64), t.double())
    out = torch.zeros(37, 5, dtype=torch.float64)
    assert r.read("f32", 1, 3, 5, out=out) is out and torch.equal(out, tensors["f32"][:, 3:8].double())
    assert torch.equal(r.read("f32", -1, 20), tensors["f32"][:, 20:])  # negative dim, length to the end
    with r.reading(), r.reading():  # batched (and nested): same values, handles closed at exit
        assert all(torch.equal(r.read(n), t) for n, t in tensors.items())
    assert r._batch is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reader_reads_transformers_sharded_checkpoint(tmp_path, tiny_llama, dtype):
    model = copy.deepcopy(tiny_llama).to(dtype)  # a copy: .to() also rewrites the shared config's dtype
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    expected = tiny_state_dict(model, dtype)
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / SAFE_WEIGHTS_NAME).exists()
    r = CheckpointReader(tmp_path, chunk_bytes=1024)
    assert sorted(r.names()) == sorted(expected)
    for name, t in expected.items():
        assert r.dtype(name) == dtype and r.shape(name) == tuple(t.shape)
        assert torch.equal(r.read(name), t), name
        if t.dim() == 2:  # a TSP rank's rows and columns
            rows, cols = t.shape
            assert torch.equal(r.read(name, 0, rows // 4, rows // 2), t.narrow(0, rows // 4, rows // 2))
            assert torch.equal(r.read(name, 1, cols // 2, cols // 2), t.narrow(1, cols // 2, cols // 2))
            assert torch.equal(r.read(name, 1, 0, cols // 4, dtype=torch.float32), t[:, : cols // 4].float())


# ------------------------------------------------------------------------------------------------ writer


def test_writer_shards_index_and_oversized_tensor(tmp_path, tiny_llama):
    sd = tiny_state_dict(tiny_llama)
    target = tmp_path / "ckpt"
    # 20 KB shards: the 32 KB embedding and lm_head are bigger than a shard, so each gets one of its own.
    write_all(target, sd, max_shard_size="20KB")
    index = json.loads((target / SAFE_WEIGHTS_INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    n = len(shards)
    assert n > 3 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(weight_map) == sorted(sd)  # every tensor exactly once (dict keys)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    files = sorted(p.name for p in target.iterdir())
    assert files == sorted(shards + [SAFE_WEIGHTS_INDEX_NAME]) and siblings(target) == []
    for shard in shards:
        on_disk = load_file(target / shard)
        assert sorted(on_disk) == sorted(k for k, v in weight_map.items() if v == shard)
        size = sum(t.nbytes for t in on_disk.values())
        assert size <= 20_000 or len(on_disk) == 1
    assert [k for k, v in weight_map.items() if v == weight_map["model.embed_tokens.weight"]] == [
        "model.embed_tokens.weight"
    ]
    assert_checkpoint_equals(target, sd)


def test_transformers_loads_writer_checkpoint_with_identical_logits(tmp_path, tiny_llama):
    transformers = pytest.importorskip("transformers")
    target = tmp_path / "ckpt"
    with StreamingCheckpointWriter(target, max_shard_size="50KB") as w:
        for name, t in tiny_llama.state_dict().items():
            w.add(name, t)
        w.add_file("config.json", tiny_llama.config.to_json_string())
    assert (target / SAFE_WEIGHTS_INDEX_NAME).exists() and (target / "config.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(target).eval()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tiny_llama(ids).logits, rtol=0, atol=0)


def test_single_shard_writes_model_safetensors_without_index(tmp_path):
    tensors = {"a": torch.randn(4, 4), "b": torch.ones(3, dtype=torch.bfloat16), "c": torch.randn(8, 2)[:, 0]}
    target = tmp_path / "one"
    write_all(target, tensors, metadata={"format": "pt", "who": "test"})
    assert sorted(p.name for p in target.iterdir()) == [SAFE_WEIGHTS_NAME]
    assert_checkpoint_equals(target, tensors)
    from safetensors import safe_open

    with safe_open(target / SAFE_WEIGHTS_NAME, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "who": "test"}


def test_writer_holds_about_one_shard_plus_one_tensor(tmp_path):
    # 40 MB tensors: above glibc's largest dynamic mmap threshold (32 MB), so a freed one leaves RSS at once.
    tensor_bytes, shard_bytes = 40 * MB, 80 * MB
    bound = shard_bytes + tensor_bytes + 10 * MB
    # The process's peak RSS also counts what any other thread allocates meanwhile (a full suite run leaves
    # some), which can only add: the least of up to three writes is the writer's own. A writer that held more
    # than the bound would exceed it every time.
    peaks = []
    for attempt in range(3):
        with HostMemoryPeak() as m:
            with StreamingCheckpointWriter(tmp_path / f"ckpt{attempt}", max_shard_size=shard_bytes) as w:
                for i in range(6):  # 240 MB streamed, produced one at a time
                    w.add(f"t{i}", torch.full((tensor_bytes // 4,), float(i)))
        peaks.append(m)
        if m.peak_bytes < bound:
            break
    print(f"\nwriter peaks {[round(p.peak_bytes / MB) for p in peaks]} MB for 240 MB streamed in 80 MB shards")
    assert min(p.peak_bytes for p in peaks) < bound, peaks
    shutil.move(tmp_path / f"ckpt{attempt}", tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("model-*-of-00003.safetensors"))) == 3
    mode = (tmp_path / "ckpt" / "model-00001-of-00003.safetensors").stat().st_mode & 0o777
    assert mode == (tmp_path / "ckpt").stat().st_mode & 0o666  # umask-respecting, not safetensors' 0600


def test_writer_rejects_misuse(tmp_path):
    w = StreamingCheckpointWriter(tmp_path / "x")
    w.add("a", torch.zeros(2))
    with pytest.raises(TSPConfigError, match="'a' was already added"):
        w.add("a", torch.zeros(2))
    for bad in ["../escape.json", "/abs.json", "model.safetensors", SAFE_WEIGHTS_INDEX_NAME]:
        with pytest.raises(TSPConfigError, match="add_file"):
            w.add_file(bad, "{}")
    w.add_file("config.json", "{}")
    with pytest.raises(TSPConfigError, match="taken"):
        w.add_file("config.json", "{}")
    w.close()
    with pytest.raises(TSPConfigError, match="closed"):
        w.add("b", torch.zeros(2))
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", SAFE_WEIGHTS_NAME]


# ------------------------------------------------------------------------------------------------ atomicity


def test_exception_mid_save_keeps_old_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    old = {"w": torch.arange(10.0)}
    write_all(target, old)
    with pytest.raises(RuntimeError, match="boom"):
        with StreamingCheckpointWriter(target, max_shard_size=4096) as w:
            for i in range(5):
                w.add(f"t{i}", torch.full((1024,), float(i)))
            (tmp,) = siblings(target)
            assert len(list((tmp_path / tmp).glob("*.part"))) >= 3  # shards were on disk
            raise RuntimeError("boom")
    assert siblings(target) == []
    assert_checkpoint_equals(target, old)


def test_active_writer_is_not_stale(tmp_path):
    target = tmp_path / "ckpt"
    first, second = StreamingCheckpointWriter(target), StreamingCheckpointWriter(target)
    first.add("a", torch.zeros(1))
    second.add("b", torch.ones(1))
    first.close()  # cleans stale siblings: the other live writer's is not one
    assert len(siblings(target)) == 1
    second.close()
    assert siblings(target) == [] and CheckpointReader(target).names() == ["b"]


SLOW_WRITER = """
import sys, time, torch
from ds_tsp.checkpoint.safetensors.writer import StreamingCheckpointWriter
with StreamingCheckpointWriter(sys.argv[1], max_shard_size=4096) as w:
    for i in range(400):
        w.add(f"t{i}", torch.full((1024,), float(i)))  # one 4 KB shard per tensor
        time.sleep(0.05)
"""


@pytest.mark.parametrize("had_old", [True, False])
def test_sigkill_mid_save_never_leaves_partial_checkpoint(tmp_path, had_old):
    target = tmp_path / "ckpt"
    old = {"w": torch.arange(10.0)}
    if had_old:
        write_all(target, old)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(target)], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while not list(tmp_path.glob(".ckpt.tmp-*/*.part")):
            assert proc.poll() is None and time.monotonic() < deadline, "writer died or never wrote a shard"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()  # reaped: its pid is no longer alive, so its temporary directory is stale
    stale = siblings(target)
    assert len(stale) == 1 and ".tmp-" in stale[0]
    if had_old:
        assert_checkpoint_equals(target, old)
    else:
        assert not target.exists()
    new = {"v": torch.ones(3)}
    write_all(target, new)
    assert siblings(target) == []
    assert_checkpoint_equals(target, new)


# ------------------------------------------------------------------------------------------------ reader errors


def test_reader_errors_name_the_problem(tmp_path):
    with pytest.raises(TSPConfigError, match=r"missing.*does not exist"):
        CheckpointReader(tmp_path / "missing")

    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "pytorch_model.bin").write_bytes(b"not unpickled")
    never = r"pytorch_model\.bin.*safetensors only and never unpickles.*save_pretrained"
    with pytest.raises(TSPConfigError, match=never):
        CheckpointReader(bins)

    sharded = tmp_path / "sharded"
    write_all(sharded, {f"t{i}": torch.full((1024,), float(i)) for i in range(3)}, max_shard_size=4096)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(TSPConfigError, match=r"model\.safetensors\.index\.json.*model-00002-of-00003\.safetensors"):
        CheckpointReader(sharded)

    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_text("{not json")
    with pytest.raises(TSPConfigError, match=r"index .*index\.json is malformed: not valid JSON"):
        CheckpointReader(sharded)
    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(TSPConfigError, match="malformed: no non-empty 'weight_map'"):
        CheckpointReader(sharded)
    (sharded / SAFE_WEIGHTS_INDEX_NAME).write_text('{"weight_map": {"t0": "../elsewhere.safetensors"}}')
    with pytest.raises(TSPConfigError, match="not a file name in the same directory"):
        CheckpointReader(sharded)

    single = tmp_path / "single"
    write_all(single, {"w": torch.zeros(4, 6)})
    r = CheckpointReader(single)
    for call in (lambda: r.shape("nope"), lambda: r.dtype("nope"), lambda: r.read("nope")):
        with pytest.raises(TSPConfigError, match=rf"'nope' is not in the checkpoint {single}"):
            call()
    for args in [(0, 3, 2), (1, -1, 2), (1, 0, 7), (0, 0, -1)]:
        with pytest.raises(TSPConfigError, match=r"'w'.*out of range.*has size"):
            r.read("w", *args)
    with pytest.raises(TSPConfigError, match=r"dim=2.*shape \(4, 6\)"):
        r.read("w", 2, 0, 1)
    with pytest.raises(TSPConfigError, match="out for 'w' has shape"):
        r.read("w", 0, 0, 2, out=torch.empty(3, 6))


# ------------------------------------------------------------------------------------------------ host memory


def test_host_memory_peak_sees_a_freed_allocation():
    with HostMemoryPeak() as m:
        x = torch.ones(50_000_000)  # 200 MB, touched
        del x
    if os.path.exists("/proc/self/clear_refs"):
        assert m.method == "clear_refs"
    assert m.peak_bytes >= 190 * MB, m
    assert abs(m.end_bytes - m.start_bytes) < 20 * MB, m
    with HostMemoryPeak() as idle:
        pass
    assert 0 <= idle.peak_bytes < 20 * MB, idle
    assert current_rss_bytes() > 0


def test_host_memory_peak_nested_and_sampling_fallback(monkeypatch):
    with HostMemoryPeak() as outer:
        x = torch.ones(50_000_000)
        del x
        with HostMemoryPeak() as inner:  # resets the high-water mark: the outer still counts its 200 MB
            pass
    assert outer.peak_bytes >= 190 * MB and inner.peak_bytes < 20 * MB, (outer, inner)

    monkeypatch.setattr(host_memory, "_reset_high_water_mark", lambda: False)
    with HostMemoryPeak() as sampled:
        x = torch.ones(50_000_000)
        time.sleep(0.05)  # the sampler misses spikes shorter than its interval; give it a few
        del x
    assert sampled.method == "sampling" and sampled.peak_bytes >= 190 * MB, sampled


def test_slice_read_keeps_only_the_slice_resident(tmp_path):
    save_file({"w": torch.randn(5000, 5000)}, tmp_path / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})  # 100 MB
    size = 5000 * 5000 * 4
    r = CheckpointReader(tmp_path)
    with HostMemoryPeak() as row:
        quarter = r.read("w", 0, 1250, 1250)
    with HostMemoryPeak() as col:
        column_quarter = r.read("w", 1, 0, 1250)
    assert quarter.shape == (1250, 5000) and column_quarter.shape == (5000, 1250)
    del quarter, column_quarter
    with HostMemoryPeak() as loaded:
        # load_file in safetensors 0.8 is lazy too (mmap views): the pages become resident once used.
        tensors = load_file(tmp_path / SAFE_WEIGHTS_NAME)
        float(tensors["w"].sum())
        del tensors
    print(f"\nrow quarter {row.peak_bytes / size:.1%}, column quarter {col.peak_bytes / size:.1%}, "
          f"load_file {loaded.peak_bytes / size:.1%} of the {size / MB:.0f} MB tensor")
    assert row.peak_bytes < 0.45 * size, row
    assert col.peak_bytes < 0.45 * size, col
    # >= 100% up to Linux's per-CPU batching of RSS counters (a few hundred KB).
    assert loaded.peak_bytes >= 0.99 * size, loaded


def test_replacing_a_checkpoint_keeps_the_directory_s_other_entries(tmp_path):
    target = tmp_path / "out"
    with StreamingCheckpointWriter(target) as w:
        w.add("a", torch.zeros(3))
        w.add_file("config.json", "{}")
    (target / "checkpoint-10").mkdir()
    (target / "checkpoint-10" / "state.json").write_text("kept")
    (target / "README.md").write_text("kept too")
    with StreamingCheckpointWriter(target, max_shard_size=8) as w:
        w.add("a", torch.ones(3))
        w.add("b", torch.ones(3))
    assert (target / "checkpoint-10" / "state.json").read_text() == "kept"
    assert (target / "README.md").read_text() == "kept too"
    assert not (target / "config.json").exists()  # checkpoint files are the new save's only
    assert (target / "model.safetensors.index.json").is_file() and not (target / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
