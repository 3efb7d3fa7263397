"""The position-wise feed-forward ``linear2(dropout(act(linear1(x))))``: the products on torch's GEMMs (cuBLAS on a
GPU, ATen's on the CPU), the activation and dropout between them one pass of ours.

The backends' launchers (``LAUNCHERS``) take ``x [..., d_model]``::

    forward(x, w1, b1, w2, b2, activation, dropout_p, seed, keep, allow_tf32) -> (y, saved)
    backward(dy, x, w1, b1, w2, saved, has_b2, activation, dropout_p, seed, allow_tf32) -> (dx, dw1, db1, dw2, db2)

``saved`` the tensors a backward reads beyond the inputs (``()`` unless ``keep``: the backward then recomputes them);
``dx`` shaped as ``x``; an absent bias's gradient None (or empty). Differences from torch: none in the result; dropout
draws its own mask.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import route
from ..autograd import backward_seed, draw_seed, saved_seed, traced_apply
from ..contract import (
    FLOAT_DTYPES, Seed, as_rows, autocast_all, autocast_dtype, check_dropout, check_same, check_tensor, describe,
    seed_tensor, stats_dtype,
)
from ..reference import ACTIVATIONS as ACTIVATION_FUNCTIONS, dropout
from . import Example, Launchers, Op, TuneSeries, Work, register

Tensor = torch.Tensor
_CPU = torch.device("cpu")  # the C++ kernels' device
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
OPTIONS = dict(activation="gelu", dropout_p=0.0)


class FeedForwardSpec(NamedTuple):
    """A call's options, checked."""

    activation: str  # one of ACTIVATIONS
    dropout_p: float
    recompute: bool = False  # keep only the inputs; the backward recomputes the pre-activation (Triton entry's option)
    allow_tf32: bool = False  # float32 products in TF32 on tensor cores (the Triton entry's option)


# ----------------------------------------------------------------------------------------------- contract


def check(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: object,
          dropout_p: object) -> FeedForwardSpec:
    """The checked ``FeedForwardSpec`` of a call: x ``[..., d_model]``, weights in ``nn.Linear`` layout."""
    if (isinstance(x, Tensor) and isinstance(w1, Tensor) and isinstance(w2, Tensor) and x.dtype in FLOAT_DTYPES
            and x.dim() > 0 and w1.dim() == 2 and w2.dim() == 2 and w1.shape[1] == x.shape[-1]
            and w2.shape[1] == w1.shape[0] and _same(w1, x) and _same(w2, x) and activation in ACTIVATIONS
            and dropout_p.__class__ is float and 0.0 <= dropout_p < 1.0
            and (b1 is None or (isinstance(b1, Tensor) and _same(b1, x) and b1.shape == w1.shape[:1]))
            and (b2 is None or (isinstance(b2, Tensor) and _same(b2, x) and b2.shape == w2.shape[:1]))):
        return FeedForwardSpec(activation, dropout_p)  # checked: the common case, in one expression
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (the features), got a scalar")
    d_model = x.shape[-1]
    for name, w in (("w1", w1), ("w2", w2)):
        check_tensor(name, w, rank=2)
        check_same(name, w, "x", x)
    d_ff = w1.shape[0]
    if w1.shape[1] != d_model:
        raise ValueError(f"w1 must be [d_ff, d_model={d_model}], got {describe(w1)}")
    if w2.shape[1] != d_ff:
        raise ValueError(f"w2 must be [d_out, d_ff={d_ff}] to follow w1 {tuple(w1.shape)}, got {describe(w2)}")
    for name, b, size in (("b1", b1, d_ff), ("b2", b2, w2.shape[0])):
        if b is not None:
            check_tensor(name, b)
            check_same(name, b, "x", x)
            if tuple(b.shape) != (size,):
                raise ValueError(f"{name} must be [{size}], got {describe(b)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    return FeedForwardSpec(activation, check_dropout(dropout_p))


def _same(t: Tensor, x: Tensor) -> bool:
    return t.dtype == x.dtype and t.device == x.device


# ---------------------------------------------------------------------------------------------- reference


def reference(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
              activation: str = "gelu", dropout_p: float = 0.0, keep_mask: Optional[Tensor] = None) -> Tensor:
    """The float64 oracle and the reference backend: ``linear(dropout(act(linear(x, w1, b1))), w2, b2)`` with weights in
    ``nn.Linear`` layout ``[out, in]`` (``keep_mask``: the kernel's own dropout mask of the hidden layer, replayed)."""
    hidden = ACTIVATION_FUNCTIONS[activation](F.linear(x, w1, b1))
    return F.linear(dropout(hidden, dropout_p, keep_mask), w2, b2)


def torch_path(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
               activation: str = "gelu", dropout_p: float = 0.0) -> Tensor:
    """The call as torch.nn computes it: ATen's ``linear``, activation, dropout and ``linear``."""
    hidden = ACTIVATION_FUNCTIONS[activation](F.linear(x, w1, b1))
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, dropout_p)
    return F.linear(hidden, w2, b2)


