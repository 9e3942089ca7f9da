"""ds_tsp.hf.TSPForConditionalGeneration: a multimodal Qwen3.5 (vision tower + hybrid Gated DeltaNet / gated
attention language model) with images and videos under TSP, against transformers' own
Qwen3_5ForConditionalGeneration, float64.

The image batch (tests/helpers/vlm_tiny.image_batch): three rows, two images in the first, none in the second, one
in the third, S = 21, so at D = 2 (chunks of 6) and D = 4 (chunks of 3) both images of row 0 are cut by rank
boundaries and at D = 4 one rank encodes no image at all. The mrope section [2, 1, 1] gives the t, h and w position
rows a rotary frequency each, so a wrong row would show. The mixed batch (vlm_tiny.MIXED) adds videos of 2 and 3
frames (timestamps between frames) beside images, frames landing on different ranks.

Proofs: loss and EVERY gradient (the vision tower's included) within 1e-10 at D = 1 (in process), D = 2 and D = 4
(one 4-rank spawn: D = 4 on the world, D = 2 on both halves, the second half with right padding; the mixed batch and
packed multimodal documents at D = 1, 2, 4, the latter against each document run alone), measured ~1e-15; the
all-to-all's bytes per rank equal the rows that change rank; the D = 4 save reloaded by plain transformers with
identical tensors and logits; positions equal transformers' get_rope_index (images, padding, video frames); the
routing plan moves every vision token exactly once; bad input refused by name. Qwen3.5-MoE (experts, shared expert,
the aux loss), Qwen3-VL (DeepStack features into the first layers) and Qwen3-VL-MoE likewise at D = 1, 2, 4.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import shift  # noqa: E402,I001
from hybrid_tiny import rel  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from vlm_tiny import (  # noqa: E402
    IMAGE,
    MIXED,
    VIDEO,
    VISION,
    image_batch,
    packed_batch,
    packed_documents,
    reference_loss_and_grads,
    reference_packed,
    save_vlm_checkpoint,
    tsp_vlm_step,
    vlm_config,
)

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.tokens.vision_route import frame_items, plan_vision_route  # noqa: E402
from ds_tsp.core.tokens.mrope import mrope_cos_sin, mrope_positions  # noqa: E402
from ds_tsp.tools.hf_reference import load_hf_reference  # noqa: E402

PADDED = (0, 5, 2)  # right padding per row of the padded case


def _spawned(directory: str, save_root: str, moe_directory: str, vl_directory: str, vl_moe_directory: str) -> dict:
    """D=4 on the world (then saved); D=2 on [0, 1] (the image batch) and on [2, 3] (the same, right-padded);
    Qwen3.5-MoE: D=4 on the image batch, D=2 on the mixed one; Qwen3-VL: D=4 on the mixed batch, D=2 on images;
    Qwen3-VL-MoE: D=4 on images, D=2 on the mixed batch."""
    import torch.distributed as dist

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    model, results[4] = tsp_vlm_step(directory, image_batch())
    results["a2a_bytes", rank] = model.tsp.comm.counter.bytes["all_to_all"]
    model.save_pretrained(save_root, max_shard_size="24KB")  # collective over the world
    results["syncs", rank], results["ops", rank] = [], []
    _, results["mixed", 4] = tsp_vlm_step(directory, image_batch(**MIXED), syncs=results["syncs", rank],
                                          ops=results["ops", rank])
    results["encodes", rank] = [plan_vision_route(batch["input_ids"] == token, frame_items(batch[grid]), 2, 32, 4,
                                                  rank).encodes
                                for batch in [image_batch(**MIXED)]
                                for token, grid in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw"))]
    _, results["packed", 4] = tsp_vlm_step(directory, packed_batch(packed_documents()))
    _, results["moe", 4] = tsp_vlm_step(moe_directory, image_batch())
    _, results["vl mixed", 4] = tsp_vlm_step(vl_directory, image_batch(**MIXED))
    _, results["vl moe", 4] = tsp_vlm_step(vl_moe_directory, image_batch())
    results["zero3 path", 4], results["tower calls", rank] = _zero3_marked_step(directory, image_batch())
    results["fsdp2", rank] = _fsdp2_step(directory, image_batch(), image_batch(**MIXED))
    if rank < 2:
        _, results[2] = tsp_vlm_step(directory, image_batch(), halves[0])
        _, results["mixed", 2] = tsp_vlm_step(directory, image_batch(**MIXED), halves[0])
        _, results["moe mixed", 2] = tsp_vlm_step(moe_directory, image_batch(**MIXED), halves[0])
        _, results["vl moe mixed", 2] = tsp_vlm_step(vl_moe_directory, image_batch(**MIXED), halves[0])
    else:
        _, results["padded", 2] = tsp_vlm_step(directory, image_batch(pad_right=PADDED), halves[1])
        _, results["packed", 2] = tsp_vlm_step(directory, packed_batch(packed_documents()), halves[1])
        _, results["vl", 2] = tsp_vlm_step(vl_directory, image_batch(), halves[1])
    gathered = [None] * 4
    dist.all_gather_object(gathered, results)
    return {**gathered[3], **gathered[1], **gathered[2], **gathered[0]} if rank == 0 else None


def _zero3_marked_step(directory: str, batch: dict):
    """((loss, grads), tower calls) of a step whose tower parameters carry ds_id as DeepSpeed ZeRO-3 marks them
    (whole here: no engine gathers them): the ZeRO-3 path runs (the tower in the step's graph, its grads summed over
    the TSP group by per-parameter hooks, a placeholder item through it for the absent videos and on the rank with
    no image to encode), so its sums and zeros are checked exactly against transformers."""
    from ds_tsp.hf import TSPForConditionalGeneration

    model = TSPForConditionalGeneration.from_pretrained(directory, None, dtype=torch.float64)
    for i, p in enumerate(model.visual.parameters()):
        p.ds_id = i
    calls = []
    model.visual.register_forward_hook(lambda module, args, out: calls.append(int(args[0].shape[0])))
    out = model(**batch)
    out.loss.backward()
    return (out.loss.detach(), model.full_state_dict(grads=True)), calls


def _fsdp2_step(directory: str, *batches: dict) -> dict:
    """One step under shard_with_fsdp2 at D = 2 x data 2 (data replica r takes batches[r]: the images, then images
    and videos, so replica 0 runs the tower for its absent videos): the language model fully_shard'ed over the data
    axis, the tower kept whole. {loss, the tower's grads (plain tensors), the full grad norm (clip_grad_norm_,
    the tower counted once), whether the language model's parameters are DTensors and the tower's are not}."""
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.hf import TSPForConditionalGeneration
    from ds_tsp.integrations.fsdp import shard_with_fsdp2

    groups = build_runtime(parse_tsp_config({"size": 2})).groups
    model = TSPForConditionalGeneration.from_pretrained(directory, groups.tsp_group, dtype=torch.float64)
    shard_with_fsdp2(model, groups)
    out = model(**batches[groups.data_rank])
    out.loss.backward()
    tower = {"model.visual." + n: p.grad.clone() for n, p in model.visual.named_parameters()}
    norm = clip_grad_norm_(model, 1e9, groups)
    kinds = {type(p).__name__ for p in model.tsp.parameters()}, {type(p).__name__ for p in model.visual.parameters()}
    return {"loss": out.loss.detach(), "tower": tower, "norm": norm, "kinds": kinds}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_vlm_checkpoint(tmp_path_factory.mktemp("qwen3_5_vlm") / "tiny")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_hf_reference(checkpoint, torch.float64, image_text=True)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    return model


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return save_vlm_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe_vlm") / "tiny", "qwen3_5_moe")


@pytest.fixture(scope="module")
def moe_reference(moe_checkpoint):
    return load_hf_reference(moe_checkpoint, torch.float64, image_text=True)


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return save_vlm_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "tiny", "qwen3_vl")


@pytest.fixture(scope="module")
def vl_reference(vl_checkpoint):
    return load_hf_reference(vl_checkpoint, torch.float64, image_text=True)


@pytest.fixture(scope="module")
def vl_moe_checkpoint(tmp_path_factory):
    return save_vlm_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe") / "tiny", "qwen3_vl_moe")


@pytest.fixture(scope="module")
def runs(checkpoint, moe_checkpoint, vl_checkpoint, vl_moe_checkpoint, tmp_path_factory):
    saved = tmp_path_factory.mktemp("qwen3_5_vlm_saved") / "d4"
    return run_on_local_ranks(_spawned, 4, checkpoint, str(saved), moe_checkpoint, vl_checkpoint, vl_moe_checkpoint,
                              timeout_s=600)[0], str(saved)


def assert_matches(got, ref, what, tol: float = 1e-10):
    loss, grads = got
    ref_loss, ref_grads = ref
    assert set(grads) == set(ref_grads), (what, set(grads) ^ set(ref_grads))
    assert rel(loss, ref_loss) < tol, (what, float(loss), float(ref_loss))
    errors = {n: rel(grads[n], g) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, (what, worst, errors[worst])
    assert float(ref_grads["model.visual.blocks.0.attn.qkv.weight"].norm()) > 0  # the tower really learns


def test_positions_equal_transformers_get_rope_index(reference):
    rope_index = reference.model.get_rope_index
    batch = image_batch(pad_right=PADDED)
    for mask in (None, batch["attention_mask"]):
        want, _ = rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                             attention_mask=mask)
        got = mrope_positions(batch["mm_token_type_ids"], 2, batch["image_grid_thw"], attention_mask=mask)
        assert torch.equal(got, want)
    # a video of 2 frames (a timestamp token between them) beside an image: frames restart h, w at the position
    types = torch.tensor([[0, 1, 1, 0, 0, 2, 2, 0, 2, 2, 0]])
    image, video = torch.tensor([[1, 2, 4]]), torch.tensor([[2, 2, 4]])
    want, _ = rope_index(torch.zeros_like(types), types, image, video)
    assert torch.equal(mrope_positions(types, 2, image, video), want)
    batch = image_batch(**MIXED)
    want, _ = rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                         batch["video_grid_thw"])
    assert torch.equal(mrope_positions(batch["mm_token_type_ids"], 2, batch["image_grid_thw"],
                                       batch["video_grid_thw"]), want)


def test_mrope_tables_equal_transformers_rotary_embedding(reference):
    """float32, three different rows: the interleaved recomposition bit for bit."""
    rotary = reference.model.language_model.rotary_emb
    positions = torch.stack((torch.arange(12), torch.arange(12) * 3 % 7, torch.arange(12) * 5 % 11))[:, None]
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    want = Qwen3_5TextRotaryEmbedding.forward(rotary, torch.zeros(1, dtype=torch.float32), positions)
    got = mrope_cos_sin(positions, 8, 10000.0, torch.float32, (2, 1, 1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_routing_moves_every_vision_token_exactly_once():
    """Coordinate check of the plan at D = 4: the ranks' received rows cover every image token's slot once, every
    rank's sends match its peers' receives, and each rank sends only the rows it encoded (~1/D of them)."""
    batch = image_batch()
    mask = batch["input_ids"] == IMAGE
    routes = [plan_vision_route(mask, batch["image_grid_thw"], 2, 24, 4, r) for r in range(4)]
    for p in range(4):
        for q in range(4):
            assert routes[p].in_splits[q] == routes[q].out_splits[p]
    rows, cols = mask.nonzero(as_tuple=True)
    slots = set()
    for r, route in enumerate(routes):
        for flat in route.local_index.tolist():
            b, local = divmod(flat, 6)
            g = (r if local < 3 else 7 - r)  # the zigzag chunk this local row sits in
            slots.add((b, g * 3 + local % 3))
    assert slots == set(zip(rows.tolist(), cols.tolist())) and sum(r.local_index.numel() for r in routes) == len(slots)
    encoded = [sum(r.in_splits) for r in routes]
    assert sum(encoded) == len(slots) and encoded.count(0) == 1  # three images, four ranks: one encodes none
    assert [r.items for r in routes] == [(0, 1), (1, 1), (1, 2), (2, 3)]  # by patch count: 16, 24, 8


def test_d1_matches_transformers_from_a_directory_and_in_memory(checkpoint, reference):
    batch = image_batch()
    ref = reference_loss_and_grads(reference, batch)
    _, got = tsp_vlm_step(checkpoint, batch)
    assert_matches(got, ref, "D=1 directory")
    _, got = tsp_vlm_step(reference, batch)
    assert_matches(got, ref, "D=1 in memory")
    batch = image_batch(**MIXED)
    _, got = tsp_vlm_step(checkpoint, batch)
    assert_matches(got, reference_loss_and_grads(reference, batch), "D=1 images and videos")


def test_qwen3_5_moe_matches_transformers(moe_checkpoint, moe_reference, runs):
    """Qwen3_5MoeForConditionalGeneration: experts, shared expert and the aux loss of the whole batch; D = 1 here,
    D = 4 (images) and D = 2 (images and videos) from the spawn."""
    assert type(moe_reference).__name__ == "Qwen3_5MoeForConditionalGeneration"
    batch = image_batch()
    ref = reference_loss_and_grads(moe_reference, batch)
    model, got = tsp_vlm_step(moe_checkpoint, batch)
    assert_matches(got, ref, "MoE D=1")
    assert model(**batch).aux_loss is not None
    results, _ = runs
    assert_matches(results["moe", 4], ref, ("MoE", 4))
    assert_matches(results["moe mixed", 2], reference_loss_and_grads(moe_reference, image_batch(**MIXED)),
                   ("MoE images and videos", 2))


def test_logits_and_num_items_in_batch(checkpoint, reference):
    """logits_to_keep=k: the last k positions' logits (all of them here) equal transformers'; num_items_in_batch
    (the Trainer's count over an accumulated batch) divides the token sum instead of this batch's count."""
    from ds_tsp.hf import TSPForConditionalGeneration

    batch = image_batch()
    model = TSPForConditionalGeneration.from_pretrained(checkpoint, None, dtype=torch.float64)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        want = reference(**inputs).logits
        assert rel(model(**inputs, logits_to_keep=21).logits, want) < 1e-12
        assert rel(model(**inputs, logits_to_keep=3).logits, want[:, -3:]) < 1e-12
        count = int((batch["labels"][:, 1:] != -100).sum())
        mean = model(**batch).loss
        assert rel(model(**batch, num_items_in_batch=2 * count).loss, mean / 2) < 1e-14


def test_qwen3_vl_deepstack_matches_transformers(vl_checkpoint, vl_reference, runs, tmp_path):
    """Qwen3VLForConditionalGeneration: Qwen3's layer under mrope, and the tower's DeepStack features (both vision
    blocks) added to the first two layers' outputs at the vision rows, routed in the embeddings' all-to-all; D = 1
    here (directory and in memory), D = 4 (images and videos) and D = 2 (images) from the spawn."""
    assert type(vl_reference).__name__ == "Qwen3VLForConditionalGeneration"
    results, _ = runs
    for batch, key in ((image_batch(), ("vl", 2)), (image_batch(**MIXED), ("vl mixed", 4))):
        ref = reference_loss_and_grads(vl_reference, batch)
        assert float(ref[1]["model.visual.deepstack_merger_list.1.linear_fc2.weight"].norm()) > 0
        for source in (vl_checkpoint, vl_reference):
            assert_matches(tsp_vlm_step(source, batch)[1], ref, ("Qwen3-VL D=1", key))
        assert_matches(results[key], ref, ("Qwen3-VL", key))
    # activation checkpointing (the DeepStack additions sit between the checkpointed layers) and a frozen tower
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.hf import TSPForConditionalGeneration

    model = TSPForConditionalGeneration.from_pretrained(vl_checkpoint, None, dtype=torch.float64,
                                                        options=TSPOptions(activation_checkpointing=True))
    assert model.visual.is_activation_checkpointing  # the tower's blocks too, as transformers checkpoints them
    loss = model(**batch).loss
    loss.backward()
    assert_matches((loss.detach(), model.full_state_dict(grads=True)), ref, "Qwen3-VL activation checkpointing")
    model.zero_grad(set_to_none=True)
    model.visual.requires_grad_(False)
    model(**batch).loss.backward()
    grads = model.full_state_dict(grads=True)
    assert all(float(grads[n].norm()) == 0 for n in grads if n.startswith("model.visual."))
    assert rel(grads["lm_head.weight"], ref[1]["lm_head.weight"]) < 1e-10
    # its save (the DeepStack mergers included) reloads in transformers with identical tensors
    saved = model.save_pretrained(tmp_path / "saved")
    reloaded = load_hf_reference(saved, torch.float64, image_text=True)
    assert type(reloaded).__name__ == "Qwen3VLForConditionalGeneration"
    original = dict(vl_reference.state_dict())
    assert reloaded.state_dict().keys() == original.keys()
    assert all(torch.equal(v, original[k]) for k, v in reloaded.state_dict().items())


def test_qwen3_vl_moe_matches_transformers(vl_moe_checkpoint, runs):
    """Qwen3VLMoeForConditionalGeneration: Qwen3-MoE's experts (top-k always renormalised, the whole batch's aux
    loss) under the DeepStack tower; D = 1 here (directory and in memory), D = 4 (images) and D = 2 (images and
    videos) from the spawn."""
    reference = load_hf_reference(vl_moe_checkpoint, torch.float64, image_text=True)
    assert type(reference).__name__ == "Qwen3VLMoeForConditionalGeneration"
    results, _ = runs
    for batch, key in ((image_batch(), ("vl moe", 4)), (image_batch(**MIXED), ("vl moe mixed", 2))):
        ref = reference_loss_and_grads(reference, batch)
        for source in (vl_moe_checkpoint, reference):
            assert_matches(tsp_vlm_step(source, batch)[1], ref, ("Qwen3-VL-MoE D=1", key))
        assert_matches(results[key], ref, ("Qwen3-VL-MoE", key))


def test_packed_documents_equal_each_document_alone(checkpoint, reference):
    """D = 1 here (D = 2, 4 in the spawn): positions restart per document, attention and the Gated DeltaNet state
    stay inside it; transformers' own call on the packed batch (vision positions as text) is far from it."""
    documents = packed_documents()
    batch = packed_batch(documents)
    alone = reference_packed(reference, documents)
    _, got = tsp_vlm_step(checkpoint, batch)
    assert_matches(got, alone, "D=1 packed")
    assert rel(reference_loss_and_grads(reference, batch)[0], alone[0]) > 1e-4
    with pytest.raises(TSPConfigError, match="position_ids"):  # documents not counting from 0
        tsp_vlm_step(checkpoint, {**batch, "position_ids": batch["position_ids"] + 1})


