"""The attention probabilities behind a forward, recomputed from its LSE for ``need_weights=True``: one program per
(query tile, key tile) block of one (batch, head), masked as in the forward, written to a dense [B, H, Lq, Lk]."""

import torch
import triton
import triton.language as tl
from .._common import cdiv, launch_kernel
from .configs import head_dim_bucket
from .jit import _batch_head, _dot, _mask_scores, _real_rows, _sequence, _tile_mask, _tma_tile
from .launch import LOG2E, Layout, MaskArgs, grid, launch_options, tiles_of, tma_can_load

Tensor = torch.Tensor


@triton.jit
def attention_weights_kernel(
    Q, K, LSE,  # as in the forward (Q and K TMA descriptors with USE_TMA)
    W,  # [B, H, Lq, Lk] contiguous: the normalised probabilities
    MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    tl.static_assert(not VARLEN, "the weights of packed sequences are not implemented")
    col_tiles = tl.cdiv(n_keys, BLOCK_N)
    first_row = tl.program_id(0) // col_tiles * BLOCK_M
    first_col = tl.program_id(0) % col_tiles * BLOCK_N
    batch_head = _batch_head(n_heads)
    batch = (batch_head // n_heads).to(tl.int64)
    head = (batch_head % n_heads).to(tl.int64)
    kv_head = head // kv_group
    _, _, seq_q, seq_k, q_len, k_len, offset = _sequence(
        batch, n_queries, n_keys, causal_offset, KEY_LENS, QUERY_LENS, CU_SEQLENS_Q, CU_SEQLENS_K, HAS_PADDING,
        HAS_QUERY_LENS, PER_SEQUENCE_OFFSET, VARLEN,
    )

    rows = first_row + tl.arange(0, BLOCK_M)
    real_rows = _real_rows(rows, q_len, seq_q, batch, QUERY_PAD, stride_qpb, HAS_QUERY_PADDING)
    cols = first_col + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q = _tma_tile(Q, batch, head, 0, first_row, n_queries, VARLEN, False)
        k = _tma_tile(K, batch, kv_head, 0, first_col, n_keys, VARLEN, False)
    else:
        q = tl.load(
            Q + batch * stride_qb + head * stride_qh + rows[:, None].to(tl.int64) * stride_qm + dims[None, :],
            mask=_tile_mask(rows < n_queries, dims, HEAD_DIM, BLOCK_D), other=0.0,
        )
        k = tl.load(
            K + batch * stride_kb + kv_head * stride_kh + cols[:, None].to(tl.int64) * stride_kn + dims[None, :],
            mask=_tile_mask(cols < n_keys, dims, HEAD_DIM, BLOCK_D), other=0.0,
        )
    row_offsets = batch_head.to(tl.int64) * n_queries + rows
    lse = tl.load(LSE + row_offsets, mask=rows < n_queries, other=float("-inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    s = _dot(q, tl.trans(k), UPCAST, DOT_PRECISION) * qk_scale
    s = _mask_scores(
        s, rows[:, None], cols[None, :], real_rows[:, None], batch, head, k_len, seq_k, offset, window_left,
        window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, MASK_KIND, HAS_PADDING,
        IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
    )
    p = tl.math.exp2(s - lse[:, None])
    tl.store(W + row_offsets[:, None] * n_keys + cols[None, :], p.to(W.dtype.element_ty),
             mask=(rows[:, None] < n_queries) & (cols[None, :] < n_keys))


def launch_weights(q: Tensor, k: Tensor, lse: Tensor, weights: Tensor, layout: Layout, masks: MaskArgs,
                   scale: float) -> None:
    """The probabilities kernel, writing ``weights`` ``[B, H, Lq, Lk]`` (dense inputs only)."""
    launch = launch_options("weights", attention_weights_kernel, q, layout.head_dim, masks, 0.0, False,
                            tma_can_load((q, k), layout))
    tile, use_tma, block_d = launch.plan.tile, launch.plan.use_tma, head_dim_bucket(layout.head_dim)
    tiles = cdiv(layout.n_queries, tile.block_m) * cdiv(layout.n_keys, tile.block_n)
    launch_kernel(attention_weights_kernel, grid(tiles, layout.batch, layout.heads), (
        tiles_of(q, tile.block_m, block_d, use_tma), tiles_of(k, tile.block_n, block_d, use_tma), lse, weights,
        *masks.pointer_args(), *layout.q_strides, *layout.k_strides, *masks.stride_args(), layout.heads,
        layout.kv_group, layout.n_queries, layout.n_keys, *masks.offset_args(), scale * LOG2E, *launch.constexprs,
    ), launch.num_warps, launch.num_stages)
