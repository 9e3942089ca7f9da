"""Numerics self-check with a context-parallel axis: C TSP groups of D ranks share each sequence (tsp.cp_size).

The same check as ds_tsp.tools.verify (same cases, batches, reference and tolerances), on a world of C x D ranks
laid out by ds_tsp.core.setup.build_runtime from {"size": D, "cp_size": C}. After backward every parameter's
gradient is averaged over the data group (data x cp), what the data-parallel engine (DeepSpeed, FSDP2, DDP) does
in training, so the check covers the cp reduction and the loss denominator as well as the cp ring.
With case.hf_model (`ds-tsp verify --hf-model DIR --tsp D --cp C`) the model is that checkpoint loaded by slices
and the reference is transformers' own model (ds_tsp.tools.verify.hf_reference_loss_and_grads); a mixture-of-experts
checkpoint's aux loss (over the whole sequence, cp x TSP) is checked too, as ds-tsp verify does under TSP alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.data_grads import average_grads_over_group
from ds_tsp.core.launch import local_device
from ds_tsp.core.partition import shard_batch
from ds_tsp.core.setup import build_runtime
from ds_tsp.model.sharded_causal_lm import ShardedCausalLM
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_
from ds_tsp.tools.verify import (
    DTYPES,
    VerifyCase,
    _aux_loss,
    _rel_err,
    hf_reference_loss_and_grads,
    make_batch,
    reference_loss_and_grads,
)


def average_grads_over_data(model: torch.nn.Module, data_group: dist.ProcessGroup | None) -> None:
    """What a data-parallel engine does to the grads of one step: the mean over the data group (here data x cp).
    model: a ShardedCausalLM (its comm bounds the all-reduce)."""
    average_grads_over_group(model.parameters(), data_group, model.comm)


def run_cp_case(case: VerifyCase, tsp: int, cp: int, options: dict | None = None) -> dict | None:
    """Collective over the initialised world (C x D ranks, or a multiple: more data replicas of the same batch).
    Returns the report on global rank 0, None elsewhere."""
    runtime = build_runtime(parse_tsp_config({"size": tsp, "cp_size": cp, **(options or {})}))
    groups, comm = runtime.groups, runtime.comm
    dtype = DTYPES[case.dtype]
    device = local_device()
    ids, labels, positions = (t.to(device) for t in make_batch(case))
    batch = shard_batch(ids, tsp=tsp, rank=groups.tsp_rank if groups else 0, labels=labels, position_ids=positions,
                        cp=cp, cp_rank=groups.cp_rank if groups else 0)
    if case.hf_model is not None:
        from ds_tsp.model.hf_causal_lm import TSPForCausalLM

        model = TSPForCausalLM.from_pretrained(case.hf_model, comm, dtype=dtype, options=runtime.options,
                                               device=device, data_group=runtime.data_group).tsp
    else:
        reference = ReferenceCausalLM(case.shape, dtype=dtype)
        init_weights_(reference, case.seed)
        full = full_state_dict(reference)
        del reference
        model = ShardedCausalLM(case.shape, comm, options=runtime.options, dtype=dtype, device=device,
                                data_group=runtime.data_group)
        model.load_full_state_dict(full)
    loss_share = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"], seq_len=case.seq)
    loss_share.backward()
    average_grads_over_data(model, runtime.data_group)
    aux = _aux_loss(model, batch, case.seq)
    loss = model.loss_for_logging(loss_share).cpu()
    grads = {name: g.cpu() for name, g in model.full_state_dict(grads=True).items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    ref_aux = {}
    ref_loss, ref_grads = (hf_reference_loss_and_grads(case, ref_aux) if case.hf_model is not None
                           else reference_loss_and_grads(case, full))
    grad_errs = {name: _rel_err(grads[name], g) for name, g in ref_grads.items()}
    worst = max(grad_errs, key=grad_errs.get)
    report = {"loss_rel_err": _rel_err(loss, ref_loss), "grad_rel_err": grad_errs[worst], "worst_grad": worst,
              "tsp": tsp, "cp": cp, "dtype": case.dtype, "loss": float(loss), "ref_loss": float(ref_loss),
              "tolerance": case.tolerance, "documents": case.documents,
              "reference": "transformers" if case.hf_model is not None else "ds_tsp"}
    if aux is not None:
        report.update(aux_loss=float(aux), ref_aux_loss=float(ref_aux["aux_loss"]),
                      aux_rel_err=_rel_err(aux, ref_aux["aux_loss"]))
    report["ok"] = (report["loss_rel_err"] <= case.tolerance and report["grad_rel_err"] <= case.tolerance
                    and report.get("aux_rel_err", 0.0) <= case.tolerance)
    return report


def run_cp_cases(cases: list[VerifyCase], tsp: int, cp: int, options: dict | None = None) -> list:
    """run_cp_case for each case, in one process group (entry for run_on_local_ranks)."""
    return [run_cp_case(case, tsp, cp, options) for case in cases]
