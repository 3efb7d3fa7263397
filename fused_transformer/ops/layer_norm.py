"""LayerNorm over the last dim with the residual add and dropout before it: ``y = LN(dropout(x) + residual)``, and
``z = dropout(x) + residual`` too with ``prenorm`` (the residual stream of a pre-LN block).

The backends' launchers (``LAUNCHERS``) work on rows, ``x`` ``[rows, N]`` (any row stride) or contiguous ``[..., N]``,
with the arguments of the custom ops ``fused_transformer::layer_norm_fwd`` / ``layer_norm_bwd`` (the Triton launchers
are those ops' eager path)::

    forward(x, weight, bias, residual, eps, dropout_p, seed, rms, store_z, store_stats) -> (y, z, mean, rstd)
    backward(dy, dz, z, weight, bias, mean, rstd, dropout_p, seed, rms, has_residual) -> (dx, dresidual, dweight, dbias)

``y``, ``z``, ``dx`` and ``dresidual`` shaped as ``x``; ``z`` only with ``store_z``; ``mean`` / ``rstd`` per row in
float32, with ``store_stats`` (``mean`` not for RMSNorm, whose spec has ``rms``: the RMSNorm op shares this Function
and these launchers); what a launcher does not compute is None or empty, an absent parameter's gradient too.
Differences from torch: none in the result; dropout draws its own mask (a Philox seed from torch's generator, so
``torch.manual_seed`` reproduces it).
"""
from __future__ import annotations

import importlib
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import route
from ..autograd import backward_seed, draw_seed, saved_seed, traced_apply
from ..contract import (
    FLOAT_DTYPES, Seed, as_rows, autocast_all, autocast_dtype, check_dropout, check_same, check_tensor, describe,
    seed_tensor, stats_dtype,
)
from ..reference import dropout
from . import Example, Launchers, Op, TuneSeries, VariantCases, Work, register

Tensor = torch.Tensor
_CPU = torch.device("cpu")  # the C++ kernels' device
OPTIONS = dict(residual=None, dropout_p=0.0, prenorm=False)


class LayerNormSpec(NamedTuple):
    """A call's options, checked: ``y = norm(dropout(x) + residual)``, and the sum with ``prenorm``."""

    eps: float
    dropout_p: float
    prenorm: bool
    rms: bool = False  # RMSNorm: no mean subtracted, ``z * rsqrt(mean(z^2) + eps)``


# ----------------------------------------------------------------------------------------------- contract


def _plain_param(p: Optional[Tensor], x: Tensor) -> bool:
    """Whether ``p`` is None or a float tensor ``[N]`` on x's device (``check``'s checks, passed)."""
    return p is None or (isinstance(p, Tensor) and p.dtype in FLOAT_DTYPES and p.device == x.device
                         and p.dim() == 1 and p.shape[0] == x.shape[-1])


def check(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: object, residual: Optional[Tensor],
          dropout_p: object, prenorm: object, rms: bool = False) -> LayerNormSpec:
    """The checked ``LayerNormSpec`` of a call on these tensors."""
    if (isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES and x.dim() > 0 and eps.__class__ is float and eps >= 0
            and dropout_p.__class__ is float and 0.0 <= dropout_p < 1.0 and prenorm.__class__ is bool
            and _plain_param(weight, x) and _plain_param(bias, x) and (residual is None or (
                isinstance(residual, Tensor) and residual.dtype == x.dtype and residual.device == x.device
                and residual.shape == x.shape))):
        return LayerNormSpec(eps, dropout_p, prenorm, rms)  # checked: the common case, in one expression
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (the normalised one), got a scalar")
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_tensor(name, p)
            check_same(name, p, "x", x, dtype=False)
            if tuple(p.shape) != (n,):
                raise ValueError(f"{name} must be [{n}] (x's last dim), got {describe(p)}")
    if residual is not None:
        check_tensor("residual", residual)
        check_same("residual", residual, "x", x)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {describe(residual)}")
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a non-negative number")
    if not isinstance(prenorm, (bool, int)):
        raise TypeError(f"prenorm={prenorm!r} must be a bool")
    return LayerNormSpec(float(eps), check_dropout(dropout_p), bool(prenorm), rms)


