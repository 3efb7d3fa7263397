"""Shared numerical checks: a kernel is compared with the float64 reference, and in low precision it may be
at most FACTOR times as far from it as the same PyTorch computation run in that precision."""
from __future__ import annotations

import torch

FACTOR = 2.0
# Absolute floor added to the allowed error, per dtype: round-off of a handful of ulps near 1.
ATOL_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def max_error(x: torch.Tensor, ref64: torch.Tensor) -> float:
    if x.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref64.shape)}")
    x, ref64 = x.detach(), ref64.detach()
    diff = (x.double() - ref64.double()).abs()
    # inf - inf is NaN: positions where both are the same infinity agree.
    same_inf = torch.isinf(x.double()) & (x.double() == ref64.double())
    return float(torch.where(same_inf, torch.zeros_like(diff), diff).max()) if diff.numel() else 0.0


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