# -------------------------------------------------------------------------------------------- route facts


def decide(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
           spec: FeedForwardSpec) -> route.Decision:
    """Who runs a call of checked arguments."""
    grad = route.needs_grad(x, w1, b1, w2, b2)
    if torch.compiler.is_compiling():
        return route.choose(_call(x, spec, grad), x.device)
    key = ("feed_forward", x.device, x.dtype, x.shape, spec, grad, torch.are_deterministic_algorithms_enabled(),
           route.backend.get_backend())
    return route.remembered(key, lambda: (_call(x, spec, grad), x.device))


def _call(x: Tensor, spec: FeedForwardSpec, grad: bool, device: Optional[torch.device] = None) -> route.Call:
    needs = frozenset(name for name in ("recompute", "allow_tf32") if getattr(spec, name))
    return route.Call("feed_forward", route.device_tag(x.device if device is None else device), x.dtype,
                      dropout=spec.dropout_p > 0.0,
                      size=route.size(x.numel() // max(x.shape[-1], 1)), needs_grad=grad,
                      deterministic=torch.are_deterministic_algorithms_enabled(), needs=needs,
                      torch_default="" if spec.dropout_p > 0.0 else "no dropout: nothing to fuse (ATen's ops)",
                      backends=_BACKENDS)


# -------------------------------------------------------------------------------------------- the backends
# The C++ backend: with dropout the bias, activation and dropout of the hidden layer are one C++ pass
# (``csrc/bias_activation.cpp``) between ATen's products, one in backward.


def _bias_in_kernel(x: Tensor, dropout_p: float) -> bool:
    """Whether the C++ pass adds b1 (float32 with dropout). In 16 bits the bias must be added before the
    pre-activation is rounded, as ATen's addmm does: rounding first moves values near 0 across ReLU's kink, whose
    gradient then flips between 0 and 1."""
    return dropout_p > 0.0 and x.dtype not in (torch.float16, torch.bfloat16)


def _cpu_hidden(pre: Tensor, b1: Optional[Tensor], x: Tensor, activation: str, dropout_p: float,
                seed: Optional[Seed]) -> Tensor:
    if dropout_p == 0.0:
        return ACTIVATION_FUNCTIONS[activation](pre)
    bias = b1 if _bias_in_kernel(x, dropout_p) else None
    return torch.ops.fused_transformer_cpu.bias_activation_fwd(pre, bias, activation, dropout_p,
                                                               seed_tensor(seed, _CPU))


def cpu_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
                dropout_p: float, seed: Optional[Seed], keep: bool,
                allow_tf32: bool = False) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``y`` and, with ``keep``, ``(pre, hidden)``: the pre-activation (without b1 where the C++ pass adds it) and
    the activation after dropout, as rows ``[M, d_ff]``."""
    rows = as_rows(x)
    pre = F.linear(rows, w1, None if _bias_in_kernel(x, dropout_p) else b1)
    hidden = _cpu_hidden(pre, b1, x, activation, dropout_p, seed)
    return F.linear(hidden, w2, b2).view(*x.shape[:-1], w2.shape[0]), ((pre, hidden) if keep else ())


def cpu_backward(dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, saved: Tuple[Tensor, ...],
                 has_b2: bool, activation: str, dropout_p: float, seed: Optional[Seed],
                 allow_tf32: bool = False) -> Tuple[Tensor, ...]:
    """``dx, dw1, db1, dw2, db2``; without ``saved``, the pre-activation and the hidden activation are recomputed (the
    same dropout mask: the same seed)."""
    shape, x, dy = x.shape, as_rows(x), as_rows(dy)
    bias_in_kernel = _bias_in_kernel(x, dropout_p)
    if saved:
        pre, hidden = saved
    else:
        pre = F.linear(x, w1, None if bias_in_kernel else b1)
        hidden = _cpu_hidden(pre, b1, x, activation, dropout_p, seed)
    dhidden = dy.mm(w2)
    dw2 = dy.t().mm(hidden)
    if dropout_p > 0.0:
        dpre = torch.ops.fused_transformer_cpu.bias_activation_bwd(
            dhidden, pre, b1 if bias_in_kernel else None, activation, dropout_p, seed_tensor(seed, _CPU))
    elif activation == "relu":
        dpre = torch.ops.aten.threshold_backward(dhidden, pre, 0)
    else:
        dpre = torch.ops.aten.gelu_backward(dhidden, pre, approximate="tanh" if activation == "gelu_tanh" else "none")
    db1 = dpre.sum(dim=0, dtype=stats_dtype(dpre.dtype)).to(b1.dtype) if b1 is not None else None
    db2 = dy.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_b2 else None
    return dpre.mm(w1).view(shape), dpre.t().mm(x), db1, dw2, db2


LAUNCHERS = Launchers(triton="fused_transformer.kernels.feed_forward:feed_forward_fwd,feed_forward_bwd",
                      cpu=f"{__name__}:cpu_forward,cpu_backward")
_BACKENDS = frozenset(LAUNCHERS.where)


class FeedForwardFunction(torch.autograd.Function):
    """Autograd over a backend's launchers on ``x [..., d_model]``."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, spec: FeedForwardSpec, name: str):
        seed = draw_seed(spec.dropout_p, x.device)
        y, saved = LAUNCHERS(name)[0](x, w1, b1, w2, b2, spec.activation, spec.dropout_p, seed, not spec.recompute,
                                      spec.allow_tf32)
        ctx.save_for_backward(x, w1, b1, w2, saved_seed(ctx, seed), *saved)
        ctx.spec, ctx.name, ctx.has_b2 = spec, name, b2 is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, b1, w2, seed, *saved = ctx.saved_tensors
        spec = ctx.spec
        dx, dw1, db1, dw2, db2 = LAUNCHERS(ctx.name)[1](dy, x, w1, b1, w2, tuple(saved), ctx.has_b2, spec.activation,
                                                        spec.dropout_p, backward_seed(ctx, seed), spec.allow_tf32)
        return dx, dw1, db1 if b1 is not None else None, dw2, db2 if ctx.has_b2 else None, None, None


