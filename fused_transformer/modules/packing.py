"""Padding costs nothing: a padded batch's real tokens, packed sequence after sequence for ``attention_varlen``,
and back. The layers and stacks decide here whether an input can be packed at all."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import is_causal_mask


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run any hook (its own or a global one)."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def row_wise_norm(norm: Optional[nn.Module]) -> bool:
    """Whether ``norm`` (None: absent) normalises each token on its own, so packed tokens get the same result."""
    return norm is None or (isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) and len(norm.normalized_shape) == 1)


def fits_padding(mask: Optional[Tensor], x: Tensor, batch_first: bool) -> bool:
    """Whether ``mask`` is None or a bool key padding mask of ``x`` (``[B, L]`` for ``x`` ``[B, L, d]`` or
    ``[L, B, d]``, ``[L]`` for unbatched ``x`` ``[L, d]``): one that packing can take."""
    if mask is None:
        return True
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or x.dim() not in (2, 3) or mask.is_nested:
        return False
    if x.dim() == 2:
        return tuple(mask.shape) == (x.shape[0],)
    return tuple(mask.shape) == ((x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0]))


# False: never pack, run every module padded (with zeros at padding all the same). For tests and measurements.
PACK_PADDING = True


def packing_allowed() -> bool:
    """Whether inputs are packed at all: not while compiling (boolean indexing has data-dependent
    shapes: a graph break, and an error under ``fullgraph`` and ``torch.export``)."""
    return PACK_PADDING and not torch.compiler.is_compiling()


def causal_or_none(mask: Optional[Tensor], is_causal: bool, size: int) -> Optional[bool]:
    """What the self-attention mask means for packing: False for no mask, True for the causal mask (by the
    ``is_causal`` hint or by value), None for any other mask (not packed). With the hint but no mask, None:
    the padded path raises torch.nn's error."""
    if mask is None:
        return None if is_causal else False
    if tuple(mask.shape) != (size, size):
        return None
    return True if is_causal or is_causal_mask(mask, None, size) else None


class Packing(NamedTuple):
    """Where the real tokens of a padded batch sit. They are packed sequence after sequence, each in its
    order, so that right padding, left padding and holes all work."""

    # [T] int64: each real token's row in the input seen as [B * L, d] (or [L * B, d]) in its layout; None when
    # the tokens are the input's own rows in order (batch-first with no padding: packing is a view).
    index: Optional[Tensor]
    cu_seqlens: Tensor  # [B + 1] int32 on the CPU: 0, then the running sums of the sequence lengths
    max_seqlen: int
    shape: Tuple[int, ...]  # the input's shape without its feature dim


def pack(x: Tensor, padding: Optional[Tensor], batch_first: bool) -> Tuple[Tensor, Packing]:
    """``x`` ``[B, L, d]``, ``[L, B, d]`` (``batch_first=False``) or ``[L, d]`` -> its real tokens ``[T, d]``
    (``padding``: True = padding, as ``fits_padding`` checked; None = every token) and where they were. Reads
    the lengths on the host (boolean indexing synchronises anyway) and keeps ``cu_seqlens`` there, where every
    ``attention_varlen`` call of the layers checks them without waiting for the GPU."""
    shape = tuple(x.shape[:-1])
    seq_first = x.dim() == 3 and not batch_first
    batch, length = (shape[1], shape[0]) if seq_first else ((1, shape[0]) if x.dim() == 2 else shape)
    ranks = None  # batch-major positions of the real tokens; None: all of them
    if padding is None:
        lengths = torch.full((batch,), length, dtype=torch.int32)
        max_seqlen = length
    else:
        keep = ~padding.reshape(batch, length)
        ranks = keep.flatten().nonzero().squeeze(1)  # waits for the GPU: the lengths' copy below then costs none
        lengths = keep.sum(1, dtype=torch.int32).cpu()
        max_seqlen = int(lengths.max()) if batch else 0
        if ranks.shape[0] == batch * length:
            ranks = None
    if ranks is None and seq_first:
        ranks = torch.arange(batch * length, device=x.device)
    # Tokens go sequence after sequence; a seq-first input holds token l of sequence b at row l * B + b.
    index = (ranks % length) * batch + ranks // length if seq_first and length else ranks
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    rows = x.reshape(-1, x.shape[-1])
    # Advanced indexing (and index_put in unpack): their backward is deterministic on every device.
    return rows if index is None else rows[index], Packing(index, cu_seqlens, max_seqlen, shape)


def unpack(tokens: Tensor, packing: Packing) -> Tensor:
    """Packed tokens ``[T, d]`` back to the padded input's layout ``[*shape, d]``, zeros at padding."""
    if packing.index is None:
        return tokens.reshape(*packing.shape, tokens.shape[-1])
    rows = tokens.new_zeros(math.prod(packing.shape), tokens.shape[-1]).index_put((packing.index,), tokens)
    return rows.view(*packing.shape, tokens.shape[-1])


def zero_padding(x: Tensor, padding: Optional[Tensor], batch_first: bool) -> Tensor:
    """The padded path's output with zeros at padding, as the packed path gives (``padding`` as
    ``fits_padding`` checked; None: nothing to zero)."""
    if padding is None:
        return x
    if x.dim() == 3 and not batch_first:
        padding = padding.t()
    return x.masked_fill(padding[..., None], 0.0)


def batch_first_of(layer: nn.Module) -> bool:
    return bool(getattr(getattr(layer, "self_attn", None), "batch_first", False))


def seq_len(layer: nn.Module, x: Tensor) -> int:
    """The sequence length of a stack's input, laid out as its first layer's attention expects."""
    return x.shape[1 if batch_first_of(layer) and x.dim() == 3 else 0]
