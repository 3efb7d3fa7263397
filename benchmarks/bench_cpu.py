"""CPU benchmark of the C++ kernels (backend "cpu") against PyTorch, measured side by side in one run.

    python -m benchmarks.bench_cpu [--quick]

1. attention forward and forward+backward against ``torch.nn.functional.scaled_dot_product_attention``,
   B=8, H=8, D=64, float32, L = 128 .. 2048, with no mask, causal, and 50% key padding (right-padded; SDPA
   gets the same padding as a boolean attn_mask).
2. a whole ``TransformerEncoderLayer`` (d_model 256, 8 heads, ff 512, dropout 0.1) training step (forward +
   backward) and eval forward (no_grad), ours on the cpu backend against ``torch.nn.TransformerEncoderLayer``,
   with and without padding.

Timings use ``torch.utils.benchmark.Timer.blocked_autorange``; the table reports medians and the speed-up
``torch time / our time`` (> 1: ours is faster). Compare ratios, not absolute times, across machines.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

import fused_transformer as ft
from fused_transformer import backend

Row = Tuple[str, float, float]


def median_seconds(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm-up: first-call allocations and one-time dispatch
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def attention_rows(lengths: List[int], min_run_time: float) -> List[Row]:
    batch, heads, dim = 8, 8, 64
    rows = []
    for length in lengths:
        q, k, v = (torch.randn(batch, heads, length, dim, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, length, dim)
        # Every other sequence keeps a quarter of the keys, the rest three quarters: 50% padding on average.
        kept = torch.tensor([length // 4 if b % 2 else 3 * length // 4 for b in range(batch)])
        padding = torch.arange(length)[None, :] >= kept[:, None]
        cases = {
            "none": (dict(), dict()),
            "causal": (dict(is_causal=True), dict(is_causal=True)),
            "pad50%": (dict(key_padding_mask=padding), dict(attn_mask=~padding[:, None, None, :])),
        }
        for mask_name, (ours_kwargs, sdpa_kwargs) in cases.items():
            def ours_forward():
                with torch.no_grad(), ft.use_backend("cpu"):
                    return ft.attention(q, k, v, **ours_kwargs)

            def sdpa_forward():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)

            def ours_training():
                with ft.use_backend("cpu"):
                    ft.attention(q, k, v, **ours_kwargs).backward(grad)

            def sdpa_training():
                F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs).backward(grad)

            for phase, ours, theirs in (("fwd", ours_forward, sdpa_forward), ("fwd+bwd", ours_training, sdpa_training)):
                name = f"attention L={length:<5d} {mask_name:<7s} {phase}"
                rows.append((name, median_seconds(theirs, min_run_time), median_seconds(ours, min_run_time)))
                print_row(rows[-1])
    return rows


def encoder_rows(min_run_time: float) -> List[Row]:
    batch, length, d_model, heads, d_ff = 16, 256, 256, 8, 512
    torch.manual_seed(0)
    reference = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.1, batch_first=True)
    ours = ft.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.1, batch_first=True)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(batch, length, d_model)
    kept = torch.randint(length // 4, length + 1, (batch,))
    padding = torch.arange(length)[None, :] >= kept[:, None]
    rows = []
    for padding_name, mask in (("no padding", None), ("padding", padding)):
        def step(module: nn.Module) -> Callable[[], None]:
            def run():
                module.train()
                module.zero_grad(set_to_none=True)
                with ft.use_backend("cpu"):
                    module(x, src_key_padding_mask=mask).sum().backward()
            return run

        def evaluate(module: nn.Module) -> Callable[[], torch.Tensor]:
            def run():
                module.eval()
                with torch.no_grad(), ft.use_backend("cpu"):
                    return module(x, src_key_padding_mask=mask)
            return run

        for phase, make in (("train step", step), ("eval fwd", evaluate)):
            name = f"encoder layer {padding_name:<10s} {phase}"
            rows.append((name, median_seconds(make(reference), min_run_time), median_seconds(make(ours), min_run_time)))
            print_row(rows[-1])
    return rows


def print_row(row: Row) -> None:
    name, theirs, ours = row
    print(f"{name:<42s}{theirs * 1e3:>12.2f}{ours * 1e3:>12.2f}{theirs / ours:>10.2f}x", flush=True)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 128, 512 only and shorter timing runs")
    args = parser.parse_args(argv)
    reason = backend.cpu_unavailable_reason()
    if reason is not None:
        print(f"bench_cpu: the cpu backend is unavailable, nothing to measure: {reason}", file=sys.stderr)
        return 1
    lengths = [128, 512] if args.quick else [128, 256, 512, 1024, 2048]
    min_run_time = 0.3 if args.quick else 1.0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    print(f"{'case':<42s}{'torch ms':>12s}{'ours ms':>12s}{'speed-up':>11s}")
    attention_rows(lengths, min_run_time)
    encoder_rows(min_run_time)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