def test_d2_and_d4_match_transformers(runs, reference):
    results, _ = runs
    ref = reference_loss_and_grads(reference, image_batch())
    for degree in (4, 2):
        assert_matches(results[degree], ref, ("images", degree))
    assert_matches(results["padded", 2], reference_loss_and_grads(reference, image_batch(pad_right=PADDED)),
                   ("padded", 2))
    # the tower as DeepSpeed ZeRO-3 marks it (test _zero3_marked_step): exact too; every rank ran it twice, once
    # per modality, the rank with no image and the absent videos through a placeholder of m x m = 4 patches
    assert_matches(results["zero3 path", 4], ref, ("ZeRO-3 path", 4))
    assert [len(results["tower calls", r]) for r in range(4)] == [2] * 4
    assert sum(calls.count(4) for calls in (results["tower calls", r] for r in range(4))) == 5
    mixed = reference_loss_and_grads(reference, image_batch(**MIXED))
    for degree in (4, 2):
        assert_matches(results["mixed", degree], mixed, ("images and videos", degree))
    _assert_fsdp2_matches(results, ref, mixed)
    alone = reference_packed(reference, packed_documents())
    for degree in (4, 2):
        assert_matches(results["packed", degree], alone, ("packed documents", degree))
    # the vision rows' all-to-all, forward and backward: each rank moves only the rows that change rank (row-wise
    # 1/D of the vision tokens here), never an all-gather of them all
    batch = image_batch()
    routes = [plan_vision_route(batch["input_ids"] == IMAGE, batch["image_grid_thw"], 2, 24, 4, r) for r in range(4)]
    row_bytes = 32 * 8
    for r, route in enumerate(routes):
        moved = sum(route.in_splits) - route.in_splits[r] + sum(route.out_splits) - route.out_splits[r]
        assert results["a2a_bytes", r] == moved * row_bytes, r
    assert sum(results["a2a_bytes", r] for r in range(4)) > 0


