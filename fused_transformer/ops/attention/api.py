"""Attention's public entries: ``attention`` (dense, every mask in the kernel), ``attention_varlen`` (packed sequences),
``attention_with_kvcache`` (decoding over a KV cache) and ``attention_weights`` (the probabilities an ``attention`` call
used, from its LSE). Each checks its arguments once (``contract``), asks the route who runs it (``facts``) and hands
the call to its Function (``function``) or, forward only, to the backend's entry.

Under ``torch.autocast`` they run in the autocast dtype, as autocast runs SDPA: float16 / bfloat16 / float32 tensor
arguments are cast (masks, the cache and float64 are left alone) and the op runs with autocast off inside.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import torch

from ... import backend, reference, route
from ...contract import NO_SCORE_MODS, AttentionMasks, KVCache, Window, autocast_all, autocast_dtype
from . import contract, facts, function, torch_paths

Tensor = torch.Tensor

_NO_MASKS = AttentionMasks()


def _autocast_off(anchor: Tensor, cast: Optional[torch.dtype]) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``anchor``'s device when it was on (the arguments are already in the dtype it
    chose), else nothing. The hot entry writes the two branches out instead: entering even a null context costs."""
    return contextlib.nullcontext() if cast is None else torch.autocast(anchor.device.type, enabled=False)


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
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Scaled dot-product attention, ``softmax(q @ k^T * scale + mask) @ v``.

    Args:
        q: ``[B, H, Lq, D]``.
        k, v: ``[B, Hkv, Lk, D]``; ``H`` a multiple of ``Hkv`` (grouped-query attention: query head ``h``
            reads key/value head ``h // (H // Hkv)``).
        attn_mask: broadcastable to ``[B, H, Lq, Lk]``, as in ``scaled_dot_product_attention``: bool with
            True = may attend, or floating and added to the scores.
        key_padding_mask: ``[B, Lk]`` bool, True = padding (the ``nn.MultiheadAttention`` convention).
        query_padding_mask: ``[B, Lq]`` bool, True = padding: those query rows give zeros (LSE ``-inf``) and
            pass no gradient.
        is_causal: mask keys after the query. With ``causal_alignment="top_left"`` query ``i`` sees keys
            ``j <= i``; with ``"bottom_right"`` it sees ``j <= i + Lk - Lq`` (the last query sees every key,
            as in incremental decoding)::

                top_left, Lq=2, Lk=4     bottom_right, Lq=2, Lk=4
                  1 0 0 0                  1 1 1 0
                  1 1 0 0                  1 1 1 1

            With ``query_padding_mask`` given, ``bottom_right`` aligns each sequence on its own: its last real
            query with its last real key (``Lk - Lq`` becomes ``key_end - query_end``, one past the last
            position that is not padding, ``key_end = Lk`` without ``key_padding_mask``).
        window: ``(left, right)``, local attention: query ``i`` sees only keys ``i + o - left <= j <= i + o +
            right``, ``o`` the offset of the causal alignment above (0 for ``top_left``) whether or not
            ``is_causal``; None on a side (or ``window=None``) means no limit there. Key tiles wholly outside
            the window are skipped.

        dropout_p: probability of dropping an attention probability (always applied when > 0).
        scale: multiplies the scores; default ``1 / sqrt(D)`` (1 for ``D = 0``, whose scores are all 0).
        softcap: the scaled scores become ``softcap * tanh(scores / softcap)`` (Gemma 2, Grok), before ALiBi and
            the masks.
        alibi_slopes: float32 ``[H]`` or ``[B, H]`` (float64 too for float64 inputs): adds ``-slope * |i + o - j|``
            to the score of query ``i`` and key ``j``, ``o`` the causal alignment's offset (as for ``window``);
            computed in the kernel, never stored as a ``[Lq, Lk]`` bias. Constants: no gradient flows to them.
        sinks: float32 ``[H]`` (float64 too for float64 inputs): a logit per head that joins every query row's
            softmax denominator without a value (attention sinks, as gpt-oss uses them), so a row's weights sum to
            less than 1; the LSE includes it. Differentiable.
        return_lse: also return the log-sum-exp ``[B, H, Lq]`` (float32, float64 for float64 inputs) of the
            scaled, masked scores.

    Returns:
        ``[B, H, Lq, D]`` in q's dtype, and the LSE if asked. Edges as ``scaled_dot_product_attention`` (math
        backend) has them: a query row with no key left to attend (every key masked by ``is_causal``, a bool
        or ``-inf`` float ``attn_mask`` or ``key_padding_mask``, or ``Lk = 0``) gives zeros (LSE ``-inf``) and
        zero gradients; a NaN score (from q, k or a float ``attn_mask``) makes that row of the output and of
        the LSE NaN, and the NaN flows back into the gradients as in torch; ``Lq = 0`` and ``D = 0`` give empty
        outputs (with ``D = 0`` every score is 0, and the LSE and ``attention_weights`` follow the masks
        alone). A float ``attn_mask`` is added as SDPA adds it, so a NaN score at a ``-inf`` key still makes
        the row NaN. One difference, on purpose: a key that a bool mask, padding or the causal mask hides is
        out of the softmax whatever its score (the kernels skip such key blocks), so a NaN there does not
        reach the row, where SDPA, which adds those masks as ``-inf``, gives NaN. Another: ``attn_mask`` and
        ``is_causal`` together apply both, where SDPA documents an error (docs/differences.md).
    """
    cast = autocast_dtype(q, matmul=True)
    if cast is not None:
        q, k, v = autocast_all(cast, q, k, v)
    key = None
    if (attn_mask is None and key_padding_mask is None and query_padding_mask is None and softcap is None
            and alibi_slopes is None and sinks is None and window is None and q.__class__ is Tensor
            and k.__class__ is Tensor and v.__class__ is Tensor and is_causal.__class__ is bool
            and causal_alignment.__class__ is str and dropout_p.__class__ is float and return_lse.__class__ is bool
            and (scale is None or scale.__class__ is float) and not torch.compiler.is_compiling()):
        # Everything the checks, the spec and the route read of a call without masks: a call seen before needs none
        # of them again (route.recall: its decision, and the spec, kept where it was checked).
        key = ("attention", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               is_causal, causal_alignment, dropout_p, scale, return_lse, route.needs_grad(q, k, v),
               torch.are_deterministic_algorithms_enabled(), backend.get_backend())
        found = route.recall(key)
        if found is not None:
            masks, mods, spec, name = _NO_MASKS, NO_SCORE_MODS, found[2], found[1].backend
    if key is None or found is None:
        masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask)
        contract.check_attention_args(q, k, v, masks)
        mods = contract.score_mods(q, q.shape[0], q.shape[1], softcap, alibi_slopes)
        if sinks is not None:
            contract.check_sinks(q, q.shape[1], sinks)
        spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, dropout_p, scale)
        name = facts.decide(q, k, v, masks, spec, mods, sinks, return_lse, remember_as=key).backend
    if cast is None:
        out, lse = function.run(name, q, k, v, masks, spec, mods, sinks, return_lse)
    else:
        with torch.autocast(q.device.type, enabled=False):
            out, lse = function.run(name, q, k, v, masks, spec, mods, sinks, return_lse)
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
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a batch of sequences of different lengths, packed without padding.

    Sequence ``b`` holds queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and keys / values
    ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]`` and attends only within itself, exactly as ``attention``
    would on that sequence alone; no work is done for padding.

    Args:
        q: ``[Tq, H, D]``; k, v: ``[Tk, Hkv, D]``, ``H`` a multiple of ``Hkv`` (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]``: 0, the running sums of the lengths, and ``Tq`` / ``Tk``
            (``torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))``), on q's device or on the
            CPU (with q on a GPU: checked without waiting for the GPU, then copied; on the GPU not read, unless
            ``fused_transformer.contract.set_device_value_checks(True)``: a read would wait for the work queued before it).
            Self-attention's one tensor for both is read once.
        max_seqlen_q, max_seqlen_k: at least every sequence's length (they size the kernels' grids).
        is_causal, causal_alignment, window, scale: as in ``attention``, per sequence: with ``bottom_right``
            each sequence's last query is aligned with its last key.
        dropout_p, softcap, sinks: as in ``attention``.
        alibi_slopes: as in ``attention``, ``[H]`` or ``[B, H]``; positions counted within each sequence.
        return_lse: also return the LSE ``[H, Tq]`` (float32, float64 for float64 inputs).

    Returns:
        ``[Tq, H, D]`` in q's dtype, and the LSE if asked. Edges as in ``attention``: a query with no visible
        key gives zeros. The values of ``cu_seqlens_*`` are checked where ``fused_transformer.contract.reads_values`` allows.
    """
    cast = autocast_dtype(q, matmul=True)
    q, k, v = autocast_all(cast, q, k, v)
    contract.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = contract.score_mods(q, cu_seqlens_q.shape[0] - 1, q.shape[1], softcap, alibi_slopes)
    contract.check_sinks(q, q.shape[1], sinks)
    spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, dropout_p, scale)
    contract.check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    same = cu_seqlens_k is cu_seqlens_q
    if not (same and k.shape[0] == q.shape[0] and max_seqlen_k == max_seqlen_q):  # self-attention: read once
        contract.check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    seqs = contract.packed_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    name = facts.decide_packed("attention_varlen", q, max_seqlen_k, mods, sinks,
                                  route.needs_grad(q, k, v, sinks)).backend
    with _autocast_off(q, cast):
        out, lse = function.run_varlen(name, q, k, v, seqs, spec, mods, sinks, return_lse)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cache_seqlens: Union[Tensor, int],
    k_new: Optional[Tensor] = None,
    v_new: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    is_causal: bool = True,
    window: Window = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of new queries to a KV cache, after writing the new keys and values into it (decoding, chunked
    prefill); forward only.

    Args:
        q: ``[B, Lq, H, D]``, ``Lq >= 1`` (1 for a decoding step).
        k_cache, v_cache: ``[B, Lmax, Hkv, D]``, or a paged cache ``[num_blocks, block_size, Hkv, D]`` with
            ``block_table``; ``H`` a multiple of ``Hkv`` (grouped-query attention reads each KV head once).
        cache_seqlens: int32 ``[B]`` (or an int for every sequence): keys already in each sequence's cache. On the
            CPU (with q on a GPU) it is checked without waiting for the GPU, then copied; on the GPU it is not read
            (``fused_transformer.contract.set_device_value_checks(True)`` checks it there, a read that waits for the GPU).
        k_new, v_new: ``[B, Lnew, Hkv, D]`` or None: written into the cache in place at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1`` before attending, so sequence ``b`` attends to
            ``cache_seqlens[b] + Lnew`` keys.
        block_table: int32 ``[B, max_blocks]``: key position ``p`` of sequence ``b`` lives in block
            ``block_table[b, p // block_size]``, row ``p % block_size``.
        is_causal: query ``i`` sits at key position ``n_b - Lq + i`` (``n_b`` the sequence's keys after the append,
            bottom-right alignment) and sees the keys up to it.
        window: ``(left, right)`` around that position, as in ``attention``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (after the scale, before ALiBi and masks).
        alibi_slopes: float32 ``[H]`` or ``[B, H]``: adds ``-slope * |query position - key position|``.
        sinks: float32 ``[H]``: one logit per head that joins each row's softmax denominator (no value).
        scale: default ``1 / sqrt(D)``.
        num_splits: key splits of the GPU kernel (None: chosen from the SM count; 1: no split). Results do not
            depend on it beyond round-off.
        return_lse: also return the LSE ``[B, H, Lq]`` (float32; float64 for float64 inputs).

    Returns:
        ``[B, Lq, H, D]`` in q's dtype, and the LSE if asked. A query with no visible key gives zeros (LSE
        ``-inf``, or the sink). Lengths and block ids the host holds are checked before the cache is touched (a
        refused call leaves it as it was); on a GPU only when asked (``fused_transformer.contract.set_device_value_checks``), never
        under ``torch.compile`` or CUDA graph capture: the GPU's kernels write and read nothing outside the cache
        whatever their values.
    """
    cast = autocast_dtype(q, matmul=True)
    q, k_new, v_new = autocast_all(cast, q, k_new, v_new)  # the cache keeps its dtype: it is written in place
    lengths = contract.check_kvcache_args(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
    mods = contract.score_mods(q, q.shape[0], q.shape[2], softcap, alibi_slopes)
    contract.check_sinks(q, q.shape[2], sinks)
    spec = contract.kvcache_spec(q.shape[-1], is_causal, window, scale, num_splits)
    new_len = 0 if k_new is None else k_new.shape[1]
    known_length = cache_seqlens if isinstance(cache_seqlens, int) else None
    cache = KVCache(k_cache, v_cache, lengths, block_table, known_length)
    host_lengths = contract.check_kvcache_values(lengths, new_len, cache.capacity, block_table, k_cache.shape[0],
                                                 k_cache.shape[1], known_length)
    if lengths.device != q.device:  # lengths the caller kept on the host, checked there: now the kernels' copy
        cache = cache._replace(lengths=lengths.to(q.device, non_blocking=True))
    name = facts.decide_kvcache(q, cache, host_lengths, new_len, mods, sinks, spec, return_lse).backend
    if name == "torch":  # no LSE: the route refuses torch's path where it is asked for
        with _autocast_off(q, cast):
            return torch_paths.kvcache_sdpa(q, cache, host_lengths, k_new, v_new, spec.is_causal, spec.scale)
    implementation = backend.ops(name).attention_with_kvcache
    new_keys = ()
    if new_len and getattr(implementation, "appends_new_keys", False):
        new_keys = (k_new, v_new)  # its kernel writes them itself; cache.lengths count the keys before them
    elif new_len:
        if known_length is None and host_lengths and min(host_lengths) == max(host_lengths):
            cache = cache._replace(uniform_length=host_lengths[0])  # read anyway: the append is then a slice
        cache = reference.append_to_cache(cache, k_new, v_new)
    with _autocast_off(q, cast):
        out, lse = implementation(q, cache, mods, sinks, spec, *new_keys)
    return (out, lse) if return_lse else out


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
) -> Tensor:
    """The attention probabilities ``[B, H, Lq, Lk]`` (before dropout) that ``attention`` used, recomputed
    from its ``lse`` (``return_lse=True``); same masks, scale and ``softcap`` as that call. For
    ``need_weights=True``. The weights kernels do not cap: a call with ``softcap`` runs on the reference (the route
    decides, and ``explain()`` says so).
    """
    cast = autocast_dtype(q, matmul=True)
    q, k = autocast_all(cast, q, k)
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask)
    contract.check_attention_args(q, k, k, masks)
    spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, 0.0, scale)
    if not isinstance(lse, Tensor) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must be a tensor of shape [B, H, Lq] = {list(q.shape[:3])}")
    if softcap is not None:
        contract.score_mods(q, q.shape[0], q.shape[1], softcap)
    name = route.choose(facts.weights_call(q, k, softcap), q.device).backend
    with _autocast_off(q, cast):
        if softcap is not None:  # only the reference caps (the route ran it there)
            return backend.ops(name).attention_weights(q, k, lse, masks, spec, softcap=softcap)
        return backend.ops(name).attention_weights(q, k, lse, masks, spec)
