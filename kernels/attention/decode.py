"""Attention over a KV cache for decoding (and chunked prefill), split over the keys (FlashDecoding): forward only.

One program takes one (batch, kv head), one tile of BLOCK_M rows and one split of the keys. Its rows are the
(query position, head of the group) pairs of that kv head, row r = i * G + g for query i and head kv_head * G + g
(G = H / Hkv), so each key tile is read once per kv head and split, not once per query head:

    s = q k^T * scale -> softcap * tanh(s / softcap) -> - slope |qpos - kpos|      (softcap, ALiBi: optional)
    online softmax over the split's keys, as the forward (fwd.py): o_s = softmax(s) v, lse_s = logsumexp(s)

Query i of sequence b sits at key position qpos = cache_lens[b] - Lq + i (bottom-right) and sees key j when
qpos - left <= j <= qpos + right (causal: right = 0). cache_lens is read on the device and the grid comes from
static shapes only, so a launch can be captured in a CUDA graph. With several splits every program writes its
o_s (float32) and lse_s to scratch and the merge kernel combines them:

    lse = logsumexp_s(lse_s [, sink]),   o = sum_s exp(lse_s - lse) o_s

a split that saw no key has lse_s = -inf (weight 0); a row that saw none gives o = 0, lse = -inf (with a sink: the
sink alone, lse = sink). With one split the decode kernel writes o and lse itself, the sink folded in there.
The key cache is contiguous [B, Lmax, Hkv, D] or paged [num_blocks, block_size, Hkv, D], key p of sequence b in
block block_table[b, p // block_size], row p % block_size (any block_size: each key's page is looked up).

A decoding step's new keys and values are appended by a kernel of their own before the decode launch, which also
writes the lengths after them: one launch for what were two slice copies (or index_put_ calls) and an add. It
writes nothing past a sequence's cache, into a block outside the pool, or for a sequence whose new keys do not fit,
whatever the lengths and block ids (the host checks those where it may read them, not under torch.compile or CUDA
graph capture); the decode kernel leaves out a key whose block id lies outside the pool instead of reading it.
"""
import functools
from typing import List, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ...contract import (
    KVCache, KVCacheSpec, ScoreMods, score_mods_flat, score_mods_of_flat, window_bounds, window_of_bounds,
)
from ...reference import append_to_cache
from .. import variants
from .._common import (
    cdiv, interpreting as interpreting_now, launch_kernel, next_power_of_2, positional_constexprs, traced,
)
from ..aot import AotKernel
from ..targets import CAPABILITIES, Target
from ..toolchain import Version
from .configs import Tile, head_dim_bucket
from .jit import (
    EVERY_SCORE_MOD, MODS_SIGNATURE, NO_SCORE_MOD, _dot, _modified_scores, _score_mod_values, _tile_mask,
    score_mod_args, score_mod_flags,
)
from .launch import MAX_GRID_YZ, kernel_window, sm_count_of

Tensor = torch.Tensor

LN2 = 0.6931471805599453
# The lowest finite float32: the running max of a row whose keys so far are all masked (see fwd.py).
_LOWEST = -3.4028234663852886e38


@triton.jit
def _with_sink(out, lse2, SINKS, head, real_rows):
    """``out`` and ``lse2`` (log2 units) of rows whose softmax denominator also holds exp(SINKS[head])."""
    sink = tl.load(SINKS + head, mask=real_rows, other=0.0) * 1.4426950408889634
    top = tl.maximum(tl.maximum(lse2, sink), -3.4028234663852886e38)
    total = top + tl.math.log2(tl.math.exp2(lse2 - top) + tl.math.exp2(sink - top))
    return out * tl.math.exp2(lse2 - total)[:, None], total


