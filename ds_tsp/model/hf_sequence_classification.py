"""`TSPForSequenceClassification`: a transformers ...ForSequenceClassification checkpoint (a reward model's form) under
TSP, with transformers' face.

    model = TSPForSequenceClassification.from_pretrained("path/to/reward-model", tsp_group=group)  # its slices
    out = model(input_ids=ids, attention_mask=mask, labels=scores)       # the FULL batch, on every rank
    out.logits                                                           # [batch, num_labels], every rank
    model.save_pretrained("out/")                                        # ...ForSequenceClassification, streamed

Each row is scored at its last non-padding token (transformers' rule: the rightmost token that is not
config.pad_token_id; ds_tsp.model.sequence_classifier), whichever TSP rank holds it. The loss is transformers' own
ForSequenceClassificationLoss on those logits (regression, single- or multi-label by config.problem_type), the same
value on every rank; its backward gives each rank its share of the gradients.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.hf_config import import_transformers
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.hf_causal_lm import _HARMLESS_KWARGS, TSPForCausalLM, as_comm
from ds_tsp.model.sequence_classifier import ShardedSequenceClassifier

__all__ = ["TSPForSequenceClassification"]


class TSPForSequenceClassification(TSPForCausalLM):
    """The TSP sequence classifier with the face of transformers' ...ForSequenceClassification: from_pretrained
    reads this rank's slices (and the replicated score head), the call takes the full batch by keyword and returns
    SequenceClassifierOutputWithPast(loss, logits [batch, num_labels]) on every rank, save_pretrained streams the
    checkpoint transformers' AutoModelForSequenceClassification reloads."""

    def __init__(self, config, tsp_group=None, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device=None, data_group=None):
        nn.Module.__init__(self)
        self.config = config
        self.generation_config_json = None  # a classifier has no generation config
        self.tsp = ShardedSequenceClassifier(ModelShape.from_hf_config(config), as_comm(tsp_group),
                                             num_labels=config.num_labels, pad_token_id=config.pad_token_id,
                                             options=options, dtype=dtype, device=device, data_group=data_group)

    def forward(self, input_ids: torch.Tensor | None = None, *args, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                margin: torch.Tensor | None = None, **kwargs):
        """transformers' sequence-classification call on the full batch; labels as transformers takes them
        (float scores for regression, class ids, or multi-hot floats). margin: TRL's RewardTrainer passes its batch
        whole, preference margins included (its loss reads them; transformers' model ignores them): unused here.
        Rows are pooled at config.pad_token_id as it is at the call (RewardTrainer sets it from the tokenizer
        after the model is built)."""
        del margin
        if args:
            raise TSPConfigError("TSPForSequenceClassification.forward takes input_ids positionally and everything "
                                 "else by keyword (attention_mask=, position_ids=, labels=)")
        for key, value in kwargs.items():
            if key not in _HARMLESS_KWARGS or not any(value is v or value == v for v in _HARMLESS_KWARGS[key]):
                raise TSPConfigError(f"{key}={value!r} is not supported by TSPForSequenceClassification.forward; "
                                     "accepted: input_ids, attention_mask, position_ids, labels, margin")
        if input_ids is None or input_ids.dim() != 2:
            raise TSPConfigError("input_ids [batch, seq] is required (inputs_embeds is not supported: the embedding "
                                 "is sharded)")
        comm = self.tsp.comm
        local = shard_batch(input_ids, tsp=comm.size, rank=comm.rank, position_ids=position_ids,
                            attention_mask=attention_mask, check_values=False, cp=comm.cp_size, cp_rank=comm.cp_rank)
        h, _ = self.tsp.final_hidden(local["input_ids"], local["position_ids"], local.get("attention_mask"))
        logits = self.tsp.pooled_logits(h, local["input_ids"], local["seq_len"],
                                        pad_token_id=self.config.pad_token_id)
        loss = None
        if labels is not None:
            from transformers.loss.loss_utils import ForSequenceClassificationLoss

            loss = ForSequenceClassificationLoss(labels=labels, pooled_logits=logits, config=self.config)
        outputs = import_transformers().modeling_outputs
        return outputs.SequenceClassifierOutputWithPast(loss=loss, logits=logits)

    def save_pretrained(self, save_directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, **kwargs) -> Path | None:
        """Collective: the ...ForSequenceClassification checkpoint (backbone shards gathered one module at a time,
        score.weight) that transformers' AutoModelForSequenceClassification loads."""
        from ds_tsp.checkpoint.hf.save import save_streaming

        if {k: v for k, v in kwargs.items() if not (k == "safe_serialization" and v) and k != "is_main_process"}:
            raise TSPConfigError(f"save_pretrained: {', '.join(kwargs)} not supported (ds_tsp always writes "
                                 "safetensors; the writer is global rank 0)")
        dtype = dtype or self.dtype
        config = copy.deepcopy(self.config)
        names = import_transformers().models.auto.modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
        config.architectures = [names[config.model_type]]
        config.dtype = dtype
        return save_streaming(self.tsp, save_directory, config.to_json_string(use_diff=False),
                              max_shard_size=max_shard_size, dtype=dtype)

    def extra_repr(self) -> str:
        return f"model_type={self.config.model_type}, num_labels={self.config.num_labels}, tsp={self.tsp.comm.size}"
