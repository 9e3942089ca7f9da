"""Activation terms: what one decoder layer and the LM head save for backward, and their loss transients.

The peers (tp, tp_sp, ulysses, fsdp_cp) run Hugging Face Llama modules (as ds_tsp.tools.bench runs them, and as ALST,
DeepSpeed AutoTP and DTensor TP plans do): the counts below are the tensors those modules' autograd graph keeps,
checked against saved-tensor hooks (tests/tools/test_plan.py, bench fixture):
- RMSNorm (HF, as ds_tsp.core.layers.norm): its input in the compute dtype (>= fp32), rsqrt [tokens, 1], the
  normalised input before the weight.
- attention: the q/k/v linears' input (one tensor for the three); RoPE saves only the shared cos/sin; SDPA's
  flash kernel saves q, k, v, the output and its log-sum-exp (fp32); o_proj reads the output in place (the CPU and
  CUDA flash kernels return it [B, S, H, d]-contiguous, so HF's transpose(1, 2).contiguous() copies nothing) --
  except after Ulysses' reverse all-to-all, which makes a new tensor.
- SwiGLU as HF writes it (act(gate(x)) * up(x), not fused): gate/up input once, gate output (SiLU's input), SiLU
  output and up output (the product's inputs), the product (down_proj's input): 4F per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.shape_terms import Dims


def compute_bytes(b: int) -> int:
    """HF's norms and losses compute in at least fp32."""
    return max(b, 4)


def norm_saved(tokens: int, dims: Dims, b: int) -> int:
    """HF's RMSNorm under plain autograd (the peers' modules): input in the compute dtype, rsqrt, and the normalised
    input."""
    cb = compute_bytes(b)
    return tokens * (dims.h * cb + cb + dims.h * b)


def tsp_norm_saved(tokens: int, dims: Dims, b: int) -> int:
    """ds_tsp's fused RMSNorm Function (ds_tsp.core.layers.norm._TSPRMSNorm): its input (dtype) and rstd
    (compute dtype) only; dx and dweight are formed from them in backward."""
    return tokens * (dims.h * b + compute_bytes(b))


@dataclass(frozen=True)
class Placement:
    """Tokens a layout holds in each region of a decoder layer, and how its heads / MLP columns are split.

    norm_tokens: tokens the two norms (and the residual stream) see; linear_in_tokens: tokens of the saved q/k/v
    and gate/up inputs; attn_tokens: tokens attention runs on (with heads / heads_div); mlp_tokens with F / mlp_div.
    kv_heads: kv heads per rank inside attention; o_copy_tokens: tokens of a separate o_proj input (Ulysses)."""

    norm_tokens: int
    linear_in_tokens: int
    attn_tokens: int
    heads_div: int
    kv_heads: int
    mlp_tokens: int
    mlp_div: int
    o_copy_tokens: int = 0


def hf_layer_saved(inp: PlanInput, dims: Dims, at: Placement) -> int:
    """Saved for backward by one HF decoder layer placed as `at` (see the module docstring for the list)."""
    b = inp.dtype_bytes
    nq = dims.nq // at.heads_div
    q, kv = nq * dims.d, at.kv_heads * dims.d
    return (2 * norm_saved(at.norm_tokens, dims, b) + 2 * at.linear_in_tokens * dims.h * b
            + at.attn_tokens * ((2 * q + 2 * kv) * b + nq * 4)
            + at.o_copy_tokens * dims.nq * dims.d * b
            + at.mlp_tokens * 4 * (dims.F // at.mlp_div) * b)


def rope_tables(tokens: int, dims: Dims, b: int) -> int:
    """cos and sin [B, tokens, d] (and each query's scale [B, tokens] where queries are scaled by position),
    computed once per forward and shared by every layer."""
    return 2 * tokens * dims.d * b + (tokens * b if dims.q_scaled else 0)


def hf_head_saved(inp: PlanInput, dims: Dims, *, norm_tokens: int, head_tokens: int, logits_tokens: int,
                  vocab: int) -> int:
    """HF final norm + LM head + cross-entropy (token-summed, fp32): the norm, the LM head input, the fp32
    log-softmax [logits_tokens, vocab] autograd keeps, and the logits themselves, which the training step holds in
    a variable (`model(...).logits`) until backward is done."""
    b, cb = inp.dtype_bytes, compute_bytes(inp.dtype_bytes)
    logits = logits_tokens * vocab * b + (logits_tokens * vocab * cb if b < cb else 0)  # + their .float() copy
    return norm_saved(norm_tokens, dims, b) + head_tokens * dims.h * b + logits_tokens * vocab * cb + logits


def embedding_saved(tokens: int, dims: Dims, b: int) -> int:
    """The embedding's saved token ids (int64) and the RoPE tables every layer shares."""
    return tokens * 8 + rope_tables(tokens, dims, b)


def hf_loss_backward(inp: PlanInput, tokens: int, vocab: int, buffers: int = 2) -> int:
    """Cross-entropy backward on [tokens, vocab] fp32 logits: nll's grad and log-softmax's grad (`buffers` = 2;
    DTensor's loss_parallel keeps one more)."""
    return buffers * tokens * vocab * compute_bytes(inp.dtype_bytes)
