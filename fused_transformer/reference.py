"""Plain PyTorch versions of every op: the CPU fallback and, run in float64, the oracle for the kernels.

These functions do no argument checking (``fused_transformer.functional`` does it once for every backend)
and favour clarity over speed: attention materialises the ``[B, H, Lq, Lk]`` score matrix.

Dropout takes an explicit ``keep_mask`` (bool, True = keep) so a kernel's own random mask can be replayed
here exactly; without one, a mask is drawn from torch's generator.

Precision: float64 inputs are computed in float64. Lower precisions do their matrix products in the input
dtype (as PyTorch would), except attention's scores ``q @ k^T``, which are computed, like its softmax and the
normalisation statistics, in float32 (as PyTorch's fused attention does; float16 scores overflow past 65504).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .contract import (  # noqa: F401 (softmax_scale and stats_dtype are part of the reference)
    NO_SCORE_MODS, AttentionMasks, AttentionSpec, KVCache, KVCacheSpec, ScoreMods, Window, softmax_scale,
    stats_dtype,
)

Tensor = torch.Tensor

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def dropout(x: Tensor, p: float, keep_mask: Optional[Tensor] = None) -> Tensor:
    """Inverted dropout: ``x * keep / (1 - p)``; ``keep_mask`` (bool, True = keep) replays a given mask."""
    if p == 0.0:
        return x
    if keep_mask is None:
        keep_mask = torch.rand(x.shape, device=x.device) >= p
    return x * keep_mask.to(x.dtype) * (1.0 / (1.0 - p))


def causal_keep(lq: int, lk: int, alignment: str, device: torch.device) -> Tensor:
    """Bool ``[lq, lk]``, True where query i may see key j.

    ``top_left``: j <= i.  ``bottom_right``: j <= i + (lk - lq), the last query sees every key.
    """
    offset = 0 if alignment == "top_left" else lk - lq
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    return cols <= rows + offset


def last_real_position(padding_mask: Tensor) -> Tensor:
    """``[B]`` int64: one past the last position of each row of ``padding_mask`` ``[B, L]`` (True = padding) that is
    not padding; 0 for a row of padding only. Computed on the mask's device (no host sync)."""
    batch, length = padding_mask.shape
    if length == 0:
        return torch.zeros(batch, dtype=torch.int64, device=padding_mask.device)
    positions = torch.arange(1, length + 1, device=padding_mask.device)
    return torch.where(padding_mask, 0, positions).amax(dim=1)


def alignment_offset(
    lq: int, lk: int, alignment: str, query_padding_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
) -> Union[int, Tensor]:
    """The offset ``o`` of the causal alignment (query i's diagonal key is ``i + o``): 0 for ``top_left``;
    ``lk - lq`` for ``bottom_right``, or, when ``query_padding_mask`` is given, ``[B]`` per sequence: one past
    its last real key (``lk`` without ``key_padding_mask``) minus one past its last real query, so that each
    sequence's last real query is aligned with its last real key."""
    if alignment == "top_left":
        return 0
    if query_padding_mask is None:
        return lk - lq
    key_end = last_real_position(key_padding_mask) if key_padding_mask is not None else lk
    return key_end - last_real_position(query_padding_mask)


def window_keep(lq: int, lk: int, offset: Union[int, Tensor], window: Window,
                is_causal: bool, device: torch.device) -> Optional[Tensor]:
    """Bool, broadcastable to ``[B, 1, lq, lk]``: True where query i may see key j under the causal mask and the
    window, ``i + o - left <= j <= i + o + right`` (``o`` from ``alignment_offset``, ``right`` 0 when causal;
    None = no limit on that side). None when neither limits anything."""
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    offset = torch.as_tensor(offset, device=device).reshape(-1, 1, 1, 1)
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    relative = cols - rows - offset  # j - (i + o)
    keep = torch.ones_like(relative, dtype=torch.bool)
    if left is not None:
        keep &= relative >= -left
    if right is not None:
        keep &= relative <= right
    return keep


