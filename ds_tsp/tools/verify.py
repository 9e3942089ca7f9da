"""Numerics self-check: the TSP model against the single-device reference, same weights, same batch.

Run on every rank of a TSP group; the reference runs on TSP rank 0 only. Errors are norm-wise relative
(||g_tsp - g_ref|| / ||g_ref||) per parameter, HF-named; the report keeps the largest.

Two references: ds_tsp.tools.reference_model.ReferenceCausalLM (weights from a seed), or with `hf_model` transformers'
OWN model loaded from that checkpoint directory (float64 made exact by ds_tsp.tools.hf_reference), while TSP loads the
same directory by slices (TSPForCausalLM.from_pretrained). With a cp axis (`run_cp_case`,
`ds-tsp verify --tsp D --cp C`) C TSP groups share each sequence and the grads are averaged over data x cp first, as the
data-parallel engine does. With `documents` = K > 1 every sequence packs K documents of random lengths (position_ids
restarting, the first label of each document -100, as DataCollatorWithFlattening makes them) and the reference runs
every document on its own.

Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral): the loss includes router_aux_loss_coef x the load-balancing
loss when the config sets output_router_logits (as transformers adds it), and the report gives the aux loss's own
error (aux_rel_err, from a second, gradient-free forward); transformers' fused in-memory expert gradients are
compared per expert under the checkpoint names (ds_tsp.checkpoint.hf.moe_names).

Tolerances (documented; float64 proves the schedule exact, the others sit on their dtype's noise floor):
float64 1e-10 (a correct schedule reaches ~1e-14), float32 1e-5 (noise floor ~1e-6), bfloat16 5e-2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.data_parallel import average_grads_over_group
from ds_tsp.core.parallel.launch import local_device
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.documents import documents_of_lengths
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.core.tokens.zigzag import shift_labels as shift
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 5e-2}


@dataclass(frozen=True)
class VerifyCase:
    shape: ModelShape
    seq: int = 64
    batch: int = 2
    dtype: str = "float32"
    seed: int = 0
    ignore_fraction: float = 0.1  # share of labels set to -100, so masking is exercised too
    documents: int = 1  # documents packed into every sequence
    hf_model: str | None = None  # checkpoint directory: the reference is transformers' own model
    images: int = 0  # a multimodal checkpoint's images in the batch (ds_tsp.tools.verify_multimodal)
    videos: int = 0  # ... and its videos

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def document_lengths(case: VerifyCase) -> list[list[int]]:
    """Per row, `case.documents` random lengths (each >= 1) summing to case.seq (deterministic in the seed)."""
    if not 1 <= case.documents <= case.seq:
        raise TSPConfigError(f"documents={case.documents}: must be between 1 and seq={case.seq}")
    g = torch.Generator().manual_seed(case.seed + 2)
    rows = []
    for _ in range(case.batch):
        cuts = torch.randperm(case.seq - 1, generator=g)[:case.documents - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, case.seq]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return rows


def make_batch(case: VerifyCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic (input_ids, labels, position_ids) [B, S]; a fraction of labels is -100, and so is the first
    label of every packed document."""
    g = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.randint(0, case.shape.vocab_size, (case.batch, case.seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < case.ignore_fraction] = -100
    positions = torch.stack([documents_of_lengths(row) for row in document_lengths(case)])
    labels[positions == 0] = -100
    return ids, labels, positions


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def reference_loss_and_grads(case: VerifyCase, full: dict[str, torch.Tensor], loss_scale: float = 1.0):
    """ReferenceCausalLM on the same batch, every packed document run on its own; token-mean over all of them.
    loss_scale: as hf_reference_loss_and_grads's."""
    ids, labels, _ = make_batch(case)
    targets = shift(labels)
    ref = ReferenceCausalLM(case.shape, dtype=DTYPES[case.dtype])
    ref.load_state_dict(full, strict=False)
    total = torch.zeros((), dtype=torch.float64)
    for b, lengths in enumerate(document_lengths(case)):
        start = 0
        for n in lengths:
            doc_targets = targets[b:b + 1, start:start + n]
            count = int((doc_targets != -100).sum())
            if count:
                mean = ref(ids[b:b + 1, start:start + n], doc_targets, torch.arange(n)[None])
                total = total + mean.double() * count
            start += n
    loss = total / int((targets != -100).sum())
    (loss * loss_scale).backward()
    grads = {n: p.grad if p.grad is None else p.grad / loss_scale for n, p in ref.named_parameters()}
    if case.shape.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return loss.detach(), grads


def hf_reference_loss_and_grads(case: VerifyCase, aux_out: dict | None = None, loss_scale: float = 1.0):
    """transformers' own model from case.hf_model, same batch, every packed document on its own (an MoE aux loss
    over all of them, into aux_out["aux_loss"]); gradients under the checkpoint names. loss_scale = the data group's
    size: the gradients as that many data-parallel replicas compute them (ds_tsp.tools.hf_reference.hf_loss_and_grads;
    the same float32 router rounding as the TSP model's, whose loss share carries that factor)."""
    from ds_tsp.checkpoint.hf.language_model_names import language_model_tensors
    from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict
    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    ids, labels, _ = make_batch(case)
    model = load_hf_reference(case.hf_model, DTYPES[case.dtype])
    loss, grads = hf_loss_and_grads(model, ids, shift(labels), documents=document_lengths(case), aux_out=aux_out,
                                    loss_scale=loss_scale)
    # a multimodal checkpoint's reference is its ForConditionalGeneration: compare its language model
    return loss, canonical_state_dict(language_model_tensors(grads), case.shape.moe_family)


def _aux_loss(model: ShardedCausalLM, batch: dict, seq_len: int) -> torch.Tensor | None:
    """The MoE aux loss of the batch (the value of the sequence's ranks, TSP group x cp groups), or None when the
    model adds none. Gradient-free."""
    if not (model.shape.num_experts and model.shape.output_router_logits):
        return None
    router_logits = []
    with torch.no_grad():
        model.final_hidden(batch["input_ids"], batch["position_ids"], None, batch["shift_labels"], router_logits)
        share = model.aux_loss_share(router_logits, tuple(batch["input_ids"].shape), None, seq_len)
    return model.loss_for_logging(model.aux_in_mean_loss(share)).cpu()


def _build_model(case: VerifyCase, comm: TSPComm, options: TSPOptions, data_group=None):
    """(the TSP model on this rank's shards, the reference's full state dict or None for an HF checkpoint)."""
    dtype, device = DTYPES[case.dtype], local_device()  # the model on this rank's GPU when there is one
    if case.hf_model is not None:
        from ds_tsp.model.hf_causal_lm import TSPForCausalLM

        return TSPForCausalLM.from_pretrained(case.hf_model, comm, dtype=dtype, options=options, device=device,
                                              data_group=data_group).tsp, None
    reference = ReferenceCausalLM(case.shape, dtype=dtype)
    init_weights_(reference, case.seed)
    full = full_state_dict(reference)
    del reference
    model = ShardedCausalLM(case.shape, comm, options=options, dtype=dtype, device=device, data_group=data_group)
    model.load_full_state_dict(full)
    return model, full


def _step_and_compare(case: VerifyCase, model: ShardedCausalLM, full: dict | None, batch: dict, reporter: bool,
                      data_group=None, **layout) -> dict | None:
    """One forward + backward of the TSP model (grads averaged over `data_group` as a data-parallel engine does,
    when given), then on the reporting rank the comparison with the single-device reference. `layout` goes into
    the report (tsp, and cp where there is a cp axis)."""
    loss_share = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"], seq_len=case.seq)
    loss_share.backward()
    if data_group is not None:
        average_grads_over_data(model, data_group)
    aux = _aux_loss(model, batch, case.seq)
    loss = model.loss_for_logging(loss_share).cpu()  # compared with the reference on the CPU, once, after the step
    grads = {name: g.cpu() for name, g in model.full_state_dict(grads=True).items()}
    if not reporter:
        return None
    ref_aux = {}
    # the reference's gradients as a data-parallel engine of data_size replicas computes them: the TSP model's loss
    # share is scaled by data_size (its grads then averaged), and a float32 step inside a float64 model (the MoE
    # routers' softmax) rounds data_size x its gradient: for data x cp of 3 that alone moves the routers' grads ~1e-8
    scale = float(model.data_size)
    ref_loss, ref_grads = (hf_reference_loss_and_grads(case, ref_aux, scale) if case.hf_model is not None
                           else reference_loss_and_grads(case, full, scale))
    grad_errs = {name: _rel_err(grads[name], g) for name, g in ref_grads.items()}
    worst = max(grad_errs, key=grad_errs.get)
    report = {"loss_rel_err": _rel_err(loss, ref_loss), "grad_rel_err": grad_errs[worst], "worst_grad": worst,
              **layout, "dtype": case.dtype, "loss": float(loss), "ref_loss": float(ref_loss),
              "tolerance": case.tolerance, "documents": case.documents,
              "reference": "transformers" if case.hf_model is not None else "ds_tsp"}
    if aux is not None:
        report.update(aux_loss=float(aux), ref_aux_loss=float(ref_aux["aux_loss"]),
                      aux_rel_err=_rel_err(aux, ref_aux["aux_loss"]))
    report["ok"] = (report["loss_rel_err"] <= case.tolerance and report["grad_rel_err"] <= case.tolerance
                    and report.get("aux_rel_err", 0.0) <= case.tolerance)
    return report


def run_case(case: VerifyCase, group: dist.ProcessGroup | None, options: TSPOptions = TSPOptions(),
             overlap: bool = True, weight_group: dist.ProcessGroup | None = None) -> dict | None:
    """Collective over `group` (one TSP group). Returns the report on TSP rank 0, None elsewhere. weight_group:
    the weights' channel (TSPComm.weight_group), as training runs get it."""
    comm = TSPComm(group, overlap=overlap, weight_group=weight_group)
    ids, labels, positions = (t.to(local_device()) for t in make_batch(case))
    batch = shard_batch(ids, tsp=comm.size, rank=comm.rank, labels=labels, position_ids=positions)
    model, full = _build_model(case, comm, options)
    return _step_and_compare(case, model, full, batch, comm.rank == 0, tsp=comm.size)


def average_grads_over_data(model: torch.nn.Module, data_group: dist.ProcessGroup | None) -> None:
    """What a data-parallel engine does to the grads of one step: the mean over the data group (data x cp).
    model: a ShardedCausalLM (its comm bounds the all-reduce)."""
    average_grads_over_group(model.parameters(), data_group, model.comm)


def run_cp_case(case: VerifyCase, tsp: int, cp: int, options: dict | None = None) -> dict | None:
    """The same check with a context-parallel axis: C TSP groups of D ranks share each sequence (tsp.cp_size),
    laid out by build_runtime from {"size": D, "cp_size": C}. After backward every gradient is averaged over the
    data group (data x cp), what the data-parallel engine does in training, so the check covers the cp reduction
    and the loss denominator as well as the cp ring. Collective over the initialised world (C x D ranks, or a
    multiple: more data replicas of the same batch). Returns the report on global rank 0, None elsewhere."""
    runtime = build_runtime(parse_tsp_config({"size": tsp, "cp_size": cp, **(options or {})}))
    groups = runtime.groups
    ids, labels, positions = (t.to(local_device()) for t in make_batch(case))
    batch = shard_batch(ids, tsp=tsp, rank=groups.tsp_rank if groups else 0, labels=labels, position_ids=positions,
                        cp=cp, cp_rank=groups.cp_rank if groups else 0)
    model, full = _build_model(case, runtime.comm, runtime.options, runtime.data_group)
    reporter = not dist.is_initialized() or dist.get_rank() == 0
    report = _step_and_compare(case, model, full, batch, reporter, runtime.data_group, tsp=tsp, cp=cp)
    if report is not None and runtime.config.cp_comm != "ring":
        report["cp_comm"] = runtime.config.cp_comm
    if report is not None and runtime.config.cp_comm == "auto":  # the schedule each attention layer ran
        from ds_tsp.model.modules.attention import cp_schedules_at

        report["cp_comm_chosen"] = cp_schedules_at(model.model.layers, batch["input_ids"].shape[1] * tsp * cp,
                                                   DTYPES[case.dtype])
    return report


def run_case_on_world(case: VerifyCase, options: TSPOptions = TSPOptions(), overlap: bool = True) -> dict | None:
    """Entry for an already-initialised default group (torchrun) or a spawned one: the whole world is one TSP group."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return run_case(case, None, options, overlap)
    # the weights' own channel where a training run gets one (CUDA: ds_tsp.core.parallel.topology.ProcessGroups.build);
    # collective: every rank runs this entry
    # (a spawned gloo group computes on the CPU, see local_device: no second channel there)
    weights = dist.new_group(list(range(dist.get_world_size()))) if local_device().type == "cuda" else None
    return run_case(case, dist.group.WORLD, options, overlap, weights)
