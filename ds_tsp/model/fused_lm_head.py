"""TRL's fused LM head call, answered through TSP's streaming head: the one adapter between TSPForCausalLM and TRL.

TRL's trainers replace a model's forward by a fused head (trl.trainer.utils.add_fused_lm_head) that reads the full
lm_head weight: under TSP that weight is a vocab shard, so ds_tsp.integrations.trl leaves the forward alone and TRL
calls it with fused_lm_head=True (and, from GRPO, its sampling temperature). Those two keywords are popped here from
the model call and answered with the fields of TRL's FusedCausalLMOutput, per token of the whole sequence, without a
[tokens, vocab] logits tensor or a full LM-head weight on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_tsp.core.errors import TSPConfigError

__all__ = ["FusedLMHeadCall", "FusedLMHeadOutput"]


@dataclass
class FusedLMHeadOutput:
    """forward(fused_lm_head=True)'s answer: the fields of TRL's FusedCausalLMOutput (per-token, [B, seq_len], zero
    where the label is -100); log_sum_sq_probs and mean_logits only when the model was given them as fused-head
    outputs (TSPForCausalLM.fused_lm_head_outputs, what TRL's add_fused_lm_head(outputs=...) asks for), else None;
    aux_loss is None."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def __getitem__(self, key: str):  # outputs["loss"], as the Trainer reads a ModelOutput
        return getattr(self, key)


@dataclass(frozen=True)
class FusedLMHeadCall:
    """TRL's options of one model call: fused_lm_head=True, and the statistics of logits / temperature."""

    temperature: float = 1.0
    logit_stats: bool = False  # also mean_logits and log_sum_sq_probs (TRL's DPO metrics and WPO weights)

    @classmethod
    def pop_from(cls, kwargs: dict) -> "FusedLMHeadCall | None":
        """The call's TRL options, removed from `kwargs`; None when it is a plain causal-LM call."""
        fused, temperature = kwargs.pop("fused_lm_head", False), kwargs.pop("temperature", 1.0)
        if temperature != 1.0 and (not fused or not isinstance(temperature, (int, float)) or temperature <= 0):
            raise TSPConfigError(f"temperature={temperature!r}: only with fused_lm_head=True, a number > 0 (the "
                                 "per-token statistics of logits / temperature)")
        return cls(temperature) if fused else None

    def check(self, has_targets: bool, logits_to_keep: int) -> None:
        if not has_targets or logits_to_keep:
            raise TSPConfigError("fused_lm_head=True scores the labels without building logits: pass labels / "
                                 "shift_labels, and no logits_to_keep")

    def answer(self, model, h: torch.Tensor, batch: dict, seq_len: int, num_items_in_batch,
               aux_share: torch.Tensor | None) -> FusedLMHeadOutput:
        """model: the ShardedCausalLM; h its final hidden states of this rank's tokens."""
        if aux_share is not None:
            raise TSPConfigError("fused_lm_head=True on a mixture-of-experts model with output_router_logits: the "
                                 "fused head's loss has no aux loss term; set output_router_logits=False")
        # logits / T = (h / T) @ W^T: the streaming head scores the scaled hidden states, exactly
        return self._stats(model, h if self.temperature == 1.0 else h / self.temperature, batch, seq_len,
                           num_items_in_batch)

    def _stats(self, model, h, batch: dict, seq_len: int, num_items_in_batch) -> FusedLMHeadOutput:
        """TRL's fused LM head (trl.trainer.utils.add_fused_lm_head's output fields) through TSP's streaming head:
        per-token log_probs / entropy / is_top1 / label_mask of the whole sequence [B, seq_len] (pre-shifted label
        order), identical on every TSP rank, never a [tokens, vocab] logits tensor nor a full LM-head weight.
        A loss computed from log_probs (e.g. -log_probs.sum() / num_items) has the group's value on every rank and
        back-propagates only this rank's share (each rank keeps its tokens' slice of the gradient). Only log_probs
        carries a gradient; entropy and is_top1 are metrics."""
        from ds_tsp.core.layers.vocab import token_stats as token

        labels = batch["shift_labels"]
        if batch["attention_mask"] is not None:
            labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        local = model.lm_head(h, labels, token_stats=True, logit_stats=self.logit_stats)
        stats = token.gather_token_stats(local, model.comm, seq_len)
        log_probs, mask = stats[token.LOG_PROB], stats[token.LABEL_MASK].detach().bool()
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        extra = {"mean_logits": stats[token.MEAN_LOGIT].detach(),
                 "log_sum_sq_probs": stats[token.LOG_SUM_SQ_PROBS].detach()} if self.logit_stats else {}
        return FusedLMHeadOutput(loss=-log_probs.sum() / denominator, log_probs=log_probs,
                                 entropy=stats[token.ENTROPY].detach(), is_top1=stats[token.IS_TOP1].detach().bool(),
                                 label_mask=mask, **extra)
