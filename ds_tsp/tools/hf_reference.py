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
* Gemma 4's RMSNorm (w-scaled, or without a weight: v_norm) does `.float()` too: patched the same way.
* Qwen3.5 / Qwen3-Next: their zero-centred RMSNorm (`x_hat * (1 + w)`, attribute `eps`) does `.float()` too:
  patched the same way (float64 kept, other dtypes unchanged). Their rotary embedding is mrope: the patch keeps
  transformers' three-row recomposition (`recomposition_frequencies`) and only forms the angles in float64. Their
  Gated DeltaNet layers (delta rule, gate, gated norm) get ds_tsp.tools.gdn_reference.float64_gated_deltanet_.
* The loss: `loss_function` upcasts logits with `.float()`, i.e. DOWNcasts float64. `hf_loss_and_grads`
  computes the token cross entropy itself, in the logits' dtype.
* Mixture of experts (Qwen3-MoE, Mixtral): `load_balancing_loss_func` accumulates in float32. With
  output_router_logits the aux loss is transformers' formula over the router logits transformers returns, for a
  float64 model accumulated in float64 (`load_balancing_loss`), else transformers' own function. The routers' float32
  softmax is left as it is: ds_tsp routes with the same float32 probabilities (ds_tsp.core.layers.moe.routing).
* GLM-4.5's router (`*TopkRouter` with e_score_correction_bias) keeps its weight and bias in float32 and computes
  its logits, scores and weights in float32, whose weight gradient sums tokens in float32: the patch holds both
  in float64 and routes float64 inputs in float64, transformers' same ops (ds_tsp routes a float64 model alike).
  transformers adds no load-balancing loss for it, so neither does the reference.

Attention must not be "eager" (its softmax uses dtype=float32): the model is loaded with attn_implementation
"sdpa", which computes in the input dtype. GPT-OSS has no sdpa path (its attention sinks) and its eager attention
softmaxes in the input dtype: it loads eager (EAGER_IN_DTYPE), and its rotary embedding (cos / sin of half the head
dim) gets the float64 angles too. Every forward passes use_cache=False: transformers only applies its
packed-sequence masking (position_ids restarting at 0 per document) when attention_mask is None and no cache is
used; with `documents=` the reference does not rely on it and runs each document as its own sequence, except
for a rope whose frequencies follow the batch's longest position (longrope): there each document alone would pick
its own factors, so the packed rows run through that packed path (what transformers computes on the packed batch).
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


def _scaled_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers' Gemma4RMSNorm.forward (x_hat, times the weight when with_scale, in the compute dtype, cast
    # after), with float64 kept in float64
    wide = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    x = hidden_states.to(wide)
    x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon, -0.5)
    if self.with_scale:
        x = x * self.weight.to(wide)
    return x.type_as(hidden_states)


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    # transformers' LlamaRotaryEmbedding.forward with float64 angles for float64 inputs; same inv_freq values
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = position_ids[..., None].to(wide) * self.inv_freq.to(device=x.device, dtype=wide)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _half_rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    # transformers' GptOssRotaryEmbedding.forward (cos / sin of head_dim / 2: its rotation takes the two halves) with
    # float64 angles for float64 inputs
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = position_ids[..., None].to(wide) * self.inv_freq.to(device=x.device, dtype=wide)
    return (freqs.cos() * self.attention_scaling).to(dtype=x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)


def _layered_rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
    # transformers' Gemma3RotaryEmbedding.forward (one inv_freq per layer type) with float64 angles for float64 inputs
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = getattr(self, f"{layer_type}_inv_freq")
    freqs = position_ids[..., None].to(wide) * inv_freq.to(device=x.device, dtype=wide)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(self, f"{layer_type}_attention_scaling")
    return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


def _zero_centred_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    # transformers' Qwen3_5RMSNorm.forward ((1 + w), computed wide, cast after), float64 kept in float64
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.to(wide)
    output = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
    return (output * (1.0 + self.weight.to(wide))).type_as(x)