def _assert_fsdp2_matches(results: dict, *refs) -> None:
    """FSDP2 at D = 2 x data 2 (_fsdp2_step) against transformers on both replicas' batches: the token-weighted
    mean loss, every tower grad on every rank (summed over TSP, averaged over data in the tower's backward), the
    full grad norm (the language model's DTensor grads and the tower's plain ones counted once)."""
    counts = [int((shift(batch["labels"]) != -100).sum()) for batch in (image_batch(), image_batch(**MIXED))]
    weights = [n / sum(counts) for n in counts]
    loss = sum(w * ref[0] for w, ref in zip(weights, refs))
    grads = {name: sum(w * ref[1][name] for w, ref in zip(weights, refs)) for name in refs[0][1]}
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    for rank in range(4):
        got = results["fsdp2", rank]
        assert got["kinds"] == ({"DTensor"}, {"Parameter"}), got["kinds"]
        assert rel(got["loss"], loss) < 1e-10 and rel(got["norm"], norm) < 1e-10, (rank, got["loss"], got["norm"])
        tower = {name: g for name, g in grads.items() if name.startswith("model.visual.")}
        assert set(got["tower"]) == set(tower)
        errors = {name: rel(got["tower"][name], g) for name, g in tower.items()}
        assert max(errors.values()) < 1e-10, (rank, max(errors, key=errors.get), max(errors.values()))


