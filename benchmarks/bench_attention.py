"""Attention forward and forward+backward TFLOP/s on a GPU: the Triton kernel against every backend of
``torch.nn.functional.scaled_dot_product_attention`` that accepts the case, and flash-attn when installed.

    python -m benchmarks.bench_attention [--dtype bf16] [--quick] [--csv out.csv]

Cases: sequence length 512 .. 16k at 16k tokens per batch, head dim 64 and 128 (2048 / D heads), causal or
not, 0% or 50% key padding (half the sequences keep a quarter of their keys, half three quarters; SDPA gets
the same padding as a boolean ``attn_mask``, which is the only way to pass it). FLOPs are the dense count,
4·B·H·L²·D forward (halved when causal) and 3.5× that for forward+backward (the backward does 2.5×), so every column divides the same
work by its time: a kernel that skips padded tiles shows it as a higher rate. Times are
``triton.testing.do_bench`` medians. Needs a CUDA device: without one it exits with a message.
"""
from __future__ import annotations

import argparse
import csv
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOKENS = 16384


def _sdpa_backends() -> Dict[str, object]:
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}


def _flash_attn() -> Optional[Callable]:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        print("bench_attention: flash-attn is not installed: its column is left out (pip install flash-attn)")
        return None
    return flash_attn_func


def _time_ms(fn: Callable[[], torch.Tensor], backward: bool, grad: torch.Tensor) -> float:
    from triton.testing import do_bench

    if backward:
        return do_bench(lambda: fn().backward(grad), grad_to_none=None)
    with torch.no_grad():
        return do_bench(fn)


def run_case(length: int, head_dim: int, causal: bool, padding: bool, dtype: torch.dtype,
             flash_attn: Optional[Callable]) -> List[dict]:
    import fused_transformer as ft

    batch, heads = max(TOKENS // length, 1), 2048 // head_dim
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    kept = torch.tensor([length // 4 if b % 2 else 3 * length // 4 for b in range(batch)], device="cuda")
    key_padding = torch.arange(length, device="cuda")[None, :] >= kept[:, None] if padding else None
    sdpa_mask = None
    if padding:
        sdpa_mask = ~key_padding[:, None, None, :]
        if causal:
            sdpa_mask = sdpa_mask & torch.ones(length, length, dtype=torch.bool, device="cuda").tril()

    candidates: Dict[str, Callable[[], torch.Tensor]] = {
        "triton": lambda: ft.attention(q, k, v, key_padding_mask=key_padding, is_causal=causal),
    }
    for name, sdpa_backend in _sdpa_backends().items():
        def sdpa(sdpa_backend=sdpa_backend):
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([sdpa_backend]):
                if sdpa_mask is not None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        candidates[name] = sdpa
    if flash_attn is not None and not padding:
        candidates["flash_attn"] = lambda: flash_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      causal=causal).transpose(1, 2)

    flops_fwd = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    rows = []
    for phase, backward, flops in (("fwd", False, flops_fwd), ("fwd+bwd", True, 3.5 * flops_fwd)):
        row = dict(length=length, head_dim=head_dim, causal=causal, padding="50%" if padding else "0%", phase=phase)
        for name, fn in candidates.items():
            try:
                ms = _time_ms(fn, backward, grad)
            except RuntimeError as exc:  # a backend that rejects the case (mask, head dim, dtype)
                row[name] = None
                if "No available kernel" not in str(exc) and "not supported" not in str(exc).lower():
                    print(f"bench_attention: {name} failed on {row}: {str(exc).splitlines()[0]}")
                continue
            row[name] = flops / ms / 1e9  # TFLOP/s
        best_sdpa = max((row[n] for n in row if n.startswith("sdpa") and row[n] is not None), default=None)
        row["triton_vs_best_sdpa"] = row["triton"] / best_sdpa if best_sdpa else None
        rows.append(row)
        print("  ".join(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in row.items()), flush=True)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--quick", action="store_true", help="lengths 1024 and 4096 only")
    parser.add_argument("--csv", help="write the rows to this CSV file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention: no CUDA device found. This benchmark measures the GPU kernels and needs a GPU "
                 "(the interpreter on CPU is for correctness only; benchmarks.bench_cpu measures the CPU path).")
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, {TOKENS} tokens per batch, TFLOP/s (dense FLOP count)")
    flash_attn = _flash_attn()
    lengths = (1024, 4096) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    rows = []
    for head_dim in (64, 128):
        for causal in (False, True):
            for padding in (False, True):
                for length in lengths:
                    rows.extend(run_case(length, head_dim, causal, padding, DTYPES[args.dtype], flash_attn))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            fieldnames = list(dict.fromkeys(key for row in rows for key in row))
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