def attention_scores(
    q: Tensor,
    k: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    query_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: Window = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
) -> Tensor:
    """Scaled, modified (``modify_scores``: query i at position ``i + o``, ``o`` the causal alignment's offset), masked
    scores ``[B, H, Lq, Lk]`` in the statistics dtype; -inf where a key is masked (every key of a padding query)."""
    dtype = stats_dtype(q.dtype)
    k = _repeat_kv_heads(k, q.shape[1])
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * softmax_scale(q.shape[-1], scale)
    lq, lk = q.shape[-2], k.shape[-2]
    offset = alignment_offset(lq, lk, causal_alignment, query_padding_mask, key_padding_mask)
    mods = ScoreMods(softcap, alibi_slopes)
    if mods.given:
        query_position = torch.arange(lq, device=q.device)[:, None] + torch.as_tensor(
            offset, device=q.device).reshape(-1, 1, 1, 1)  # [1 or B, 1, Lq, 1]
        scores = modify_scores(scores, mods, query_position, torch.arange(lk, device=q.device))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)  # as torch adds it: NaN + -inf stays NaN
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if query_padding_mask is not None:
        scores = scores.masked_fill(query_padding_mask[:, None, :, None], float("-inf"))
    keep = window_keep(lq, lk, offset, window, is_causal, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def modify_scores(scores: Tensor, mods: ScoreMods, query_position: Tensor, key_position: Tensor) -> Tensor:
    """``scores`` ``[B, H, Lq, Lk]`` (scaled) with ``mods`` applied in their order: capped, ``softcap * tanh(s /
    softcap)``, then biased by ALiBi, ``-slope * |query position - key position|`` (positions broadcastable to
    ``[B, 1, Lq, 1]`` and ``[Lk]``)."""
    if mods.softcap is not None:
        scores = mods.softcap * torch.tanh(scores / mods.softcap)
    if mods.alibi_slopes is not None:
        slopes = mods.alibi_slopes.to(scores.dtype).expand(*scores.shape[:2])[:, :, None, None]
        scores = scores - slopes * (query_position - key_position).abs().to(scores.dtype)
    return scores


def _repeat_kv_heads(x: Tensor, q_heads: int) -> Tensor:
    """Grouped-query attention: query head h reads key/value head ``h // (q_heads // kv_heads)``."""
    kv_heads = x.shape[1]
    return x if kv_heads == q_heads else x.repeat_interleave(q_heads // kv_heads, dim=1)


def _softmax_and_lse(scores: Tensor, sinks: Optional[Tensor] = None,
                     real_rows: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax over the last dim that gives 0 (and zero gradients) for rows with no finite score (every key
    masked, or no key at all), and NaN for rows with a NaN score, as torch's softmax does. ``sinks`` ``[H]``: a logit
    per head (dim 1) that joins the denominator of every row that ``real_rows`` (broadcastable to the rows; None: all)
    says is a query; rows that are not stay zeros with LSE -inf."""
    if scores.shape[-1] == 0:  # amax has nothing to reduce; the sum below is 0, as for fully masked rows
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        if real_rows is not None:
            sink = sink.masked_fill(~real_rows, float("-inf"))
        row_max = torch.maximum(row_max, sink)
    # Shifting by any constant leaves the softmax unchanged; detaching it keeps -inf rows out of autograd.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    exp = torch.exp(scores - shift)
    total = exp.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - shift)
    has_key = total != 0  # NaN counts as a key: the row stays NaN
    probs = exp / torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(has_key, shift + torch.log(torch.where(has_key, total, torch.ones_like(total))), float("-inf"))
    return probs, lse.squeeze(-1)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    query_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: Window = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    keep_mask: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Reference for ``fused_transformer.functional.attention`` (same arguments, plus ``keep_mask``).

    ``keep_mask``: bool, broadcastable to ``[B, H, Lq, Lk]``, True where a probability survives dropout.
    Returns the output ``[B, H, Lq, D]`` and, with ``return_lse``, the log-sum-exp ``[B, H, Lq]`` of the
    scaled, masked scores (before dropout), -inf for rows with no key, NaN for rows with a NaN score.
    """
    scores = attention_scores(
        q, k, attn_mask=attn_mask, key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    real_rows = None if query_padding_mask is None else ~query_padding_mask[:, None, :, None]
    probs, lse = _softmax_and_lse(scores, sinks, real_rows)
    probs = dropout(probs, dropout_p, keep_mask)
    out = torch.matmul(probs.to(v.dtype), _repeat_kv_heads(v, q.shape[1]))
    return (out, lse) if return_lse else out


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: Window = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    keep_mask: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Reference for ``fused_transformer.functional.attention_varlen``: ``attention`` on each sequence's slice
    of the packed ``q [Tq, H, D]``, ``k / v [Tk, Hkv, D]``, one sequence at a time.

    ``keep_mask``: bool ``[B, H, max_seqlen_q, max_seqlen_k]``; sequence b uses its top-left
    ``[H, len_q, len_k]`` corner. Returns ``[Tq, H, D]`` and, with ``return_lse``, the LSE ``[H, Tq]``.
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        keep = keep_mask[b : b + 1, :, : q1 - q0, : k1 - k0] if keep_mask is not None else None
        out, lse = attention(
            q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
            is_causal=is_causal, causal_alignment=causal_alignment, window=window, dropout_p=dropout_p, scale=scale,
            softcap=softcap, alibi_slopes=None if alibi_slopes is None else alibi_slopes.expand(
                len(starts_q) - 1, q.shape[1])[b], sinks=sinks, return_lse=True, keep_mask=keep,
        )
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_empty((0, *q.shape[1:]))
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=stats_dtype(q.dtype))
    return out, lse


def attention_weights(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    query_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    window: Window = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
) -> Tensor:
    """The normalised attention probabilities ``[B, H, Lq, Lk]`` (before dropout), from the forward's LSE (with sinks
    in it, a row's weights sum to less than 1)."""
    scores = attention_scores(
        q, k, attn_mask=attn_mask, key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, window=window, scale=scale, softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    lse = lse.to(scores.dtype)[..., None]
    # Rows with no key (lse -inf) give 0; a NaN lse (a NaN score) gives a NaN row, as torch's softmax does.
    probs = torch.exp(scores - torch.where(lse.isneginf(), torch.zeros_like(lse), lse))
    return probs.to(q.dtype)


def run_attention(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                  mods: ScoreMods = NO_SCORE_MODS, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The reference backend's entry for ``functional.attention``: ``(out, lse)``."""
    if masks.query_lengths is not None:
        raise ValueError("query_lengths is an option of the Triton kernels' entry; pass a query_padding_mask")
    return attention(q, k, v, **_mask_options(masks), **_spec_options(spec), **mods._asdict(), sinks=sinks,
                     return_lse=True)


def _mask_options(masks: AttentionMasks) -> dict:
    return dict(attn_mask=masks.attn_mask, key_padding_mask=masks.key_padding_mask,
                query_padding_mask=masks.query_padding_mask)


def _spec_options(spec: AttentionSpec) -> dict:
    """The keyword arguments of ``attention`` a spec holds (the reference computes in full precision: no TF32)."""
    return dict(is_causal=spec.is_causal, causal_alignment=spec.causal_alignment, window=spec.window,
                dropout_p=spec.dropout_p, scale=spec.scale)


def run_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, spec: AttentionSpec, mods: ScoreMods = NO_SCORE_MODS,
                         sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The reference backend's entry for ``functional.attention_varlen``: ``(out, lse)``."""
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **_spec_options(spec),
                            **mods._asdict(), sinks=sinks, return_lse=True)


def run_attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                          softcap: Optional[float] = None) -> Tensor:
    """The reference backend's entry for ``functional.attention_weights`` (``softcap``: the reference's alone, the
    backends' interface has none)."""
    return attention_weights(q, k, lse, **_mask_options(masks), is_causal=spec.is_causal,
                             causal_alignment=spec.causal_alignment, window=spec.window, scale=spec.scale,
                             softcap=softcap)


def cached_keys(cache: KVCache) -> Tuple[Tensor, Tensor]:
    """The cache's keys and values as ``[B, capacity, Hkv, D]`` (a paged cache gathered through its block table)."""
    if cache.block_table is None:
        return cache.k, cache.v
    # Entries past a sequence's last block may hold anything (they are never read as keys): clamp them in range.
    blocks = cache.block_table.long().clamp(0, cache.k.shape[0] - 1)
    return cache.k[blocks].flatten(1, 2), cache.v[blocks].flatten(1, 2)


def attention_with_kvcache(q: Tensor, cache: KVCache, mods: ScoreMods, sinks: Optional[Tensor],
                           spec: KVCacheSpec) -> Tuple[Tensor, Tensor]:
    """Reference for ``functional.attention_with_kvcache`` once the new keys are in the cache: ``(out [B, Lq, H, D],
    lse [B, H, Lq])``. Query i of sequence b sits at key position ``lengths[b] - Lq + i``; scores are scaled,
    modified (``modify_scores``), masked (keys past the sequence's length, causal, window), and a sink logit per head
    joins each row's denominator."""
    batch, lq, heads, _ = q.shape
    dtype = stats_dtype(q.dtype)
    k, v = cached_keys(cache)
    lk = k.shape[1]
    k, v = (_repeat_kv_heads(t.transpose(1, 2), heads) for t in (k, v))  # [B, H, capacity, D]
    scores = torch.matmul(q.transpose(1, 2).to(dtype), k.to(dtype).transpose(-1, -2)) * spec.scale
    lengths = cache.lengths.long().to(q.device)
    query_position = (lengths[:, None] - lq + torch.arange(lq, device=q.device))[:, None, :, None]  # [B, 1, Lq, 1]
    key_position = torch.arange(lk, device=q.device)[None, None, None, :]
    scores = modify_scores(scores, mods, query_position, key_position)
    keep = key_position < lengths[:, None, None, None]
    relative = key_position - query_position
    left, right = spec.window if spec.window is not None else (None, None)
    if spec.is_causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        keep = keep & (relative >= -left)
    if right is not None:
        keep = keep & (relative <= right)
    scores = scores.masked_fill(~keep, float("-inf"))
    past_the_end = (torch.arange(lk, device=q.device) >= lengths[:, None])[:, None, :, None]  # [B, 1, capacity, 1]
    v = v.masked_fill(past_the_end, 0.0)  # unwritten cache slots may hold NaN: 0 * NaN would reach the output
    if sinks is not None:
        sink = sinks.to(dtype)[None, :, None, None].expand(batch, heads, lq, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse.isneginf(), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(probs.to(v.dtype), v)
    return out.transpose(1, 2).to(q.dtype), lse


def run_attention_with_kvcache(q: Tensor, cache: KVCache, mods: ScoreMods, sinks: Optional[Tensor],
                               spec: KVCacheSpec) -> Tuple[Tensor, Tensor]:
    """The reference backend's entry for ``functional.attention_with_kvcache`` (after the append)."""
    return attention_with_kvcache(q, cache, mods, sinks, spec)


def append_to_cache(cache: KVCache, k_new: Tensor, v_new: Tensor) -> KVCache:
    """Write ``k_new`` / ``v_new`` ``[B, Lnew, Hkv, D]`` into the cache at each sequence's end, in place, and return
    the cache after it (its lengths counting them): a slice where every sequence of a contiguous cache ends at
    ``cache.uniform_length``, else an ``index_put_`` at indices made on the device (no host sync: CUDA-graph
    capturable and traceable)."""
    batch, new_len = k_new.shape[:2]
    uniform = cache.uniform_length
    if uniform is not None and cache.block_table is None:
        cache.k[:, uniform:uniform + new_len] = k_new
        cache.v[:, uniform:uniform + new_len] = v_new
    else:
        positions = cache.lengths.long()[:, None] + torch.arange(new_len, device=k_new.device)  # [B, Lnew]
        if cache.block_table is None:
            rows = (torch.arange(batch, device=k_new.device)[:, None].expand(batch, new_len), positions)
        else:
            block_size = cache.k.shape[1]
            rows = (cache.block_table.long().gather(1, positions // block_size), positions % block_size)
        cache.k.index_put_(rows, k_new)
        cache.v.index_put_(rows, v_new)
    return KVCache(cache.k, cache.v, cache.lengths + new_len, cache.block_table,
                   None if uniform is None else uniform + new_len)


def __getattr__(name: str) -> Callable[..., object]:
    """The reference of every other op, written in its own module (``fused_transformer.ops``): ``reference.<op>``."""
    if name.startswith("__"):
        raise AttributeError(name)
    from . import ops

    try:
        return ops.get(name).reference
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