_autograd_apply = super(torch.autograd.Function, FeedForwardFunction).apply  # autograd's own (C++) apply: no frame


def run(name: str, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        spec: FeedForwardSpec) -> Tensor:
    """The op of checked arguments ``[..., d_model]`` on backend ``name`` (``"torch"``: ``torch_path``;
    ``"reference"``: ``reference``)."""
    if name == "torch" or name == "reference":
        path = torch_path if name == "torch" else reference
        return path(x, w1, b1, w2, b2, activation=spec.activation, dropout_p=spec.dropout_p)
    if route.needs_grad(x, w1, b1, w2, b2):
        apply = FeedForwardFunction.apply if traced_apply() else _autograd_apply
        return apply(x, w1, b1, w2, b2, spec, name)
    return LAUNCHERS(name)[0](x, w1, b1, w2, b2, spec.activation, spec.dropout_p, draw_seed(spec.dropout_p, x.device),
                              False, spec.allow_tf32)[0]


# --------------------------------------------------------------------------------------------- the op


def feed_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
                 activation: str = "gelu", dropout_p: float = 0.0) -> Tensor:
    """The position-wise feed-forward ``linear2(dropout(act(linear1(x))))``.

    Args:
        x: ``[..., d_model]``.
        w1: ``[d_ff, d_model]`` and b1 ``[d_ff]`` or None (``nn.Linear`` layout).
        w2: ``[d_out, d_ff]`` and b2 ``[d_out]`` or None.
        activation: ``"relu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``; NaN passes through each, as in
            torch (``relu``'s gradient at NaN is the incoming one, as ``torch.relu``'s).
        dropout_p: dropout on the activation (always applied when > 0).

    Returns:
        ``[..., d_out]`` in x's dtype. Under ``torch.autocast`` it runs in the autocast dtype (matrix products).
    """
    cast = autocast_dtype(x, matmul=True)
    if cast is not None:
        x, w1, b1, w2, b2 = autocast_all(cast, x, w1, b1, w2, b2)
    spec = check(x, w1, b1, w2, b2, activation, dropout_p)
    name = decide(x, w1, b1, w2, b2, spec).backend
    if cast is None:
        return run(name, x, w1, b1, w2, b2, spec)
    with torch.autocast(x.device.type, enabled=False):
        return run(name, x, w1, b1, w2, b2, spec)


