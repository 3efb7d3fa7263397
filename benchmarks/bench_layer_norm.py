"""LayerNorm forward / backward bandwidth on a GPU: GB/s and fraction of the device's peak, Triton vs torch.

    python -m benchmarks.bench_layer_norm [--dtype bf16] [--tokens 8192]

Bytes counted are the minimum each pass must move: forward reads x, residual, writes y, z (+ the weights);
backward reads z, dy, dz, writes dx, dresidual (+ weights and their gradients). Times are
``triton.testing.do_bench`` medians. Needs a CUDA device: without one it exits with a message.
"""
import argparse
import sys

import torch

# Peak DRAM bandwidth in GB/s, by a substring of torch.cuda.get_device_name().
PEAK_BANDWIDTH_GBPS = {
    "H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "H200": 4800.0,
    "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100-PCIE-40GB": 1555.0, "A100": 1555.0,
    "L40S": 864.0, "RTX 4090": 1008.0, "A10G": 600.0,
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HIDDEN_SIZES = (768, 1024, 2048, 4096, 8192, 12288, 16384)


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{what}: no CUDA device found. This benchmark measures GPU kernels and needs a GPU "
                 "(the interpreter on CPU is for correctness only).")


def peak_bandwidth_gbps() -> float:
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BANDWIDTH_GBPS.items():
        if key in name:
            return value
    return float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_layer_norm", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    require_cuda("bench_layer_norm")

    from triton.testing import do_bench

    from fused_transformer.kernels.layer_norm import layer_norm as triton_layer_norm

    dtype, tokens = DTYPES[args.dtype], args.tokens
    peak = peak_bandwidth_gbps()
    name = torch.cuda.get_device_name()
    print(f"{name}: peak {'unknown (not in PEAK_BANDWIDTH_GBPS)' if peak != peak else f'{peak:.0f} GB/s'}; "
          f"{tokens} tokens, {args.dtype}, residual + prenorm\n")
    header = f"{'hidden':>7} {'pass':>4} {'triton ms':>10} {'GB/s':>8} {'of peak':>8} {'torch ms':>9} {'GB/s':>8} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for hidden in HIDDEN_SIZES:
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        residual = torch.randn_like(x, requires_grad=True)
        weight = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        bias = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
        size = x.element_size()

        def fused():
            return triton_layer_norm(x, weight, bias, residual=residual, prenorm=True)

        def torch_ref():
            z = x + residual
            return torch.nn.functional.layer_norm(z, (hidden,), weight, bias), z

        rows = {}
        for label, fn in (("triton", fused), ("torch", torch_ref)):
            y, z = fn()
            dy, dz = torch.randn_like(y), torch.randn_like(z)
            fwd = do_bench(fn, return_mode="median")
            bwd = do_bench(lambda: torch.autograd.backward((y, z), (dy, dz), retain_graph=True),
                           grad_to_none=[x, residual, weight, bias], return_mode="median")
            rows[label] = (fwd, bwd)
        fwd_bytes = 4 * tokens * hidden * size + 2 * hidden * size
        bwd_bytes = 5 * tokens * hidden * size + 4 * hidden * size
        for i, (pass_name, nbytes) in enumerate((("fwd", fwd_bytes), ("bwd", bwd_bytes))):
            t_ms, r_ms = rows["triton"][i], rows["torch"][i]
            gbps, ref_gbps = nbytes / t_ms * 1e-6, nbytes / r_ms * 1e-6
            print(f"{hidden:>7} {pass_name:>4} {t_ms:>10.4f} {gbps:>8.0f} {gbps / peak:>8.2f} {r_ms:>9.4f} "
                  f"{ref_gbps:>8.0f} {r_ms / t_ms:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