# where the step may read values on the host: the model's entry (the batch is read once there to plan the routes, the
# positions and the tower's inputs), the input check's one read, and transformers' vision attention (its sdpa path
# splits its segments by a host read: three per block, per encoded run)
ENTRY = ("model/hf_conditional_generation.py:", "core/tokens/mrope.py:", "core/tokens/vision_route.py:")


def test_host_reads_only_at_the_entry_and_in_transformers_tower(runs):
    """At D = 4 on the mixed batch, per rank: the exchange, the language model's layers and the whole backward read
    no value; past the model's entry only the input check (once) and transformers' own vision attention (splitting
    its segments) do. (Counted by what runs, so the CPU sees what a GPU would stall on; the entry's reads are of
    host tensors there.)"""
    results, _ = runs
    for rank in range(4):
        events = results["syncs", rank]
        tower = [e for e in events if e[2] == "layers"]
        assert all(e[1] == "tolist" and e[3].endswith(" encode") for e in tower), (rank, tower)  # the tower's call
        # at most three per block and encoded run: the count varies with what ran earlier in the process (12 when
        # this file runs alone, 9 on one rank once in the full suite's forkserver); where they come from is checked
        assert len(tower) <= 3 * VISION["depth"] * sum(results["encodes", rank]), rank
        assert len([e for e in events if e[2] == "input_checks"]) == 1, rank
        rest = [e for e in events if e[2] not in ("layers", "input_checks")]
        assert all(e[3].startswith(ENTRY) and not e[3].endswith(" encode") for e in rest), (rank, rest)


