"""Feed-forward forward / backward throughput on a GPU: TFLOP/s of the fused Triton op vs
``F.linear -> F.gelu -> F.linear`` in torch, and their ratio.

    python -m benchmarks.bench_feed_forward [--dtype bf16] [--tokens 8192]

FLOPs counted: 2 * tokens * d_model * d_ff per linear in the forward, twice that in the backward. Times are
``triton.testing.do_bench`` medians. Needs a CUDA device: without one it exits with a message.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_layer_norm import DTYPES, require_cuda

SHAPES = ((768, 3072), (1024, 4096), (2048, 8192), (4096, 16384))  # (d_model, d_ff)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_feed_forward", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--activation", choices=("relu", "gelu", "gelu_tanh"), default="gelu")
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    require_cuda("bench_feed_forward")

    from triton.testing import do_bench

    from fused_transformer.kernels.feed_forward import feed_forward as triton_ffn

    dtype, tokens = DTYPES[args.dtype], args.tokens
    approximate = "tanh" if args.activation == "gelu_tanh" else "none"
    act = F.relu if args.activation == "relu" else (lambda h: F.gelu(h, approximate=approximate))
    print(f"{torch.cuda.get_device_name()}: {tokens} tokens, {args.dtype}, {args.activation}, "
          f"dropout {args.dropout}\n")
    header = (f"{'d_model':>7} {'d_ff':>6} {'pass':>4} {'triton ms':>10} {'TFLOP/s':>8} {'torch ms':>9} "
              f"{'TFLOP/s':>8} {'triton/torch':>13}")
    print(header)
    print("-" * len(header))
    for d_model, d_ff in SHAPES:
        x = torch.randn(tokens, d_model, device="cuda", dtype=dtype, requires_grad=True)
        w1 = (torch.randn(d_ff, d_model, device="cuda", dtype=dtype) / d_model**0.5).requires_grad_()
        b1 = torch.zeros(d_ff, device="cuda", dtype=dtype, requires_grad=True)
        w2 = (torch.randn(d_model, d_ff, device="cuda", dtype=dtype) / d_ff**0.5).requires_grad_()
        b2 = torch.zeros(d_model, device="cuda", dtype=dtype, requires_grad=True)
        params = [x, w1, b1, w2, b2]

        def fused():
            return triton_ffn(x, w1, b1, w2, b2, activation=args.activation, dropout_p=args.dropout)

        def torch_ref():
            return F.linear(F.dropout(act(F.linear(x, w1, b1)), args.dropout), w2, b2)

        times = {}
        for label, fn in (("triton", fused), ("torch", torch_ref)):
            y = fn()
            dy = torch.randn_like(y)
            fwd = do_bench(fn, return_mode="median")
            bwd = do_bench(lambda: y.backward(dy, retain_graph=True), grad_to_none=params, return_mode="median")
            times[label] = (fwd, bwd)
        flops_fwd = 2 * 2 * tokens * d_model * d_ff
        for i, (pass_name, flops) in enumerate((("fwd", flops_fwd), ("bwd", 2 * flops_fwd))):
            t_ms, r_ms = times["triton"][i], times["torch"][i]
            print(f"{d_model:>7} {d_ff:>6} {pass_name:>4} {t_ms:>10.4f} {flops / t_ms * 1e-9:>8.1f} {r_ms:>9.4f} "
                  f"{flops / r_ms * 1e-9:>8.1f} {r_ms / t_ms:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