# ------------------------------------------------------------------------------------------------ cases

BENCH_DROPOUT = 0.1


def flops(tokens: int, d_model: int, d_ff: int, *, backward: bool = False) -> float:
    """The two matmuls: ``2 * 2 * tokens * d_model * d_ff`` forward; the backward does twice that."""
    return 4.0 * tokens * d_model * d_ff * (3.0 if backward else 1.0)


def example(label: str, lead: Sequence[int], d_model: int, d_ff: int, d_out: Optional[int] = None, *,
            activation: str = "gelu", dropout_p: float = 0.0, quick: bool = False, bias_scale: float = 0.5) -> Example:
    """A call on ``x [*lead, d_model]``."""
    d_out = d_model if d_out is None else d_out

    def tensors(draw):
        return {"x": draw(*lead, d_model), "w1": draw(d_ff, d_model, scale=d_model ** -0.5),
                "b1": draw(d_ff, scale=bias_scale), "w2": draw(d_out, d_ff, scale=d_ff ** -0.5),
                "b2": draw(d_out, scale=bias_scale)}

    return Example(label, tensors, {"activation": activation, "dropout_p": dropout_p}, quick,
                   {"batch": lead[0], "seq_len": lead[1] if len(lead) > 1 else 1, "d_model": d_model, "d_ff": d_ff},
                   size=math.prod(lead))


CHECK = (
    example("x 2x19x64 64-128-64 gelu", (2, 19), 64, 128, quick=True),
    example("x 2x37x64 64-256-64 relu", (2, 37), 64, 256, activation="relu"),
    example("x 2x37x64 64-256-64 gelu", (2, 37), 64, 256),
    example("x 2x37x64 64-256-64 gelu_tanh", (2, 37), 64, 256, activation="gelu_tanh"),
    example("x 77x48 48-200-40 gelu_tanh", (77,), 48, 200, 40, activation="gelu_tanh"),
)


def _bench(gpu: bool, lengths: Sequence[int]) -> Sequence[Example]:
    shapes = ((1024, 4096), (4096, 16384)) if gpu else ((256, 1024), (512, 2048))
    return [example(f"d{d_model} ff{d_ff}", (8, length), d_model, d_ff, dropout_p=BENCH_DROPOUT, bias_scale=0.1)
            for d_model, d_ff in shapes for length in lengths]


def _work(example: Example, itemsize: int, backward: bool) -> Work:
    shape = example.shape
    return Work(flops=flops(shape["batch"] * shape["seq_len"], shape["d_model"], shape["d_ff"], backward=backward))


def _describe(gpu: bool) -> str:
    shapes = "1024/4096, 4096/16384" if gpu else "256/1024, 512/2048"
    return f"batch 8, d_model/d_ff {shapes}, GELU, dropout {BENCH_DROPOUT}"


def _tune(device_type: str, dtype: torch.dtype, quick: bool) -> Sequence[TuneSeries]:
    """Rows of d_model 512 (1024 on a GPU), d_ff four times that; the sizes counted in rows."""
    d_model = 1024 if device_type == "cuda" else 512
    rows = (64,) if quick else ((1024, 8192, 32768) if device_type == "cuda" else (8, 64, 1024, 4096))
    return tuple(TuneSeries("yes" if p else "no", tuple(
        example(f"{n}x{d_model}", (n,), d_model, 4 * d_model, dropout_p=p) for n in rows)) for p in (0.1, 0.0))