# ---------------------------------------------------------------------------------------------- reference


def reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
              residual: Optional[Tensor] = None, dropout_p: float = 0.0, prenorm: bool = False,
              keep_mask: Optional[Tensor] = None, rms: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The float64 oracle and the reference backend: ``z = dropout(x) + residual`` (``keep_mask``: the kernel's own
    dropout mask, replayed), ``y = (z - mean) / sqrt(var + eps) * weight + bias`` over the last dim (``rms``:
    ``y = z / sqrt(mean(z^2) + eps) * weight + bias``), statistics in float32 (float64 for float64); ``(y, z)`` with
    ``prenorm``."""
    z = dropout(x, dropout_p, keep_mask)
    if residual is not None:
        z = z + residual
    zs = z.to(stats_dtype(z.dtype))
    if rms:
        y = zs * torch.rsqrt(zs.square().mean(dim=-1, keepdim=True) + eps)
    else:
        mean = zs.mean(dim=-1, keepdim=True)
        y = (zs - mean) * torch.rsqrt((zs - mean).square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype)
    return (y, z) if prenorm else y


def torch_path(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
               residual: Optional[Tensor] = None, dropout_p: float = 0.0,
               prenorm: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The call as torch.nn computes it: ATen's dropout, add, then ``F.layer_norm``."""
    if dropout_p > 0.0:
        x = F.dropout(x, dropout_p)
    z = x if residual is None else x + residual
    y = F.layer_norm(z, (x.shape[-1],), weight, bias, eps)
    return (y, z) if prenorm else y


# -------------------------------------------------------------------------------------------- route facts


def decide(op: str, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
           spec: LayerNormSpec) -> route.Decision:
    """Who runs a call of checked arguments (``op``: this op or RMSNorm, which share the facts)."""
    grad = route.needs_grad(x, weight, bias, residual)
    if torch.compiler.is_compiling():
        return route.choose(_call(op, x, weight, bias, spec, grad), x.device)
    key = (op, x.device, x.dtype, x.shape, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, spec, grad, torch.are_deterministic_algorithms_enabled(),
           route.backend.get_backend())
    return route.remembered(key, lambda: (_call(op, x, weight, bias, spec, grad), x.device))


def _call(op: str, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], spec: LayerNormSpec, grad: bool,
          device: Optional[torch.device] = None) -> route.Call:
    device = x.device if device is None else device
    cannot = ""
    if x.shape[-1] <= 1:
        cannot = "rows of one feature (ATen's backward cancels 1/sqrt(eps)-sized terms)"
    elif any(p is not None and p.dtype != x.dtype for p in (weight, bias)):
        cannot = "parameters in another dtype than x's"
    elif device.type == "cpu" and x.dtype != torch.float32:
        cannot = "16 bits on the CPU (ATen's weight gradient misses the 2x rule)"
    return route.Call(op, route.device_tag(device), x.dtype, dropout=spec.dropout_p > 0.0,
                      size=route.size(x.numel()), needs_grad=grad,
                      deterministic=torch.are_deterministic_algorithms_enabled(), torch_cannot=cannot,
                      torch_default="" if spec.dropout_p > 0.0 else "no dropout: nothing to fuse (ATen's ops)",
                      backends=_BACKENDS)


# -------------------------------------------------------------------------------------------- the backends


def cpu_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
                dropout_p: float, seed: Optional[Seed], rms: bool, store_z: bool,
                store_stats: bool = True) -> Tuple[Tensor, ...]:
    """The C++ kernel's forward (``csrc/norm.cpp``, on ``[rows, N]``; it always keeps the statistics)."""
    y, z, mean, rstd = torch.ops.fused_transformer_cpu.layer_norm_fwd(
        as_rows(x), weight, bias, as_rows(residual) if residual is not None else None, eps, dropout_p,
        seed_tensor(seed, _CPU), store_z, rms)
    return y.view(x.shape), z.view(x.shape) if store_z else z, mean, rstd


