"""Helpers shared by the Triton kernel tests: the "outputs and every gradient against the float64 reference"
check (the 2x rule of tests/numerics.py) and dropout replay. The interpreter fixtures live in conftest.py."""
from __future__ import annotations

import os

import torch

from fused_transformer.kernels._common import draw_dropout_seed, dropout_keep_mask
from fused_transformer.tools.numerics import outputs_and_grads
from tests.numerics import assert_close_to_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Worst err / (baseline err + floor) seen per dtype in this process; with FUSED_TRANSFORMER_RATIO_LOG=path
# each check also appends "dtype name ratio" lines there (for reports across test files).
WORST_RATIO: dict = {}


def _record(dtype: torch.dtype, name: str, ratio: float) -> None:
    WORST_RATIO[dtype] = max(WORST_RATIO.get(dtype, 0.0), ratio)
    path = os.environ.get("FUSED_TRANSFORMER_RATIO_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {dtype} {name} {ratio:.3f}\n")


def check_against_reference(kernel_fn, reference_fn, inputs, out_grads):
    """Kernel outputs and gradients vs the float64 reference, with the reference in the kernel's own dtypes
    as the baseline (the 2x rule of tests/numerics.py)."""
    outs, grads = outputs_and_grads(kernel_fn, inputs, out_grads)
    ref_outs, ref_grads = outputs_and_grads(reference_fn, inputs, out_grads, dtype=torch.float64)
    base_outs, base_grads = outputs_and_grads(reference_fn, inputs, out_grads)
    for i, (out, ref, base) in enumerate(zip(outs, ref_outs, base_outs)):
        assert out.dtype == base.dtype and out.shape == base.shape
        _record(out.dtype, f"output {i}", assert_close_to_reference(out, ref, base, f"output {i}"))
    for name, grad in grads.items():
        assert grad is not None, f"no gradient for {name}"
        assert grad.dtype == inputs[name].dtype
        _record(grad.dtype, f"d{name}", assert_close_to_reference(grad, ref_grads[name], base_grads[name], f"d{name}"))


def replayed_keep_mask(torch_seed: int, n_rows: int, n_cols: int, dropout_p: float, device,
                       quads: bool = False) -> torch.Tensor:
    """The ``[n_rows, n_cols]`` keep-mask a kernel drew for its first dropout after ``torch.manual_seed(torch_seed)``
    (``quads``: the feed-forward's stream, four lanes a Philox call)."""
    torch.manual_seed(torch_seed)
    return dropout_keep_mask(draw_dropout_seed(device), n_rows, n_cols, dropout_p, device, quads=quads)
