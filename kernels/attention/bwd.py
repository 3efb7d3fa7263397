"""The attention backward: recomputes p = exp(s - lse) tile by tile (Z = dropout keep / (1 - p), delta =
rowsum(do * o) - dlse):
    dv = (p Z)^T do,   dp = (do v^T) Z,   ds = p (dp - delta),   dq = ds k * scale,   dk = ds^T q * scale
in two kernels with no atomics (deterministic): one program per query tile writes dq (and delta first), one program
per key tile of a key/value head writes dk and dv, walking every query head of its group (GQA). Masks as in the
forward (``jit.py``); the dropout mask is regenerated from the forward's seed. The score modifiers are recomputed
and ds multiplied by their derivative (``jit._score_mods_grad``: softcap's 1 - tanh^2); the sinks need nothing more
(they are in the forward's LSE).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...contract import (
    AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed, score_mods_flat, seed_tensor,
)
from .._common import (
    cdiv, contiguous_last_dim, contiguous_last_dims, dropout_keep, dropout_seed, launch_kernel, traced,
)
from . import configs
from .call import backward_outputs, flat_masks, flat_spec
from .configs import head_dim_bucket
from .jit import (
    _batch_head, _dot, _leading_real_keys, _mask_scores, _modified_scores, _modifies_scores, _real_rows, _row_index,
    _scales_gradient, _score_mod_values, _score_mods_grad, _sequence, _stat_base, _tile_mask, _tma_tile,
    _unmasked_keys_end, _visible_keys, _visible_queries,
)
from .launch import (
    LaunchArgs, chosen_variant, grid, cached_key_of, launch_options, output_layout, row_strides, tiles_of, tma_can_load,
)

Tensor = torch.Tensor
# The dq kernel's tile order other than the grid's, as the kernel reads it (configs.py).
HEAVIEST_FIRST = tl.constexpr(configs.HEAVIEST_FIRST)


@triton.jit
def _attention_dq_tile(
    dq,  # the [BLOCK_M, BLOCK_D] float32 sum, returned updated
    q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn, dropout_row,
    batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed, mod_values,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, EDGE: tl.constexpr,
):
    """dq's step over the key tile starting at ``first_col`` (EDGE as in _attention_fwd_tile)."""
    cols = first_col + tl.arange(0, BLOCK_N)
    key_ok = cols < seq_k if EDGE else tl.full((BLOCK_N,), 1, tl.int1)
    kv_mask = _tile_mask(key_ok, dims, HEAD_DIM, BLOCK_D)
    if USE_TMA:
        k = _tma_tile(k_base, batch, kv_head, k_start, first_col, seq_k, VARLEN, EDGE)
        v = _tma_tile(v_base, batch, kv_head, k_start, first_col, seq_k, VARLEN, EDGE)
    else:
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), UPCAST, DOT_PRECISION) * qk_scale
    s, saved = _modified_scores(s, rows[:, None], cols[None, :], offset, mod_values, SCORE_MODS)
    if EDGE:
        s = _mask_scores(
            s, rows[:, None], cols[None, :], real_rows[:, None], batch, head, k_len, seq_k, offset, window_left,
            window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, MASK_KIND, HAS_PADDING,
            IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
        )
    p = tl.math.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), UPCAST, DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, dropout_row[:, None] + cols[None, :], dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = _score_mods_grad(p * (dp - delta[:, None]), mod_values, saved, SCORE_MODS)
    return dq + _dot(ds.to(k.dtype), k, UPCAST, DOT_PRECISION)


