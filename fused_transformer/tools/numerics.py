"""The accuracy rule every check and test applies, and helpers that run an op so a kernel cannot pass by luck.

With ``err`` the largest absolute difference of a result from the float64 reference, and ``torch err`` the
same for PyTorch's own computation in that precision (the reference backend: what ``torch`` does with these
dtypes), a result passes when

    err <= 2 * torch err + floor[dtype]          floor: float32 2e-5, float16 2e-3, bfloat16 1.6e-2

and it is finite wherever the float64 result is. Gradients follow the same rule: PyTorch's own error grows
with a gradient's magnitude, so the limit scales with it, and the floor only matters for results of magnitude
about 1 or below. ``error_ratio`` is ``err / (torch err + floor / 2)``: 1.0 means "as accurate as PyTorch in
this precision", and a result passes exactly when its ratio is at most 2.0.

Under the Triton interpreter (no GPU) ``interpreter_rounds_to_nearest`` makes the interpreter's float32 ->
bfloat16 casts round to nearest, as a GPU does (the interpreter truncates), so interpreted kernels are held to
the GPU's rounding error; ``unwritten_elements_are_nan`` makes buffers allocated with ``torch.empty`` start as
NaN, so an element a kernel forgets to write fails instead of passing by luck.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fused_transformer import backend

FACTOR = 2.0
# Absolute floor added to the allowed error, per dtype: round-off of a handful of ulps near 1.
ATOL_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# ------------------------------------------------------------------------------------------- the rule


def max_error(x: Tensor, ref64: Tensor) -> float:
    """Largest ``|x - ref64|``, in float64; positions where both hold the same infinity agree."""
    if x.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref64.shape)}")
    x, ref64 = x.detach().double(), ref64.detach().double()
    diff = (x - ref64).abs()
    # inf - inf is NaN: positions where both are the same infinity agree.
    same_inf = torch.isinf(x) & (x == ref64)
    return float(torch.where(same_inf, torch.zeros_like(diff), diff).max()) if diff.numel() else 0.0


def allowed_error(baseline_error: float, dtype: torch.dtype) -> float:
    """The most a result of ``dtype`` may differ from float64, given PyTorch's own error in that dtype."""
    return FACTOR * baseline_error + ATOL_FLOOR[dtype]


def error_ratio(err: float, baseline_error: float, dtype: torch.dtype) -> float:
    """``err / (baseline_error + floor / FACTOR)``: 1 is PyTorch's own accuracy, the rule passes up to FACTOR."""
    return FACTOR * err / allowed_error(baseline_error, dtype)


def _non_finite(x: Tensor, ref64: Tensor) -> int:
    """How many elements of ``x`` are NaN or infinite where ``ref64`` is not that same value."""
    x = x.detach().double()
    return int((~torch.isfinite(x) & ~(x == ref64.detach().double())).sum())


@dataclass
class Verdict:
    """One result of a check (an output or a gradient) against float64."""

    name: str
    err: float
    baseline_err: float
    ratio: float
    ok: bool
    note: str = ""


def judge(name: str, out: Optional[Tensor], ref64: Optional[Tensor], baseline: Optional[Tensor]) -> Verdict:
    """``out`` (the backend's) against ``ref64`` (float64), with ``baseline`` PyTorch's own in ``out``'s dtype."""
    nan = float("nan")
    if ref64 is None or baseline is None:
        return Verdict(name, nan, nan, math.inf, False, "no float64 / baseline result")
    if out is None:
        return Verdict(name, nan, nan, math.inf, False, "missing (no gradient?)")
    if out.shape != baseline.shape or out.dtype != baseline.dtype:
        return Verdict(name, nan, nan, math.inf, False, f"got {tuple(out.shape)} {out.dtype}, expected "
                       f"{tuple(baseline.shape)} {baseline.dtype}")
    bad = _non_finite(out, ref64)
    err, base = max_error(out, ref64), max_error(baseline, ref64)
    ratio = error_ratio(err, base, out.dtype) if bad == 0 else math.inf
    ok = bad == 0 and err <= allowed_error(base, out.dtype)
    return Verdict(name, err, base, ratio, ok, f"{bad} non-finite" if bad else "")


# -------------------------------------------------------------------- running ops under the interpreter


@contextlib.contextmanager
def interpreter_rounds_to_nearest() -> Iterator[None]:
    """Under the Triton interpreter, make float32 -> bfloat16 casts round to nearest even, as a GPU does (the
    interpreter truncates), so interpreted kernels are held to the GPU's rounding error, not twice that.
    Does nothing when the interpreter is off."""
    if not backend.triton_interpreting() or backend.triton_unavailable_reason() is not None:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_rounding(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            bits = np.ascontiguousarray(data).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).reshape(data.shape)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_rounding
    try:
        yield
    finally:
        interpreter._convert_float = convert


@contextlib.contextmanager
def unwritten_elements_are_nan() -> Iterator[None]:
    """Every floating buffer allocated with ``torch.empty`` / ``torch.empty_like`` starts as NaN, so an element a
    kernel forgets to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty, torch.empty_like = nan_empty, nan_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def outputs_and_grads(fn: Callable, inputs: Dict[str, object], out_grads: Sequence[Tensor],
                      dtype: Optional[torch.dtype] = None) -> Tuple[Tuple[Tensor, ...], Dict[str, Optional[Tensor]]]:
    """Run ``fn(**inputs)`` (floating tensors cast to ``dtype`` if given) and backpropagate ``out_grads`` into its
    first outputs; returns the outputs and the gradient of every floating input, by name (none without
    ``out_grads``). Non-tensors and non-floating tensors (masks) are passed as they are."""
    leaves = {}
    for name, t in inputs.items():
        if isinstance(t, Tensor):
            t = t.detach().to(dtype if dtype is not None and t.is_floating_point() else t.dtype)
            leaves[name] = t.requires_grad_(t.is_floating_point() and len(out_grads) > 0)
        else:
            leaves[name] = t
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not out_grads:
        return outs, {}
    torch.autograd.backward(outs[:len(out_grads)], [g.to(o.dtype) for o, g in zip(outs, out_grads)])
    grads = {name: t.grad for name, t in leaves.items() if isinstance(t, Tensor) and t.is_floating_point()}
    return outs, grads
