"""Attention's contract: the checks every attention entry runs once, on every backend, and the errors' wording
(``ValueError`` / ``TypeError`` naming the argument, what it got and what was expected). The types the backends take
(``AttentionMasks``, ``AttentionSpec``, ``ScoreMods``, ``PackedSequences``, ``KVCache``) are the backends' interface
and live below them, in ``fused_transformer.contract``.

Differences from torch, on purpose (docs/differences.md): ``attn_mask`` with ``is_causal`` applies both, where SDPA
raises; a key that a bool mask, padding or the causal mask hides is out of the softmax whatever its score (a NaN
there does not reach the row).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from ...contract import (
    CAUSAL_ALIGNMENTS, FLOAT_DTYPES, NO_SCORE_MODS, AttentionMasks, AttentionSpec, KVCacheSpec, PackedSequences,
    ScoreMods, Window, check_dropout, check_same, check_tensor, describe, reads_values, softmax_scale,
)

Tensor = torch.Tensor

# The keyword arguments of functional's ops and their defaults, for the kernel-level entries that take them as
# ``**options`` beside options of their own (``options_of`` checks the names).
ATTENTION_OPTIONS = dict(attn_mask=None, key_padding_mask=None, query_padding_mask=None, is_causal=False,
                         causal_alignment="top_left", window=None, dropout_p=0.0, scale=None, softcap=None,
                         alibi_slopes=None, sinks=None, return_lse=False)
ATTENTION_WEIGHTS_OPTIONS = dict(attn_mask=None, key_padding_mask=None, query_padding_mask=None, is_causal=False,
                                 causal_alignment="top_left", window=None, scale=None)
ATTENTION_VARLEN_OPTIONS = dict(is_causal=False, causal_alignment="top_left", window=None, dropout_p=0.0, scale=None,
                                softcap=None, alibi_slopes=None, sinks=None, return_lse=False)


def check_window(window: object) -> Window:
    """``window`` as a ``(left, right)`` tuple of non-negative ints or None, or None when no side is limited."""
    if window is None:
        return None

    def bound(x: object) -> bool:
        return x is None or (isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0)

    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(bound(x) for x in window):
        raise ValueError(f"window={window!r} must be None or (left, right), each a non-negative int or None")
    left, right = window
    if left is None and right is None:
        return None
    return (None if left is None else int(left), None if right is None else int(right))


def check_padding_mask(name: str, mask: object, batch: int, length: int, anchor: Tensor) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be bool (True = padding), got {mask.dtype}")
    check_same(name, mask, "q", anchor, dtype=False)
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must be [batch, seq_{name[0]}] = {[batch, length]}, got {tuple(mask.shape)}")


def _check_flags(is_causal: object, causal_alignment: object, scale: object) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r} must be one of {CAUSAL_ALIGNMENTS}")
    if scale is not None and type(scale) is not float and (
            isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")


def attention_spec(head_dim: int, is_causal: object, causal_alignment: object, window: object, dropout_p: object,
                   scale: object) -> AttentionSpec:
    """The checked ``AttentionSpec`` of a call with these flags on inputs of ``head_dim`` (the common flags in one
    condition, the checks below for the rest)."""
    if (window is None and scale is None and is_causal.__class__ is bool
            and dropout_p.__class__ is float and 0.0 <= dropout_p < 1.0 and causal_alignment in CAUSAL_ALIGNMENTS):
        return AttentionSpec(is_causal, causal_alignment, None, dropout_p, softmax_scale(head_dim))  # as checked
    _check_flags(is_causal, causal_alignment, scale)
    return AttentionSpec(is_causal, causal_alignment, check_window(window), check_dropout(dropout_p),
                         softmax_scale(head_dim, scale))


def score_mods(q: Tensor, batch: int, heads: int, softcap: object = None,
               alibi_slopes: object = None) -> ScoreMods:
    """The checked ``ScoreMods`` of a call on ``q`` over ``batch`` sequences of ``heads`` query heads."""
    if softcap is None and alibi_slopes is None:
        return NO_SCORE_MODS
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not softcap > 0 or not math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap!r} must be None or a finite number > 0")
    if alibi_slopes is not None:
        _check_head_parameter("alibi_slopes", alibi_slopes, q, ((heads,), (batch, heads)))
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise ValueError("alibi_slopes requires grad, but the slopes are constants here (no gradient flows to "
                             "them); pass alibi_slopes.detach()")
    return ScoreMods(None if softcap is None else float(softcap), alibi_slopes)


def check_sinks(q: Tensor, heads: int, sinks: object) -> None:
    """Attention sinks ``[H]``: float32 (float64 too with float64 inputs), on q's device; differentiable."""
    if sinks is not None:
        _check_head_parameter("sinks", sinks, q, ((heads,),))