@triton.jit(do_not_specialize=["host_seed"])
def attention_dq_kernel(
    Q, K, V,  # as in the forward (TMA descriptors with USE_TMA)
    O,  # as the forward wrote it (a TMA descriptor with USE_TMA)
    DO,  # O's shape: in any layout with unit stride along D with DO_STRIDES, else O's (a TMA descriptor with USE_TMA)
    LSE,  # as the forward wrote it
    DLSE,  # LSE's shape and layout, float32: gradient of the returned LSE (HAS_DLSE)
    DELTA,  # LSE's shape and layout, float32, written here: rowsum(do * o) - dlse, for the dk/dv kernel
    DQ,  # O's shape and layout
    stride_dob, stride_doh, stride_dom,  # DO's, as Q's (DO_STRIDES)
    MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale,
    dropout_p, SEED, host_seed,
    SINKS, MODS,  # attention sinks (unused: they are in the LSE), score modifiers (see fwd.py)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DLSE: tl.constexpr, SCORE_MODS: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, INTERIOR_LOOP: tl.constexpr,
    DO_STRIDES: tl.constexpr, TILE_ORDER: tl.constexpr,
):
    seed = 0
    if HAS_DROPOUT:  # the op's Philox seed, read once
        seed = dropout_seed(SEED, host_seed)
    query_tile = tl.program_id(0)
    if TILE_ORDER == HEAVIEST_FIRST:  # the GPU starts programs in grid order: the causal long ones first
        query_tile = tl.num_programs(0) - 1 - query_tile
    first_row = query_tile * BLOCK_M
    batch_head = _batch_head(n_heads)
    batch = (batch_head // n_heads).to(tl.int64)
    head = (batch_head % n_heads).to(tl.int64)
    kv_head = head // kv_group
    q_start, k_start, seq_q, seq_k, q_len, k_len, offset = _sequence(
        batch, n_queries, n_keys, causal_offset, KEY_LENS, QUERY_LENS, CU_SEQLENS_Q, CU_SEQLENS_K, HAS_PADDING,
        HAS_QUERY_LENS, PER_SEQUENCE_OFFSET, VARLEN,
    )
    if VARLEN:
        if first_row >= seq_q:
            return

    rows = first_row + tl.arange(0, BLOCK_M)
    real_rows = _real_rows(rows, q_len, seq_q, batch, QUERY_PAD, stride_qpb, HAS_QUERY_PADDING)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    tile_mask = _tile_mask(row_ok, dims, HEAD_DIM, BLOCK_D)
    if USE_TMA:
        q = _tma_tile(Q, batch, head, q_start, first_row, seq_q, VARLEN, True)
    else:
        q = tl.load(
            Q + batch * stride_qb + head * stride_qh + q_start * stride_qm + rows[:, None].to(tl.int64) * stride_qm
            + dims[None, :],
            mask=tile_mask, other=0.0,
        )
    stat_offsets = _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN, 0, False) + rows
    tile_offsets = (_row_index(head, n_heads, rows, n_queries, q_start, VARLEN, False, batch, False)[:, None] * HEAD_DIM
                    + dims[None, :])
    if USE_TMA:
        do = _tma_tile(DO, batch, head, q_start, first_row, seq_q, VARLEN, True)
        o = _tma_tile(O, batch, head, q_start, first_row, seq_q, VARLEN, True)
    else:
        if DO_STRIDES:
            do = tl.load(
                DO + batch * stride_dob + head * stride_doh + q_start * stride_dom
                + rows[:, None].to(tl.int64) * stride_dom + dims[None, :],
                mask=tile_mask, other=0.0,
            )
        else:
            do = tl.load(DO + tile_offsets, mask=tile_mask, other=0.0)
        o = tl.load(O + tile_offsets, mask=tile_mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + stat_offsets, mask=row_ok, other=0.0)
    tl.store(DELTA + stat_offsets, delta, mask=row_ok)
    lse = tl.load(LSE + stat_offsets, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    # Rows with no key have lse = -inf; +inf makes exp2(s - lse) = 0 there instead of NaN.
    lse = tl.where(lse == float("-inf"), float("inf"), lse)

    if USE_TMA:
        k_base, v_base = K, V
    else:
        k_base = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
        v_base = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
    dropout_row = (batch_head.to(tl.int64) * n_queries + rows) * n_keys
    mod_values = _score_mod_values(MODS, batch, head, SCORE_MODS)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_start, key_end = _visible_keys(
        first_row, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    # As in the forward: with no attn_mask, query padding, window or dropout, the key tiles that no bound,
    # diagonal or padding key crosses skip _mask_scores (rows past q_len have lse = -inf, so p = 0 there; their dq
    # is dropped below), the edge tiles first; unless the plan says the two loops spill with these tiles
    # (INTERIOR_LOOP False).
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (
        HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT or _modifies_scores(SCORE_MODS))
    if split:
        leading_keys = _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING, 0, False)
        inner_end = _unmasked_keys_end(first_row, key_end, leading_keys, offset, BLOCK_N, IS_CAUSAL)
        for first_col in tl.range(inner_end, key_end, BLOCK_N, num_stages=1):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )
        for first_col in range(key_start, inner_end, BLOCK_N):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=False,
            )
    else:
        for first_col in range(key_start, key_end, BLOCK_N):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )
    if split or HAS_QUERY_LENS or HAS_QUERY_PADDING:
        # Rows that are no queries get no gradient, even where an inf or NaN in their do or q met their probability 0
        # (without these features, the rows past seq_q are not stored).
        dq = tl.where(real_rows[:, None], dq, 0.0)
    # qk_scale carries log2(e) for exp2; the gradient wants the plain scale.
    dq *= qk_scale * 0.6931471805599453
    tl.store(DQ + tile_offsets, dq.to(DQ.dtype.element_ty), mask=tile_mask)


