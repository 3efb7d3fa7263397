"""What every op's autograd Function shares (each op's Function is written once, in its module under
``fused_transformer.ops``): how a Function is applied (``traced_apply``), and the dropout seed a forward draws and
its backward replays. The ops call their backend's forward directly when no input needs a gradient, without
autograd's per-call cost (about 20 us, as much as the kernel of a one-token decoding step).
"""
from __future__ import annotations

from typing import Optional

import torch

from .contract import Seed, draw_dropout_seed

Tensor = torch.Tensor


def traced_apply() -> bool:
    """Whether a Function must be applied through torch's Python layer (``Function.apply``): under torch.compile
    and functorch transforms. Elsewhere the ops call autograd's own (C++) apply, which skips that layer's look for
    functorch wrappers left over from a finished transform among the arguments, one by one (about 4 us of a 60 us
    attention forward + backward on the host), and adds no frame."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def draw_seed(p: float, device: torch.device) -> Optional[Seed]:
    """A dropout seed for a call with dropout ``p`` on ``device`` (None without dropout)."""
    return draw_dropout_seed(device) if p > 0.0 else None


def saved_seed(ctx, seed: Optional[Seed]) -> Optional[Tensor]:
    """What ``save_for_backward`` takes of a seed: a tensor; a host draw (an int) is kept on ctx instead."""
    ctx.host_seed = seed if isinstance(seed, int) else None
    return None if isinstance(seed, int) else seed


def backward_seed(ctx, saved: Optional[Tensor]) -> Optional[Seed]:
    """The forward's seed, from what ``_saved_seed`` kept."""
    return saved if ctx.host_seed is None else ctx.host_seed
