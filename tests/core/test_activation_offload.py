"""Offload of checkpointed decoder-layer inputs to host memory (ds_tsp.core.activation_offload).

On the CPU the same code path runs as on CUDA with every copy synchronous into a separate host pool, so here:
- the "tsp" keys, DeepSpeed's activation_checkpointing.cpu_checkpointing read as the same request, and one error per
  bad combination naming the keys;
- exactness: losses and EVERY gradient with offload equal those without, bit for bit (float64, a copy is exact), at
  D=1 and at D=2 (gloo), and the D=2 run equals the single-device model (1e-10, float64);
- the pool: after forward it holds exactly the checkpointed inputs of layers 0..L-2 (bitwise equal to what each layer
  got, in buffers of its own), none after backward, and a second step allocates no new host memory;
- the schedule: in backward each layer's input comes back one layer ahead (its copy starts while the next-higher
  layer's recompute unpacks), the first offloaded one on demand;
- two forwards before their backwards (each graph keeps its own buffers) and a model copy start clean;
- no host sync in the new path (tests/helpers/sync_counter.py; a planted one is caught). The meta-device step with offload
  is a case of tests/model/test_meta_device.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from local_ranks import run_on_local_ranks
from sync_counter import SyncCounter

from ds_tsp.core.activation_offload import ActivationOffload
from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)
B, S = 2, 16
OFF = TSPOptions(activation_checkpointing=True)
ON = TSPOptions(activation_checkpointing=True, offload_activations=True)


def _batch(seed: int = 0) -> dict:
    ids = torch.randint(0, SHAPE.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _model(comm: TSPComm, options: TSPOptions) -> ShardedCausalLM:
    return ShardedCausalLM(SHAPE, comm, options=options, dtype=torch.float64).init_weights_(seed=1)


def _step(model: ShardedCausalLM, batch: dict) -> torch.Tensor:
    b = shard_batch(tsp=model.comm.size, rank=model.comm.rank, **batch)
    loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
    loss.backward()
    return model.loss_for_logging(loss)


# --- configuration ------------------------------------------------------------------------------------------------
def test_tsp_keys_reach_the_options_through_setup():
    runtime = build_runtime(parse_tsp_config({"activation_checkpointing": True, "offload_activations": True}))
    assert runtime.options.offload_activations and runtime.options.activation_checkpointing


def test_deepspeed_cpu_checkpointing_is_the_same_request():
    runtime = build_runtime(parse_tsp_config({"activation_checkpointing": True}),
                            ds_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert runtime.options.offload_activations and runtime.config.offload_activations
    plain = build_runtime(parse_tsp_config({"activation_checkpointing": True}),
                          ds_config={"activation_checkpointing": {"cpu_checkpointing": False}})
    assert not plain.options.offload_activations


@pytest.mark.parametrize("block, ds_config, match", [
    ({"offload_activations": True}, None,
     r"tsp.offload_activations=true needs tsp.activation_checkpointing=true"),
    ({"activation_checkpointing": True, "offload_activations": True, "pipeline_stages": 2}, None,
     r"tsp.offload_activations=true with tsp.pipeline_stages=2"),
    ({}, {"activation_checkpointing": {"cpu_checkpointing": True}},
     r"activation_checkpointing.cpu_checkpointing=true needs tsp.activation_checkpointing=true"),
    ({"activation_checkpointing": True}, {"activation_checkpointing": {"partition_activations": True}},
     r"activation_checkpointing.partition_activations=true: the TSP model checkpoints"),
    ({"activation_checkpointing": True, "pipeline_stages": 2},
     {"activation_checkpointing": {"cpu_checkpointing": True}}, r"tsp.offload_activations=true with tsp.pipeline_stages=2"),
], ids=["no-checkpointing", "pipeline", "ds-cpu-without-checkpointing", "ds-partition", "ds-cpu-pipeline"])
def test_bad_combinations_are_one_error_naming_the_keys(block, ds_config, match):
    with pytest.raises(TSPConfigError, match=match):
        build_runtime(parse_tsp_config(block), ds_config=ds_config)


def test_options_refuse_offload_without_checkpointing():
    with pytest.raises(TSPConfigError, match=r"offload_activations=True\) needs activation_checkpointing=True"):
        TSPOptions(offload_activations=True)


# --- exactness, pool, schedule at D=1 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run():
    model = _model(TSPComm.single(), OFF)
    losses = [_step(model, _batch(s)) for s in range(2)]
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_losses_and_every_gradient_bit_for_bit(reference_run):
    model = _model(TSPComm.single(), ON)
    losses = [_step(model, _batch(s)) for s in range(2)]
    want_losses, want_grads = reference_run
    assert [float(x) for x in losses] == [float(x) for x in want_losses]
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want_grads[name]), name


def test_pool_holds_exactly_the_checkpointed_inputs():
    model = _model(TSPComm.single(), ON)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    pool = model.activation_offload
    for step in range(2):
        seen.clear()
        b = shard_batch(tsp=1, rank=0, **_batch(step))
        loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        held = pool.host_in_use()
        # layers 0..L-2 (the last layer's input stays: backward needs it first), equal to what each layer got
        assert len(held) == SHAPE.num_layers - 1
        for host, layer_input in zip(held, seen):
            assert torch.equal(host, layer_input) and host.device.type == "cpu"
            assert host.untyped_storage().data_ptr() != layer_input.untyped_storage().data_ptr()
        assert pool.host_bytes == (SHAPE.num_layers - 1) * B * S * SHAPE.hidden_size * 8
        loss.backward()
        del loss
        assert pool.host_in_use() == []  # given back as each layer's backward freed its saved input
        assert pool.host_allocations == SHAPE.num_layers - 1  # step 2 reuses step 1's buffers


def test_the_device_copies_are_freed_after_forward():
    """Only the last layer's input is still alive on the device after forward (nothing else holds the others)."""
    import gc
    import weakref

    for options, alive in ((OFF, [True] * SHAPE.num_layers), (ON, [False] * (SHAPE.num_layers - 1) + [True])):
        model = _model(TSPComm.single(), options)
        inputs = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(
                lambda mod, args: inputs.append(weakref.ref(args[0])) if len(inputs) < SHAPE.num_layers else None)
        b = shard_batch(tsp=1, rank=0, **_batch())
        loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        gc.collect()
        assert [ref() is not None for ref in inputs] == alive, options
        loss.backward()