@triton.jit
def _unmasked_queries(first_col, row_start, row_end, q_len, leading_keys, offset, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """With no window: [start, end) of the query tiles (from row_start, a multiple of BLOCK_M) that see every key of
    the tile starting at ``first_col`` whole, empty unless that tile lies below ``leading_keys``
    (``_leading_real_keys``): tiles below q_len and, causal, whose first row sees the tile's last key. Those from
    row_start to start and from end to row_end are edges."""
    start = row_start
    if IS_CAUSAL:
        start = tl.maximum(start, tl.cdiv(tl.maximum(first_col + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M)
    start = tl.minimum(start, row_end)
    end = tl.minimum(q_len, row_end) // BLOCK_M * BLOCK_M
    end = tl.where(first_col + BLOCK_N <= leading_keys, end, start)
    return start, tl.maximum(end, start)


@triton.jit
def _attention_dkdv_tile(
    dk, dv,  # the [BLOCK_N, BLOCK_D] float32 sums, returned updated
    k, v, first_row, cols, dims, q_base, stride_qm, DO, stride_dob, stride_doh, stride_dom, batch, head, batch_head,
    q_start, seq_q, q_len, k_len, seq_k, offset, window_left, window_right, stat_base, LSE, DELTA, QUERY_PAD,
    stride_qpb,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, n_heads, n_queries, n_keys,
    qk_scale, dropout_p, seed, mod_values,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr, HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, DO_STRIDES: tl.constexpr, EDGE: tl.constexpr,
):
    """dk's and dv's step over the query tile starting at ``first_row`` of one query head. EDGE False: the caller
    knows the tile's rows are all real queries below q_len that see every key of this key tile (below k_len)."""
    rows = first_row + tl.arange(0, BLOCK_M)
    if EDGE:
        real_rows = _real_rows(rows, q_len, seq_q, batch, QUERY_PAD, stride_qpb, HAS_QUERY_PADDING)
    row_ok = rows < seq_q if EDGE else tl.full((BLOCK_M,), 1, tl.int1)
    tile_mask = _tile_mask(row_ok, dims, HEAD_DIM, BLOCK_D)
    stat_offsets = stat_base + rows
    if USE_TMA:
        q = _tma_tile(q_base, batch, head, q_start, first_row, seq_q, VARLEN, EDGE)
        do = _tma_tile(DO, batch, head, q_start, first_row, seq_q, VARLEN, EDGE)
    else:
        q = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qm + dims[None, :], mask=tile_mask, other=0.0)
        if DO_STRIDES:  # the batch is the program's, read here as _row_index does (not held through the loop)
            do_base = DO + tl.program_id(2).to(tl.int64) * stride_dob + head * stride_doh + q_start * stride_dom
            do = tl.load(do_base + rows[:, None].to(tl.int64) * stride_dom + dims[None, :], mask=tile_mask, other=0.0)
        else:
            do_rows = _row_index(head, n_heads, rows, n_queries, q_start, VARLEN, True, batch, False)
            do = tl.load(DO + do_rows[:, None] * HEAD_DIM + dims[None, :], mask=tile_mask, other=0.0)
    if EDGE:
        lse = tl.load(LSE + stat_offsets, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        # Rows with no key have lse = -inf; +inf makes exp2(s - lse) = 0 there instead of NaN.
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(DELTA + stat_offsets, mask=row_ok, other=0.0)
    else:  # real rows that see keys: a finite lse
        lse = tl.load(LSE + stat_offsets) * 1.4426950408889634
        delta = tl.load(DELTA + stat_offsets)

    s_t = _dot(k, tl.trans(q), UPCAST, DOT_PRECISION) * qk_scale
    s_t, saved_t = _modified_scores(s_t, rows[None, :], cols[:, None], offset, mod_values, SCORE_MODS)
    if EDGE:
        s_t = _mask_scores(
            s_t, rows[None, :], cols[:, None], real_rows[None, :], batch, head, k_len, seq_k, offset,
            window_left, window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb,
            MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
        )
    p_t = tl.math.exp2(s_t - lse[None, :])
    if _scales_gradient(SCORE_MODS):
        # dv's product first: then p takes the modifiers' derivative (ds's factor) and no tile they saved stays live.
        if HAS_DROPOUT:
            dropout_row = (batch_head * n_queries + rows) * n_keys
            keep = dropout_keep(seed, dropout_row[None, :] + cols[:, None], dropout_p)
            keep_scale = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
            dv += _dot((p_t * keep_scale).to(do.dtype), do, UPCAST, DOT_PRECISION)
        else:
            dv += _dot(p_t.to(do.dtype), do, UPCAST, DOT_PRECISION)
        p_t = _score_mods_grad(p_t, mod_values, saved_t, SCORE_MODS)
        dp_t = _dot(v, tl.trans(do), UPCAST, DOT_PRECISION)
        if HAS_DROPOUT:
            dp_t *= keep_scale
    else:
        dp_t = _dot(v, tl.trans(do), UPCAST, DOT_PRECISION)
        if HAS_DROPOUT:
            dropout_row = (batch_head * n_queries + rows) * n_keys
            keep = dropout_keep(seed, dropout_row[None, :] + cols[:, None], dropout_p)
            keep_scale = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
            dv += _dot((p_t * keep_scale).to(do.dtype), do, UPCAST, DOT_PRECISION)
            dp_t *= keep_scale
        else:
            dv += _dot(p_t.to(do.dtype), do, UPCAST, DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, UPCAST, DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["host_seed"])
def attention_dkdv_kernel(
    Q, K, V, DO, LSE,  # as in the dq kernel (Q, K, V and DO TMA descriptors with USE_TMA)
    DELTA,  # LSE's shape and layout, float32, from the dq kernel
    DK, DV,  # [B, Hkv, Lk, D] laid out as [B, Lk, Hkv, D] (TMA descriptors with USE_TMA); VARLEN: [Tk, Hkv, D]
    stride_dob, stride_doh, stride_dom,  # DO's, as Q's (DO_STRIDES)
    MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale,
    dropout_p, SEED, host_seed,
    SINKS, MODS,  # attention sinks (unused: they are in the LSE), score modifiers (see fwd.py)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, INTERIOR_LOOP: tl.constexpr,
    DO_STRIDES: tl.constexpr,
):
    seed = 0
    if HAS_DROPOUT:  # the op's Philox seed, read once
        seed = dropout_seed(SEED, host_seed)
    # Works in the transposed orientation (keys along dim 0) so no tile needs a transpose but q's and do's.
    first_col = tl.program_id(0) * BLOCK_N
    n_kv_heads = n_heads // kv_group
    batch_kv_head = _batch_head(n_kv_heads)
    batch = (batch_kv_head // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % n_kv_heads).to(tl.int64)
    q_start, k_start, seq_q, seq_k, q_len, k_len, offset = _sequence(
        batch, n_queries, n_keys, causal_offset, KEY_LENS, QUERY_LENS, CU_SEQLENS_Q, CU_SEQLENS_K, HAS_PADDING,
        HAS_QUERY_LENS, PER_SEQUENCE_OFFSET, VARLEN,
    )
    if VARLEN:
        if first_col >= seq_k:
            return

    cols = first_col + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kv_mask = _tile_mask(cols < seq_k, dims, HEAD_DIM, BLOCK_D)
    if USE_TMA:
        k = _tma_tile(K, batch, kv_head, k_start, first_col, seq_k, VARLEN, True)
        v = _tma_tile(V, batch, kv_head, k_start, first_col, seq_k, VARLEN, True)
    else:
        k = tl.load(K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
                    + cols[:, None].to(tl.int64) * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
                    + cols[:, None].to(tl.int64) * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    # Query tiles wholly above the causal diagonal or outside the window see none of these keys: not visited.
    row_start, row_end = _visible_queries(
        first_col, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    # As in the forward: with no attn_mask, query padding, window or dropout, the query tiles that see every key of
    # this tile whole (a key tile before the first padding key; query tiles below q_len and, causal, below the
    # diagonal through its last key) skip _mask_scores; one loop walks the edge tiles before and after them, then one
    # the interior (INTERIOR_LOOP as in the dq kernel).
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (
        HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT or _modifies_scores(SCORE_MODS))
    inner_start, inner_end = row_end, row_end
    if split:
        inner_start, inner_end = _unmasked_queries(
            first_col, row_start, row_end, q_len, _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING, 0, False),
            offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    leading_edge_tiles = tl.cdiv(inner_start - row_start, BLOCK_M)
    edge_tiles = leading_edge_tiles + tl.cdiv(row_end - inner_end, BLOCK_M)
    for group_member in range(0, kv_group):
        head = kv_head * kv_group + group_member
        batch_head = batch * n_heads + head
        q_base = Q
        if not USE_TMA:
            q_base = Q + batch * stride_qb + head * stride_qh + q_start * stride_qm
        stat_base = _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN, 0, False)
        mod_values = _score_mod_values(MODS, batch, head, SCORE_MODS)
        if split:
            for edge_tile in tl.range(0, edge_tiles, num_stages=1):
                first_row = tl.where(edge_tile < leading_edge_tiles, row_start + edge_tile * BLOCK_M,
                                     inner_end + (edge_tile - leading_edge_tiles) * BLOCK_M)
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, DO, stride_dob, stride_doh, stride_dom,
                    batch, head, batch_head, q_start, seq_q, q_len, k_len, seq_k, offset, window_left, window_right,
                    stat_base, LSE, DELTA, QUERY_PAD, stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                    PAD, stride_pb, n_heads, n_queries, n_keys, qk_scale, dropout_p, seed, mod_values,
                    BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW,
                    MASK_OFFSETS_64, HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA,
                    DO_STRIDES, EDGE=True,
                )
            for first_row in range(inner_start, inner_end, BLOCK_M):
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, DO, stride_dob, stride_doh, stride_dom,
                    batch, head, batch_head, q_start, seq_q, q_len, k_len, seq_k, offset, window_left, window_right,
                    stat_base, LSE, DELTA, QUERY_PAD, stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                    PAD, stride_pb, n_heads, n_queries, n_keys, qk_scale, dropout_p, seed, mod_values,
                    BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW,
                    MASK_OFFSETS_64, HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA,
                    DO_STRIDES, EDGE=False,
                )
        else:
            for first_row in range(row_start, row_end, BLOCK_M):
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, DO, stride_dob, stride_doh, stride_dom,
                    batch, head, batch_head, q_start, seq_q, q_len, k_len, seq_k, offset, window_left, window_right,
                    stat_base, LSE, DELTA, QUERY_PAD, stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                    PAD, stride_pb, n_heads, n_queries, n_keys, qk_scale, dropout_p, seed, mod_values,
                    BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW,
                    MASK_OFFSETS_64, HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA,
                    DO_STRIDES, EDGE=True,
                )
    dk *= qk_scale * 0.6931471805599453

    if USE_TMA and not VARLEN:
        # Through TMA, which drops the rows past Lk and the columns past D (a packed tile's rows past its sequence
        # are the next one's: VARLEN stores through pointers). The per-row address arithmetic of the pointer path
        # spilled here in the sm_90 tiles.
        tile_start = [batch.to(tl.int32), kv_head.to(tl.int32), first_col, 0]
        DK.store(tile_start, dk.to(k.dtype).reshape(1, 1, BLOCK_N, BLOCK_D))
        DV.store(tile_start, dv.to(k.dtype).reshape(1, 1, BLOCK_N, BLOCK_D))
    else:
        out_rows = _row_index(kv_head, n_kv_heads, cols, n_keys, k_start, VARLEN, True, batch, False)
        out_offsets = out_rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(DK + out_offsets, dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _backward_launches(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       dq: Tensor, dk: Tensor, dv: Tensor, launch_args: LaunchArgs,
                       spec: AttentionSpec) -> Tuple[tuple, ...]:
    """``launch_kernel``'s arguments for the dq kernel, then the dk/dv kernel (in that order: dq's writes the row sums
    dk/dv's reads), dense or packed (``launch_args.layout``), writing ``dq``, ``dk`` and ``dv``: the kernel, the grid,
    the arguments, warps, stages, CTAs and the cached key."""
    layout, masks, args = launch_args.layout, launch_args.masks, launch_args.args
    delta = torch.empty_like(lse)  # lse's shape and layout
    # Both kernels load alike: through TMA only if it can address every input and output.
    addressable = tma_can_load((q, k, v, o, do, dk, dv), layout)
    variant = chosen_variant("attention.bwd", q, layout, masks, spec.dropout_p)
    dq_launch = launch_options("bwd_dq", attention_dq_kernel, q, layout.head_dim, masks, spec.dropout_p,
                               spec.allow_tf32, addressable, has_dlse=dlse is not None, variant=variant)
    dkdv_launch = launch_options("bwd_dkdv", attention_dkdv_kernel, q, layout.head_dim, masks, spec.dropout_p,
                                 spec.allow_tf32, addressable, variant=variant)
    dq_tile, dkdv_tile = dq_launch.plan.tile, dkdv_launch.plan.tile
    dq_tma, dkdv_tma = dq_launch.plan.use_tma, dkdv_launch.plan.use_tma
    if not (dq_tma and dkdv_tma):  # the pointer path reads o in its own layout; TMA in any
        o = output_layout(o)
    # The pointer path reads do through its strides where the plan's tile allows it (``Plan.do_strides``), else in
    # o's layout, copied there unless it is in it already; TMA reads it in any.
    do = contiguous_last_dim(do)
    dq_strided, dkdv_strided = dq_tma or dq_launch.plan.do_strides, dkdv_tma or dkdv_launch.plan.do_strides
    laid_out = output_layout(do) if not (dq_strided and dkdv_strided) else do
    dq_do, dkdv_do = do if dq_strided else laid_out, do if dkdv_strided else laid_out
    q_in, k_in, v_in, o_in, do_in = q, k, v, o, dq_do
    block_d = head_dim_bucket(layout.head_dim) if dq_tma or dkdv_tma else None
    if dq_tma:
        q_in, o_in, do_in = (tiles_of(x, dq_tile.block_m, block_d, True) for x in (q, o, do))
        k_in, v_in = (tiles_of(x, dq_tile.block_n, block_d, True) for x in (k, v))
    dq_kernel = (attention_dq_kernel, grid(cdiv(layout.n_queries, dq_tile.block_m), layout.batch, layout.heads),
                 (q_in, k_in, v_in, o_in, do_in, lse, dlse.contiguous() if dlse is not None else None, delta, dq,
                  *row_strides(dq_do), *args, *dq_launch.constexprs), dq_launch.num_warps, dq_launch.num_stages, 1,
                 cached_key_of(12, launch_args))
    dk_out, dv_out = dk, dv
    if not dkdv_tma:
        q_in, k_in, v_in, do_in = q, k, v, dkdv_do
    else:  # the dq launch's descriptors serve where its tiles have the same rows
        if not dq_tma or dkdv_tile.block_m != dq_tile.block_m:
            q_in, do_in = (tiles_of(x, dkdv_tile.block_m, block_d, True) for x in (q, do))
        if not dq_tma or dkdv_tile.block_n != dq_tile.block_n:
            k_in, v_in = (tiles_of(x, dkdv_tile.block_n, block_d, True) for x in (k, v))
        if dk.dim() == 4:  # dense: TMA stores as well
            dk_out, dv_out = (tiles_of(t, dkdv_tile.block_n, block_d, True) for t in (dk, dv))
    dkdv_kernel = (attention_dkdv_kernel, grid(cdiv(layout.n_keys, dkdv_tile.block_n), layout.batch, layout.kv_heads),
                   (q_in, k_in, v_in, do_in, lse, delta, dk_out, dv_out, *row_strides(dkdv_do), *args,
                    *dkdv_launch.constexprs), dkdv_launch.num_warps, dkdv_launch.num_stages, 1,
                   cached_key_of(11, launch_args))
    return dq_kernel, dkdv_kernel


# ------------------------------------------------------------------------------------- the backend's entries


def attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  seed: Optional[Seed], for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` laid out as o (o in q's dtype or float32: ``float_output``), launched here in eager mode,
    through the custom op when traced; the forward's launch arguments taken from ``for_backward`` where it left one."""
    q, k, v = contiguous_last_dims(q, k, v)
    o, lse = (o if o.dtype == q.dtype else o.to(q.dtype)), lse.contiguous()
    if traced():
        return torch.ops.fused_transformer.attention_bwd(
            do, dlse, q, k, v, o, lse, *flat_masks(masks), *flat_spec(spec), seed_tensor(seed, q.device),
            *score_mods_flat(mods))
    dq, dk, dv, launch_args = backward_outputs(q, k, v, spec, mods, seed, masks=masks, for_backward=for_backward)
    if launch_args is not None:
        kernels = _backward_launches(do, dlse, q, k, v, o, lse, dq, dk, dv, launch_args, spec)
        for launch in (*launch_args.masks.launches, *kernels):
            launch_kernel(*launch)
    return dq, dk, dv


def attention_varlen_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         lse: Tensor, seqs: PackedSequences, spec: AttentionSpec, mods: ScoreMods,
                         seed: Optional[Seed], for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq [Tq, H, D], dk, dv [Tk, Hkv, D]``, as ``attention_bwd``."""
    q, k, v = contiguous_last_dims(q, k, v)
    o, lse = (o if o.dtype == q.dtype else o.to(q.dtype)), lse.contiguous()
    if traced():
        return torch.ops.fused_transformer.attention_varlen_bwd(
            do, dlse, q, k, v, o, lse, *seqs, *flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods))
    dq, dk, dv, launch_args = backward_outputs(q, k, v, spec, mods, seed, seqs=seqs, for_backward=for_backward)
    if launch_args is not None:
        for launch in _backward_launches(do, dlse, q, k, v, o, lse, dq, dk, dv, launch_args, spec):
            launch_kernel(*launch)
    return dq, dk, dv