def test_collectives_obey_nccl_rules(runs):
    """The D = 4 mixed step's collectives on every rank (the language model's, the vision rows' all-to-all both
    ways, the tower's grads all-reduced), replayed under NCCL's queueing rules: no hang, the same sequence of kinds
    on every rank, the all-to-all's splits matching pairwise with really uneven rows."""
    from nccl_rules import check

    results, _ = runs
    ops = {rank: results["ops", rank] for rank in range(4)}
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops.values()), report
    kinds = [[o["kind"] for o in rank_ops] for rank_ops in ops.values()]
    assert all(k == kinds[0] for k in kinds)
    exchanges = [o for o in ops[0] if o["kind"] == "all_to_all"]
    assert len(exchanges) == 4  # images and videos, forward and backward
    assert any(len(set(o["in_splits"])) > 1 for rank_ops in ops.values() for o in rank_ops
               if o["kind"] == "all_to_all")
    assert [o["what"] for o in ops[0] if o["kind"] == "all_reduce"].count("vision tower weight grads") == 2


def test_save_reloads_in_transformers_with_identical_logits(runs, reference):
    _, saved = runs
    config = json.loads(open(f"{saved}/config.json").read())
    assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    reloaded = load_hf_reference(saved, torch.float64, image_text=True)
    original = dict(reference.state_dict())
    assert reloaded.state_dict().keys() == original.keys()
    differ = [k for k, v in reloaded.state_dict().items() if not torch.equal(v, original[k])]
    assert not differ, differ
    batch = {k: v for k, v in image_batch().items() if k != "labels"}
    with torch.no_grad():
        assert rel(reloaded(**batch).logits, reference(**batch).logits) < 1e-13


