"""The TSP sequence classifier (transformers' ...ForSequenceClassification, the reward model's form): the causal
LM's sharded backbone with a score head on the last non-padding token of each row.

| parameter                     | shape              | sharding                                  |
|-------------------------------|--------------------|-------------------------------------------|
| model.* (backbone)            | as ShardedCausalLM | as ShardedCausalLM (no lm_head)            |
| score.weight                  | [num_labels, h]    | replicated, grads summed over the group   |

transformers pools the row's rightmost token that is not config.pad_token_id (left or right padding alike; the
last token when pad_token_id is None). That token lives on one TSP rank, wherever its zigzag chunk falls: every rank
finds its candidates among its own tokens, one all-gather of [B] indices gives the row's last one, its owner
scores it, and the scores are summed over the group (value: the row's score on every rank; gradient: the owner's
token only). The zigzag padding tail (shard_batch's) is never a candidate.
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import zigzag_positions
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.loss import tsp_group_loss

__all__ = ["ShardedSequenceClassifier"]


class ShardedSequenceClassifier(ShardedCausalLM):
    """ShardedCausalLM's backbone (no LM head) and a replicated score head [num_labels, h]."""

    def __init__(self, shape: ModelShape, comm: TSPComm, num_labels: int, pad_token_id: int | None, **kwargs):
        if not isinstance(num_labels, int) or num_labels < 1:
            raise TSPConfigError(f"num_labels={num_labels!r}: a sequence classifier needs at least one label")
        super().__init__(shape, comm, lm_head=False, **kwargs)
        self.num_labels, self.pad_token_id = num_labels, pad_token_id
        norm = self.model.norm.weight
        self.score = nn.Parameter(torch.empty(num_labels, shape.hidden_size, dtype=norm.dtype, device=norm.device))

    def replicated_params(self) -> dict[str, nn.Parameter]:
        return {**super().replicated_params(), "score.weight": self.score}

    def pooled_logits(self, h: torch.Tensor, input_ids: torch.Tensor, seq_len: int,
                      pad_token_id: int | None | str = "built") -> torch.Tensor:
        """[B, num_labels] on every rank: the score of each row's last non-padding token (collective).
        h: final_hidden's output [B, L, hidden]; input_ids: this rank's shard [B, L]; seq_len: the unpadded length;
        pad_token_id: the id pooling skips (default: the one this classifier was built with)."""
        pad_token_id = self.pad_token_id if pad_token_id == "built" else pad_token_id
        if self.comm.cp is not None:
            raise TSPConfigError(f"sequence classification with tsp.cp_size={self.comm.cp.size}: the pooled token "
                                 "may sit in another cp group; use cp_size 1")
        B, L = input_ids.shape
        comm = self.comm
        index = zigzag_positions(L * comm.size, comm.size, comm.rank, device=input_ids.device)  # global, local order
        real = index < seq_len  # shard_batch's zigzag padding is never pooled
        if pad_token_id is None:
            if B != 1:
                raise TSPConfigError("pad_token_id is None with a batch of more than one row: set the config's "
                                     "pad_token_id (transformers refuses this too)")
            candidate = torch.where(real, index, torch.zeros_like(index))[None]
            last = torch.full((B,), seq_len - 1, dtype=index.dtype, device=index.device)
        else:
            candidate = torch.where(real & (input_ids != pad_token_id), index, torch.zeros_like(index))
            last = candidate.max(dim=1).values  # [B]: this rank's rightmost candidate (0 when it has none)
            if comm.size > 1:
                everyone = torch.empty((comm.size, B), dtype=last.dtype, device=last.device)
                comm.all_gather(everyone, last.contiguous(), what="last non-padding token").wait()
                last = everyone.max(dim=0).values
        mine = (index[None, :] == last[:, None]).to(h.dtype)  # [B, L]: one-hot where this rank holds the token
        pooled = torch.einsum("bl,blh->bh", mine, h)
        local = pooled @ replicated_param(self.score, comm).t()
        return tsp_group_loss(local, comm)  # value summed over the group (one owner per row), gradient local