class ThinFeedForward(torch.autograd.Function):
    """The least the op can cost on the host (the overhead suite's thin): the same products, torch's launches that no
    implementation skips, with the activation pass's outputs allocated and not computed; no check, route or seed."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        hidden = torch.empty_like(F.linear(x, w1, b1))
        ctx.save_for_backward(x, w1, b1, w2, b2, hidden)
        return F.linear(hidden, w2, b2)

    @staticmethod
    def backward(ctx, dy):
        x, w1, b1, w2, b2, hidden = ctx.saved_tensors
        dy = as_rows(dy)
        dpre = torch.empty_like(dy.mm(w2))
        return (dpre.mm(w1).view(x.shape), dpre.t().mm(as_rows(x)), torch.empty_like(b1), dy.t().mm(as_rows(hidden)),
                torch.empty_like(b2))


def _thin(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    return ThinFeedForward.apply(x, w1, b1, w2, b2)


# Measured with bench --device cuda (docs/benchmarks.md "On a GPU" holds the runs).
MEASURED = """
feed_forward  forward   H200           bfloat16          *         *            yes      *           *               0.88-1.00  -          H200 bench --quick bdb1535 2026-11-28
feed_forward  training  H200           bfloat16          *         *            yes      *           *               0.72-0.95  yes        H200 bench --quick bdb1535 2026-11-28
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
feed_forward  forward   cpu-avx512-t2  float32           *         *            yes      functional  *               1.17-1.87  -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  0..22           0.89       -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  22..256         1.02       -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  256..2048       0.91       -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  2048..          1.19       -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  bfloat16          *         *            yes      functional  *               1.12-2.60  -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  0..2048         0.88-0.99  -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  2048..          1.01       -          CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  float32           *         *            yes      functional  *               1.01-1.28  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  float32           *         *            no       functional  0..2048         0.87-1.00  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  float32           *         *            no       functional  2048..          1.01       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  bfloat16          *         *            yes      functional  0..22           0.93       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  bfloat16          *         *            yes      functional  22..            1.11-1.26  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  training  cpu-avx512-t2  bfloat16          *         *            no       functional  *               0.89-0.98  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
feed_forward  forward   cpu-avx2-t2    float32           *         *            yes      functional  *               1.11-1.48  -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    float32           *         *            no       functional  0..256          0.92-0.98  -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    float32           *         *            no       functional  256..           1.00-1.07  -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            yes      functional  *               1.14-2.12  -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  0..256          0.87-0.97  -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  256..2048       1.01       -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  2048..          0.99       -          CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    float32           *         *            yes      functional  *               1.04-1.22  yes        CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    float32           *         *            no       functional  0..22           0.95       yes        CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    float32           *         *            no       functional  22..256         1.01       yes        CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    float32           *         *            no       functional  256..           0.93-0.96  yes        CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    bfloat16          *         *            yes      functional  *               1.03-1.25  yes        CPU tune f0f0518 (avx2) 2026-12-07
feed_forward  training  cpu-avx2-t2    bfloat16          *         *            no       functional  *               0.83-0.91  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""

OP = register(Op(
    name="feed_forward", function=feed_forward, torch_path=torch_path, reference=reference, size_of="rows of x",
    outputs=("out",), check=CHECK, bench=_bench,
    lengths={"cpu": ((128, 512, 2048), (128, 512)), "cuda": ((512, 1024, 2048, 4096), (1024, 4096))},
    work=_work, throughput=("tflops", "TFLOP/s"), describe=_describe,
    overhead=(example("B2 L8 d32 ff64", (2, 8), 32, 64, dropout_p=BENCH_DROPOUT),),
    overhead_target={"fwd": 2.5, "fwd+bwd": 2.5},
    tune=_tune, call_of=lambda tensors, options, device, grad: _call(tensors["x"], FeedForwardSpec(**options), grad,
                                                                    device),
    route_examples=(example("dropout", (1024,), 512, 2048, dropout_p=0.1),),
    launchers=LAUNCHERS, measured=MEASURED, overhead_thin=_thin,
))