@triton.jit
def _store_rows(O, LSE, out, lse2, batch, query, head, n_queries, n_heads, real_rows, dims,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store rows (query, head) of sequence ``batch``: O [B, Lq, H, D] and LSE [B, H, Lq], both contiguous."""
    out_rows = (batch * n_queries + query) * n_heads + head
    tl.store(O + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(O.dtype.element_ty),
             mask=_tile_mask(real_rows, dims, HEAD_DIM, BLOCK_D))
    tl.store(LSE + (batch * n_heads + head) * n_queries + query, lse2 * 0.6931471805599453, mask=real_rows)


@triton.jit
def _cache_rows(BLOCK_TABLE, batch, positions, ok, stride_kb, stride_kn, stride_vb, stride_vn, stride_tb, stride_tn,
                page_size, PAGED: tl.constexpr):
    """The offsets in K and V of key ``positions`` of sequence ``batch`` (where ``ok``), and (PAGED) their block ids,
    0 where not ok; without PAGED, ``batch`` in their place."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + batch * stride_tb + (positions // page_size) * stride_tn, mask=ok, other=0)
        offset = positions % page_size
        k_rows = page.to(tl.int64) * stride_kb + offset * stride_kn
        v_rows = page.to(tl.int64) * stride_vb + offset * stride_vn
    else:
        page = batch
        k_rows = batch * stride_kb + positions.to(tl.int64) * stride_kn
        v_rows = batch * stride_vb + positions.to(tl.int64) * stride_vn
    return k_rows, v_rows, page


@triton.jit
def _attention_append_kernel(
    K_NEW, V_NEW,  # [B, n_new, Hkv, D] contiguous: the keys and values to append
    K, V,  # the cache, as the decode kernel takes it
    CACHE_LENS,  # [B] int32: keys before the new ones
    NEW_LENS,  # [B] int32, written: CACHE_LENS + n_new
    BLOCK_TABLE,  # [B, max_blocks] int32 (PAGED)
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb, stride_tn,
    kv_heads, n_new, max_keys, n_blocks, page_size,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr,
):
    # Program (b Hkv + h, j) writes rows j BLOCK_N .. of (b, h)'s new keys and values at positions CACHE_LENS[b] + ..
    batch_kv = tl.program_id(0)
    batch = (batch_kv // kv_heads).to(tl.int64)
    kv_head = batch_kv % kv_heads
    old_len = tl.load(CACHE_LENS + batch)
    if (kv_head == 0) & (tl.program_id(1) == 0):
        tl.store(NEW_LENS + batch, old_len + n_new)
    new = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    positions = old_len + new
    ok = new < tl.where((old_len >= 0) & (old_len + n_new <= max_keys), n_new, 0)  # none where they do not fit
    k_rows, v_rows, page = _cache_rows(BLOCK_TABLE, batch, positions, ok, stride_kb, stride_kn, stride_vb, stride_vn,
                                       stride_tb, stride_tn, page_size, PAGED)
    if PAGED:
        ok = ok & (page >= 0) & (page < n_blocks)
    dims = tl.arange(0, BLOCK_D)
    mask = _tile_mask(ok, dims, HEAD_DIM, BLOCK_D)
    new_rows = ((batch * n_new + new) * kv_heads + kv_head).to(tl.int64) * HEAD_DIM
    k = tl.load(K_NEW + new_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    tl.store(K + kv_head * stride_kh + k_rows[:, None] + dims[None, :], k.to(K.dtype.element_ty), mask=mask)
    v = tl.load(V_NEW + new_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    tl.store(V + kv_head * stride_vh + v_rows[:, None] + dims[None, :], v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _attention_decode_kernel(
    Q,  # [B, Lq, H, D], read through strides
    K, V,  # [B, Lmax, Hkv, D]; PAGED: [num_blocks, block_size, Hkv, D]; read through strides
    CACHE_LENS,  # [B] int32: the keys of each sequence
    BLOCK_TABLE,  # [B, max_blocks] int32: each sequence's cache blocks (PAGED)
    SINKS,  # [H] float32 contiguous (HAS_SINKS; folded in here only without SPLIT)
    O,  # [B, Lq, H, D] contiguous, q's dtype; SPLIT: [splits, B Hkv, Lq G, D] float32
    LSE,  # [B, H, Lq] float32 contiguous, natural log; SPLIT: [splits, B Hkv, Lq G]
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,  # the batch (PAGED: block) and row strides
    stride_vb, stride_vn, stride_vh,
    stride_tb, stride_tn,
    n_queries, n_heads, kv_heads, kv_group,
    max_keys,  # Lmax; PAGED: max_blocks * block_size
    page_size, n_blocks,  # PAGED: the pool's blocks (a key in a block id outside it is left out, never read)
    window_left, window_right, scale,
    MODS,  # the score modifiers (jit.score_mod_args)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SCORE_MODS: tl.constexpr,
    HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0).to(tl.int64)
    batch_kv = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    batch = (batch_kv // kv_heads).to(tl.int64)
    kv_head = batch_kv % kv_heads
    n_rows = n_queries * kv_group
    k_len = tl.minimum(tl.load(CACHE_LENS + batch), max_keys)

    rows = first_row + tl.arange(0, BLOCK_M)
    real_rows = rows < n_rows
    query = rows // kv_group
    head = kv_head * kv_group + rows % kv_group
    qpos = k_len - n_queries + query
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + batch * stride_qb + query[:, None].to(tl.int64) * stride_qm + head[:, None] * stride_qh
                + dims[None, :], mask=_tile_mask(real_rows, dims, HEAD_DIM, BLOCK_D), other=0.0)
    mod_values = _score_mod_values(MODS, batch, head[:, None], SCORE_MODS)  # each row's head: < H, row or not
    qk_scale = scale * 1.4426950408889634  # log2 units, as exp2 takes the scores
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    # This split's key blocks, balanced over the splits (never an empty split while splits <= key blocks),
    # narrowed to the keys any row of the tile may see.
    key_blocks = tl.cdiv(max_keys, BLOCK_N)
    splits = tl.num_programs(0)
    key_start = (split * key_blocks // splits) * BLOCK_N
    key_end = tl.minimum(((split + 1) * key_blocks // splits) * BLOCK_N, k_len)
    last_qpos = k_len - n_queries + (tl.minimum(first_row + BLOCK_M, n_rows) - 1) // kv_group
    if HAS_WINDOW:  # the launcher folds causal into window_right (at most 0)
        first_qpos = k_len - n_queries + first_row // kv_group
        key_start = tl.maximum(key_start, tl.maximum(first_qpos - window_left, 0) // BLOCK_N * BLOCK_N)
        key_end = tl.minimum(key_end, last_qpos + window_right + 1)
    elif IS_CAUSAL:
        key_end = tl.minimum(key_end, last_qpos + 1)

    row_max = tl.full((BLOCK_M,), -3.4028234663852886e38, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for first_col in range(key_start, key_end, BLOCK_N):
        cols = first_col + tl.arange(0, BLOCK_N)
        key_ok = cols < k_len
        k_rows, v_rows, page = _cache_rows(BLOCK_TABLE, batch, cols, key_ok, stride_kb, stride_kn, stride_vb,
                                           stride_vn, stride_tb, stride_tn, page_size, PAGED)
        if PAGED:  # block ids go unchecked under torch.compile and CUDA graph capture: none is read outside the pool
            key_ok = key_ok & (page >= 0) & (page < n_blocks)
        kv_mask = _tile_mask(key_ok, dims, HEAD_DIM, BLOCK_D)
        k = tl.load(k_head + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), UPCAST, DOT_PRECISION)
        s, _ = _modified_scores(qk * qk_scale, qpos[:, None], cols[None, :], 0, mod_values, SCORE_MODS)
        keep = real_rows[:, None] & key_ok[None, :]
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= qpos[:, None] - window_left) & (cols[None, :] <= qpos[:, None]
                                                                             + window_right)
        elif IS_CAUSAL:
            keep = keep & (cols[None, :] <= qpos[:, None])
        s = tl.where(keep, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        p = tl.math.exp2(s - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_head + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
        row_max = new_max

    has_key = row_sum != 0.0
    out = acc / tl.where(has_key, row_sum, 1.0)[:, None]
    lse2 = tl.where(has_key, row_max + tl.math.log2(tl.where(has_key, row_sum, 1.0)), float("-inf"))
    if SPLIT:
        part_rows = (split * tl.num_programs(1) + batch_kv) * n_rows + rows
        tl.store(LSE + part_rows, lse2 * 0.6931471805599453, mask=real_rows)
        tl.store(O + part_rows[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=_tile_mask(real_rows, dims, HEAD_DIM, BLOCK_D))
    else:
        if HAS_SINKS:
            out, lse2 = _with_sink(out, lse2, SINKS, head, real_rows)
        _store_rows(O, LSE, out, lse2, batch, query, head, n_queries, n_heads, real_rows, dims, HEAD_DIM, BLOCK_D)


@triton.jit
def _attention_decode_merge_kernel(
    O_PART,  # [splits, B Hkv, Lq G, D] float32 contiguous: each split's normalised output
    LSE_PART,  # [splits, B Hkv, Lq G] float32 contiguous: each split's LSE, -inf where it saw no key
    SINKS,  # [H] float32 contiguous (HAS_SINKS)
    O,  # [B, Lq, H, D] contiguous, q's dtype
    LSE,  # [B, H, Lq] float32 contiguous
    n_queries, n_heads, kv_heads, kv_group, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    first_row = tl.program_id(0) * BLOCK_M
    batch_kv = tl.program_id(1)
    batch = (batch_kv // kv_heads).to(tl.int64)
    n_rows = n_queries * kv_group
    rows = first_row + tl.arange(0, BLOCK_M)
    real_rows = rows < n_rows
    query = rows // kv_group
    head = (batch_kv % kv_heads) * kv_group + rows % kv_group
    dims = tl.arange(0, BLOCK_D)
    mask = _tile_mask(real_rows, dims, HEAD_DIM, BLOCK_D)

    row_max = tl.full((BLOCK_M,), -3.4028234663852886e38, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for split in range(n_splits):
        part_rows = (split * tl.num_programs(1) + batch_kv).to(tl.int64) * n_rows + rows
        lse2 = tl.load(LSE_PART + part_rows, mask=real_rows, other=float("-inf")) * 1.4426950408889634
        part = tl.load(O_PART + part_rows[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
        new_max = tl.maximum(row_max, lse2)
        weight = tl.math.exp2(lse2 - new_max)
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * part
        row_max = new_max

    has_key = row_sum != 0.0
    out = acc / tl.where(has_key, row_sum, 1.0)[:, None]
    lse2 = tl.where(has_key, row_max + tl.math.log2(tl.where(has_key, row_sum, 1.0)), float("-inf"))
    if HAS_SINKS:
        out, lse2 = _with_sink(out, lse2, SINKS, head, real_rows)
    _store_rows(O, LSE, out, lse2, batch, query, head, n_queries, n_heads, real_rows, dims, HEAD_DIM, BLOCK_D)


# ------------------------------------------------------------------------------------------------- the plan

# Small tiles under the interpreter, so short test caches still cross several key tiles.
INTERPRETER_DECODE_TILE = Tile(16, 16, 1, 1)
MERGE_WARPS = 4
# Rows a merge program combines, whatever the decode tile: 64 rows of head dim 128 need a stack under Triton 3.6.
MERGE_ROWS = 16
# Splits at most: more would only add merge work (the merge reads every split's partial output).
MAX_SPLITS = 128
# SMs of a typical part of each target, for the report's table of programs per SM: A100, A40, L40S, H100.
TYPICAL_SM_COUNT = {80: 108, 86: 84, 89: 142, 90: 132}


def decode_tile(rows: int, dtype: torch.dtype, interpreting: Optional[bool] = None) -> Tile:
    """The tile of a decode launch with ``rows`` = Lq x (H / Hkv) rows per kv head: 16-bit inputs take 16 rows
    (tl.dot's least) for decoding, 64 for chunked prefill, and 64 keys a step; float32, whose exact products run on
    the CUDA cores, 16 x 16 (BM16_BN32 and BM64_BN16 spill up to 800 B at head_dim 128 under Triton 3.9)."""
    if interpreting_now() if interpreting is None else interpreting:
        return INTERPRETER_DECODE_TILE
    if dtype == torch.float32:
        return Tile(16, 16, 4, 2)
    return Tile(16, 64, 4, 2) if rows <= 16 else Tile(64, 64, 8, 2)


# The rules the decode launcher picks its key splits by (``decode_splits``), a variant of op "decode.split"
# (``kernels/variants.py``): the fewest splits that give every SM a program; or the fewest whose waves fill the SMs
# nearly as well as the best count does (the last wave of a grid that is not a multiple of the SM count leaves SMs
# idle).
SPLIT_RULES = ("fill_sms", "full_waves")
DEFAULT_SPLIT_RULE = "fill_sms"
# "full_waves": a count whose waves keep this share of the best count's SMs busy is as good.
WAVE_EFFICIENCY = 0.85
variants.register("decode.split", DEFAULT_SPLIT_RULE, {rule: "" for rule in SPLIT_RULES})


def shape_class(batch: int, kv_heads: int, max_keys: int) -> str:
    """The class of decode launches a measured split rule holds for: the (batch, kv head) programs and the cache's
    keys, each to its power of two (keys within 1024..65536): ``P8/L8192``."""
    return f"P{next_power_of_2(max(batch * kv_heads, 1))}/L{min(max(next_power_of_2(max(max_keys, 1)), 1024), 65536)}"


def decode_splits(batch: int, kv_heads: int, query_tiles: int, max_keys: int, sm_count: int, block_n: int,
                  rule: str = DEFAULT_SPLIT_RULE) -> int:
    """How many key splits to launch, never more than the key blocks (``cdiv(max_keys, block_n)``, so each split has
    one at least) nor ``MAX_SPLITS``; 1 when the grid fills the SMs already. ``rule`` "fill_sms": the fewest that
    give every SM a program (``batch * kv_heads * query_tiles * splits >= sm_count``, under two waves);
    "full_waves": the fewest whose waves keep ``WAVE_EFFICIENCY`` of the SMs busy that the best count keeps busy."""
    programs = batch * kv_heads * query_tiles
    key_blocks = cdiv(max_keys, block_n)
    if programs <= 0 or programs >= sm_count or key_blocks <= 1:
        return 1
    most = min(key_blocks, MAX_SPLITS)
    if rule == "fill_sms":
        return max(1, min(cdiv(sm_count, programs), most))
    if rule != "full_waves":
        raise ValueError(f"decode split rule {rule!r} is not one of {', '.join(SPLIT_RULES)}")
    busy = {splits: programs * splits / (cdiv(programs * splits, sm_count) * sm_count) for splits in range(1, most + 1)}
    best = max(busy.values())
    return min(splits for splits, share in busy.items() if share >= WAVE_EFFICIENCY * best)


def programs_per_sm(batch: int, kv_heads: int, max_keys: int, lq: int, heads: int,
                    target: Union[Target, int]) -> float:
    """Decode programs per SM that a launch of these sizes runs on a typical part of ``target``
    (``TYPICAL_SM_COUNT``), with the split count the launcher picks (bfloat16 tiles)."""
    capability = target if isinstance(target, int) else target.capability
    sm_count = TYPICAL_SM_COUNT[capability]
    tile = decode_tile(lq * (heads // kv_heads), torch.bfloat16, interpreting=False)
    query_tiles = cdiv(lq * (heads // kv_heads), tile.block_m)
    splits = decode_splits(batch, kv_heads, query_tiles, max_keys, sm_count, tile.block_n)
    return batch * kv_heads * query_tiles * splits / sm_count


# ---------------------------------------------------------------------------------------------- the launcher


def attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lens: Tensor, block_table: Optional[Tensor], *,
    is_causal: bool, window_left: Optional[int], window_right: Optional[int], scale: float, mods: ScoreMods,
    sinks: Optional[Tensor], num_splits: Optional[int],
) -> Tuple[Tensor, Tensor]:
    """Attention of ``q`` over a KV cache, split over the keys (arguments checked by the caller): the decode
    kernel, then with more than one split the merge kernel; traced (``_common.traced``) through the custom op
    ``fused_transformer::attention_decode``.

    Args:
        q: ``[B, Lq, H, D]`` (Lq >= 1), float16 / bfloat16 / float32, last dim contiguous.
        k_cache, v_cache: ``[B, Lmax, Hkv, D]``, or paged ``[num_blocks, block_size, Hkv, D]`` with
            ``block_table``; H a multiple of Hkv; last dim contiguous.
        cache_lens: int32 ``[B]``, the keys of each sequence (new ones included), read on the device.
        block_table: int32 ``[B, max_blocks]``: key p of sequence b lives in block ``block_table[b, p //
            block_size]``, row ``p % block_size``; None for a contiguous cache.
        is_causal, window_left, window_right: query i of sequence b sits at key position ``cache_lens[b] - Lq +
            i`` and sees the keys ``qpos - window_left <= p <= qpos + window_right`` (causal: ``p <= qpos``; a
            side that is None is unlimited)::

                cache_lens[b] = 5, Lq = 2, causal:   keys 0 1 2 3 4
                                        query 0       x x x x .
                                        query 1       x x x x x
        scale: applied to the scores, before ``mods``: ``softcap * tanh(s / softcap)``, then ALiBi's ``- slope *
            |qpos - p|`` (``alibi_slopes`` float32 ``[H]`` or ``[B, H]``).
        sinks: float32 ``[H]``: a logit per head that joins each row's softmax denominator (no value).
        num_splits: key splits (>= 1; None: ``decode_splits`` for this device). Splits past the key blocks, or past
            a sequence's keys, see no key and add nothing.

    Returns:
        ``out [B, Lq, H, D]`` in q's dtype and ``lse [B, H, Lq]`` float32 (natural log, the sink included). A row
        that sees no key gives zeros and LSE -inf (with a sink: the sink's logit).
    """
    if traced():
        return torch.ops.fused_transformer.attention_decode(q, k_cache, v_cache, cache_lens, block_table, is_causal,
                                                            window_left, window_right, scale, *score_mods_flat(mods),
                                                            sinks, num_splits)
    return _launch_decode(q, k_cache, v_cache, cache_lens, block_table, is_causal, window_left, window_right, scale,
                          mods, sinks, num_splits)


def attention_with_kvcache(q: Tensor, cache: KVCache, mods: ScoreMods, sinks: Optional[Tensor],
                           spec: KVCacheSpec, k_new: Optional[Tensor] = None,
                           v_new: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The Triton backend's ``attention_with_kvcache`` (arguments checked): ``(out [B, Lq, H, D], lse [B, H, Lq])``.
    With ``k_new`` / ``v_new`` (``appends_new_keys``) ``cache.lengths`` count the keys before them: an eager call
    appends them with the append kernel, a traced one (the custom ops write no cache), or a cache whose last dim is
    strided, with torch ops."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"triton attention_with_kvcache runs float16, bfloat16 and float32, got {q.dtype}; float64 "
                        "runs on the reference backend")
    if k_new is not None:  # the kernel writes rows of contiguous last dims
        if traced() or cache.k.stride(-1) != 1 or cache.v.stride(-1) != 1:
            cache = append_to_cache(cache, k_new, v_new)
        else:
            cache = cache._replace(lengths=append_new_keys(cache, k_new.contiguous(), v_new.contiguous()))
    left, right = window_bounds(spec.window)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, cache.k, cache.v))
    return attention_decode(q, k, v, cache.lengths, cache.block_table, is_causal=spec.is_causal, window_left=left,
                            window_right=right, scale=spec.scale, mods=mods, sinks=sinks,
                            num_splits=spec.num_splits)


# functional.attention_with_kvcache hands this backend the new keys and values instead of appending them itself:
# the append kernel replaces two slice copies (or index_put_ calls) and the lengths' update, two launches a step.
attention_with_kvcache.appends_new_keys = True

# The append kernel's tile: new keys a program writes (a decoding step has one), and its warps.
APPEND_ROWS = 16
APPEND_WARPS = 4


def append_new_keys(cache: KVCache, k_new: Tensor, v_new: Tensor) -> Tensor:
    """Write ``k_new`` / ``v_new`` ``[B, Lnew, Hkv, D]`` (contiguous) into the cache after the ``cache.lengths`` keys
    of each sequence, in place (``_attention_append_kernel``); returns the lengths after them, int32 ``[B]``."""
    batch, new_len, kv_heads, head_dim = k_new.shape
    new_lengths = torch.empty_like(cache.lengths)
    if batch * kv_heads == 0 or new_len == 0 or head_dim == 0:
        return torch.add(cache.lengths, new_len, out=new_lengths)
    paged = cache.block_table is not None
    k, v = cache.k, cache.v
    launch_kernel(_attention_append_kernel, (batch * kv_heads, cdiv(new_len, APPEND_ROWS)), (
        k_new, v_new, k, v, cache.lengths, new_lengths, cache.block_table, *k.stride()[:3], *v.stride()[:3],
        *(cache.block_table.stride() if paged else (0, 0)), kv_heads, new_len, cache.capacity,
        k.shape[0] if paged else 0, k.shape[1],
    ), 1 if interpreting_now() else APPEND_WARPS, BLOCK_N=APPEND_ROWS, BLOCK_D=head_dim_bucket(head_dim),
        HEAD_DIM=head_dim, PAGED=paged)
    return new_lengths


def _launch_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lens: Tensor, block_table: Optional[Tensor], is_causal: bool,
    window_left: Optional[int], window_right: Optional[int], scale: float, mods: ScoreMods,
    sinks: Optional[Tensor], num_splits: Optional[int],
) -> Tuple[Tensor, Tensor]:
    """The launches of ``attention_decode`` (same arguments, positional)."""
    batch, n_queries, heads, head_dim = q.shape
    paged = block_table is not None
    kv_heads = k_cache.shape[2]
    kv_group = heads // kv_heads
    page_size = k_cache.shape[1]
    max_keys = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    out = torch.empty((batch, n_queries, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:  # no query row: a grid of 0 programs is an error on a GPU
        return out, lse

    rows = n_queries * kv_group
    tile = decode_tile(rows, q.dtype)
    query_tiles = cdiv(rows, tile.block_m)
    if num_splits is None:
        rule = variants.chosen("decode.split", q.device, lambda: shape_class(batch, kv_heads, max_keys))
        num_splits = decode_splits(batch, kv_heads, query_tiles, max_keys, sm_count_of(q.device), tile.block_n, rule)
    if num_splits < 1:
        raise ValueError(f"attention_decode: num_splits={num_splits} must be at least 1")
    if batch * kv_heads > MAX_GRID_YZ or query_tiles > MAX_GRID_YZ:
        raise ValueError(f"attention_decode: batch x kv_heads = {batch * kv_heads} and {query_tiles} row tiles must "
                         f"each be at most {MAX_GRID_YZ} (a CUDA grid axis); split the batch")
    window = kernel_window(window_of_bounds(window_left, window_right), is_causal, n_queries + max_keys)
    block_d = head_dim_bucket(head_dim)
    split = num_splits > 1
    if split:
        o_target = torch.empty((num_splits, batch * kv_heads, rows, head_dim), dtype=torch.float32, device=q.device)
        lse_target = torch.empty((num_splits, batch * kv_heads, rows), dtype=torch.float32, device=q.device)
    else:
        o_target, lse_target = out, lse
    sinks = sinks.contiguous() if sinks is not None else None
    launch_kernel(_attention_decode_kernel, (num_splits, batch * kv_heads, query_tiles), (
        q, k_cache, v_cache, cache_lens, block_table, sinks, o_target, lse_target,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(block_table.stride() if paged else (0, 0)),
        n_queries, heads, kv_heads, kv_group, max_keys, page_size, k_cache.shape[0] if paged else 0,
        *(window if window is not None else (0, 0)), scale, score_mod_args(mods),
        *_decode_constexprs(tile, head_dim, paged, is_causal, window is not None, score_mod_flags(mods),
                            sinks is not None, split, interpreting_now() and q.dtype == torch.bfloat16),
    ), tile.num_warps, tile.num_stages)
    if split:
        launch_kernel(_attention_decode_merge_kernel, (cdiv(rows, MERGE_ROWS), batch * kv_heads),
                      (o_target, lse_target, sinks, out, lse, n_queries, heads, kv_heads, kv_group, num_splits),
                      MERGE_WARPS, BLOCK_M=MERGE_ROWS, BLOCK_D=block_d, HEAD_DIM=head_dim, HAS_SINKS=sinks is not None)
    return out, lse


@functools.lru_cache(maxsize=None)
def _decode_constexprs(tile: Tile, head_dim: int, paged: bool, is_causal: bool, has_window: bool,
                       score_mods: Tuple[bool, ...], has_sinks: bool, split: bool, upcast: bool) -> tuple:
    """The decode kernel's constexprs for a launch of this kind, by position."""
    return positional_constexprs(_attention_decode_kernel, dict(
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=head_dim_bucket(head_dim), HEAD_DIM=head_dim,
        PAGED=paged, IS_CAUSAL=is_causal, HAS_WINDOW=has_window, SCORE_MODS=score_mods, HAS_SINKS=has_sinks,
        SPLIT=split, UPCAST=upcast, DOT_PRECISION="ieee"))


@torch.library.custom_op("fused_transformer::attention_decode", mutates_args=())
def _attention_decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lens: Tensor, block_table: Optional[Tensor], is_causal: bool,
    window_left: Optional[int], window_right: Optional[int], scale: float, mod_tensors: List[Optional[Tensor]],
    mod_numbers: List[float], sinks: Optional[Tensor], num_splits: Optional[int],
) -> Tuple[Tensor, Tensor]:
    """``attention_decode`` as torch.compile and torch.export trace it (the score modifiers as
    ``contract.score_mods_flat`` gives them)."""
    return _launch_decode(q, k_cache, v_cache, cache_lens, block_table, is_causal, window_left, window_right, scale,
                          score_mods_of_flat(mod_tensors, mod_numbers), sinks, num_splits)


@_attention_decode_op.register_fake
def _(q, k_cache, v_cache, cache_lens, block_table, is_causal, window_left, window_right, scale, mod_tensors,
      mod_numbers, sinks, num_splits):
    batch, n_queries, heads, head_dim = q.shape
    return q.new_empty((batch, n_queries, heads, head_dim)), q.new_empty((batch, heads, n_queries),
                                                                         dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------- AOT

# Every feature on (the most registers), and the plain causal launch without split (the decoding step of most
# models); each for a contiguous and a paged cache.
DECODE_VARIANTS = {
    "": dict(IS_CAUSAL=True, HAS_WINDOW=True, SCORE_MODS=EVERY_SCORE_MOD, HAS_SINKS=True, SPLIT=True),
    "/causal": dict(IS_CAUSAL=True, HAS_WINDOW=False, SCORE_MODS=NO_SCORE_MOD, HAS_SINKS=False, SPLIT=False),
}
AOT_HEAD_DIMS = (64, 128)
AOT_ROWS = (1, 64)  # rows per kv head: a decoding step's tile and chunked prefill's
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Pointers whose type does not follow q's dtype.
POINTER_TYPES = {"CACHE_LENS": "*i32", "NEW_LENS": "*i32", "BLOCK_TABLE": "*i32", "SINKS": "*fp32", "LSE": "*fp32",
                 "O_PART": "*fp32", "LSE_PART": "*fp32"}


def _signature(fn, elem: str, split_output: bool) -> dict:
    signature = {}
    for name in fn.arg_names:
        if name == "O":
            signature[name] = "*fp32" if split_output else elem
        elif name in POINTER_TYPES:
            signature[name] = POINTER_TYPES[name]
        elif name in ("Q", "K", "V", "K_NEW", "V_NEW"):
            signature[name] = elem
        elif name == "MODS":
            signature[name] = MODS_SIGNATURE
        elif name == "scale":
            signature[name] = "fp32"
        elif name.islower():
            signature[name] = "i32"
    return signature


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """The decode kernel in each tile ``decode_tile`` picks (decoding and chunked prefill), bfloat16 and float32,
    head dims 64 and 128, contiguous and paged caches, in each of ``DECODE_VARIANTS``; the append and merge
    kernels. The plan is the same on every target (and every Triton release: ``triton`` is taken for the report's
    interface)."""
    shipped = []
    for precision, dtype in DTYPES.items():
        elem = "*bf16" if precision == "bf16" else "*fp32"
        for head_dim in AOT_HEAD_DIMS:
            tiles = sorted({decode_tile(rows, dtype, interpreting=False) for rows in AOT_ROWS}, key=str)
            for tile in tiles:
                for paged in (False, True):
                    for variant, features in DECODE_VARIANTS.items():
                        signature = _signature(_attention_decode_kernel, elem, features["SPLIT"])
                        shipped.append(AotKernel(
                            name="attention_decode",
                            config=f"{precision}/D{head_dim}/{tile}{'/paged' if paged else ''}{variant}",
                            fn=_attention_decode_kernel, signature=signature,
                            constexprs=dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=head_dim,
                                            HEAD_DIM=head_dim, PAGED=paged, UPCAST=False, DOT_PRECISION="ieee",
                                            **features),
                            num_warps=tile.num_warps, num_stages=tile.num_stages, targets=CAPABILITIES,
                            expect_tensor_cores=precision == "bf16",
                            divisible_by_16=tuple(n for n, t in signature.items() if isinstance(t, tuple) or (
                                t.startswith("*") or (n.startswith("stride_") and n != "stride_tn"))),
                        ))
            for paged in (False, True):
                signature = _signature(_attention_append_kernel, elem, False)
                shipped.append(AotKernel(
                    name="attention_decode_append", config=f"{precision}/D{head_dim}/BN{APPEND_ROWS}_w{APPEND_WARPS}"
                    + ("/paged" if paged else ""), fn=_attention_append_kernel, signature=signature,
                    constexprs=dict(BLOCK_N=APPEND_ROWS, BLOCK_D=head_dim, HEAD_DIM=head_dim, PAGED=paged),
                    num_warps=APPEND_WARPS, num_stages=1, targets=CAPABILITIES,
                    divisible_by_16=tuple(n for n, t in signature.items() if t.startswith("*")),
                ))
            signature = _signature(_attention_decode_merge_kernel, elem, False)
            shipped.append(AotKernel(
                name="attention_decode_merge", config=f"{precision}/D{head_dim}/BM{MERGE_ROWS}_w{MERGE_WARPS}",
                fn=_attention_decode_merge_kernel, signature=signature,
                constexprs=dict(BLOCK_M=MERGE_ROWS, BLOCK_D=head_dim, HEAD_DIM=head_dim, HAS_SINKS=True),
                num_warps=MERGE_WARPS, num_stages=1, targets=CAPABILITIES,
                divisible_by_16=tuple(n for n, t in signature.items() if t.startswith("*")),
            ))
    return shipped