def _mrope_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    # transformers' Qwen3_5TextRotaryEmbedding.forward with float64 angles for float64 inputs
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].to(wide) * self.inv_freq.to(device=x.device, dtype=wide)
    cos = self.recomposition_frequencies(freqs.cos() * self.attention_scaling)
    sin = self.recomposition_frequencies(freqs.sin() * self.attention_scaling)
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _grouped_router_forward(self, hidden_states: torch.Tensor):
    # transformers' Glm4MoeTopkRouter.forward in float64 for float64 inputs (float32 otherwise, as the original)
    wide = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(wide), self.weight.to(wide))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias.to(wide)
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def patch_float64_(model: torch.nn.Module) -> int:
    """Patch every RMSNorm and rotary embedding of `model` (per instance) to compute float64 inputs in float64.

    Returns the number of modules patched. Idempotent. Raises if a module looks like one of these but does not
    have the Llama-style attributes the patch relies on, or if the model uses eager attention.
    """
    from transformers.modeling_rope_utils import dynamic_rope_update

    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn == "eager" and getattr(config, "model_type", None) not in EAGER_IN_DTYPE:
        raise ValueError("eager attention softmaxes in float32: load the model with attn_implementation='sdpa'")
    rotary = dynamic_rope_update(_rotary_forward)
    half_rotary = dynamic_rope_update(_half_rotary_forward)
    mrope = dynamic_rope_update(_mrope_forward)
    patched = 0
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("RMSNorm") and hasattr(module, "eps") and not hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_zero_centred_rmsnorm_forward, module)  # Qwen3.5 / Qwen3-Next
        elif cls.endswith("GatedDeltaNet"):  # its delta rule, gate and gated norm (ds_tsp.tools.gdn_reference)
            from ds_tsp.tools.gdn_reference import float64_gated_deltanet_

            float64_gated_deltanet_(module)
        elif cls.endswith("RMSNormGated"):
            continue  # patched with its Gated DeltaNet just above
        elif cls.endswith("TopkRouter") and hasattr(module, "e_score_correction_bias"):  # GLM-4.5
            with torch.no_grad():
                module.weight.data = module.weight.data.to(torch.float64)
                module.e_score_correction_bias = module.e_score_correction_bias.to(torch.float64)
            module.forward = types.MethodType(_grouped_router_forward, module)
        elif cls.endswith("VisionRotaryEmbedding"):
            continue  # a vision tower's 2-D rope: transformers' float32 tables, which TSP runs through the same module
        elif cls.endswith("RotaryEmbedding") and hasattr(module, "mrope_section"):
            module.forward = types.MethodType(mrope, module)
        elif cls.endswith("RMSNorm") and hasattr(module, "with_scale"):
            module.forward = types.MethodType(_scaled_rmsnorm_forward, module)  # Gemma 4 (v_norm has no weight)
        elif cls.endswith("RMSNorm"):
            if not (hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor)):
                raise NotImplementedError(f"{name}: {cls} is not a Llama-style RMSNorm (weight, variance_epsilon)")
            module.forward = types.MethodType(_rmsnorm_forward, module)
        elif cls == "GptOssRotaryEmbedding":
            module.forward = types.MethodType(half_rotary, module)
        elif cls.endswith("RotaryEmbedding") and hasattr(module, "layer_types") and not hasattr(module, "inv_freq"):
            module.forward = types.MethodType(_layered_rotary_forward, module)  # Gemma 3: a rope per layer type
        elif cls.endswith("RotaryEmbedding"):
            if not (hasattr(module, "inv_freq") and hasattr(module, "attention_scaling")):
                raise NotImplementedError(f"{name}: {cls} is not a Llama-style rotary embedding")
            module.forward = types.MethodType(rotary, module)
        else:
            continue
        patched += 1
    return patched


# families whose eager attention softmaxes in the input dtype and that have no sdpa path (GPT-OSS: its sinks)
EAGER_IN_DTYPE = ("gpt_oss",)


def reference_attention(model_type: str) -> str:
    """The attn_implementation the reference loads a family with: sdpa, or eager where that is exact (above)."""
    return "eager" if model_type in EAGER_IN_DTYPE else "sdpa"


def load_hf_reference(directory, dtype: torch.dtype, image_text: bool = False):
    """`AutoModelForCausalLM.from_pretrained(directory)` (AutoModelForImageTextToText for a multimodal checkpoint it
    does not list, or for any with image_text=True: the vision tower too) in `dtype` with sdpa attention (GPT-OSS:
    eager, reference_attention) and the eager expert loop for MoE; float64 gets the patches."""
    try:
        import transformers
    except ImportError as exc:  # an optional dependency
        raise ImportError("the transformers reference needs transformers: pip install 'ds_tsp[hf]'") from exc
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    # MoE experts: transformers' per-expert loop ("eager"); its default grouped GEMM has no float64 kernel
    text = getattr(config, "text_config", None)  # a multimodal config keeps its experts there
    moe = ({"experts_implementation": "eager"} if getattr(config, "num_experts_per_tok", None)
           or getattr(text, "num_experts_per_tok", None) else {})
    # a multimodal checkpoint whose ForConditionalGeneration AutoModelForCausalLM does not list (Mistral 3)
    auto = (transformers.AutoModelForCausalLM if type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
            and not image_text else transformers.AutoModelForImageTextToText)
    model = auto.from_pretrained(directory, dtype=dtype, attn_implementation=reference_attention(config.model_type),
                                 local_files_only=True, **moe)
    if dtype == torch.float64:
        patch_float64_(model)
    return model


def _forward_logits(model, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 use_cache=False).logits


def _wants_aux(model) -> bool:
    """Whether transformers' forward adds the load-balancing loss (its family has one: not GLM-4.5)."""
    import sys

    config = model.config
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: its transformers one
    has_aux = hasattr(sys.modules[type(base).__module__], "load_balancing_loss_func")
    return has_aux and bool(getattr(config, "output_router_logits", False)) and bool(
        getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))


