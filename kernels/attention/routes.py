"""Which kernel runs an attention call on a GPU: ours, or torch's SDPA where a GPU measured SDPA faster on exactly the
same computation.

``route`` is a pure function of what decides it (the GPU's compute capability, dtype, head dim, heads, lengths,
the mask, dropout, whether the caller needs the LSE) over ``ROUTES``, rows measured by ``bench --device cuda``.
A call goes to SDPA only where its result is the same as ours: no mask but ``is_causal`` (SDPA's causal mask is
top-left, so with ``Lq != Lk`` only that alignment), no dropout (SDPA's random mask is not our seed's), no window,
score modifiers, sinks or padding, the query's heads on the keys' (no GQA), and no LSE asked for (SDPA returns none).
A call that needs gradients goes there only where the row says SDPA's backward is deterministic as ours is (the
gpu-check graphs part holds ours to bitwise-equal gradients): its backward is then SDPA's own, the forward's route
deciding the backward's.

A GPU whose capability has no row runs ours (the documented default), as do ``use_backend("triton")`` (the caller's
choice, which ``fused_transformer.autograd`` honours before asking), the interpreter and a traced call (the custom
ops keep what torch.compile and torch.export see the same on every GPU).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ...contract import NO_SCORE_MODS, AttentionMasks, AttentionSpec, ScoreMods
from .._common import interpreting

Tensor = torch.Tensor


class Route(NamedTuple):
    """Calls that SDPA's own dispatch runs faster than our kernel on GPUs of ``capability``, as measured."""

    capability: int  # major * 10 + minor
    dtypes: Tuple[torch.dtype, ...]
    head_dims: Tuple[int, ...]
    masks: Tuple[str, ...]  # "none", "causal"
    sdpa_backend: str  # what SDPA's dispatch picked there
    with_gradients: bool  # also calls that need gradients (SDPA's backward measured faster and deterministic)
    measured: str


ROUTES: Tuple[Route, ...] = (
    # bench --device cuda:0 --quick (16k tokens a batch, 2048 / D heads, L 1024 and 4096), twice: ours against the
    # fastest SDPA backend 0.54-0.79x forward and 0.54-0.71x forward + backward (2026-11-28, bdb1535; docs/benchmarks.md
    # "On a GPU"), 0.54-0.85x at 660f042. Host time on a tiny call: SDPA 30 us forward, 231 forward + backward; ours
    # 44 and 420. The backward (forward + backward 0.54-0.71x) is not taken: cuDNN's determinism is unmeasured (the
    # gpu-check graphs part measures it now: sdpa_determinism).
    Route(90, (torch.bfloat16,), (64, 128), ("none", "causal"), "cudnn_attention", False,
          "H200, torch 2.11 + cuDNN 9.19, triton 3.6, bfloat16"),
)


def mask_kind(q: Tensor, k: Tensor, masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
              sinks: Optional[Tensor]) -> Optional[str]:
    """``"none"`` or ``"causal"`` where SDPA computes what we compute from ``is_causal`` alone, else None."""
    if not masks.unmasked or mods is not NO_SCORE_MODS or sinks is not None:
        return None
    if spec.window is not None or spec.dropout_p != 0.0:
        return None
    if not spec.is_causal:
        return "none"
    return "causal" if not spec.bottom_right or q.shape[2] == k.shape[2] else None


def route(capability: Optional[int], dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, query_len: int,
          key_len: int, mask: Optional[str], needs_lse: bool, needs_grad: bool) -> Optional[Route]:
    """The row that sends this call to SDPA, or None for our kernel."""
    if capability is None or mask is None or needs_lse or heads != kv_heads or min(query_len, key_len) == 0:
        return None
    for row in ROUTES:
        if (row.capability == capability and dtype in row.dtypes and head_dim in row.head_dims and mask in row.masks
                and (row.with_gradients or not needs_grad)):
            return row
    return None


@functools.lru_cache(maxsize=None)
def _cuda_capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def capability_of(device: torch.device) -> Optional[int]:
    """The compute capability of a CUDA ``device`` (queried once per device), None elsewhere and under the
    interpreter. Not ``targets.target_of``, which gives a newer GPU the plans of the closest older one."""
    if device.type != "cuda" or interpreting():
        return None
    return _cuda_capability(device)


def attention_composed(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                       mods: ScoreMods, sinks: Optional[Tensor], needs_lse: bool,
                       needs_grad: bool) -> Optional[Tensor]:
    """``o`` by ``F.scaled_dot_product_attention`` (differentiated by autograd) where ``route`` says so; None for
    the calls our kernels run."""
    if torch.compiler.is_compiling():  # first: torch.compile would trace into the cached capability query
        return None
    capability = capability_of(q.device)
    if capability is None:
        return None
    row = route(capability, q.dtype, q.shape[3], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                mask_kind(q, k, masks, spec, mods, sinks), needs_lse, needs_grad)
    if row is None:
        return None
    return F.scaled_dot_product_attention(q, k, v, is_causal=spec.is_causal, scale=spec.scale)
