"""The attention forward (FlashAttention-2 style), every mask in the kernel.

Per tile of BLOCK_M query rows of one (batch, head), over tiles of BLOCK_N keys:
    s = q k^T * scale (+ float mask), masked to -inf        (kept in log2 units: exp2 is the fast exponential)
    online softmax: m = running row max, l = running sum of exp(s - m), acc = sum exp(s - m) * dropout v
    o = acc / l,   lse = m + log(l)          (a row with no key: o = 0, lse = -inf; with a NaN score: NaN, as torch)
Only q, k, v, o and lse (float32, [B, H, Lq]) are saved; the [Lq, Lk] matrices are never stored.
Score modifiers (``jit._modified_scores``: MODS and the constexpr flags SCORE_MODS), before the masks, in the edge
tiles only (a launch with one takes no interior loop). Attention sinks (SINKS [H] float32)
join each real row's sum once its keys are done: m' = max(m, sink), l' = l e^(m - m') + e^(sink - m'); the LSE
holds them, so the backward's p = exp(s - lse) needs nothing more.
Dropout on the probabilities: element (b, h, i, j) is kept when ``dropout_keep(seed, ((b H + h) Lq + i) Lk + j,
p)`` (Lq, Lk: max_seqlen_q, max_seqlen_k with VARLEN, i and j counted within the sequence; ``seed`` the op's,
``dropout_seed``);
``attention_keep_mask`` replays the mask for the reference.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...contract import (
    AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed, score_mods_flat, seed_tensor,
)
from .._common import cdiv, contiguous_last_dims, dropout_keep, dropout_seed, launch_kernel, traced
from . import configs
from .call import flat_masks, flat_spec, forward_outputs
from .configs import head_dim_bucket
from .jit import (
    _batch_head, _dot, _leading_real_keys, _mask_scores, _modified_scores, _modifies_scores, _real_rows, _row_index,
    _score_mod_values, _sequence, _stat_base, _tile_mask, _tma_tile, _unmasked_keys_end, _visible_keys,
)
from .launch import (
    LaunchArgs, chosen_variant, grid, cached_key_of, launch_options, persistent_programs, tiles_of, tma_can_load,
)

Tensor = torch.Tensor
# The forward's tile orders other than the grid's, as the kernel reads them (configs.py).
HEAVIEST_FIRST, PERSISTENT = tl.constexpr(configs.HEAVIEST_FIRST), tl.constexpr(configs.PERSISTENT)


@triton.jit
def _attention_fwd_tile(
    acc, row_sum, row_max,  # the online softmax's state, returned updated
    q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn, dropout_row,
    batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed, mod_values,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, EDGE: tl.constexpr,
):
    """The forward's step over the key tile starting at ``first_col``. EDGE False: the caller knows the tile lies
    below k_len (<= seq_k) and inside every row's causal / window range, and drops the rows that are not real
    itself: nothing is masked, and keys and values load with no row bound. USE_TMA: k_base and v_base are K's and
    V's descriptors (``_tma_tile``), else pointers to key row 0 of this sequence and kv head."""
    cols = first_col + tl.arange(0, BLOCK_N)
    key_ok = cols < seq_k if EDGE else tl.full((BLOCK_N,), 1, tl.int1)
    kv_mask = _tile_mask(key_ok, dims, HEAD_DIM, BLOCK_D)
    if USE_TMA:
        k = _tma_tile(k_base, batch, kv_head, k_start, first_col, seq_k, VARLEN, EDGE)
    else:
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
    qk = _dot(q, tl.trans(k), UPCAST, DOT_PRECISION)
    if EDGE:
        s, _ = _modified_scores(qk * qk_scale, rows[:, None], cols[None, :], offset, mod_values, SCORE_MODS)
        s = _mask_scores(
            s, rows[:, None], cols[None, :], real_rows[:, None], batch, head, k_len, seq_k, offset,
            window_left, window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, MASK_KIND,
            HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
        )
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
    else:
        # qk_scale >= 0 here (the caller sends other scales to the edge loop), so the scaled scores' row max is the
        # scaled row max, bit for bit (rounding is monotonic): one multiply per row, and s below has one use, the
        # subtraction, which fuses with it (an FFMA per score instead of an FMUL and an FFMA).
        new_max = tl.maximum(row_max, tl.max(qk, axis=1) * qk_scale)
        s = qk * qk_scale
    p = tl.math.exp2(s - new_max[:, None])
    rescale = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, dropout_row[:, None] + cols[None, :], dropout_p)
        p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
    if USE_TMA:
        v = _tma_tile(v_base, batch, kv_head, k_start, first_col, seq_k, VARLEN, EDGE)
    else:
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _attention_fwd_block(
    first_row, batch_head, seed,  # the tile's first query row, its batch * n_heads + head, the dropout seed
    Q, K, V, O, LSE, MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale, dropout_p,
    SINKS, MODS, n_batch,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, INTERIOR_LOOP: tl.constexpr,
    BATCH_GIVEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """One program's tile of BLOCK_M query rows from ``first_row`` of one (batch, head): o and lse."""
    batch = (batch_head // n_heads).to(tl.int64)
    head = (batch_head % n_heads).to(tl.int64)
    kv_head = head // kv_group
    q_start, k_start, seq_q, seq_k, q_len, k_len, offset = _sequence(
        batch, n_queries, n_keys, causal_offset, KEY_LENS, QUERY_LENS, CU_SEQLENS_Q, CU_SEQLENS_K, HAS_PADDING,
        HAS_QUERY_LENS, PER_SEQUENCE_OFFSET, VARLEN,
    )
    if VARLEN:
        if first_row >= seq_q:  # the grid covers the longest sequence; this one is shorter
            return

    rows = first_row + tl.arange(0, BLOCK_M)
    real_rows = _real_rows(rows, q_len, seq_q, batch, QUERY_PAD, stride_qpb, HAS_QUERY_PADDING)
    dims = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q = _tma_tile(Q, batch, head, q_start, first_row, seq_q, VARLEN, True)
        k_base, v_base = K, V
    else:
        q = tl.load(
            Q + batch * stride_qb + head * stride_qh + q_start * stride_qm + rows[:, None].to(tl.int64) * stride_qm
            + dims[None, :],
            mask=_tile_mask(rows < seq_q, dims, HEAD_DIM, BLOCK_D), other=0.0,
        )
        k_base = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
        v_base = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
    dropout_row = (batch_head.to(tl.int64) * n_queries + rows) * n_keys
    mod_values = _score_mod_values(MODS, batch, head, SCORE_MODS)

    # The lowest finite float32 rather than -inf: a row whose keys so far are all masked (scores -inf) keeps a finite
    # max, so exp2(s - max) is 0 there, not NaN, with no test per row and tile.
    row_max = tl.full((BLOCK_M,), -3.4028234663852886e38, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_start, key_end = _visible_keys(
        first_row, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    # Plain and causal attention, key padding and packed sequences included (no attn_mask, query padding, window or
    # dropout): the key tiles that no bound, diagonal or padding key crosses skip _mask_scores, after the edge tiles
    # (the other way round, or with the few edge tiles pipelined too, spilled). Rows past q_len are dropped at the
    # end. With any of those features on, two loops spilled in some tile configs of the AOT report: one loop masks
    # every tile there, as it does where the plan says the two spill with these tiles (INTERIOR_LOOP off).
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (
        HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT or _modifies_scores(SCORE_MODS))
    if split:
        leading_keys = _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING, n_batch, BATCH_GIVEN)
        inner_end = _unmasked_keys_end(first_row, key_end, leading_keys, offset, BLOCK_N, IS_CAUSAL)
        if qk_scale < 0:  # the interior tiles take the row max before scaling, which a negative scale turns over
            inner_end = key_start
        for first_col in tl.range(inner_end, key_end, BLOCK_N, num_stages=1):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )
        for first_col in tl.range(key_start, inner_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=False,
            )
    else:
        for first_col in range(key_start, key_end, BLOCK_N):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, seed,
                mod_values, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
                HAS_DROPOUT, SCORE_MODS, UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )

    if HAS_SINKS:
        sink = tl.load(SINKS + head) * 1.4426950408889634
        new_max = tl.maximum(row_max, sink)
        rescale = tl.math.exp2(row_max - new_max)
        acc = acc * rescale[:, None]
        row_sum = row_sum * rescale + tl.where(real_rows, tl.math.exp2(sink - new_max), 0.0)
        row_max = new_max
    # A NaN score made row_sum NaN (however tl.max treats NaN): != 0 lets it through to out and lse, as in torch.
    has_key = row_sum != 0.0
    if split:  # rows past q_len ran unmasked through the interior tiles: what they hold is dropped here
        has_key = has_key & real_rows
        acc = tl.where(real_rows[:, None], acc, 0.0)
    out = acc / tl.where(has_key, row_sum, 1.0)[:, None]
    lse = tl.where(has_key, (row_max + tl.math.log2(tl.where(has_key, row_sum, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    row_ok = rows < seq_q
    lse_base = _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN, n_batch, BATCH_GIVEN)
    tl.store(LSE + lse_base + rows, lse, mask=row_ok)
    out_rows = _row_index(head, n_heads, rows, n_queries, q_start, VARLEN, False, batch, BATCH_GIVEN)
    tl.store(O + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(O.dtype.element_ty),
             mask=_tile_mask(row_ok, dims, HEAD_DIM, BLOCK_D))


@triton.jit(do_not_specialize=["host_seed"])
def attention_fwd_kernel(
    Q,  # [B, H, Lq, D]; VARLEN: [Tq, H, D]; a TMA descriptor with USE_TMA (see _tma_tile)
    K, V,  # [B, Hkv, Lk, D]; VARLEN: [Tk, Hkv, D]; TMA descriptors with USE_TMA
    O,  # [B, H, Lq, D] laid out as [B, Lq, H, D] (see _row_index); VARLEN: [Tq, H, D] contiguous
    LSE,  # [B, H, Lq] float32 contiguous, natural log; VARLEN: [H, Tq]
    MASK,  # attn_mask, read through strides (MASK_KIND != 0)
    PAD,  # [B, Lk] uint8, 1 = padding (HAS_PADDING)
    KEY_LENS,  # [2, B] int32: one past each sequence's last key that is not padding, then its keys before the first
    # padding key (HAS_PADDING; lengths.padding_lengths)
    QUERY_LENS,  # [B] int32 (or the first row of [2, B]): one past each sequence's last query row to compute
    QUERY_PAD,  # [B, Lq] uint8, 1 = padding (HAS_QUERY_PADDING)
    CU_SEQLENS_Q, CU_SEQLENS_K,  # [B + 1] int32: each packed sequence's first row, then the total (VARLEN)
    stride_qb, stride_qh, stride_qm,  # the batch strides are unused with VARLEN
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group,
    n_queries, n_keys,  # Lq, Lk; VARLEN: max_seqlen_q, max_seqlen_k
    causal_offset, window_left, window_right, qk_scale, dropout_p, SEED, host_seed,
    SINKS, MODS,  # attention sinks, score modifiers (see above)
    n_batch,  # B (PERSISTENT)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, SCORE_MODS: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, INTERIOR_LOOP: tl.constexpr,
    TILE_ORDER: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    seed = 0
    if HAS_DROPOUT:  # the op's Philox seed, read once
        seed = dropout_seed(SEED, host_seed)
    if TILE_ORDER == PERSISTENT:
        # Each program walks the tiles from its own, a grid's width apart, the last query tiles first: a causal
        # mask gives them the most keys, so the programs' loads even out as the light tiles come last.
        query_tiles = tl.cdiv(n_queries, BLOCK_M)
        pairs = n_batch * n_heads
        # (num_stages=1: the key loops inside are the ones to pipeline, not this one)
        for tile in tl.range(tl.program_id(0), query_tiles * pairs, tl.num_programs(0), num_stages=1):
            _attention_fwd_block(
                (query_tiles - 1 - tile // pairs) * BLOCK_M, tile % pairs, seed,
                Q, K, V, O, LSE, MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_qpb,
                n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale, dropout_p,
                SINKS, MODS, n_batch, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, HAS_QUERY_LENS,
                HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW, PER_SEQUENCE_OFFSET, VARLEN, MASK_OFFSETS_64, HAS_DROPOUT,
                SCORE_MODS, HAS_SINKS, UPCAST, DOT_PRECISION, USE_TMA, INTERIOR_LOOP, TILE_ORDER == PERSISTENT,
                WARP_SPECIALIZE,
            )
    else:
        query_tile = tl.program_id(0)
        if TILE_ORDER == HEAVIEST_FIRST:  # the GPU starts programs in grid order: the causal long ones first
            query_tile = tl.num_programs(0) - 1 - query_tile
        _attention_fwd_block(
            query_tile * BLOCK_M, _batch_head(n_heads), seed,
            Q, K, V, O, LSE, MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_qpb,
            n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale, dropout_p,
            SINKS, MODS, n_batch, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, HAS_QUERY_LENS,
            HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW, PER_SEQUENCE_OFFSET, VARLEN, MASK_OFFSETS_64, HAS_DROPOUT,
            SCORE_MODS, HAS_SINKS, UPCAST, DOT_PRECISION, USE_TMA, INTERIOR_LOOP, TILE_ORDER == PERSISTENT,
            WARP_SPECIALIZE,
        )


def _forward_launch(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, launch_args: LaunchArgs,
                    spec: AttentionSpec) -> tuple:
    """``launch_kernel``'s arguments after the kernel for the forward, dense or packed (``launch_args.layout``),
    writing ``o`` and ``lse``: the grid, the arguments, warps, stages, CTAs and the cached key."""
    layout, masks = launch_args.layout, launch_args.masks
    # Launched for head_dim 0 as well: its scores are 0, and the LSE still depends on the masks.
    launch = launch_options("fwd", attention_fwd_kernel, q, layout.head_dim, masks, spec.dropout_p, spec.allow_tf32,
                            tma_can_load((q, k, v), layout),
                            variant=chosen_variant("attention.fwd", q, layout, masks, spec.dropout_p))
    plan = launch.plan
    tile = plan.tile
    if plan.use_tma:
        block_d = head_dim_bucket(layout.head_dim)
        q, k = tiles_of(q, tile.block_m, block_d, True), tiles_of(k, tile.block_n, block_d, True)
        v = tiles_of(v, tile.block_n, block_d, True)
    query_tiles = cdiv(layout.n_queries, tile.block_m)
    if plan.tile_order == configs.PERSISTENT:
        launch_grid = (persistent_programs(o.device, tile, query_tiles * layout.batch * layout.heads), 1, 1)
    else:
        launch_grid = grid(query_tiles, layout.batch, layout.heads)
    return (launch_grid, (q, k, v, o, lse, *launch_args.args, layout.batch, *launch.constexprs), launch.num_warps,
            launch.num_stages, 1, cached_key_of(5, launch_args))


# ------------------------------------------------------------------------------------- the backend's entries


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  sinks: Optional[Tensor], seed: Optional[Seed], float_output: bool,
                  for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """``o [B, H, Lq, D]`` laid out as ``[B, Lq, H, D]`` (float32 with ``float_output``) and the float32 LSE, launched
    here in eager mode, through the custom op when traced."""
    q, k, v = contiguous_last_dims(q, k, v)
    if traced():
        return torch.ops.fused_transformer.attention_fwd(
            q, k, v, *flat_masks(masks), *flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods),
            sinks, float_output)
    o, lse, launch_args = forward_outputs(q, k, v, spec, mods, sinks, seed, float_output, masks=masks,
                                          for_backward=for_backward)
    if launch_args is not None:
        for launch in launch_args.masks.launches:
            launch_kernel(*launch)
        launch_kernel(attention_fwd_kernel, *_forward_launch(q, k, v, o, lse, launch_args, spec))
    return o, lse


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSequences, spec: AttentionSpec,
                         mods: ScoreMods, sinks: Optional[Tensor], seed: Optional[Seed],
                         float_output: bool, for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """``o [Tq, H, D]`` (float32 with ``float_output``) and the float32 LSE ``[H, Tq]``, as ``attention_fwd``."""
    q, k, v = contiguous_last_dims(q, k, v)
    if traced():
        return torch.ops.fused_transformer.attention_varlen_fwd(
            q, k, v, *seqs, *flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods), sinks, float_output)
    o, lse, launch_args = forward_outputs(q, k, v, spec, mods, sinks, seed, float_output, seqs=seqs,
                                          for_backward=for_backward)
    if launch_args is not None:
        launch_kernel(attention_fwd_kernel, *_forward_launch(q, k, v, o, lse, launch_args, spec))
    return o, lse