def load_balancing_loss(model, gate_logits: Sequence[torch.Tensor], attention_mask=None) -> torch.Tensor:
    """transformers' load_balancing_loss_func of `model`'s family over the sparse layers' router logits (and the
    flat [tokens] mask); for float64 logits the same formula accumulated in float64 instead of float32."""
    import sys

    config = model.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    top_k = config.num_experts_per_tok
    if gate_logits[0].dtype != torch.float64:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        own = sys.modules[type(base).__module__].load_balancing_loss_func
        return own(tuple(gate_logits), experts, top_k, attention_mask)
    counts = torch.zeros(experts, dtype=torch.float64)
    prob_sum = torch.zeros(experts, dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.float64)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(torch.float64)
    for logits in gate_logits:
        probs = torch.softmax(logits, dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices
        weight = torch.ones(logits.shape[0], dtype=torch.float64) if mask is None else mask
        counts = counts.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return experts * torch.sum((counts / rows) * (prob_sum / rows))


def hf_logits(model, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
    """Logits [B, S, V] in the model's dtype (no grad, use_cache=False)."""
    with torch.no_grad():
        return _forward_logits(model, input_ids, position_ids, attention_mask)


def _rope_switches_with_length(model) -> bool:
    rope = getattr(model.config, "rope_parameters", None) or {}
    return rope.get("rope_type") == "longrope"


def hf_loss_and_grads(model, input_ids: torch.Tensor, shift_labels: torch.Tensor, position_ids=None,
                      attention_mask=None, documents: Sequence[Sequence[int]] | None = None,
                      aux_out: dict | None = None, loss_scale: float = 1.0):
    """Token-mean cross entropy over shift_labels != -100 (shift_labels[b, t] is the target of position t) and
    the gradient of every parameter, HF-named (a tied lm_head.weight is reported too: the embedding's grad).

    `documents`: per batch row, the document lengths (summing to the row length). Each document then runs as a
    separate sequence (positions 0..n-1, its slice of shift_labels); token losses are summed over all documents
    and divided once by the total count. `attention_mask` (padding) is passed to the model; padded positions
    must have shift_labels -100. Returns (loss, grads) in the model's dtype; loss is 0 if nothing is counted.

    A mixture-of-experts model whose config sets output_router_logits: loss includes router_aux_loss_coef x the
    load-balancing loss of ALL the tokens (every document's router logits together, as one unpacked batch would
    give), and aux_out (a dict, when given) receives it as "aux_loss".

    `loss_scale` = n: the gradients of n x loss, divided by n, as a data-parallel engine of n replicas computes them
    (each replica's loss scaled by n, the gradients averaged). Equal in math; in rounding too except where the model
    computes in float32 inside a float64 model: the MoE routers' float32 softmax rounds n x its gradient, which for
    n not a power of two moves the routers' gradients (and what flows back through them) by ~1e-8 relative.
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
        pieces, packed = [], []
        for b, row in enumerate(documents):
            if sum(row) != seq or min(row, default=0) < 1:
                raise ValueError(f"documents[{b}] = {list(row)} must be positive lengths summing to {seq}")
            start = 0
            for n in row:
                pos = torch.arange(n, device=input_ids.device)[None]
                pieces.append((input_ids[b:b + 1, start:start + n], shift_labels[b:b + 1, start:start + n], pos,
                               None))
                start += n
            packed.append(torch.cat([torch.arange(n, device=input_ids.device) for n in row]))
        if _rope_switches_with_length(model):
            pieces = [(input_ids, shift_labels, torch.stack(packed), None)]
    count = (shift_labels != -100).sum().clamp_min(1)
    model.zero_grad(set_to_none=True)
    total = ce = None
    aux = _wants_aux(model)
    router, masks = [], []  # per piece: the sparse layers' router logits, its flat token mask
    with torch.enable_grad():
        for ids, labels, pos, mask in pieces:
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False,
                        **({"output_router_logits": True} if aux else {}))
            valid = labels != -100
            piece = F.cross_entropy(out.logits[valid], labels[valid], reduction="sum")  # in the logits' dtype
            if aux:  # one backward at the end: the aux loss couples every piece
                router.append(out.router_logits)
                masks.append(torch.ones(ids.numel(), dtype=torch.long) if mask is None else mask.reshape(-1))
                ce = piece / count if ce is None else ce + piece / count
            else:
                (piece * loss_scale / count).backward()
            total = piece.detach() if total is None else total + piece.detach()
    loss = total / count
    if aux:
        with torch.enable_grad():
            layers = [torch.cat(per_layer) for per_layer in zip(*router)]  # every piece's tokens, layer by layer
            has_mask = any(m is not None for *_, m in pieces)
            aux_loss = load_balancing_loss(model, layers, torch.cat(masks) if has_mask else None)
            ((ce + model.config.router_aux_loss_coef * aux_loss) * loss_scale).backward()
        loss = loss + model.config.router_aux_loss_coef * aux_loss.detach()
        if aux_out is not None:
            aux_out["aux_loss"] = aux_loss.detach()
    grads = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # tied: both names, one Parameter
        grads[name] = torch.zeros_like(param) if param.grad is None else param.grad.detach() / loss_scale
    return loss, grads
