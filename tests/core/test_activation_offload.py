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
