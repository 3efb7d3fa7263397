"""The main job: ``python -m fused_transformer [check | bench | all | demo]``.

``check`` runs every op on every backend usable here against the float64 reference and prints the error
and the error ratio (kernel error / error of PyTorch in the same dtype); exit code 1 on any failure.
``bench`` times a Transformer encoder layer, fused against torch.nn, on this machine's device.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterator, List, Tuple

import torch
from torch import nn

import fused_transformer as ft
from fused_transformer import backend, reference

LOW_PRECISION_FACTOR = 2.0
ABS_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _usable_backends(device: torch.device) -> List[str]:
    names = []
    for name in ("triton", "cpu", "reference"):
        try:
            with ft.use_backend(name):
                ft.current(device)
        except RuntimeError:
            continue
        names.append(name)
    return names


def _cases(device: torch.device) -> Iterator[Tuple[str, str, Callable]]:
    """(op, shape description, fn(module_or_reference, dtype) -> output) for a fixed grid."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    q, k, v = randn(2, 4, 77, 64), randn(2, 2, 130, 64), randn(2, 2, 130, 64)
    padding = (torch.arange(130)[None, :] >= torch.tensor([130, 90])[:, None]).to(device)
    bias = randn(77, 130)
    for mask_name, kwargs in (("none", {}), ("causal_br+padding", dict(is_causal=True, causal_alignment="bottom_right",
                                                                      key_padding_mask=padding)),
                              ("float mask", dict(attn_mask=bias))):
        yield "attention", f"B2 H4/2 Lq77 Lk130 D64 {mask_name}", (
            lambda impl, dt, kw=kwargs: impl.attention(q.to(dt), k.to(dt), v.to(dt), **kw))
    x, r, w, b = randn(37, 1000), randn(37, 1000), randn(1000), randn(1000)
    yield "layer_norm", "37x1000 +residual", lambda impl, dt: impl.layer_norm(x.to(dt), w.to(dt), b.to(dt), residual=r.to(dt))
    x, w1, b1, w2, b2 = randn(37, 64), randn(256, 64) / 8, randn(256), randn(64, 256) / 16, randn(64)
    yield "feed_forward", "37x64 -> 256 gelu", lambda impl, dt: impl.feed_forward(
        *(t.to(dt) for t in (x, w1, b1, w2, b2)), activation="gelu")


def check(device: torch.device, quick: bool) -> int:
    """Print the check table; return the number of failures."""
    dtypes = [torch.float32, torch.bfloat16] if quick else [torch.float32, torch.float16, torch.bfloat16]
    header = f"{'op':<13}{'backend':<11}{'dtype':<10}{'shape':<42}{'max err':>10}{'ratio':>8}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for op, shape, run in _cases(device):
        expected = run(reference, torch.float64)
        for name in _usable_backends(device):
            for dtype in dtypes:
                with ft.use_backend(name):
                    out = run(ft, dtype)
                baseline = run(reference, dtype)
                err = (out.double() - expected).abs().max().item()
                base = (baseline.double() - expected).abs().max().item()
                ratio = err / (base + ABS_FLOOR[dtype])
                ok = bool(torch.isfinite(out).all()) and err <= LOW_PRECISION_FACTOR * base + ABS_FLOOR[dtype]
                failures += not ok
                print(f"{op:<13}{name:<11}{str(dtype)[6:]:<10}{shape:<42}{err:>10.2e}{ratio:>8.2f}  {'pass' if ok else 'FAIL'}")
    print(f"\n{failures} failure(s)")
    return failures


def bench(device: torch.device, quick: bool) -> None:
    """Encoder layer (d_model 256, 8 heads, ff 512): training step and eval forward, fused vs torch.nn."""
    from torch.utils import benchmark

    batch, length, dim = (8, 128, 256) if quick else (16, 256, 256)
    torch.manual_seed(0)
    reference_layer = nn.TransformerEncoderLayer(dim, 8, 512, batch_first=True).to(device)
    fused_layer = ft.TransformerEncoderLayer(dim, 8, 512, batch_first=True).to(device)
    fused_layer.load_state_dict(reference_layer.state_dict())
    x = torch.randn(batch, length, dim, device=device)
    padding = (torch.arange(length)[None, :] >= torch.randint(length // 2, length + 1, (batch,))[:, None]).to(device)
    print(f"\nencoder layer d_model {dim}, 8 heads, ff 512, batch {batch}, seq {length}, {device} "
          f"(backend {ft.current(device)}); median times")
    print(f"{'case':<28}{'torch.nn ms':>12}{'fused ms':>10}{'speed-up':>10}")
    for padded in (False, True):
        kpm = padding if padded else None
        for mode in ("train step", "eval forward"):
            times = []
            for layer in (reference_layer, fused_layer):
                layer.train(mode == "train step")
                if mode == "train step":
                    def step(layer=layer):
                        layer(x, src_key_padding_mask=kpm).sum().backward()
                else:
                    def step(layer=layer):
                        with torch.no_grad():
                            layer(x, src_key_padding_mask=kpm)
                timer = benchmark.Timer("step()", globals={"step": step})
                times.append(timer.blocked_autorange(min_run_time=0.5 if quick else 2.0).median * 1e3)
            label = f"{mode}{', 50% padding' if padded else ''}"
            print(f"{label:<28}{times[0]:>12.2f}{times[1]:>10.2f}{times[0] / times[1]:>9.2f}x")


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the Seq2Seq demo parses its own options
        from fused_transformer.models.demo import main as demo_main
        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fused_transformer", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="all", choices=["check", "bench", "all", "demo"])
    parser.add_argument("--quick", action="store_true", help="a smaller grid and shorter timings")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"fused_transformer {ft.__version__}, torch {torch.__version__}, device {device}, "
          f"backends usable here: {', '.join(_usable_backends(device))}")
    failures = check(device, args.quick) if args.command in ("check", "all") else 0
    if args.command in ("bench", "all"):
        bench(device, args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
