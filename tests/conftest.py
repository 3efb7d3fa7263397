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