def _check_head_parameter(name: str, t: object, q: Tensor, shapes: Tuple[Tuple[int, ...], ...]) -> None:
    """A parameter per head (``shapes``: ``[H]`` or also ``[B, H]``): float32, float64 too with float64 inputs, on
    q's device."""
    dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes or tuple(t.shape) not in shapes:
        raise TypeError(f"{name} must be {' or '.join(str(d).replace('torch.', '') for d in dtypes)} of shape "
                        f"{' or '.join(str(list(s)) for s in shapes)}, got {describe(t)}")
    check_same(name, t, "q", q, dtype=False)


def _plain_qkv(q: object, k: object, v: object, rank: int) -> bool:
    """Whether q, k, v are tensors of ``rank`` dims in one float dtype on one device: what ``_check_qkv`` checks, in
    one expression for the calls that pass (it says what is wrong with the others)."""
    return (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and q.dtype in FLOAT_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and q.dim() == rank and k.dim() == rank
            and v.dim() == rank and k.device == q.device and v.device == q.device)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, rank: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, rank=rank)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)


def _check_value_and_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]  # [B, H, L, D] or packed [T, H, D]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k/v's heads ({kv_heads})")


def check_attention_args(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks) -> None:
    """The tensors of an ``attention`` call: q ``[B, H, Lq, D]``, k / v ``[B, Hkv, Lk, D]`` and the masks."""
    if not _plain_qkv(q, k, v, 4):
        _check_qkv(q, k, v, rank=4)
    (batch, heads, lq, dim), (kb, _, lk, kd) = q.shape, k.shape
    if kb != batch or kd != dim:
        raise ValueError(
            f"k must be [batch={batch}, kv_heads, seq_k, head_dim={dim}] to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    _check_value_and_heads(q, k, v)
    attn_mask = masks.attn_mask
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added), got {attn_mask.dtype}")
        check_same("attn_mask", attn_mask, "q", q, dtype=False)
        target = (batch, heads, lq, lk)
        shape = tuple(attn_mask.shape)
        if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
            raise ValueError(f"attn_mask of shape {shape} does not broadcast to [B, H, Lq, Lk] = {list(target)}")
    if masks.key_padding_mask is not None:
        check_padding_mask("key_padding_mask", masks.key_padding_mask, batch, lk, q)
    if masks.query_padding_mask is not None:
        check_padding_mask("query_padding_mask", masks.query_padding_mask, batch, lq, q)


def check_varlen_args(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: object, cu_seqlens_k: object,
                      max_seqlen_q: object, max_seqlen_k: object) -> None:
    """The tensors of an ``attention_varlen`` call but the values of cu_seqlens (``check_cu_seqlens_values`` reads
    them: a host sync from a GPU). cu_seqlens may be on the CPU with q on a GPU: the caller copies them."""
    _check_qkv(q, k, v, rank=3)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [total_k, kv_heads, head_dim={q.shape[-1]}] to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    _check_value_and_heads(q, k, v)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must hold the same number of sequences")


def _check_cu_seqlens(name: str, cu: object, max_seqlen: object, anchor: Tensor) -> None:
    max_name = "max_seqlen_" + name[-1]
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        raise TypeError(f"{name} must be int32 [batch + 1] (sequence start offsets, then the total), got "
                        f"{describe(cu)}")
    if cu.device.type != "cpu":  # on the host it is read for free (check_cu_seqlens_values), then copied
        check_same(name, cu, "q", anchor, dtype=False)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0:
        raise TypeError(f"{max_name}={max_seqlen!r} must be a non-negative int")


def packed_sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     device: torch.device) -> PackedSequences:
    """The checked offsets as the backends take them, on ``device``: offsets kept on the host (checked there for free)
    copied without waiting, and one tensor for queries and keys copied once."""
    same = cu_seqlens_k is cu_seqlens_q
    if cu_seqlens_q.device != device:
        cu_seqlens_q = cu_seqlens_q.to(device, non_blocking=True)
    if same or cu_seqlens_k.device != device:
        cu_seqlens_k = cu_seqlens_q if same else cu_seqlens_k.to(device, non_blocking=True)
    return PackedSequences(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))


def check_cu_seqlens_values(name: str, cu: Tensor, total: int, max_seqlen: int) -> None:
    """The values of ``cu``, where ``reads_values`` allows (on the host; on a GPU only when asked)."""
    max_name = "max_seqlen_" + name[-1]
    if not reads_values(cu):
        return
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got {values[0]} .. "
                         f"{values[-1]}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name} holds a sequence of {max(lengths)} tokens, more than {max_name}={max_seqlen}")


