"""transformers' own model as the reference for ds_tsp: loss, parameter gradients and logits.

`load_hf_reference(dir, dtype)` loads the checkpoint with `AutoModelForCausalLM` (Llama, Mistral, Qwen2, Qwen3, ...).
In float64 a correct TSP model agrees with it to ~1e-14, but only if transformers really computes in float64;
it narrows to float32 in three places, which `patch_float64_` fixes on the INSTANCES of one loaded model (nothing
global changes; other models, and float32/bfloat16 inputs, keep transformers' exact code path):

* `*RMSNorm.forward` (every decoder norm, the final norm, Qwen3's per-head q_norm/k_norm) does
  `hidden_states.to(torch.float32)` before the variance: the patch keeps float64 inputs in float64.
* `*RotaryEmbedding.forward` computes the angles `position * inv_freq` in float32 (an angle of ~100 rad keeps
  only ~1e-5 absolute precision): the patch multiplies in float64. It keeps the module's own `inv_freq` buffer
  (computed in float32 by the rope-type init: default, linear, llama3, yarn, ...) and its `attention_scaling`, so
  the reference rope is transformers' rope; only the product is exact. Dynamic rope types keep their frequency
  update (the patched forward is wrapped in transformers' `dynamic_rope_update`).
* The loss: `loss_function` upcasts logits with `.float()`, i.e. DOWNcasts float64. `hf_loss_and_grads`
  computes the token cross entropy itself, in the logits' dtype.

Attention must not be "eager" (its softmax uses dtype=float32): the model is loaded with attn_implementation
"sdpa", which computes in the input dtype. Every forward passes use_cache=False: transformers only applies its
packed-sequence masking (position_ids restarting at 0 per document) when attention_mask is None and no cache is
used; with `documents=` the reference does not rely on it and runs each document as its own sequence.
Configs of these families have no dropout, so train/eval mode does not matter (from_pretrained returns eval).
"""
from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers' LlamaRMSNorm.forward, with float64 kept in float64 (other dtypes: identical to the original)
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float64 if input_dtype == torch.float64 else torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(input_dtype)


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    # transformers' LlamaRotaryEmbedding.forward with float64 angles for float64 inputs; same inv_freq values
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = position_ids[..., None].to(wide) * self.inv_freq.to(device=x.device, dtype=wide)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def patch_float64_(model: torch.nn.Module) -> int:
    """Patch every RMSNorm and rotary embedding of `model` (per instance) to compute float64 inputs in float64.

    Returns the number of modules patched. Idempotent. Raises if a module looks like one of these but does not
    have the Llama-style attributes the patch relies on, or if the model uses eager attention.
    """
    from transformers.modeling_rope_utils import dynamic_rope_update

    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn == "eager":
        raise ValueError("eager attention softmaxes in float32: load the model with attn_implementation='sdpa'")
    rotary = dynamic_rope_update(_rotary_forward)
    patched = 0
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("RMSNorm"):
            if not (hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor)):
                raise NotImplementedError(f"{name}: {cls} is not a Llama-style RMSNorm (weight, variance_epsilon)")
            module.forward = types.MethodType(_rmsnorm_forward, module)
        elif cls.endswith("RotaryEmbedding"):
            if not (hasattr(module, "inv_freq") and hasattr(module, "attention_scaling")):
                raise NotImplementedError(f"{name}: {cls} is not a Llama-style rotary embedding")
            module.forward = types.MethodType(rotary, module)
        else:
            continue
        patched += 1
    return patched


def load_hf_reference(directory, dtype: torch.dtype):
    """`AutoModelForCausalLM.from_pretrained(directory)` in `dtype` with sdpa attention; float64 gets the patches."""
    try:
        import transformers
    except ImportError as exc:  # an optional dependency
        raise ImportError("the transformers reference needs transformers: pip install 'ds_tsp[hf]'") from exc
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    if dtype == torch.float64:
        patch_float64_(model)
    return model


def _forward_logits(model, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 use_cache=False).logits


def hf_logits(model, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
    """Logits [B, S, V] in the model's dtype (no grad, use_cache=False)."""
    with torch.no_grad():
        return _forward_logits(model, input_ids, position_ids, attention_mask)


def hf_loss_and_grads(model, input_ids: torch.Tensor, shift_labels: torch.Tensor, position_ids=None,
                      attention_mask=None, documents: Sequence[Sequence[int]] | None = None):
    """Token-mean cross entropy over shift_labels != -100 (shift_labels[b, t] is the target of position t) and
    the gradient of every parameter, HF-named (a tied lm_head.weight is reported too: the embedding's grad).

    `documents`: per batch row, the document lengths (summing to the row length). Each document then runs as a
    separate sequence (positions 0..n-1, its slice of shift_labels); token losses are summed over all documents
    and divided once by the total count. `attention_mask` (padding) is passed to the model; padded positions
    must have shift_labels -100. Returns (loss, grads) in the model's dtype; loss is 0 if nothing is counted.
    """
    if shift_labels.shape != input_ids.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and shift_labels {tuple(shift_labels.shape)} "
                         "must both be [B, S]")
    if attention_mask is not None and bool((shift_labels[attention_mask == 0] != -100).any()):
        raise ValueError("padded positions (attention_mask 0) must have shift_labels -100")
    batch, seq = input_ids.shape
    if documents is None:
        pieces = [(input_ids, shift_labels, position_ids, attention_mask)]
    else:
        if position_ids is not None or attention_mask is not None:
            raise ValueError("documents= sets the positions itself and does not take attention_mask")
        if len(documents) != batch:
            raise ValueError(f"documents has {len(documents)} rows for a batch of {batch}")
        pieces = []
        for b, row in enumerate(documents):
            if sum(row) != seq or min(row, default=0) < 1:
                raise ValueError(f"documents[{b}] = {list(row)} must be positive lengths summing to {seq}")
            start = 0
            for n in row:
                pos = torch.arange(n, device=input_ids.device)[None]
                pieces.append((input_ids[b:b + 1, start:start + n], shift_labels[b:b + 1, start:start + n], pos,
                               None))
                start += n
    count = (shift_labels != -100).sum().clamp_min(1)
    model.zero_grad(set_to_none=True)
    total = None
    with torch.enable_grad():
        for ids, labels, pos, mask in pieces:
            logits = _forward_logits(model, ids, pos, mask)
            valid = labels != -100
            piece = F.cross_entropy(logits[valid], labels[valid], reduction="sum")  # in the logits' dtype
            (piece / count).backward()
            total = piece.detach() if total is None else total + piece.detach()
    loss = total / count
    grads = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied: both names, one Parameter
        grads[name] = torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()
    return loss, grads
