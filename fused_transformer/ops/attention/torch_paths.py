"""torch's own path of each attention entry: SDPA given the call's masks in its own form, the baseline the tools time
(``Op.torch_path``). It is not the oracle (``fused_transformer.reference`` is): where every key of a row is masked
SDPA gives NaN where ``attention`` gives zeros.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ...contract import KVCache
from ...reference import append_to_cache

Tensor = torch.Tensor


def sdpa_mask(q: Tensor, k: Tensor, attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
              is_causal: bool = False, causal_alignment: str = "top_left",
              alibi_slopes: Optional[Tensor] = None) -> Tuple[Optional[Tensor], bool]:
    """The masks of an ``attention`` call in SDPA's form: ``(attn_mask, is_causal)``, one bool (True = may attend) or
    float mask where SDPA cannot take the call's from ``is_causal`` alone (ALiBi as a float bias ``[1 or B, H, Lq,
    Lk]``)."""
    lq, lk = q.shape[-2], k.shape[-2]
    if attn_mask is None and key_padding_mask is None and alibi_slopes is None and (
            not is_causal or causal_alignment == "top_left" or lq == lk):
        return None, is_causal
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool else
                                          mask.masked_fill(~keep, float("-inf")))
    if alibi_slopes is not None:
        positions_q = torch.arange(lq, device=q.device)[:, None] + (lk - lq if causal_alignment == "bottom_right" else 0)
        distance = (positions_q - torch.arange(lk, device=q.device)[None, :]).abs().to(q.dtype)
        slopes = alibi_slopes.to(q.dtype)
        bias = -(slopes[:, :, None, None] if slopes.dim() == 2 else slopes[None, :, None, None]) * distance
        mask = bias if mask is None else (bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else
                                          bias + mask)
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq if causal_alignment == "bottom_right"
                                                                         else 0)
        mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool else
                                          mask.masked_fill(~keep, float("-inf")))
    return mask, False


def torch_path(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor] = None,
               key_padding_mask: Optional[Tensor] = None, is_causal: bool = False, causal_alignment: str = "top_left",
               alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, scale: Optional[float] = None,
               **others: object) -> Tensor:
    """``attention`` as SDPA computes it, its masks given as SDPA takes them (``sdpa_mask``: made in the call; the
    bench makes them before its timed calls). SDPA has no query padding, window, softcap or sinks: a call with one is
    a ValueError. A row every key of which is masked gives SDPA's NaN where ``attention`` gives zeros."""
    given = sorted(name for name, value in others.items() if value is not None and value is not False)
    if given:
        raise ValueError(f"torch's path of attention (SDPA) takes no {', '.join(given)}")
    mask, causal = sdpa_mask(q, k, attn_mask, key_padding_mask, is_causal, causal_alignment, alibi_slopes)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def varlen_torch_path(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, *, is_causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """``attention_varlen`` as SDPA computes it: one call over every packed token, a block-diagonal mask keeping each
    sequence to itself (top-left causal within it)."""
    mask = _same_sequence(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], is_causal)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _same_sequence(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, tq: int, tk: int, is_causal: bool) -> Tensor:
    def sequence_of(cu: Tensor, total: int) -> Tensor:
        return torch.searchsorted(cu.to(torch.int64), torch.arange(total, device=cu.device), right=True) - 1

    seq_q, seq_k = sequence_of(cu_seqlens_q, tq), sequence_of(cu_seqlens_k, tk)
    mask = seq_q[:, None] == seq_k[None, :]
    if is_causal:
        within_q = torch.arange(tq, device=mask.device) - cu_seqlens_q.to(torch.int64)[seq_q]
        within_k = torch.arange(tk, device=mask.device) - cu_seqlens_k.to(torch.int64)[seq_k]
        mask &= within_k[None, :] <= within_q[:, None]
    return mask


def kvcache_sdpa(q: Tensor, cache: KVCache, host_lengths: Sequence[int], k_new: Optional[Tensor],
                 v_new: Optional[Tensor], is_causal: bool, scale: Optional[float]) -> Tensor:
    """torch's path of a routed ``attention_with_kvcache`` call on a contiguous ``cache`` (before the append, its
    lengths on q's device; ``host_lengths`` the same lengths as the host holds them, one for every sequence where they
    are all equal): ``k_new`` / ``v_new`` written in place at each sequence's end (``reference.append_to_cache``),
    then SDPA over the keys the longest sequence uses, a bool mask keeping each sequence's own keys and, causal, the
    keys up to its queries (aligned bottom-right); without a mask where every sequence holds as many keys and one
    query each. Every query must see a key (``facts.kvcache_refusal``): SDPA gives NaN where ours gives zeros."""
    new_len = 0 if k_new is None else k_new.shape[1]
    uniform = min(host_lengths) == max(host_lengths)
    if new_len:
        if uniform and cache.uniform_length is None:
            cache = cache._replace(uniform_length=host_lengths[0])  # the append is then a slice
        cache = append_to_cache(cache, k_new, v_new)
    used, lq = max(host_lengths) + new_len, q.shape[1]
    keys, values = cache.k[:, :used].transpose(1, 2), cache.v[:, :used].transpose(1, 2)  # [B, Hkv, used, D]
    mask = None
    if not uniform or (is_causal and lq > 1):
        ends = cache.lengths.to(torch.int64)[:, None, None, None]  # [B, 1, 1, 1]: each sequence's keys
        key_at = torch.arange(used, device=q.device)
        mask = key_at < ends  # [B, 1, 1, used]
        if is_causal:
            mask = mask & (key_at <= ends - lq + torch.arange(lq, device=q.device)[:, None])  # [B, 1, Lq, used]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != keys.shape[1])
    return out.transpose(1, 2)


def kvcache_torch_path(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: object,
                       k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None, is_causal: bool = True,
                       scale: Optional[float] = None) -> Tensor:
    """``attention_with_kvcache`` on a contiguous cache as the route's torch path computes it (``kvcache_sdpa``), from
    the public call's arguments (``cache_seqlens`` an int or a host tensor)."""
    batch = q.shape[0]
    if isinstance(cache_seqlens, int):
        host, lengths = [cache_seqlens], torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        host, lengths = cache_seqlens.tolist(), cache_seqlens.to(q.device)
    cache = KVCache(k_cache, v_cache, lengths, None, cache_seqlens if isinstance(cache_seqlens, int) else None)
    return kvcache_sdpa(q, cache, host, k_new, v_new, is_causal, scale)
