"""Test setup. Without a GPU the Triton kernels run on CPU tensors under the Triton interpreter, which must be
switched on before triton is first imported: that is why this happens here, at collection."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_backend():
    """Every test starts on the default backend, whatever an earlier test chose."""
    from fused_transformer import backend

    saved = backend.get_backend()
    yield
    backend.set_backend(saved)


@pytest.fixture
def interpreter_rounds_to_nearest(monkeypatch):
    """The Triton interpreter truncates float32 -> bfloat16 casts where a GPU rounds to nearest: make it round,
    so interpreted kernels are held to the GPU's rounding error, not twice that."""
    from fused_transformer.kernels._common import interpreting

    if not interpreting():
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

    monkeypatch.setattr(interpreter, "_convert_float", convert_rounding)


@pytest.fixture
def nan_filled_outputs(monkeypatch):
    """Every floating buffer allocated with torch.empty / empty_like starts as NaN, so an element a kernel
    forgets to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
