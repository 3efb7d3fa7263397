"""Small helpers shared by the kernel modules (no kernels here)."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def draw_dropout_seed() -> int:
    """A Philox seed drawn from torch's default CPU generator, so ``torch.manual_seed`` reproduces dropout."""
    return int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).item())


def contiguous_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Kernels take strides; only the last dim must be contiguous (copy only when it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()
