"""RMSNorm over the last dim, with the residual add and dropout before it: ``y = z * rsqrt(mean(z^2) + eps) * weight``
with ``z = dropout(x) + residual``, and ``z`` too with ``prenorm`` (the residual stream of a pre-norm block, as in
the Llama family).

It shares the LayerNorm op's Function, launchers and kernels (their ``rms`` flag: no mean subtracted); what is its
own is here: the signature of ``torch.nn.functional.rms_norm`` (``eps=None``: ``torch.finfo(x.dtype).eps``; no
bias), its torch path (``F.rms_norm``), the route's facts and its cases. Differences from torch: statistics in
float32 for 16-bit inputs (torch's own RMSNorm computes them in the input dtype); under ``torch.autocast`` it runs in
float32, as LayerNorm does; dropout draws its own mask.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..contract import autocast_all, autocast_dtype
from . import layer_norm as norm
from . import register

Tensor = torch.Tensor


def _eps(eps: Optional[float], x: Tensor) -> object:
    return torch.finfo(x.dtype).eps if eps is None and isinstance(x, Tensor) and x.is_floating_point() else eps


def reference(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None, *,
              residual: Optional[Tensor] = None, dropout_p: float = 0.0, prenorm: bool = False,
              keep_mask: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The float64 oracle and the reference backend (``keep_mask``: the kernel's own dropout mask, replayed)."""
    return norm.reference(x, weight, None, _eps(eps, x), residual=residual, dropout_p=dropout_p, prenorm=prenorm,
                          keep_mask=keep_mask, rms=True)


def torch_path(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None, *,
               residual: Optional[Tensor] = None, dropout_p: float = 0.0,
               prenorm: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The call as torch computes it: ATen's dropout and add, then ``F.rms_norm``."""
    if dropout_p > 0.0:
        x = F.dropout(x, dropout_p)
    z = x if residual is None else x + residual
    y = F.rms_norm(z, (x.shape[-1],), weight, eps)
    return (y, z) if prenorm else y


def _torch_run(x: Tensor, weight: Optional[Tensor], bias: None, residual: Optional[Tensor],
               spec: norm.LayerNormSpec) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    return torch_path(x, weight, spec.eps, residual=residual, dropout_p=spec.dropout_p, prenorm=spec.prenorm)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None, *,
             residual: Optional[Tensor] = None, dropout_p: float = 0.0,
             prenorm: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``y = z * rsqrt(mean(z^2) + eps) * weight`` over the last dim of ``z = dropout(x) + residual``.

    Args:
        x: ``[..., N]``.
        weight: ``[N]`` or None.
        eps: added to the mean square; None (as in ``torch.nn.RMSNorm``): ``torch.finfo(x.dtype).eps``.
        residual: x's shape and dtype, or None.
        dropout_p: dropout on ``x`` before the residual add (always applied when > 0).
        prenorm: also return ``z``, the residual stream of a pre-norm block.

    Returns:
        ``y`` (x's dtype), or ``(y, z)`` with ``prenorm``. The mean square is computed in float32 (float64 for
        float64). ``N = 0`` or no rows give empty results.
    """
    cast = autocast_dtype(x, matmul=False)
    if cast is not None:
        x, weight, residual = autocast_all(cast, x, weight, residual)
    spec = norm.check(x, weight, None, _eps(eps, x), residual, dropout_p, prenorm, rms=True)
    name = norm.decide("rms_norm", x, weight, None, residual, spec).backend
    if cast is None:
        return norm.run(name, x, weight, None, residual, spec, _torch_run)
    with torch.autocast(x.device.type, enabled=False):
        return norm.run(name, x, weight, None, residual, spec, _torch_run)


# The C++ kernel against F.rms_norm, with dropout and without (where the norms otherwise default to ATen's ops).
# Tuned rows of the user's own CPU come first.
MEASURED = """
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
rms_norm      forward   cpu-avx512-t2  float32           *         *            yes      functional  0..4096         0.85       -          CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      forward   cpu-avx512-t2  float32           *         *            yes      functional  4096..          3.23-4.46  -          CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      forward   cpu-avx512-t2  float32           *         *            no       functional  0..4096         0.73       -          CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      forward   cpu-avx512-t2  float32           *         *            no       functional  4096..          1.03-3.26  -          CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      training  cpu-avx512-t2  float32           *         *            yes      functional  0..4096         0.95       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      training  cpu-avx512-t2  float32           *         *            yes      functional  4096..          1.68-2.44  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      training  cpu-avx512-t2  float32           *         *            no       functional  0..4096         0.98       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      training  cpu-avx512-t2  float32           *         *            no       functional  4096..          1.14-2.70  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
rms_norm      forward   cpu-avx2-t2    float32           *         *            yes      functional  0..4096         0.77       -          CPU tune f0f0518 (avx2) 2026-12-07
rms_norm      forward   cpu-avx2-t2    float32           *         *            yes      functional  4096..          3.80-4.64  -          CPU tune f0f0518 (avx2) 2026-12-07
rms_norm      forward   cpu-avx2-t2    float32           *         *            no       functional  0..262144       0.69-0.81  -          CPU tune f0f0518 (avx2) 2026-12-07
rms_norm      forward   cpu-avx2-t2    float32           *         *            no       functional  262144..        1.26-2.47  -          CPU tune f0f0518 (avx2) 2026-12-07
rms_norm      training  cpu-avx2-t2    float32           *         *            yes      functional  *               1.06-3.03  yes        CPU tune f0f0518 (avx2) 2026-12-07
rms_norm      training  cpu-avx2-t2    float32           *         *            no       functional  *               1.03-2.50  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""

OP = register(norm.op_record("rms_norm", rms_norm, torch_path, reference, rms=True, measured=MEASURED))
