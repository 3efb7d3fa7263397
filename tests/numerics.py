"""Shared numerical checks: a kernel is compared with the float64 reference, and in low precision it may be
at most FACTOR times as far from it as the same PyTorch computation run in that precision.

The rule itself (FACTOR, the per-dtype floor, max_error) lives in ``fused_transformer.tools.numerics``, which
``python -m fused_transformer check`` applies to every op on every backend; the tests use the same one."""
from __future__ import annotations

import torch

from fused_transformer.tools.numerics import ATOL_FLOOR, FACTOR, max_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_close_to_reference(
    out: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor, name: str = "output", factor: float = FACTOR
) -> float:
    """``out`` (kernel, any dtype) against ``ref64`` (reference in float64), with ``baseline`` the reference run
    in ``out``'s dtype. Returns the ratio err(out) / (err(baseline) + floor) for reporting."""
    if torch.isnan(out).any():
        raise AssertionError(f"{name}: NaN in the result")
    err = max_error(out, ref64)
    base = max_error(baseline, ref64)
    floor = ATOL_FLOOR[out.dtype]
    allowed = factor * base + floor
    if not err <= allowed:
        raise AssertionError(f"{name}: max error {err:.3e} > {factor} x baseline {base:.3e} + {floor:.1e} ({out.dtype})")
    return err / (base + floor)