def test_each_input_comes_back_one_layer_ahead(monkeypatch):
    events = []
    fetch, restore = ActivationOffload._fetch, ActivationOffload._restore
    monkeypatch.setattr(ActivationOffload, "_fetch", lambda self, saved: events.append(("fetch", saved.layer))
                        or fetch(self, saved))

    def traced_restore(self, saved):
        if hasattr(saved, "layer"):  # a layer input (kept on the device for the last layer, or offloaded)
            events.append(("unpack", saved.layer))
        return restore(self, saved)

    monkeypatch.setattr(ActivationOffload, "_restore", traced_restore)
    shape = ModelShape(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    model = ShardedCausalLM(shape, TSPComm.single(), options=ON, dtype=torch.float64).init_weights_(seed=1)
    b = shard_batch(tsp=1, rank=0, **_batch())
    model(b["input_ids"], b["shift_labels"], b["position_ids"]).backward()
    # the last layer's input stays; its recompute starts layer 2's copy back, layer 2's starts layer 1's, layer 1's
    # layer 0's: every input one layer ahead of its recompute, each fetched exactly once
    assert events == [("unpack", 3), ("fetch", 2), ("unpack", 2), ("fetch", 1), ("unpack", 1), ("fetch", 0),
                      ("unpack", 0)]


def test_two_forwards_before_their_backwards(reference_run):
    """Each graph keeps its own host buffers: the second forward does not overwrite the first one's inputs."""
    got, want = _model(TSPComm.single(), ON), _model(TSPComm.single(), OFF)
    for model in (got, want):
        shards = [shard_batch(tsp=1, rank=0, **_batch(s)) for s in range(2)]
        losses = [model(b["input_ids"], b["shift_labels"], b["position_ids"]) for b in shards]
        losses[1].backward()
        losses[0].backward()
    assert got.activation_offload.host_allocations == 2 * (SHAPE.num_layers - 1)
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_model_copy_starts_with_an_empty_pool_of_its_own():
    model = _model(TSPComm.single(), ON)
    _step(model, _batch())
    clone = copy.deepcopy(model)
    assert clone.activation_offload is not model.activation_offload and clone.activation_offload.host_bytes == 0


# --- host syncs -----------------------------------------------------------------------------------------------------
def _synced_step(model: ShardedCausalLM) -> list:
    b = shard_batch(tsp=1, rank=0, **_batch())
    with SyncCounter() as syncs:
        model(b["input_ids"], b["shift_labels"], b["position_ids"]).backward()
    return [e for e in syncs.events if e.region != "input_checks"]


def test_no_host_sync_in_the_offload_path():
    assert _synced_step(_model(TSPComm.single(), ON)) == []


def test_a_sync_planted_in_the_offload_path_is_caught(monkeypatch):
    """The counter sees the offload path (it runs in backward, called by autograd): a value read there is found."""
    fetch = ActivationOffload._fetch

    def fetch_and_read(self, saved):
        fetch(self, saved)
        return float(saved.on_device.sum())  # a device-to-host read on CUDA

    monkeypatch.setattr(ActivationOffload, "_fetch", fetch_and_read)
    found = _synced_step(_model(TSPComm.single(), ON))
    assert [e.kind for e in found] == ["read"] * (SHAPE.num_layers - 1), found


# --- D=2 ------------------------------------------------------------------------------------------------------------
def _d2_runs() -> dict:
    import torch.distributed as dist

    comm = TSPComm(dist.group.WORLD)
    out = {}
    for name, options in (("off", OFF), ("on", ON)):
        model = _model(comm, options)
        weights = model.full_state_dict()  # before the step: what the single-device model starts from
        out[name] = {"loss": float(_step(model, _batch())), "grads": model.full_state_dict(grads=True),
                     "weights": weights}
    return out


def test_d2_bit_for_bit_and_equal_to_the_single_device_model():
    ranks = run_on_local_ranks(_d2_runs, 2, timeout_s=180)
    single = _model(TSPComm.single(), OFF)
    single.load_full_state_dict(ranks[0]["off"]["weights"])  # a D=2 init differs from a D=1 one (keyed by owner)
    single_loss = float(_step(single, _batch()))
    single_grads = single.full_state_dict(grads=True)
    for r in ranks:
        assert r["on"]["loss"] == r["off"]["loss"]
        assert abs(r["on"]["loss"] - single_loss) <= 1e-10 * abs(single_loss)
        for name, g in r["off"]["grads"].items():
            assert torch.equal(r["on"]["grads"][name], g), name
            assert torch.allclose(g, single_grads[name], rtol=1e-10, atol=1e-12), name


# --- the pool's size: exact, bounded under varying lengths, what the plan counts -------------------------------------
def test_pool_stays_at_the_plan_for_the_longest_length_when_lengths_vary():
    """Lengths 8, 12, 6, 16, 10, 16: each new maximum replaces the buffers (never L-1 more per new maximum), and the
    pool then holds exactly what `ds-tsp plan --offload-activations` counts at the longest length."""
    from dataclasses import replace

    from ds_tsp.tools.plan import PlanInput, plan_tsp

    model = ShardedCausalLM(SHAPE, TSPComm.single(), options=ON, dtype=torch.float32).init_weights_(seed=1)
    pool, held = model.activation_offload, []
    for seq in (8, 12, 6, 16, 10, 16):
        ids = torch.randint(0, SHAPE.vocab_size, (B, seq), generator=torch.Generator().manual_seed(seq))
        b = shard_batch(tsp=1, rank=0, input_ids=ids, labels=ids)
        loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        held.append(pool.host_bytes)
        loss.backward()
        del loss
    x = lambda seq: B * seq * SHAPE.hidden_size * 4  # noqa: E731 - one layer input [B, S, h] fp32
    longest = max(8, 12, 6, 16, 10, 16)
    assert held == [2 * x(8), 2 * x(12), 2 * x(12), 2 * x(16), 2 * x(16), 2 * x(16)], held
    assert pool.host_allocations == 3 * (SHAPE.num_layers - 1)  # one set per new maximum (8, 12, 16), none after
    assert len(pool._free) == SHAPE.num_layers - 1 and not pool._retired
    inp = PlanInput(model=SHAPE, seq=longest, batch=B, dtype="fp32", activation_checkpointing=True)
    assert plan_tsp(replace(inp, offload_activations=True)).host_bytes_per_rank == pool.host_bytes


class _FakeCudart:
    """torch.cuda.cudart() for the pinned path on a CPU-only machine: records what is registered."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):
        assert ptr % 4096 == 0 and size % 4096 == 0  # page-aligned spans: two buffers never share a page
        assert not any(p < ptr + size and ptr < p + s for p, s in self.registered.items()), "overlapping pages"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


def test_pinned_buffers_are_exact_size_and_released_when_retired(monkeypatch):
    """The CUDA pool page-locks exact-size host tensors (cudaHostRegister) instead of pin_memory=True, whose caching
    allocator rounds each block up to a power of two (160 MiB -> 256 MiB at hidden 5120, S/D 16K); a buffer the
    pool retires or drops is unregistered. cudart mocked; the pool is driven through its take / give-back."""
    import ds_tsp.core.activation_offload as offload_module

    fake = _FakeCudart()
    monkeypatch.setattr(offload_module, "_cudart", lambda: fake)
    pinned_calls = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        pinned_calls.append(kwargs.get("pin_memory", False))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    pool, cuda = ActivationOffload(), torch.device("cuda", 0)
    layer_input = 5 * 2 ** 20 + 12  # not a power of two, not a page multiple
    first = [pool._take(layer_input, cuda) for _ in range(3)]
    assert not any(pinned_calls)  # never the rounding allocator
    span = -(-layer_input // offload_module.PAGE) * offload_module.PAGE
    assert sorted(fake.registered.values()) == [span] * 3
    assert all(b.nbytes == layer_input and b.data.numel() == span for b in first)
    assert pool.host_bytes == 3 * (span + offload_module.PAGE) < 3 * layer_input * 1.01  # not 3 x 8 MiB
    for buffer in first:
        pool._give_back(buffer)
    longer = [pool._take(2 * layer_input, cuda) for _ in range(3)]  # a new maximum: the three smaller are retired
    span2 = -(-2 * layer_input // offload_module.PAGE) * offload_module.PAGE
    assert sorted(fake.registered.values()) == [span2] * 3 and pool.host_allocations == 6
    for buffer in longer:
        pool._give_back(buffer)
    assert [pool._take(layer_input, cuda) for _ in range(3)] and pool.host_allocations == 6  # shorter: reused
    del pool, first, longer, buffer
    import gc

    gc.collect()
    assert fake.registered == {}  # nothing stays page-locked with the pool gone


def test_a_retired_buffer_waits_for_the_side_stream(monkeypatch):
    """On CUDA the side stream may still copy from a buffer that comes back: it is released only once an event
    recorded on that stream at retirement has passed (queried, never waited on)."""
    import ds_tsp.core.activation_offload as offload_module

    fake, events = _FakeCudart(), []
    monkeypatch.setattr(offload_module, "_cudart", lambda: fake)

    class Event:
        def __init__(self):
            self.done = False
            events.append(self)

        def record(self, stream):
            assert stream == "side"

        def query(self):
            return self.done

    monkeypatch.setattr(torch.cuda, "Event", Event)
    pool, cuda = ActivationOffload(), torch.device("cuda", 0)
    pool._stream = "side"
    small = pool._take(3 * 4096, cuda)
    pool._give_back(small)
    big = pool._take(5 * 4096, cuda)  # retires the smaller one: still registered while its copies may run
    assert len(events) == 1 and len(fake.registered) == 2 and len(pool._retired) == 1
    events[0].done = True
    other = pool._take(4096, cuda)  # any later take releases it (and allocates at the longest size)
    assert not pool._retired and sorted(fake.registered.values()) == [5 * 4096, 5 * 4096]
    assert big.nbytes == other.nbytes == 5 * 4096


def test_a_prefetched_copy_is_kept_from_reuse_until_the_side_stream_wrote_it(monkeypatch):
    """The host -> device copy is allocated on the compute stream and written on the side stream: if its unpack never
    comes (a backward abandoned mid-way) it is freed while the write may still run, so it is recorded on the side
    stream (the caching allocator then waits for that stream before reusing the block). CUDA mocked."""
    import contextlib
    from types import SimpleNamespace

    calls = []

    class DeviceTensor:
        def copy_(self, src, non_blocking=False):
            calls.append(("copy", non_blocking))

        def record_stream(self, stream):
            calls.append(("record_stream", stream))

    class Side:
        def wait_stream(self, other):
            calls.append(("wait_stream", other))

    class Event:
        def record(self, stream):
            calls.append(("event", stream))

    side = Side()
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: DeviceTensor())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    pool = ActivationOffload()
    pool._stream = side
    saved = SimpleNamespace(shape=(2, 3), dtype=torch.float32, device=torch.device("cuda", 0), host=None,
                            on_device=None, fetched=None)
    pool._fetch(saved)
    assert calls == [("wait_stream", "compute"), ("copy", True), ("event", side), ("record_stream", side)], calls