def cpu_backward(dy: Tensor, dz: Optional[Tensor], z: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 mean: Tensor, rstd: Tensor, dropout_p: float, seed: Optional[Seed], rms: bool,
                 has_residual: bool) -> Tuple[Tensor, ...]:
    """The C++ kernel's backward."""
    dx, dresidual, dweight, dbias = torch.ops.fused_transformer_cpu.layer_norm_bwd(
        as_rows(dy), as_rows(dz) if dz is not None else None, as_rows(z), weight, bias, mean, rstd, dropout_p,
        seed_tensor(seed, _CPU), has_residual, rms)
    return dx.view(z.shape), dresidual.view(z.shape) if has_residual else None, dweight, dbias


def _prepare(backend: str) -> None:
    """The C++ ops' shapes for torch.compile (once the extension is loaded)."""
    if backend != "cpu":
        return
    importlib.import_module("fused_transformer._C")

    @torch.library.register_fake("fused_transformer_cpu::layer_norm_fwd")
    def _(x, weight, bias, residual, eps, dropout_p, seed, store_z, rms=False):
        z = torch.empty_like(x) if store_z else x.new_empty((0,))
        stats = stats_dtype(x.dtype)
        return (torch.empty_like(x), z, x.new_empty((0,) if rms else x.shape[:1], dtype=stats),
                x.new_empty(x.shape[:1], dtype=stats))

    @torch.library.register_fake("fused_transformer_cpu::layer_norm_bwd")
    def _(dy, dz, z, weight, bias, mean, rstd, dropout_p, seed, has_residual, rms=False):
        empty = z.new_empty((0,))
        return (torch.empty_like(z), torch.empty_like(z) if has_residual else empty,
                torch.empty_like(weight) if weight is not None else empty,
                torch.empty_like(bias) if bias is not None else empty)


LAUNCHERS = Launchers(_prepare, triton="fused_transformer.kernels.layer_norm:layer_norm_fwd,layer_norm_bwd",
                      cpu=f"{__name__}:cpu_forward,cpu_backward")
_BACKENDS = frozenset(LAUNCHERS.where)