def kvcache_spec(head_dim: int, is_causal: object, window: object, scale: object, num_splits: object) -> KVCacheSpec:
    """The checked ``KVCacheSpec`` of an ``attention_with_kvcache`` call on inputs of ``head_dim``."""
    _check_flags(is_causal, "bottom_right", scale)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                   or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be None (chosen from the GPU) or an int >= 1")
    return KVCacheSpec(is_causal, check_window(window), softmax_scale(head_dim, scale),
                       None if num_splits is None else int(num_splits))


def check_kvcache_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                       v_new: Optional[Tensor], cache_seqlens: object, block_table: Optional[Tensor]) -> Tensor:
    """The tensors of an ``attention_with_kvcache`` call but their values; returns ``cache_seqlens`` as an int32
    ``[B]`` tensor (an int is every sequence's length)."""
    check_tensor("q", q, rank=4)
    batch, lq, heads, dim = q.shape
    paged = block_table is not None
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, rank=4)
        check_same(name, t, "q", q)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    kv_heads = k_cache.shape[2]
    layout = "[num_blocks, block_size, kv_heads, head_dim]" if paged else "[batch, max_seqlen, kv_heads, head_dim]"
    if k_cache.shape[3] != dim or (not paged and k_cache.shape[0] != batch):
        raise ValueError(f"k_cache must be {layout} with head_dim={dim}" + ("" if paged else f", batch={batch}")
                         + f" to match q {tuple(q.shape)}, got {tuple(k_cache.shape)}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's kv heads ({kv_heads})")
    if paged:
        if not isinstance(block_table, Tensor):
            raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise TypeError(f"block_table must be int32 [batch={batch}, max_blocks] (each sequence's block ids), "
                            f"got {describe(block_table)}")
        check_same("block_table", block_table, "q", q, dtype=False)
        if k_cache.shape[1] == 0:
            raise ValueError(f"a paged k_cache needs blocks of at least one key, got {tuple(k_cache.shape)}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(name, t, rank=4)
            check_same(name, t, "q", q)
            if t.shape[0] != batch or tuple(t.shape[2:]) != (kv_heads, dim):
                raise ValueError(f"{name} must be [batch={batch}, new_len, kv_heads={kv_heads}, head_dim={dim}], "
                                 f"got {tuple(t.shape)}")
        if v_new.shape != k_new.shape:
            raise ValueError(f"v_new must have k_new's shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens={cache_seqlens} must be >= 0")
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, Tensor):
        raise TypeError(f"cache_seqlens must be an int or a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
        raise TypeError(f"cache_seqlens must be int32 [batch={batch}] (keys already in each sequence's cache), got "
                        f"{describe(cache_seqlens)}")
    if cache_seqlens.device.type != "cpu":  # on the host it is read for free (check_kvcache_values), then copied
        check_same("cache_seqlens", cache_seqlens, "q", q, dtype=False)
    return cache_seqlens


def check_kvcache_values(cache_seqlens: Tensor, new_len: int, capacity: int, block_table: Optional[Tensor],
                         num_blocks: int, block_size: int, known_length: Optional[int] = None) -> Optional[list[int]]:
    """The values of ``cache_seqlens`` and ``block_table`` before anything is written to the cache: lengths within the
    cache, the blocks they reach in range. Lengths the host holds (an int, ``known_length``, or a CPU tensor) cost
    nothing to read; a GPU's are read only where ``reads_values`` allows (when asked: each read waits for the GPU),
    never under ``torch.compile`` or CUDA graph capture (the GPU's kernels still write and read nothing outside the
    cache). Returns the lengths it read (``[known_length]`` when it read none but knows them; None when it checked
    nothing)."""
    if known_length is not None and block_table is None:
        lengths = [known_length]
    elif not reads_values(cache_seqlens, block_table):
        return None
    else:
        lengths = cache_seqlens.tolist()
    if lengths and (min(lengths) < 0 or max(lengths) + new_len > capacity):
        raise ValueError(f"cache_seqlens {lengths} plus {new_len} new keys must stay within the cache's {capacity} "
                         "keys per sequence")
    if block_table is None:
        return lengths
    for row, n in zip(block_table.tolist(), lengths):
        used = row[:(n + new_len + block_size - 1) // block_size]
        if any(not 0 <= block < num_blocks for block in used):
            raise ValueError(f"block_table holds block ids outside [0, {num_blocks}) for the keys in use: {used}")
    return lengths