def test_bad_input_is_refused_by_name(checkpoint):
    from ds_tsp.hf import TSPForConditionalGeneration

    model = TSPForConditionalGeneration.from_pretrained(checkpoint, None, dtype=torch.float64)
    batch = image_batch()
    with pytest.raises(ValueError, match="image_grid_thw"):  # a grid that does not match its span
        model(**{**batch, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 2, 4]])})
    with pytest.raises(ValueError, match="image_grid_thw"):  # more items than spans
        model(**{**batch, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 4], [1, 2, 2]])})
    with pytest.raises(ValueError, match="pixel_values"):
        model(input_ids=batch["input_ids"], labels=batch["labels"])
    mixed = image_batch(**MIXED)
    with pytest.raises(ValueError, match="video_grid_thw"):  # 3 frames where the tokens hold 2
        model(**{**mixed, "video_grid_thw": torch.tensor([[3, 4, 4], [3, 4, 2]])})
    with pytest.raises(ValueError, match="pixel_values_videos"):
        model(**{k: v for k, v in mixed.items() if k not in ("pixel_values_videos", "video_grid_thw")})
    with pytest.raises(TSPConfigError, match="position_ids"):
        model(**batch, position_ids=torch.arange(21).expand(3, 3, 21))
    with pytest.raises(ValueError, match="image_grid_thw"):  # an image span cut by a document boundary
        model(**batch, position_ids=torch.cat((torch.arange(6), torch.arange(15))).expand(3, 21))
    with pytest.raises(TSPConfigError, match="gemma3"):  # a multimodal family this face does not take
        TSPForConditionalGeneration(transformers.Gemma3Config())
    assert vlm_config().model_type == "qwen3_5"
    # FSDP2's sharded parameters (not plain tensors) on the tower are refused, not summed wrongly
    class ShardedParameter(torch.nn.Parameter):
        pass

    proj = model.visual.patch_embed.proj
    whole = proj.weight
    proj.weight = ShardedParameter(whole.detach())
    try:
        with pytest.raises(TSPConfigError, match="sharded by FSDP2 .*use DeepSpeed ZeRO-3"):
            model(**batch)
    finally:
        proj.weight = whole
    # shard_with_fsdp2 keeps the tower whole, outside FSDP2's casts: a param_dtype other than the tower's is refused
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ds_tsp.integrations.fsdp import _replicated_tower

    with pytest.raises(TSPConfigError, match=r"MixedPrecisionPolicy\(param_dtype=torch.bfloat16\) with a vision-lang"):
        _replicated_tower(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16), None)
    assert _replicated_tower(model, MixedPrecisionPolicy(param_dtype=torch.float64), None) is model.visual