class NormFunction(torch.autograd.Function):
    """Autograd over a backend's launchers on rows (``[rows, N]``, or contiguous ``[..., N]``), for LayerNorm and
    RMSNorm alike."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, spec: LayerNormSpec, name: str):
        seed = draw_seed(spec.dropout_p, x.device)
        keeps_sum = residual is not None or spec.dropout_p > 0.0  # then z, not x, is what the backward reads
        y, z, mean, rstd = LAUNCHERS(name)[0](x, weight, bias, residual, spec.eps, spec.dropout_p, seed, spec.rms,
                                              spec.prenorm or keeps_sum)
        ctx.save_for_backward(z if keeps_sum else x, weight, bias, mean, rstd, saved_seed(ctx, seed))
        ctx.spec, ctx.name, ctx.has_residual = spec, name, residual is not None
        return (y, z) if spec.prenorm else y

    @staticmethod
    def backward(ctx, dy, dz=None):
        z, weight, bias, mean, rstd, seed = ctx.saved_tensors
        spec = ctx.spec
        dx, dresidual, dweight, dbias = LAUNCHERS(ctx.name)[1](
            dy, dz, z, weight, bias, mean, rstd, spec.dropout_p, backward_seed(ctx, seed), spec.rms, ctx.has_residual)
        return (dx, dweight if weight is not None else None, dbias if bias is not None else None,
                dresidual if ctx.has_residual else None, None, None)


_autograd_apply = super(torch.autograd.Function, NormFunction).apply  # autograd's own (C++) apply: no frame


def _torch_run(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
               spec: LayerNormSpec) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    return torch_path(x, weight, bias, spec.eps, residual=residual, dropout_p=spec.dropout_p, prenorm=spec.prenorm)


def run(name: str, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
        spec: LayerNormSpec, torch_run=_torch_run) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``y``, or ``(y, z)`` with ``spec.prenorm``, of checked arguments ``[..., N]`` on backend ``name`` (``"torch"``:
    ``torch_run``, the op's torch path taking these arguments; ``"reference"``: ``reference``), the launches on
    rows."""
    if name == "torch":
        return torch_run(x, weight, bias, residual, spec)
    if name == "reference":
        return reference(x, weight, bias, spec.eps, residual=residual, dropout_p=spec.dropout_p, prenorm=spec.prenorm,
                         rms=spec.rms)
    shape = None  # x's, where the launches take its rows as [rows, N]: rows not evenly strided
    if x.dim() != 2 and not (x.is_contiguous() and (residual is None or residual.is_contiguous())):
        shape, x = x.shape, as_rows(x)
        residual = as_rows(residual) if residual is not None else None
    if route.needs_grad(x, weight, bias, residual):
        apply = NormFunction.apply if traced_apply() else _autograd_apply
        out = apply(x, weight, bias, residual, spec, name)
    else:
        y, z, _, _ = LAUNCHERS(name)[0](x, weight, bias, residual, spec.eps, spec.dropout_p,
                                        draw_seed(spec.dropout_p, x.device), spec.rms, spec.prenorm, False)
        out = (y, z) if spec.prenorm else y
    if shape is None:
        return out
    return (out[0].view(shape), out[1].view(shape)) if spec.prenorm else out.view(shape)


