"""Time the Gated DeltaNet's pure-torch chunk kernel on one head block of a TSP rank, for weak and strong decays,
with its decays as they are ("flushed": ds_tsp.core.layers.linear_attention.delta_rule's flushed_exp and
pairwise_decay, the exponents clamped and the results below the dtype's floor set to 0) and as the plain exp
("plain exp": the pairwise exponents masked with -inf, nothing clamped or flushed), in one process on one thread:

    python benchmarks/delta_rule_decays.py --tsp 2 --seq 4096 --batch 2

The block: both local zigzag chunks of every row as one batch (2B rows of c = S / 2D tokens), value heads
--heads / D, key and value head dims --head-dim (the hybrid bench config's: 8 value heads of 32). Decays: "weak",
-A softplus(a) with A = 1 and a ~ N(0, 0.3) (about -0.7 per token: what `ShardedStateDict.init_weights_`'s N(0, 0.02)
A_log and dt_bias give), and "strong", transformers' init (A uniform in (0, 16], dt_bias = 1: down to about -20 per
token, so most pairs of a 64-token sub-chunk underflow). Prints, per decay and form, the milliseconds of a forward
and of a forward + backward (best of --repeats after one untimed call, the forms interleaved). Run it with nothing
else on the machine.

    python benchmarks/delta_rule_decays.py --tsp 2 --seq 4096 --batch 2 --transformers

adds transformers' own torch chunk kernel (Qwen3.5's torch_chunk_gated_delta_rule, what the bench's hf_zero3_dp
peer runs without flash-linear-attention) on one data-parallel rank's work, one whole sequence of S tokens with
every value head, for both decays: does either kernel's cost depend on how fast the heads forget?
"""
from __future__ import annotations

import argparse
import timeit

import torch

from ds_tsp.core.layers.linear_attention import delta_rule


def _masked_exp(cum: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    return (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(cut, float("-inf")).exp()


FORMS = {"flushed": (delta_rule.pairwise_decay, delta_rule.flushed_exp), "plain exp": (_masked_exp, torch.exp)}


def _inputs(rows: int, heads: int, c: int, d: int, strong: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (delta_rule.l2_normalize(torch.randn(rows, heads, c, d, generator=g)) for _ in range(2))
    v = torch.randn(rows, heads, c, d, generator=g)
    beta = torch.rand(rows, heads, c, generator=g)
    a = 0.3 * torch.randn(rows, heads, c, generator=g)
    if strong:
        A = 16 * (1 - torch.rand(1, heads, 1, generator=g))  # (0, 16]
        log_decay = -A * torch.nn.functional.softplus(a + 1.0)
    else:
        log_decay = -torch.nn.functional.softplus(a)
    return q * d ** -0.5, k, v, log_decay, beta


def _best(call, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one untimed call."""
    call()
    return min(timeit.repeat(call, number=1, repeat=repeats))


def _forward(inputs, chunk: int):
    with torch.no_grad():
        delta_rule.chunk_gated_delta_rule(*inputs, chunk)


def _forward_backward(inputs, chunk: int):
    leaves = [t.clone().requires_grad_() for t in inputs]
    outs = delta_rule.chunk_gated_delta_rule(*leaves, chunk)
    torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tsp", type=int, default=2, help="D, the ranks")
    parser.add_argument("--seq", type=int, default=4096, help="S, a multiple of 2D")
    parser.add_argument("--batch", type=int, default=2, help="B, sequences per step")
    parser.add_argument("--heads", type=int, default=8, help="value heads of the layer, a multiple of D")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64, help="the kernel's sub-chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transformers", action="store_true",
                        help="also time transformers' torch_chunk_gated_delta_rule on one whole sequence")
    args = parser.parse_args(argv)
    D, S = args.tsp, args.seq
    if S % (2 * D) or args.heads % D:
        parser.error(f"--seq must be a multiple of 2 * --tsp and --heads of --tsp (S={S}, D={D})")
    torch.set_num_threads(1)
    rows, heads, c = 2 * args.batch, args.heads // D, S // (2 * D)
    print(f"D={D} S={S} B={args.batch}: {rows} rows x {heads} heads x {c} tokens, head dim {args.head_dim}, "
          f"sub-chunk {args.chunk}; ms forward / forward + backward")
    for strong in (False, True):
        inputs = _inputs(rows, heads, c, args.head_dim, strong)
        times = {}
        for _ in range(2):  # the forms interleaved, twice
            for form, (pairwise, exp) in FORMS.items():
                delta_rule.pairwise_decay, delta_rule.flushed_exp = pairwise, exp
                try:
                    fwd = _best(lambda: _forward(inputs, args.chunk), args.repeats)
                    both = _best(lambda: _forward_backward(inputs, args.chunk), args.repeats)
                finally:
                    delta_rule.pairwise_decay, delta_rule.flushed_exp = FORMS["flushed"]
                old = times.get(form, (float("inf"), float("inf")))
                times[form] = (min(old[0], fwd), min(old[1], both))
        for form, (fwd, both) in times.items():
            print(f"  {'strong' if strong else 'weak'} decays, {form}: {fwd * 1e3:.2f} / {both * 1e3:.2f}")
    if args.transformers:
        _transformers_rows(args)


def _transformers_rows(args) -> None:
    """transformers' torch chunk kernel on [1, S, H, d] (one data-parallel rank's sequence), both decays."""
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError as err:
        raise SystemExit(f"--transformers needs transformers with Qwen3.5: pip install 'ds_tsp[hf]' ({err})")
    S, heads, d = args.seq, args.heads, args.head_dim
    for strong in (False, True):
        q, k, v, log_decay, beta = (t.transpose(1, 2).contiguous() for t in _inputs(1, heads, S, d, strong))

        def forward():
            with torch.no_grad():
                torch_chunk_gated_delta_rule(q, k, v, log_decay, beta, chunk_size=args.chunk)

        def forward_backward():
            leaves = [t.clone().requires_grad_() for t in (q, k, v, log_decay, beta)]
            out, _ = torch_chunk_gated_delta_rule(*leaves, chunk_size=args.chunk)
            torch.autograd.grad(out, leaves, torch.ones_like(out))

        fwd, both = _best(forward, args.repeats), _best(forward_backward, args.repeats)
        print(f"  transformers' kernel, 1 x {S} tokens x {heads} heads, {'strong' if strong else 'weak'} decays: "
              f"{fwd * 1e3:.2f} / {both * 1e3:.2f}")


if __name__ == "__main__":
    main()
