"""Numerics self-check: the TSP model against the single-device reference, same weights, same batch.

Run on every rank of a TSP group; the reference runs on TSP rank 0 only. Errors are norm-wise relative
(||g_tsp - g_ref|| / ||g_ref||) per parameter, HF-named; the report keeps the largest.

Tolerances (documented; float64 proves the schedule exact, the others sit on their dtype's noise floor):
float64 1e-10 (a correct schedule reaches ~1e-14), float32 1e-5 (noise floor ~1e-6), bfloat16 5e-2.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ds_tsp.comm import TSPComm
from ds_tsp.model import TSPCausalLM, TSPOptions
from ds_tsp.model_config import ModelShape
from ds_tsp.partition import shard_batch
from ds_tsp.partition import shift_labels as shift
from ds_tsp.reference import ReferenceCausalLM, full_state_dict, init_weights_

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

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def make_batch(case: VerifyCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input_ids, labels) [B, S]; a fraction of labels is -100."""
    g = torch.Generator().manual_seed(case.seed + 1)
    ids = torch.randint(0, case.shape.vocab_size, (case.batch, case.seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < case.ignore_fraction] = -100
    return ids, labels


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def reference_loss_and_grads(case: VerifyCase, full: dict[str, torch.Tensor]):
    ids, labels = make_batch(case)
    ref = ReferenceCausalLM(case.shape, dtype=DTYPES[case.dtype])
    ref.load_state_dict(full, strict=False)
    loss = ref(ids, shift(labels), torch.arange(case.seq).expand_as(ids))
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    if case.shape.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return loss.detach(), grads


def run_case(case: VerifyCase, group: dist.ProcessGroup | None, options: TSPOptions = TSPOptions(),
             overlap: bool = True) -> dict | None:
    """Collective over `group`. Returns the report on TSP rank 0, None elsewhere."""
    comm = TSPComm(group, overlap=overlap)
    dtype = DTYPES[case.dtype]
    reference = ReferenceCausalLM(case.shape, dtype=dtype)
    init_weights_(reference, case.seed)
    full = full_state_dict(reference)
    del reference

    model = TSPCausalLM(case.shape, comm, options=options, dtype=dtype)
    model.load_full_state_dict(full)
    ids, labels = make_batch(case)
    batch = shard_batch(ids, tsp=comm.size, rank=comm.rank, labels=labels)
    loss_share = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
    loss_share.backward()
    loss = model.loss_for_logging(loss_share)
    grads = model.full_state_dict(grads=True)
    if comm.rank != 0:
        return None

    ref_loss, ref_grads = reference_loss_and_grads(case, full)
    grad_errs = {name: _rel_err(grads[name], g) for name, g in ref_grads.items()}
    worst = max(grad_errs, key=grad_errs.get)
    report = {
        "loss_rel_err": _rel_err(loss, ref_loss),
        "grad_rel_err": grad_errs[worst],
        "worst_grad": worst,
        "tsp": comm.size,
        "dtype": case.dtype,
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "tolerance": case.tolerance,
    }
    report["ok"] = report["loss_rel_err"] <= case.tolerance and report["grad_rel_err"] <= case.tolerance
    return report


def run_case_on_world(case: VerifyCase, options: TSPOptions = TSPOptions(), overlap: bool = True) -> dict | None:
    """Entry for an already-initialised default group (torchrun) or a spawned one: the whole world is one TSP group."""
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return run_case(case, group, options, overlap)


def case_to_dict(case: VerifyCase) -> dict:
    return asdict(case)