# --------------------------------------------------------------------------------------------- the op


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
               residual: Optional[Tensor] = None, dropout_p: float = 0.0,
               prenorm: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``y = LayerNorm(dropout(x) + residual) * weight + bias`` over the last dim of ``x``.

    Args:
        x: ``[..., N]``.
        weight, bias: ``[N]`` or None.
        residual: x's shape and dtype, or None.
        dropout_p: dropout on ``x`` before the residual add (always applied when > 0).
        prenorm: also return ``z = dropout(x) + residual``, the residual stream of a pre-LN block.

    Returns:
        ``y`` (x's dtype), or ``(y, z)`` with ``prenorm``. Mean and variance are computed in float32. As with
        ``torch.nn.functional.layer_norm``, ``N = 0`` or no rows give empty results (the weight and bias
        gradients then empty or zeros). Under ``torch.autocast`` it runs in float32, as autocast runs LayerNorm.
    """
    cast = autocast_dtype(x, matmul=False)
    if cast is not None:
        x, weight, bias, residual = autocast_all(cast, x, weight, bias, residual)
    spec = check(x, weight, bias, eps, residual, dropout_p, prenorm)
    name = decide("layer_norm", x, weight, bias, residual, spec).backend
    if cast is None:
        return run(name, x, weight, bias, residual, spec)
    with torch.autocast(x.device.type, enabled=False):
        return run(name, x, weight, bias, residual, spec)


# ------------------------------------------------------------------------------------------------ cases

BENCH_DROPOUT = 0.1


def bytes_moved(tokens: int, hidden: int, element_size: int, *, backward: bool = False) -> float:
    """Bytes residual + norm must move: forward reads x, residual and writes y (3 rows) plus weight and bias; the
    backward reads dy and the saved sum and writes dx and dresidual (4 rows) plus weight, dweight, dbias. The
    dropout mask is not counted."""
    forward = 3 * tokens * hidden + 2 * hidden
    return float(element_size * (forward + (4 * tokens * hidden + 3 * hidden if backward else 0)))


def example(label: str, shape: Sequence[int], *, residual: bool = True, prenorm: bool = False, weight: bool = True,
            bias: bool = True, dropout_p: float = 0.0, quick: bool = False, **options: object) -> Example:
    """A call on ``x`` of ``shape`` (weight off its 1, bias off its 0)."""
    n = shape[-1]

    def tensors(draw):
        found = {"x": draw(*shape), "weight": 1 + draw(n, scale=0.5) if weight else None}
        if bias:
            found["bias"] = draw(n)
        if residual:
            found["residual"] = draw(*shape)
        return found

    return Example(label, tensors, {"prenorm": prenorm, "dropout_p": dropout_p, **options}, quick,
                   {"batch": shape[0], "seq_len": shape[1] if len(shape) > 2 else 1, "d_model": n},
                   size=int(torch.Size(shape).numel()))


def check_examples(op_options: dict) -> Tuple[Example, ...]:
    """check's grid (shared with RMSNorm, ``op_options`` its own)."""
    return (
        example("x 2x19x300 +residual prenorm", (2, 19, 300), prenorm=True, quick=True, **op_options),
        example("x 2x37x1000 +residual prenorm", (2, 37, 1000), prenorm=True, **op_options),
        example("x 77x1023", (77, 1023), residual=False, **op_options),
        example("x 5x4096 +residual", (5, 4096), **op_options),
    )


def bench_examples(gpu: bool, lengths: Sequence[int], op_options: dict) -> Sequence[Example]:
    batch = 8
    return [example(f"d{hidden}", (batch, length, hidden), dropout_p=BENCH_DROPOUT, **op_options)
            for hidden in ((1024, 4096) if gpu else (256, 1024)) for length in lengths]


def work(example: Example, itemsize: int, backward: bool) -> Work:
    shape = example.shape
    return Work(nbytes=bytes_moved(shape["batch"] * shape["seq_len"], shape["d_model"], itemsize, backward=backward))


def describe_bench(gpu: bool) -> str:
    return f"batch 8, d_model {'1024, 4096' if gpu else '256, 1024'}, residual, dropout {BENCH_DROPOUT}"


def tune_series(device_type: str, dtype: torch.dtype, quick: bool, op_options: dict) -> Sequence[TuneSeries]:
    """Rows of 1024 features, the sizes counted in elements, and on the CPU a module's tiny call (4 rows of 64, where
    the host path decides); 16-bit calls on the CPU are not torch's to run."""
    if device_type == "cpu" and dtype != torch.float32:
        return ()
    rows = (64,) if quick else ((1024, 8192, 32768) if device_type == "cuda" else (64, 1024, 8192))
    shapes = [(n, 1024) for n in rows] if quick or device_type == "cuda" else [(4, 64)] + [(n, 1024) for n in rows]
    return tuple(TuneSeries("yes" if p else "no", tuple(
        example(f"{n}x{width}", (n, width), dropout_p=p, **op_options) for n, width in shapes)) for p in (0.1, 0.0))


# Measured with bench --device cuda (docs/benchmarks.md "On a GPU" holds the runs).
MEASURED = """
# layer_norm + residual, dropout 0.1, d 1024 and 4096, 8k and 32k rows: ours ahead forward from 32M elements
layer_norm    forward   H200           bfloat16          *         *            yes      *           0..16777216     0.45-0.54  -          H200 bench --quick bdb1535 2026-11-28
layer_norm    forward   H200           bfloat16          *         *            yes      *           16777216..      1.12-1.28  -          H200 bench --quick bdb1535 2026-11-28
layer_norm    training  H200           bfloat16          *         *            yes      *           *               0.40-0.94  yes        H200 bench --quick bdb1535 2026-11-28
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
layer_norm    forward   cpu-avx512-t2  float32           *         *            yes      functional  0..4096         0.55       -          CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    forward   cpu-avx512-t2  float32           *         *            yes      functional  4096..          3.27-4.08  -          CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    forward   cpu-avx512-t2  float32           *         *            no       functional  0..2965820      0.35-0.54  -          CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    forward   cpu-avx512-t2  float32           *         *            no       functional  2965820..       1.50       -          CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    training  cpu-avx512-t2  float32           *         *            yes      functional  0..4096         0.60       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    training  cpu-avx512-t2  float32           *         *            yes      functional  4096..          1.31-1.73  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    training  cpu-avx512-t2  float32           *         *            no       functional  *               0.34-0.74  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
layer_norm    forward   cpu-avx2-t2    float32           *         *            yes      functional  0..4096         0.60       -          CPU tune f0f0518 (avx2) 2026-12-07
layer_norm    forward   cpu-avx2-t2    float32           *         *            yes      functional  4096..          2.66-3.54  -          CPU tune f0f0518 (avx2) 2026-12-07
layer_norm    forward   cpu-avx2-t2    float32           *         *            no       functional  *               0.36-0.97  -          CPU tune f0f0518 (avx2) 2026-12-07
layer_norm    training  cpu-avx2-t2    float32           *         *            yes      functional  0..4096         0.61       yes        CPU tune f0f0518 (avx2) 2026-12-07
layer_norm    training  cpu-avx2-t2    float32           *         *            yes      functional  4096..          1.16-1.54  yes        CPU tune f0f0518 (avx2) 2026-12-07
layer_norm    training  cpu-avx2-t2    float32           *         *            no       functional  *               0.40-0.74  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""


def _variant_examples(gpu: bool, quick: bool) -> Sequence[Example]:
    """The kernels' own speed: a residual, no dropout; d 1024 and 4096, 16k and 64k rows on a GPU (quick: 16k)."""
    if not gpu:
        return (example("24x64", (24, 64)),)
    rows = (16384,) if quick else (16384, 65536)
    return tuple(example(f"{n}x{width}", (n, width)) for width in (1024, 4096) for n in rows)


def _shape_class(example: Example, dtype: torch.dtype) -> str:
    from ..kernels.layer_norm import shape_class

    return shape_class(example.shape["d_model"], example.size // example.shape["d_model"], dtype)


VARIANTS = (VariantCases("layer_norm.fwd", False, _variant_examples, _shape_class),
            VariantCases("layer_norm.bwd", True, _variant_examples, _shape_class))


def op_record(name: str, function, path, oracle, rms: bool, measured: str = "",
              variants: Tuple[VariantCases, ...] = ()) -> Op:
    """The registry's record of a norm op: this one, or RMSNorm (``rms``: its function, torch's path and reference
    take no bias)."""
    op_options = {"bias": False} if rms else {}
    return Op(
        name=name, function=function, torch_path=path, reference=oracle, size_of="elements of x", outputs=("y", "z"),
        check=check_examples(op_options),
        bench=lambda gpu, lengths: bench_examples(gpu, lengths, op_options),
        lengths={"cpu": ((128, 512, 2048), (128, 512)), "cuda": ((512, 1024, 2048, 4096, 8192), (1024, 4096))},
        work=work, throughput=("tokens_per_s", "tokens/s"), describe=describe_bench,
        overhead=(example("B2 L8 d32", (2, 8, 32), dropout_p=BENCH_DROPOUT, **op_options),),
        overhead_target={"fwd": 2.5, "fwd+bwd": 2.5},
        tune=lambda device_type, dtype, quick: tune_series(device_type, dtype, quick, op_options),
        call_of=lambda tensors, options, device, grad: _call(
            name, tensors["x"], tensors.get("weight"), tensors.get("bias"),
            LayerNormSpec(1e-5, options.get("dropout_p", 0.0), options.get("prenorm", False), rms),
            grad, device),
        route_examples=(example("", (1024, 1024), **op_options),
                        example("dropout", (1024, 1024), dropout_p=0.1, **op_options)),
        launchers=LAUNCHERS, measured=measured, variants=variants,
    )


OP = register(op_record("layer_norm", layer_norm, torch_path, reference, False, MEASURED, VARIANTS))
