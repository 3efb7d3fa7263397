"""Fused scaled-dot-product attention (FlashAttention-2 style), forward and backward, every mask in the kernel.

Forward, per tile of BLOCK_M query rows of one (batch, head), over tiles of BLOCK_N keys:
    s = q k^T * scale (+ float mask), masked to -inf        (kept in log2 units: exp2 is the fast exponential)
    online softmax: m = running row max, l = running sum of exp(s - m), acc = sum exp(s - m) * dropout v
    o = acc / l,   lse = m + log(l)          (a row with no key: o = 0, lse = -inf; with a NaN score: NaN, as torch)
Only q, k, v, o and lse (float32, [B, H, Lq]) are saved; the [Lq, Lk] matrices are never stored.

Backward recomputes p = exp(s - lse) tile by tile (Z = dropout keep / (1 - p), delta = rowsum(do * o) - dlse):
    dv = (p Z)^T do,   dp = (do v^T) Z,   ds = p (dp - delta),   dq = ds k * scale,   dk = ds^T q * scale
in two kernels with no atomics (deterministic): one program per query tile writes dq (and delta first), one
program per key tile of a key/value head writes dk and dv, walking every query head of its group (GQA).

Masks, composable, all inside the kernels:
  key lengths     derived on the device from key_padding_mask (index of the last key that is not padding, + 1):
                  key tiles past a sequence's length are skipped, not visited; the tiles from its first padding
                  key on are checked against the mask itself, so a mask that is not right-padded is exact too.
  query padding   the same for query rows (query_padding_mask): padding rows write zeros (LSE -inf) and pass
                  no gradient; query tiles past the last real query are skipped in the dk/dv loop.
  causal/window   key j visible from query i when i + o - left <= j <= i + o + right, o the alignment offset:
                  0 (top_left) or Lk - Lq (bottom_right), per sequence key_end - query_end with query padding
                  (each sequence's last real query sees its last real key); causal is right = 0, a window
                  side that is None is as wide as the sequences. Key tiles outside every row's window are
                  skipped, not visited: the key loops start at the first tile any row can see and stop after
                  the last, the query loop of dk/dv runs over the rows that see its key tile.
  attn_mask       bool (True = may attend) or float (added), read tile by tile through strides; a mask that
                  broadcasts over batch, heads or rows has stride 0 there and is never expanded in memory.
  query lengths   rows past a sequence's query length write zeros (kernel-level option).
Variable lengths (VARLEN): q [Tq, H, D], k/v [Tk, Hkv, D] hold B sequences packed end to end, cu_seqlens_q/k
[B + 1] their offsets. The grid is sized by the longest sequence; each program reads its sequence's bounds from
cu_seqlens (no host sync) and returns at once when its tile lies past the sequence's end. Outputs are packed
([Tq, H, D], LSE [H, Tq]). Dense outputs (o, dq, dk, dv) are [B, H, L, D] laid out as [B, L, H, D]
(``empty_heads_interleaved``, the packed layout with sequence b starting at row b L), so that a module merges the
heads with a view and hands back do in o's layout, which the backward reads without a copy.
Loads: on sm_90 and later (USE_TMA, for 16-bit inputs and the forward's float32 in tf32 at some head dims, when TMA
can address every input and output: ``_loads_through_tma``) the q/k/v/o/do tiles come through
host-side TMA descriptors (``_tma_tile``), whose out-of-bounds rows and columns read as zeros, and dense dk/dv go
out through them; elsewhere through pointers and masks (cp.async when pipelined).
Dropout on the probabilities: element (b, h, i, j) is kept when ``dropout_keep(SEED, ((b H + h) Lq + i) Lk + j,
p)`` (Lq, Lk: max_seqlen_q, max_seqlen_k with VARLEN, i and j counted within the sequence);
``attention_keep_mask`` replays the mask for the reference.
"""
import dataclasses
from typing import List, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import contract
from ..contract import AttentionMasks, AttentionSpec, Window, empty_heads_interleaved, heads_interleaved_strides
from ._common import (
    contiguous_last_dim, draw_dropout_seed, dropout_keep, dropout_keep_mask, interpreting, tma_addressable,
    tma_descriptor,
)
from .aot import AotKernel
from .targets import HOPPER_SHARED_MEMORY, LARGE_SHARED_MEMORY, TARGETS, target_of

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 0, 256
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# What kind of attn_mask a kernel reads (a constexpr): none, bool (True = may attend) or float (added).
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The interpreter computes bfloat16 dots wrongly: upcast there (the operands are already rounded to
    # bfloat16, so the products are the ones a GPU forms).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _tile_mask(row_ok, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load/store mask of a [rows, BLOCK_D] tile: the row bound, and the head-dim bound only when padded (with
    HEAD_DIM == BLOCK_D the second term is the constant True and folds away, so loads stay vectorised)."""
    return row_ok[:, None] & ((dims[None, :] < HEAD_DIM) | (HEAD_DIM == BLOCK_D))


@triton.jit
def _tma_tile(desc, batch, head, start, first_row, seq_len, VARLEN: tl.constexpr, MAY_CROSS_END: tl.constexpr):
    """The [rows, BLOCK_D] block of rows ``first_row, ...`` of the sequence that starts at row ``start`` of (batch,
    head), through the TMA descriptor ``desc`` over [B, H, L, D] (VARLEN: packed [T, H, D] seen as [1, H, T, D])
    with [1, 1, rows, BLOCK_D] blocks. TMA zero-fills rows past L (T) and columns past D. With VARLEN the rows past
    the sequence's ``seq_len`` are the next sequence's: zeroed here unless the caller knows the block ends inside
    (not MAY_CROSS_END), as the pointer path's masked loads give zeros, so that an inf or NaN in one sequence cannot
    reach another's sums through a probability of 0."""
    row = tl.cast(start + first_row, tl.int32)  # a loop's index is a Python int under the interpreter
    tile = desc.load([0 if VARLEN else batch.to(tl.int32), head.to(tl.int32), row, 0])
    tile = tile.reshape(tile.shape[2], tile.shape[3])
    if VARLEN and MAY_CROSS_END:
        rows = first_row + tl.arange(0, tile.shape[0])
        tile = tl.where((rows < seq_len)[:, None], tile, 0.0)
    return tile


@triton.jit
def _mask_scores(
    s, rows, cols,  # s: float32 scores in log2 units; rows / cols: query / key indices broadcastable to s
    real_rows,  # rows' _real_rows, broadcastable to s
    batch, head, k_len, seq_k, offset, window_left, window_right,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    PAD, stride_pb,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    MASK_OFFSETS_64: tl.constexpr,
):
    """``s`` with every masked (row, col) set to -inf and the float mask added (in log2 units)."""
    in_bounds = real_rows & (cols < k_len)
    keep = in_bounds
    if HAS_WINDOW:  # the launcher folds causal into window_right (at most 0)
        # -left <= j - (i + offset) <= right as one unsigned compare (a difference below -left wraps past
        # left + right): two signed compares per score cost up to 70 registers at the largest tiles, and spilled.
        width = (window_left + window_right).to(tl.uint32, bitcast=True)
        keep = keep & ((cols - rows - (offset - window_left)).to(tl.uint32, bitcast=True) <= width)
    elif IS_CAUSAL:
        keep = keep & (cols <= rows + offset)
    if HAS_PADDING:
        is_pad = tl.load(PAD + batch * stride_pb + cols, mask=cols < seq_k, other=1)
        keep = keep & (is_pad == 0)
    if MASK_KIND != 0:
        # int32 offsets inside one (batch, head) slice, half the registers of int64 ones, unless the slice spans
        # 2**31 elements or more (the launcher's MASK_OFFSETS_64).
        if MASK_OFFSETS_64:
            rows, cols = rows.to(tl.int64), cols.to(tl.int64)
        mask_ptrs = (MASK + batch * stride_mb + head * stride_mh) + (rows * stride_mm + cols * stride_mn)
        # Read under the bounds alone, not the whole keep predicate: carrying the window / causal terms into the
        # load's mask holds more registers (the largest tiles spilled); what else is masked is dropped below.
        if MASK_KIND == 1:
            keep = keep & (tl.load(mask_ptrs, mask=in_bounds, other=0) != 0)
        else:
            # Added as torch adds it: a NaN score at a -inf key stays NaN. Excluding -inf keys here spills.
            s += tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _real_rows(rows, q_len, seq_q, batch, QUERY_PAD, stride_qpb, HAS_QUERY_PADDING: tl.constexpr):
    """Which of ``rows`` (a vector) are queries to compute: before q_len, and not padding. Loaded once per query
    tile, outside the key loops: a load inside them costs registers in every iteration."""
    real = rows < q_len
    if HAS_QUERY_PADDING:
        real = real & (tl.load(QUERY_PAD + batch * stride_qpb + rows, mask=rows < seq_q, other=1) == 0)
    return real


@triton.jit
def _batch_head(n_heads):
    """The index ``batch * n_heads + head`` of this program's (batch, head) pair. Grids are (tiles, heads, batch):
    tiles on axis 0 (consecutive programs share a head's keys in L2), heads and batch on axes 1 and 2, which CUDA
    caps at 65535 each (a batch x heads product on one of them would stop at 65535 pairs)."""
    return tl.program_id(2) * n_heads + tl.program_id(1)


@triton.jit
def _sequence(
    batch, n_queries, n_keys, causal_offset, KEY_LENS, QUERY_LENS, CU_SEQLENS_Q, CU_SEQLENS_K,
    HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr, PER_SEQUENCE_OFFSET: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Where sequence ``batch`` lies and what of it is real:
    q_start, k_start: its first query / key row in q / k (int64; 0 unless VARLEN, whose rows are packed);
    seq_q, seq_k: its query / key rows in memory (Lq / Lk; its own lengths with VARLEN);
    q_len, k_len: one past its last query / key that is not padding (QUERY_LENS / KEY_LENS's first row, else seq_q /
    seq_k);
    offset: its alignment offset, query i's diagonal key being i + offset (k_len - q_len with PER_SEQUENCE_OFFSET,
    bottom_right aligned per sequence; else the launcher's causal_offset)."""
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        seq_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        seq_k = tl.load(CU_SEQLENS_K + batch + 1) - k_start
        q_start, k_start = q_start.to(tl.int64), k_start.to(tl.int64)
    else:
        q_start, k_start, seq_q, seq_k = 0, 0, n_queries, n_keys
    k_len = tl.load(KEY_LENS + batch) if HAS_PADDING else seq_k
    q_len = tl.load(QUERY_LENS + batch) if HAS_QUERY_LENS else seq_q
    offset = k_len - q_len if PER_SEQUENCE_OFFSET else causal_offset
    return q_start, k_start, seq_q, seq_k, q_len, k_len, offset


@triton.jit
def _row_index(head, n_heads, rows, n_rows, start, VARLEN: tl.constexpr, PER_ROW_INT64: tl.constexpr):
    """Each row's index in an output seen as rows of HEAD_DIM elements, [T, H] (VARLEN: packed [T, H, D], the
    sequence starting at row ``start``) or [B L, H] (dense: [B, H, L, D] laid out as [B, L, H, D]). The batch is the
    program's (``_batch_head``), read here rather than held in registers through the main loop. Within one batch
    element the index fits in int32 (the launcher checks Lq H < 2**31): PER_ROW_INT64 computes it in int64 anyway,
    the form ptxas allocates without spills in the dk/dv kernel, where the forward's and dq's need the int32 one."""
    if VARLEN:
        return (start + rows) * n_heads + head
    first = tl.program_id(2).to(tl.int64) * n_rows
    if PER_ROW_INT64:
        return (first + rows) * n_heads + head
    return first * n_heads + (rows * n_heads + head.to(tl.int32))


@triton.jit
def _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN: tl.constexpr):
    """Index of query row 0 of this (batch, head) in the float32 row statistics (LSE, its gradient, delta):
    [B, H, Lq], or [H, Tq] with VARLEN (Tq, the packed length, is cu_seqlens_q's last element)."""
    if VARLEN:
        return head * tl.load(CU_SEQLENS_Q + tl.num_programs(2)) + q_start
    return batch_head.to(tl.int64) * n_queries


@triton.jit
def _visible_keys(first_row, q_len, k_len, offset, window_left, window_right, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[start, end) of the keys any row of the query tile starting at ``first_row`` may see; start is a multiple
    of BLOCK_N (the first key tile to visit)."""
    start = 0
    end = k_len
    if HAS_WINDOW:
        start = tl.maximum(first_row + offset - window_left, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(end, first_row + BLOCK_M + offset + window_right)
    elif IS_CAUSAL:
        end = tl.minimum(end, first_row + BLOCK_M + offset)
    end = tl.where(first_row < q_len, end, 0)
    return start, tl.maximum(end, 0)


@triton.jit
def _visible_queries(first_col, q_len, k_len, offset, window_left, window_right, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[start, end) of the query rows that may see a key of the tile starting at ``first_col``; start is a
    multiple of BLOCK_M (the first query tile to visit)."""
    start = 0
    end = q_len
    if HAS_WINDOW:
        start = tl.maximum(first_col - offset - window_right, 0) // BLOCK_M * BLOCK_M
        end = tl.minimum(end, first_col + BLOCK_N - offset + window_left)
    elif IS_CAUSAL:
        start = tl.maximum(first_col - offset, 0) // BLOCK_M * BLOCK_M
    end = tl.where(first_col < k_len, end, 0)
    return start, end


@triton.jit
def _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING: tl.constexpr):
    """How many keys of sequence ``batch`` come before its first padding key (k_len when it has padding only at the
    end, or none): key tiles below that need no padding mask. KEY_LENS is [2, B] int32 (``_key_lengths``), this
    the second row; the grid's axis 2 is the batch."""
    if HAS_PADDING:
        return tl.load(KEY_LENS + tl.num_programs(2) + batch)
    return k_len


@triton.jit
def _unmasked_keys_end(first_row, key_end, leading_keys, offset, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """With no window (the key tiles start at 0): the end of the key tiles that every row of the query tile starting
    at ``first_row`` sees whole, below ``leading_keys`` (``_leading_real_keys``) and, causal, at or left of its first
    row's diagonal. The tiles from there to ``key_end`` are the edges that need ``_mask_scores``."""
    end = leading_keys
    if IS_CAUSAL:
        end = tl.minimum(end, first_row + offset + 1)
    return tl.minimum(tl.maximum(end, 0) // BLOCK_N * BLOCK_N, key_end)


@triton.jit
def _attention_fwd_tile(
    acc, row_sum, row_max,  # the online softmax's state, returned updated
    q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn, dropout_row,
    batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
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
        s = _mask_scores(
            qk * qk_scale, rows[:, None], cols[None, :], real_rows[:, None], batch, head, k_len, seq_k, offset,
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
        keep = dropout_keep(SEED, dropout_row[:, None] + cols[None, :], dropout_p)
        p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
    if USE_TMA:
        v = _tma_tile(v_base, batch, kv_head, k_start, first_col, seq_k, VARLEN, EDGE)
    else:
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _attention_fwd_kernel(
    Q,  # [B, H, Lq, D]; VARLEN: [Tq, H, D]; a TMA descriptor with USE_TMA (see _tma_tile)
    K, V,  # [B, Hkv, Lk, D]; VARLEN: [Tk, Hkv, D]; TMA descriptors with USE_TMA
    O,  # [B, H, Lq, D] laid out as [B, Lq, H, D] (see _row_index); VARLEN: [Tq, H, D] contiguous
    LSE,  # [B, H, Lq] float32 contiguous, natural log; VARLEN: [H, Tq]
    MASK,  # attn_mask, read through strides (MASK_KIND != 0)
    PAD,  # [B, Lk] uint8, 1 = padding (HAS_PADDING)
    KEY_LENS,  # [2, B] int32: one past each sequence's last key that is not padding, then its keys before the first
    # padding key (HAS_PADDING; _key_lengths)
    QUERY_LENS,  # [B] int32: one past each sequence's last query row to compute (HAS_QUERY_LENS)
    QUERY_PAD,  # [B, Lq] uint8, 1 = padding (HAS_QUERY_PADDING)
    CU_SEQLENS_Q, CU_SEQLENS_K,  # [B + 1] int32: each packed sequence's first row, then the total (VARLEN)
    stride_qb, stride_qh, stride_qm,  # the batch strides are unused with VARLEN
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group,
    n_queries, n_keys,  # Lq, Lk; VARLEN: max_seqlen_q, max_seqlen_k
    causal_offset, window_left, window_right, qk_scale, dropout_p, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    INTERIOR_LOOP: tl.constexpr,
):
    first_row = tl.program_id(0) * BLOCK_M
    batch_head = _batch_head(n_heads)
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
    # every tile there, as it does where the launcher's _interior_loop_fits says the two spill with these tiles.
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT)
    if split:
        inner_end = _unmasked_keys_end(first_row, key_end, _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING),
                                       offset, BLOCK_N, IS_CAUSAL)
        if qk_scale < 0:  # the interior tiles take the row max before scaling, which a negative scale turns over
            inner_end = key_start
        for first_col in tl.range(inner_end, key_end, BLOCK_N, num_stages=1):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N, BLOCK_D,
                HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST,
                DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )
        for first_col in range(key_start, inner_end, BLOCK_N):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N, BLOCK_D,
                HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST,
                DOT_PRECISION, VARLEN, USE_TMA, EDGE=False,
            )
    else:
        for first_col in range(key_start, key_end, BLOCK_N):
            acc, row_sum, row_max = _attention_fwd_tile(
                acc, row_sum, row_max, q, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N, BLOCK_D,
                HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST,
                DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )

    # A NaN score made row_sum NaN (however tl.max treats NaN): != 0 lets it through to out and lse, as in torch.
    has_key = row_sum != 0.0
    if split:  # rows past q_len ran unmasked through the interior tiles: what they hold is dropped here
        has_key = has_key & real_rows
        acc = tl.where(real_rows[:, None], acc, 0.0)
    out = acc / tl.where(has_key, row_sum, 1.0)[:, None]
    lse = tl.where(has_key, (row_max + tl.math.log2(tl.where(has_key, row_sum, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    row_ok = rows < seq_q
    tl.store(LSE + _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN) + rows, lse, mask=row_ok)
    out_rows = _row_index(head, n_heads, rows, n_queries, q_start, VARLEN, False)
    tl.store(O + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(O.dtype.element_ty),
             mask=_tile_mask(row_ok, dims, HEAD_DIM, BLOCK_D))


@triton.jit
def _attention_dq_tile(
    dq,  # the [BLOCK_M, BLOCK_D] float32 sum, returned updated
    q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn, dropout_row,
    batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, EDGE: tl.constexpr,
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
    if EDGE:
        s = _mask_scores(
            s, rows[:, None], cols[None, :], real_rows[:, None], batch, head, k_len, seq_k, offset, window_left,
            window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, MASK_KIND, HAS_PADDING,
            IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
        )
    p = tl.math.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), UPCAST, DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(SEED, dropout_row[:, None] + cols[None, :], dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, UPCAST, DOT_PRECISION)


@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V,  # as in the forward (TMA descriptors with USE_TMA)
    O,  # as the forward wrote it (a TMA descriptor with USE_TMA)
    DO,  # O's shape and layout (a TMA descriptor with USE_TMA)
    LSE,  # as the forward wrote it
    DLSE,  # LSE's shape and layout, float32: gradient of the returned LSE (HAS_DLSE)
    DELTA,  # LSE's shape and layout, float32, written here: rowsum(do * o) - dlse, for the dk/dv kernel
    DQ,  # O's shape and layout
    MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale, dropout_p, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DLSE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, INTERIOR_LOOP: tl.constexpr,
):
    first_row = tl.program_id(0) * BLOCK_M
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
    stat_offsets = _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN) + rows
    tile_offsets = _row_index(head, n_heads, rows, n_queries, q_start, VARLEN, False)[:, None] * HEAD_DIM + (
        dims[None, :])
    if USE_TMA:
        do = _tma_tile(DO, batch, head, q_start, first_row, seq_q, VARLEN, True)
        o = _tma_tile(O, batch, head, q_start, first_row, seq_q, VARLEN, True)
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
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_start, key_end = _visible_keys(
        first_row, q_len, k_len, offset, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    # As in the forward: with no attn_mask, query padding, window or dropout, the key tiles that no bound,
    # diagonal or padding key crosses skip _mask_scores (rows past q_len have lse = -inf, so p = 0 there; their dq
    # is dropped below), the edge tiles first; unless the launcher's _interior_loop_fits says the two loops spill
    # with these tiles (INTERIOR_LOOP False).
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT)
    if split:
        inner_end = _unmasked_keys_end(first_row, key_end, _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING),
                                       offset, BLOCK_N, IS_CAUSAL)
        for first_col in tl.range(inner_end, key_end, BLOCK_N, num_stages=1):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N,
                BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT,
                UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
            )
        for first_col in range(key_start, inner_end, BLOCK_N):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N,
                BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT,
                UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=False,
            )
    else:
        for first_col in range(key_start, key_end, BLOCK_N):
            dq = _attention_dq_tile(
                dq, q, do, lse, delta, first_col, rows, real_rows, dims, k_base, v_base, stride_kn, stride_vn,
                dropout_row, batch, head, kv_head, k_start, k_len, seq_k, offset, window_left, window_right, MASK,
                stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, qk_scale, dropout_p, SEED, BLOCK_N,
                BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT,
                UPCAST, DOT_PRECISION, VARLEN, USE_TMA, EDGE=True,
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
    k, v, first_row, cols, dims, q_base, stride_qm, batch, head, batch_head, q_start, seq_q, q_len, k_len, seq_k,
    offset, window_left, window_right, stat_base, LSE, DELTA, DO, QUERY_PAD, stride_qpb,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, n_heads, n_queries, n_keys,
    qk_scale, dropout_p, SEED,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PADDING: tl.constexpr, HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, MASK_OFFSETS_64: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, EDGE: tl.constexpr,
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
        do_rows = _row_index(head, n_heads, rows, n_queries, q_start, VARLEN, True)
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
    if EDGE:
        s_t = _mask_scores(
            s_t, rows[None, :], cols[:, None], real_rows[None, :], batch, head, k_len, seq_k, offset,
            window_left, window_right, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb,
            MASK_KIND, HAS_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64,
        )
    p_t = tl.math.exp2(s_t - lse[None, :])
    dp_t = _dot(v, tl.trans(do), UPCAST, DOT_PRECISION)
    if HAS_DROPOUT:
        dropout_row = (batch_head * n_queries + rows) * n_keys
        keep = dropout_keep(SEED, dropout_row[None, :] + cols[:, None], dropout_p)
        keep_scale = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        dv += _dot((p_t * keep_scale).to(do.dtype), do, UPCAST, DOT_PRECISION)
        dp_t *= keep_scale
    else:
        dv += _dot(p_t.to(do.dtype), do, UPCAST, DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, UPCAST, DOT_PRECISION)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE,  # as in the dq kernel (Q, K, V and DO TMA descriptors with USE_TMA)
    DELTA,  # LSE's shape and layout, float32, from the dq kernel
    DK, DV,  # [B, Hkv, Lk, D] laid out as [B, Lk, Hkv, D] (TMA descriptors with USE_TMA); VARLEN: [Tk, Hkv, D]
    MASK, PAD, KEY_LENS, QUERY_LENS, QUERY_PAD, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_qpb,
    n_heads, kv_group, n_queries, n_keys, causal_offset, window_left, window_right, qk_scale, dropout_p, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_QUERY_LENS: tl.constexpr,
    HAS_QUERY_PADDING: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PER_SEQUENCE_OFFSET: tl.constexpr, VARLEN: tl.constexpr, MASK_OFFSETS_64: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    INTERIOR_LOOP: tl.constexpr,
):
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
    split = INTERIOR_LOOP and MASK_KIND == 0 and not (HAS_QUERY_PADDING or HAS_WINDOW or HAS_DROPOUT)
    inner_start, inner_end = row_end, row_end
    if split:
        inner_start, inner_end = _unmasked_queries(
            first_col, row_start, row_end, q_len, _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING), offset,
            BLOCK_M, BLOCK_N, IS_CAUSAL)
    leading_edge_tiles = tl.cdiv(inner_start - row_start, BLOCK_M)
    edge_tiles = leading_edge_tiles + tl.cdiv(row_end - inner_end, BLOCK_M)
    for group_member in range(0, kv_group):
        head = kv_head * kv_group + group_member
        batch_head = batch * n_heads + head
        q_base = Q
        if not USE_TMA:
            q_base = Q + batch * stride_qb + head * stride_qh + q_start * stride_qm
        stat_base = _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN)
        if split:
            for edge_tile in tl.range(0, edge_tiles, num_stages=1):
                first_row = tl.where(edge_tile < leading_edge_tiles, row_start + edge_tile * BLOCK_M,
                                     inner_end + (edge_tile - leading_edge_tiles) * BLOCK_M)
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, batch, head, batch_head, q_start, seq_q,
                    q_len, k_len, seq_k, offset, window_left, window_right, stat_base, LSE, DELTA, DO, QUERY_PAD,
                    stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, n_heads, n_queries,
                    n_keys, qk_scale, dropout_p, SEED, BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING,
                    HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                    VARLEN, USE_TMA, EDGE=True,
                )
            for first_row in range(inner_start, inner_end, BLOCK_M):
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, batch, head, batch_head, q_start, seq_q,
                    q_len, k_len, seq_k, offset, window_left, window_right, stat_base, LSE, DELTA, DO, QUERY_PAD,
                    stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, n_heads, n_queries,
                    n_keys, qk_scale, dropout_p, SEED, BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING,
                    HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                    VARLEN, USE_TMA, EDGE=False,
                )
        else:
            for first_row in range(row_start, row_end, BLOCK_M):
                dk, dv = _attention_dkdv_tile(
                    dk, dv, k, v, first_row, cols, dims, q_base, stride_qm, batch, head, batch_head, q_start, seq_q,
                    q_len, k_len, seq_k, offset, window_left, window_right, stat_base, LSE, DELTA, DO, QUERY_PAD,
                    stride_qpb, MASK, stride_mb, stride_mh, stride_mm, stride_mn, PAD, stride_pb, n_heads, n_queries,
                    n_keys, qk_scale, dropout_p, SEED, BLOCK_M, BLOCK_D, HEAD_DIM, MASK_KIND, HAS_PADDING,
                    HAS_QUERY_PADDING, IS_CAUSAL, HAS_WINDOW, MASK_OFFSETS_64, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                    VARLEN, USE_TMA, EDGE=True,
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
        out_rows = _row_index(kv_head, n_kv_heads, cols, n_keys, k_start, VARLEN, True)
        out_offsets = out_rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(DK + out_offsets, dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attention_weights_kernel(
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


# ------------------------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int



# (kernel, 16-bit or float32 inputs, padded head dim) -> (BLOCK_M, BLOCK_N, num_warps, num_stages), for sm_80
# and sm_90 alike (but _TILES_SM90). Chosen as the largest tiles that compile without register spills for both
# targets with every feature on (float mask, key and query padding, causal, window, dropout) and for packed sequences;
# `python -m fused_transformer report` re-checks them. A few float32 entries got smaller (or 8 warps instead of 4)
# when the window, query padding and packed variants came: the old tiles spilled 8-96 bytes in one of them.
# Eight warps spread the [BLOCK_M, BLOCK_N] score tile and the float mask tile over more registers; float32
# tiles are smaller (its ieee dot runs on the CUDA cores, whose operand layouts replicate data across threads).
_TILES = {
    ("fwd", 16): {16: (128, 32, 8, 2), 32: (128, 32, 8, 2), 64: (128, 64, 8, 3), 128: (128, 32, 8, 2),
                  256: (32, 32, 8, 1)},
    ("fwd", 32): {16: (64, 32, 8, 2), 32: (64, 32, 8, 2), 64: (32, 32, 8, 1), 128: (32, 16, 8, 1)},
    ("bwd_dq", 16): {16: (128, 32, 8, 2), 32: (128, 32, 8, 2), 64: (128, 32, 8, 1), 128: (64, 32, 8, 2),
                     256: (32, 32, 8, 1)},
    ("bwd_dq", 32): {16: (32, 32, 4, 1), 32: (32, 32, 8, 2), 64: (64, 32, 8, 2), 128: (16, 16, 8, 1)},
    ("bwd_dkdv", 16): {16: (32, 128, 8, 1), 32: (32, 128, 8, 1), 64: (16, 64, 4, 1), 128: (16, 64, 8, 1),
                       256: (16, 32, 8, 1)},
    ("bwd_dkdv", 32): {16: (32, 64, 8, 1), 32: (32, 64, 8, 2), 64: (16, 32, 8, 1), 128: (16, 64, 8, 1)},
    ("weights", 16): {16: (64, 64, 4, 1), 32: (64, 64, 4, 1), 64: (64, 64, 4, 1), 128: (64, 64, 4, 1),
                      256: (32, 32, 4, 1)},
    ("weights", 32): {16: (64, 64, 4, 1), 32: (64, 64, 4, 1), 64: (64, 64, 8, 1), 128: (32, 32, 8, 1)},
}
# What parts with 99 KB of shared memory per block (sm_86, sm_89) run instead, where a tile above does not fit
# there (shared memory) or spills (registers).
_TILES_SMALL_SHARED_MEMORY = {
    ("fwd", 16): {32: (128, 64, 8, 2), 64: (128, 64, 8, 2)},
    ("bwd_dkdv", 32): {16: (32, 32, 8, 2)},
}
# What parts with TMA and sm_90's shared memory (H100, H200) run instead in 16 bits, pipelined. The forward's 64 keys
# (D16 / D32 / D128; the tiles above hold 32) give its scores HGMMA.64x64x16 and lower its non-MMA/kMAC in the
# dense variant (D16 95.5 -> 90.5, D32 46.9 -> 45.7, D128 12.4 -> 11.5; 195-254 registers, no spills).
# wgmma computes 64-row products per warpgroup (4 warps): with 8 warps and a 64-row operand the tiles above split
# N between the two warpgroups (HGMMA.64x16x16 at dq D128), and the dk/dv kernel's query tile (BLOCK_M) is the N
# of its transposed products (64x16x16 / 64x8x16 at D64 / D128). The dq tiles give each warpgroup 64 query rows
# and 64 keys (every HGMMA N >= 64; at D128 the report's non-MMA/kMAC goes 7.5 -> 7.7, but the old tile issued
# 1.67x the MMAs its products need, and per needed kMAC it goes 12.6 -> 7.7). dk/dv with 64 query rows spills in
# the dense variant at every head dim (40-1392 B, 4 or 8 warps, 1-3 stages), so D64 takes 32 rows (N = 32) and
# the other head dims keep the tiles above, whose pipelined versions issue more non-MMA instructions per kMAC (as
# do wider dq tiles at D16 / D32: 62 -> 68 and 31 -> 34 with 64 keys; at D256 64-row tiles spill 200-1136 B, and
# forward ones 64-872 B). dq D16 runs its 128 rows on one warpgroup: with two, ptxas serialized the K steps of
# ds @ k (the report's "wgmma serialized"; non-MMA/kMAC 62.2 -> 60.2). Only launches that load through TMA take
# them: with the pointer path they spill (72 B at dk/dv D64, 120 B at dq D128), so inputs TMA cannot address keep
# the tiles above.
_TILES_SM90 = {
    ("fwd", 16): {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 128: (128, 64, 8, 2)},
    ("bwd_dq", 16): {16: (128, 32, 4, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 3)},
    ("bwd_dkdv", 16): {64: (32, 128, 8, 2)},
}
# What 16-bit launches whose scores read no attn_mask element and draw no dropout number each (``_wide_tiles_fit``;
# key and query padding, lengths, causal, window and packing cost registers per row or column) run on sm_90 with
# TMA: the shared tiles are sized for the variant with every feature on, where each score also holds a mask value
# and a Philox draw. Forward: 32 keys (64 at D64) in the shared tiles leave the per-tile work (row max, rescaling the
# [BLOCK_M, D] accumulator, exp2 bookkeeping) few MACs to spread over; 128 keys give the scores HGMMA.64x128x16 (D256:
# 64 keys, 64x64x16, and p @ v 64x256x16 where the shared 32-row tiles ran HMMA). Report figures for the plain
# forward (the /causal variant), non-MMA per kMAC: D16 6.7, D32 3.4, D64 1.8, D128 1.0, D256 0.9 (the shared tiles
# issued 12.4, 6.6, 2.7, 2.3, 2.9 before the interior tiles took the row max before scaling, these 7.7, 3.9, 2.1,
# 1.1, 0.9); the Triton tutorial's sm_90 kernel compiled the same way issues 2.0 (D64) and 1.0-1.2 (D128). 256 keys
# (D16-D64), 256 query rows or 4 warps for 128 rows spill or sit at 240-255 registers for at most 0.9 less. D256
# takes 2 stages: 3 need 262200 B of shared memory. Backward: 64 query rows per warpgroup in dq (D16 / D32 too:
# every HGMMA N >= 64 but the head dim's) and 64 query rows in the dk/dv tile, the N of its transposed products:
# HGMMA.64x64x16 for S^T and dP^T where the every-feature tiles run 64x32x16 (D64) and 64x8x16 (D128; per kMAC
# 4.4 -> 1.9 in the /padded variant; D128 takes one warpgroup and 64 keys: two and 128 keys spilled 16 B in the
# /causal variant); with a mask tile or dropout these dk/dv tiles spill (D64: 544 B with both, 24-360 B with the
# float mask alone). D256 dk/dv keeps the shared tile (a 64-row tile's dk and dv alone take 256 registers a thread).
_TILES_SM90_WIDE = {
    ("fwd", 16): {16: (128, 128, 8, 3), 32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 128, 8, 3),
                  256: (128, 64, 8, 2)},
    ("bwd_dq", 16): {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 3),
                     256: (64, 64, 4, 2)},
    ("bwd_dkdv", 16): {16: (64, 128, 8, 2), 32: (64, 128, 8, 2), 64: (64, 128, 8, 2), 128: (64, 64, 4, 1)},
}
# Shared memory per block of sm_90: the dq tiles at D128 (3 stages) take 229400 B of it.
_SM90_SHARED_MEMORY = HOPPER_SHARED_MEMORY
# Where the wide tiles spill for packed sequences, which zero a q / do tile's rows past their sequence in registers
# (_tma_tile): such launches keep the other tiles (report: 256 B at dq D256) ...
_WIDE_TILES_SPILL_PACKED = {("bwd_dq", 256)}
# ... or take these (report, non-MMA per kMAC on sm_90 in the /varlen/causal and /varlen/nodropout variants, before
# -> after; with an attn_mask or dropout they spill). Forward D128: 128 keys spilled 8 B in the two-loop path, so
# packed launches masked every tile (2.3 / 2.5); 64 keys and 3 stages run it (1.3 / 2.8: the masked loop of
# windowed launches issues more with half the keys). dk/dv D64: 64 query rows spilled 24-88 B in the two-loop path
# (masked: 3.1 / 3.2); 32 rows run it (1.75 / 3.4), HGMMA.64x32x16 for S^T / dP^T. dk/dv D128 (64 x 64 spilled 8-24
# B, 64 x 128 8 B): 32 query rows, 128 keys and 2 stages run HGMMA.64x32x16 for S^T / dP^T and 64x128x16 for dk / dv
# where the shared tiles ran 64x8x16 (3.7 / 3.7 -> 1.9 / 2.0, every tile masked).
_TILES_SM90_WIDE_PACKED = {("fwd", 16): {128: (128, 64, 8, 3)}, ("bwd_dkdv", 16): {64: (32, 128, 8, 2),
                                                                                  128: (32, 128, 8, 2)}}
# float32 with allow_tf32=True, on every target: its tensor-core products hold their operands in more registers
# than the ieee products of the float32 tiles, which spill there. Forward D16: 16 query rows (32 spilled 8 B in the
# packed variant on sm_90 once the row max started at the lowest float instead of -inf).
_TILES_TF32 = {
    "fwd": {16: (16, 32, 4, 1), 32: (32, 32, 4, 1)},
    "bwd_dq": {16: (16, 32, 4, 1), 64: (16, 32, 8, 1)},
    "bwd_dkdv": {16: (16, 32, 4, 1), 32: (16, 32, 8, 1), 64: (16, 16, 8, 1), 128: (16, 16, 8, 1)},
}
# The forward in float32 with allow_tf32=True on sm_90, through TMA at these head dims: 128 query rows whose products
# run as wgmma (HGMMA.64xNx8.TF32; Triton stages V, p @ v's MN-major operand, transposed through shared memory) where
# the tiles above run HMMA.1688 from registers. Report, non-MMA per kMAC on sm_90 (every-feature / /causal variant),
# before -> after: D64 29.5 / 8.9 -> 24.2 / 3.4, D128 13.9 / 5.8 -> 14.2 / 3.0 (D128 64 keys spilled 16 B packed).
# D16 / D32: 64-row tiles issue up to twice as many per kMAC with a mask or dropout (D16 51.8 -> 102), and the tiles
# above 5-30 % more through TMA than through pointers. The backward keeps the pointer path: its 64-row tf32 tiles
# spilled (dq D128 32-592 B, dk/dv D64 48-640 B with 64 keys; 8 warps or 1 stage too).
_TILES_SM90_TF32_FWD = {64: (128, 64, 8, 2), 128: (128, 32, 8, 2)}
# float32 stops at head_dim 128: its dq kernel spills at every tile size tried for 256 (see the AOT report).
MAX_HEAD_DIM_FLOAT32 = 128
# Small tiles under the interpreter, so short test sequences still cross several tiles.
INTERPRETER_CONFIG = AttentionConfig(32, 32, 1, 1)


def _head_dim_bucket(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _wide_tiles_fit(kernel: str, head_dim: int, MASK_KIND: int, HAS_DROPOUT: bool, VARLEN: bool, **_) -> bool:
    """Whether a ``kernel`` launch with these constexprs may take _TILES_SM90_WIDE: its scores read no attn_mask
    element and draw no dropout number each, the registers those tiles do not have (nor, for some, packed sequences':
    _WIDE_TILES_SPILL_PACKED)."""
    if VARLEN and (kernel, _head_dim_bucket(head_dim)) in _WIDE_TILES_SPILL_PACKED:
        return False
    return MASK_KIND == MASK_NONE and not HAS_DROPOUT


# Tiles whose two-loop path (unmasked interior tiles: plain or causal, key padding or packed sequences, no
# attn_mask, query padding, window or dropout) spills in the AOT report, by (kernel, precision, head dim bucket,
# tiles, TMA loads, packed sequences): such launches mask every tile. bf16 stands for both 16-bit types. Report, two
# loops, dense: dq D256 8 B (sm_90 wide tiles), dk/dv D128 448 B (sm_90 wide tiles) and D256 752 B (sm_90), float32
# dq D64 296-328 B, float32 dk/dv D16 / D32 and tf32 dk/dv D16 / D64 / D128 8-16 B (with key padding); packed: the
# forward D256 24-120 B, dq D256 680 B (sm_90), float32 D64 312-336 B, tf32 D128 8 B,
# dk/dv D128 328 B (sm_90), D256 704 B (sm_90), float32 D16 / D32 32-48 B, tf32 D128 8 B.
_INTERIOR_LOOP_SPILLS = {
    ("bwd_dq", "bf16", 256, (64, 64, 4, 2), True, False), ("bwd_dkdv", "bf16", 128, (64, 64, 4, 1), True, False),
    ("bwd_dkdv", "bf16", 256, (16, 32, 8, 1), True, False), ("bwd_dq", "fp32", 64, (64, 32, 8, 2), False, False),
    ("bwd_dkdv", "fp32", 16, (32, 32, 8, 2), False, False), ("bwd_dkdv", "fp32", 32, (32, 64, 8, 2), False, False),
    ("bwd_dkdv", "tf32", 16, (16, 32, 4, 1), False, False), ("bwd_dkdv", "tf32", 64, (16, 16, 8, 1), False, False),
    ("bwd_dkdv", "tf32", 128, (16, 16, 8, 1), False, False),
    ("fwd", "bf16", 256, (32, 32, 8, 1), False, True), ("fwd", "bf16", 256, (128, 64, 8, 2), True, True),
    ("bwd_dq", "bf16", 256, (32, 32, 8, 1), True, True), ("bwd_dq", "fp32", 64, (64, 32, 8, 2), False, True),
    ("bwd_dq", "tf32", 128, (16, 16, 8, 1), False, True),
    ("bwd_dkdv", "bf16", 128, (32, 128, 8, 2), True, True),
    ("bwd_dkdv", "bf16", 256, (16, 32, 8, 1), True, True), ("bwd_dkdv", "fp32", 16, (32, 32, 8, 2), False, True),
    ("bwd_dkdv", "fp32", 32, (32, 64, 8, 2), False, True), ("bwd_dkdv", "tf32", 128, (16, 16, 8, 1), False, True),
}


def _interior_loop_fits(kernel: str, precision: str, head_dim: int, tiles: Tuple[int, ...], tma: bool,
                        packed: bool) -> bool:
    """Whether a ``kernel`` launch in ``precision`` ("bf16" for 16-bit inputs, "fp32" or "tf32") with these tiles,
    loading through TMA or not, on packed sequences or not, may run the two-loop path (its INTERIOR_LOOP), as the
    report compiles it without spills (the interpreter's tiles always do)."""
    return (kernel, precision, _head_dim_bucket(head_dim), tuple(tiles), tma, packed) not in _INTERIOR_LOOP_SPILLS


def _tiles(kernel: str, bits: int, bucket: int, tf32: bool, shared_memory: int, tma: bool,
           wide: bool = False, packed: bool = False) -> Tuple[int, ...]:
    """The table entry ``kernel`` runs with for ``bits``-bit inputs (``tf32``: float32 with allow_tf32) of head dim
    bucket ``bucket`` on a part with ``shared_memory`` bytes per block that has TMA or not, for a launch that
    ``_wide_tiles_fit`` or not, on ``packed`` sequences or not: what ``config_for`` picks on a GPU and
    ``aot_configs`` compiles for each report target."""
    key = (kernel, bits)
    if tf32 and tma and kernel == "fwd" and shared_memory >= _SM90_SHARED_MEMORY and bucket in _TILES_SM90_TF32_FWD:
        return _TILES_SM90_TF32_FWD[bucket]
    if tf32 and bucket in _TILES_TF32.get(kernel, {}):
        return _TILES_TF32[kernel][bucket]
    if shared_memory < LARGE_SHARED_MEMORY and bucket in _TILES_SMALL_SHARED_MEMORY.get(key, {}):
        return _TILES_SMALL_SHARED_MEMORY[key][bucket]
    if tma and shared_memory >= _SM90_SHARED_MEMORY:
        if wide and packed and bucket in _TILES_SM90_WIDE_PACKED.get(key, {}):
            return _TILES_SM90_WIDE_PACKED[key][bucket]
        if wide and bucket in _TILES_SM90_WIDE.get(key, {}):
            return _TILES_SM90_WIDE[key][bucket]
        if bucket in _TILES_SM90.get(key, {}):
            return _TILES_SM90[key][bucket]
    return _TILES[key][bucket]


def config_for(kernel: str, dtype: torch.dtype, head_dim: int, device: torch.device, allow_tf32: bool = False,
               tma: bool = False, wide: bool = False, packed: bool = False) -> AttentionConfig:
    """The tiles ``kernel`` runs with for inputs of ``dtype`` and ``head_dim`` on ``device`` (or the interpreter),
    loading them through TMA (``_loads_through_tma``) or not, for a launch that ``_wide_tiles_fit`` or not, on
    ``packed`` sequences or not: the pointer path keeps the tiles it compiles without spills with."""
    if interpreting():
        return INTERPRETER_CONFIG
    bits = 32 if dtype == torch.float32 else 16
    return AttentionConfig(*_tiles(kernel, bits, _head_dim_bucket(head_dim), allow_tf32 and bits == 32,
                                   target_of(device).shared_memory, tma, wide, packed))


# ------------------------------------------------------------------------------------------- launchers


@dataclasses.dataclass
class _MaskArgs:
    """Everything the kernels need to know about the masks and where each sequence lies, in kernel form."""

    mask: Optional[Tensor]  # attn_mask viewed as [B, H, Lq, Lk] with stride 0 on broadcast dims
    mask_kind: int
    padding: Optional[Tensor]  # [B, Lk] uint8
    key_lens: Optional[Tensor]  # [2, B] int32 (_key_lengths)
    query_lens: Optional[Tensor]  # [B] int32
    query_padding: Optional[Tensor]  # [B, Lq] uint8
    cu_seqlens_q: Optional[Tensor]  # [B + 1] int32, packed sequences only
    cu_seqlens_k: Optional[Tensor]
    is_causal: bool
    causal_offset: int  # the alignment offset, when it is one for every sequence
    per_sequence_offset: bool  # bottom_right aligned per sequence (computed in the kernel)
    window: Optional[Tuple[int, int]]  # (left, right) as the kernels take it, see _kernel_window

    def pointer_args(self) -> tuple:
        return (self.mask, self.padding, self.key_lens, self.query_lens, self.query_padding, self.cu_seqlens_q,
                self.cu_seqlens_k)

    def stride_args(self) -> tuple:
        mask_strides = self.mask.stride() if self.mask is not None else (0, 0, 0, 0)
        return (*mask_strides, self.padding.stride(0) if self.padding is not None else 0,
                self.query_padding.stride(0) if self.query_padding is not None else 0)

    def offset_args(self) -> tuple:
        return (self.causal_offset, *(self.window if self.window is not None else (0, 0)))

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    def constexprs(self) -> dict:
        return dict(
            MASK_KIND=self.mask_kind, HAS_PADDING=self.padding is not None,
            HAS_QUERY_LENS=self.query_lens is not None, HAS_QUERY_PADDING=self.query_padding is not None,
            IS_CAUSAL=self.is_causal, HAS_WINDOW=self.window is not None,
            PER_SEQUENCE_OFFSET=self.per_sequence_offset, VARLEN=self.packed,
            MASK_OFFSETS_64=self.mask is not None and mask_offsets_need_int64(self.mask),
        )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Sizes and (batch, head, row) strides of q, k and v as the kernels take them: dense ``[B, H, L, D]``, or
    packed ``[T, H, D]`` (batch stride 0: the kernels find each sequence's rows through cu_seqlens)."""

    batch: int
    heads: int
    kv_heads: int
    n_queries: int  # Lq; packed: max_seqlen_q
    n_keys: int  # Lk; packed: max_seqlen_k
    head_dim: int
    q_strides: Tuple[int, int, int]
    k_strides: Tuple[int, int, int]
    v_strides: Tuple[int, int, int]

    @staticmethod
    def dense(q: Tensor, k: Tensor, v: Tensor) -> "_Layout":
        (batch, heads, lq, head_dim), (_, kv_heads, lk, _) = q.shape, k.shape
        if lq * heads > MAX_DENSE_OUTPUT_ROWS:
            raise ValueError(f"triton attention: q {tuple(q.shape)} has Lq x heads = {lq * heads} rows of o per "
                             f"batch element; at most {MAX_DENSE_OUTPUT_ROWS} are supported")
        return _Layout(batch, heads, kv_heads, lq, lk, head_dim, *(tuple(t.stride()[:3]) for t in (q, k, v)))

    @staticmethod
    def packed(q: Tensor, k: Tensor, v: Tensor, batch: int, max_seqlen_q: int, max_seqlen_k: int) -> "_Layout":
        (_, heads, head_dim), kv_heads = q.shape, k.shape[1]
        return _Layout(batch, heads, kv_heads, max_seqlen_q, max_seqlen_k, head_dim,
                       *((0, t.stride(1), t.stride(0)) for t in (q, k, v)))

    @property
    def kv_group(self) -> int:
        return self.heads // self.kv_heads


# Offsets at or past this need int64 arithmetic in the kernels.
INT32_OFFSET_LIMIT = 2**31
# Lq x heads of one batch element: _row_index indexes those rows of o / do / dq in int32.
MAX_DENSE_OUTPUT_ROWS = 2**31 - 1
# CUDA's limits on grid axis 0 and on axes 1 and 2.
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535


def mask_offsets_need_int64(mask: Tensor) -> bool:
    """Whether an element of one (batch, head) slice of ``mask`` ``[B, H, Lq, Lk]`` lies 2**31 elements or more
    from the slice's first: its row and column offsets must then be computed in int64."""
    rows, cols = mask.shape[2:]
    return max(rows - 1, 0) * abs(mask.stride(2)) + max(cols - 1, 0) * abs(mask.stride(3)) >= INT32_OFFSET_LIMIT


def _grid(tiles: int, batch: int, heads: int) -> Tuple[int, int, int]:
    """(tiles, heads, batch), the order ``_batch_head`` reads, within CUDA's limits or a clear error."""
    axes = (("tiles", tiles, MAX_GRID_X), ("heads", heads, MAX_GRID_YZ), ("batch", batch, MAX_GRID_YZ))
    for name, size, limit in axes:
        if size > limit:
            raise ValueError(f"triton attention: {name}={size} is more than a CUDA grid axis holds ({limit}); "
                             "split the batch or the sequence")
    return (tiles, heads, batch)


def _key_lengths(key_padding_mask: Tensor) -> Tensor:
    """int32 ``[2, B]``, KEY_LENS as the kernels read it: one past each sequence's last key that is not padding
    (``contract.last_real_position``), then how many keys come before its first padding key (Lk if none), the keys whose
    tiles need no padding mask; the two are equal for a right-padded sequence. On the device (no host sync)."""
    leading = (~key_padding_mask).cumprod(dim=1).sum(dim=1)  # the run of real keys from position 0
    return torch.stack([contract.last_real_position(key_padding_mask), leading]).to(torch.int32)


def _kernel_window(window_left: Optional[int], window_right: Optional[int], is_causal: bool,
                   unlimited: int) -> Optional[Tuple[int, int]]:
    """``(left, right)`` as the kernels take it, None without a window. A side that is None, or wider than
    ``unlimited`` (Lq + Lk, beyond which no alignment offset reaches a key), becomes ``unlimited``, so the
    kernels' int32 sums stay in range; causal caps right at 0 (key j <= i + o)."""
    if window_left is None and window_right is None:
        return None
    left = unlimited if window_left is None else min(int(window_left), unlimited)
    right = unlimited if window_right is None else min(int(window_right), unlimited)
    return (left, min(right, 0) if is_causal else right)


def _mask_args(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], is_causal: bool, causal_alignment: str,
    query_padding_mask: Optional[Tensor] = None, window_left: Optional[int] = None,
    window_right: Optional[int] = None,
) -> _MaskArgs:
    (batch, heads, lq, _), lk = q.shape, k.shape[2]
    mask, mask_kind = None, MASK_NONE
    if attn_mask is not None:
        mask = attn_mask.expand(batch, heads, lq, lk)
        if attn_mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), MASK_BOOL
        else:
            mask_kind = MASK_FLOAT
    padding = key_lens = None
    if key_padding_mask is not None:
        padding = key_padding_mask.contiguous().view(torch.uint8)
        key_lens = _key_lengths(key_padding_mask)
    query_lens = query_padding = None
    if query_lengths is not None:
        query_lens = query_lengths.to(device=q.device, dtype=torch.int32).clamp(0, lq).contiguous()
    if query_padding_mask is not None:
        if query_lens is not None:  # one query mask: rows past query_lengths are padding too
            query_padding_mask = query_padding_mask | (
                torch.arange(lq, device=q.device, dtype=torch.int32)[None, :] >= query_lens[:, None])
        query_padding = query_padding_mask.contiguous().view(torch.uint8)
        query_lens = contract.last_real_position(query_padding_mask).to(torch.int32)
    window = _kernel_window(window_left, window_right, is_causal, lq + lk)
    aligned = causal_alignment == "bottom_right" and (is_causal or window is not None)
    return _MaskArgs(
        mask, mask_kind, padding, key_lens, query_lens, query_padding, None, None, is_causal,
        causal_offset=lk - lq if aligned else 0, per_sequence_offset=aligned and query_padding is not None,
        window=window,
    )


def _varlen_mask_args(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
    causal_alignment: str, window_left: Optional[int], window_right: Optional[int],
) -> _MaskArgs:
    window = _kernel_window(window_left, window_right, is_causal, max_seqlen_q + max_seqlen_k)
    aligned = causal_alignment == "bottom_right" and (is_causal or window is not None)
    return _MaskArgs(
        None, MASK_NONE, None, None, None, None, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), is_causal,
        causal_offset=0, per_sequence_offset=aligned, window=window,
    )


# Whether the interpreter takes the TMA path (tests switch it on to check it against the pointer path; the
# interpreter reads descriptors as a GPU does, out-of-bounds blocks zero-filled).
TMA_UNDER_INTERPRETER = False
# Dtypes loaded through TMA: 16-bit, and the forward's float32 with allow_tf32 at _TILES_SM90_TF32_FWD's head dims.
# Exact float32 products run on the CUDA cores from registers, where staging the tiles in shared memory gains
# nothing, and 13 of those configs spilled with TMA on sm_90.
TMA_DTYPES = (torch.float16, torch.bfloat16)


def _precision_takes_tma(kernel: str, dtype: torch.dtype, allow_tf32: bool, head_dim: int) -> bool:
    """Whether ``kernel`` ("fwd", "bwd_dq", ...; the backward's two kernels load alike) on ``dtype`` inputs of
    ``head_dim`` (float32 products in tf32 or not) loads through TMA where the part has it and TMA can address the
    inputs."""
    if dtype == torch.float32:
        return allow_tf32 and kernel == "fwd" and _head_dim_bucket(head_dim) in _TILES_SM90_TF32_FWD
    return dtype in TMA_DTYPES


def _loads_through_tma(*inputs: Tensor, kernel: str = "", allow_tf32: bool = False) -> bool:
    """Whether the kernels load ``inputs`` (the q/k/v/o/do tiles; dk/dv, which dense launches store, too) through
    TMA: for the precisions ``kernel`` takes it in (``_precision_takes_tma``), on sm_90 and later (under the
    interpreter, when TMA_UNDER_INTERPRETER), and only if TMA can address every one of them; else they use the
    pointer path (cp.async). Host-side descriptors (``tma_descriptor``) rather than ``tl.make_tensor_descriptor``:
    the driver encodes them at launch as kernel parameters, so no program builds one in global scratch memory (and
    no allocator is needed), and the AOT report compiles them from a ``tensordesc`` signature."""
    if not _precision_takes_tma(kernel, inputs[0].dtype, allow_tf32, inputs[0].shape[-1]):
        return False
    if interpreting():
        enabled = TMA_UNDER_INTERPRETER
    else:
        enabled = inputs[0].is_cuda and target_of(inputs[0].device).tma
    return enabled and all(map(tma_addressable, inputs))


def _tiles_of(x: Tensor, rows: int, block_d: int, use_tma: bool) -> Union[Tensor, TensorDescriptor]:
    """What a kernel takes for an input it loads in [rows, block_d] tiles: ``x`` itself, or with ``use_tma`` a
    descriptor over ``x`` seen as [B, H, L, D] (packed [T, H, D] as [1, H, T, D]), as ``_tma_tile`` reads it."""
    if not use_tma:
        return x
    if x.dim() == 3:
        x = x.transpose(0, 1).unsqueeze(0)
    return tma_descriptor(x, [1, 1, rows, block_d])


def _dot_args(dtype: torch.dtype, allow_tf32: bool) -> dict:
    return dict(
        UPCAST=interpreting() and dtype == torch.bfloat16,
        DOT_PRECISION="tf32" if allow_tf32 and not interpreting() else "ieee",
    )


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton attention: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    head_dim = q.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"triton attention: head_dim={head_dim} is not supported ({MIN_HEAD_DIM}..{MAX_HEAD_DIM})")
    if q.dtype == torch.float32 and head_dim > MAX_HEAD_DIM_FLOAT32:
        raise ValueError(
            f"triton attention: float32 supports head_dim up to {MAX_HEAD_DIM_FLOAT32}, got {head_dim}; "
            "use float16/bfloat16 inputs (any head_dim up to 256) or the reference backend"
        )


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """The precision name ``_interior_loop_fits`` takes: "bf16" for 16-bit inputs, else "tf32" or "fp32"."""
    return "bf16" if dtype != torch.float32 else "tf32" if allow_tf32 else "fp32"


def _launch_fwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, layout: _Layout, masks: _MaskArgs,
                dropout_p: float, seed: Optional[Tensor], scale: float, allow_tf32: bool) -> None:
    """The forward kernel, dense or packed (``layout``), writing ``o`` and ``lse``."""
    # Launched for head_dim 0 as well: its scores are 0, and the LSE still depends on the masks.
    block_d = _head_dim_bucket(layout.head_dim)
    use_tma = _loads_through_tma(q, k, v, kernel="fwd", allow_tf32=allow_tf32)
    constexprs = dict(HAS_DROPOUT=dropout_p > 0.0, **masks.constexprs())
    cfg = config_for("fwd", q.dtype, layout.head_dim, q.device, allow_tf32, use_tma,
                     _wide_tiles_fit("fwd", layout.head_dim, **constexprs), masks.packed)
    _attention_fwd_kernel[_grid(triton.cdiv(layout.n_queries, cfg.block_m), layout.batch, layout.heads)](
        _tiles_of(q, cfg.block_m, block_d, use_tma), _tiles_of(k, cfg.block_n, block_d, use_tma),
        _tiles_of(v, cfg.block_n, block_d, use_tma), o, lse, *masks.pointer_args(), *layout.q_strides,
        *layout.k_strides, *layout.v_strides, *masks.stride_args(), layout.heads, layout.kv_group, layout.n_queries,
        layout.n_keys, *masks.offset_args(), scale * LOG2E, dropout_p, seed,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, HEAD_DIM=layout.head_dim,
        **constexprs, **_dot_args(q.dtype, allow_tf32), USE_TMA=use_tma,
        INTERIOR_LOOP=_interior_loop_fits("fwd", _precision(q.dtype, allow_tf32), layout.head_dim,
                                          dataclasses.astuple(cfg), use_tma, masks.packed),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                dq: Tensor, dk: Tensor, dv: Tensor, layout: _Layout, masks: _MaskArgs, dropout_p: float,
                seed: Optional[Tensor], scale: float, allow_tf32: bool) -> None:
    """The dq kernel, then the dk/dv kernel, dense or packed (``layout``), writing ``dq``, ``dk`` and ``dv``."""
    o, do = _output_layout(o), _output_layout(do)
    block_d, use_tma = _head_dim_bucket(layout.head_dim), _loads_through_tma(q, k, v, o, do, dk, dv)
    delta = torch.empty_like(lse)  # lse's shape and layout
    common_args = (
        *masks.pointer_args(), *layout.q_strides, *layout.k_strides, *layout.v_strides, *masks.stride_args(),
        layout.heads, layout.kv_group, layout.n_queries, layout.n_keys, *masks.offset_args(), scale * LOG2E,
        dropout_p, seed,
    )
    common_constexprs = dict(
        BLOCK_D=block_d, HEAD_DIM=layout.head_dim, HAS_DROPOUT=dropout_p > 0.0, **masks.constexprs(),
        **_dot_args(q.dtype, allow_tf32), USE_TMA=use_tma,
    )
    precision = _precision(q.dtype, allow_tf32)
    cfg = config_for("bwd_dq", q.dtype, layout.head_dim, q.device, allow_tf32, use_tma,
                     _wide_tiles_fit("bwd_dq", layout.head_dim, **common_constexprs), masks.packed)
    q_in, o_in, do_in = (_tiles_of(x, cfg.block_m, block_d, use_tma) for x in (q, o, do))
    k_in, v_in = (_tiles_of(x, cfg.block_n, block_d, use_tma) for x in (k, v))
    _attention_bwd_dq_kernel[_grid(triton.cdiv(layout.n_queries, cfg.block_m), layout.batch, layout.heads)](
        q_in, k_in, v_in, o_in, do_in, lse, dlse.contiguous() if dlse is not None else None, delta, dq,
        *common_args,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_DLSE=dlse is not None, **common_constexprs,
        INTERIOR_LOOP=_interior_loop_fits("bwd_dq", precision, layout.head_dim, dataclasses.astuple(cfg), use_tma,
                                          masks.packed),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    cfg = config_for("bwd_dkdv", q.dtype, layout.head_dim, q.device, allow_tf32, use_tma,
                     _wide_tiles_fit("bwd_dkdv", layout.head_dim, **common_constexprs), masks.packed)
    _attention_bwd_dkdv_kernel[_grid(triton.cdiv(layout.n_keys, cfg.block_n), layout.batch, layout.kv_heads)](
        _tiles_of(q, cfg.block_m, block_d, use_tma), _tiles_of(k, cfg.block_n, block_d, use_tma),
        _tiles_of(v, cfg.block_n, block_d, use_tma), _tiles_of(do, cfg.block_m, block_d, use_tma), lse, delta,
        *(_tiles_of(t, cfg.block_n, block_d, use_tma and t.dim() == 4) for t in (dk, dv)),  # dense: TMA stores
        *common_args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common_constexprs,
        INTERIOR_LOOP=_interior_loop_fits("bwd_dkdv", precision, layout.head_dim, dataclasses.astuple(cfg),
                                          use_tma, masks.packed),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _empty_output(like: Tensor) -> Tensor:
    """An empty output shaped as ``like`` in the layout the kernels write: dense ``[B, H, L, D]`` laid out as
    ``[B, L, H, D]``, packed ``[T, H, D]`` contiguous."""
    if like.dim() == 4:
        return empty_heads_interleaved(like)
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _output_layout(t: Tensor) -> Tensor:
    """``t`` (o, or its gradient) in the kernels' output layout, which the backward reads it in: copied unless it
    already is (as the gradient of a module's head merge is)."""
    if t.dim() != 4:
        return t.contiguous()
    if all(size <= 1 or stride == want for size, stride, want in zip(t.shape, t.stride(),
                                                                      heads_interleaved_strides(t.shape))):
        return t
    return _empty_output(t).copy_(t)


@torch.library.custom_op("fused_transformer::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], dropout_p: float, seed: Optional[Tensor],
    scale: float, allow_tf32: bool,
) -> Tuple[Tensor, Tensor]:
    """Launch the forward; q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` with contiguous last dims.

    Returns ``o [B, H, Lq, D]`` (q's dtype, laid out as ``[B, Lq, H, D]``) and ``lse [B, H, Lq]`` (float32).
    """
    _check_inputs(q, k, v)
    batch, heads, lq, _ = q.shape
    o = _empty_output(q)
    lse = torch.empty((batch, heads, lq), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:  # no query row: a grid of 0 programs is an error on a GPU
        return o, lse
    masks = _mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                       query_padding_mask, window_left, window_right)
    _launch_fwd(q, k, v, o, lse, _Layout.dense(q, k, v), masks, dropout_p, seed, scale, allow_tf32)
    return o, lse


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, dropout_p, seed, scale, allow_tf32):
    return _empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fused_transformer::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], query_lengths: Optional[Tensor],
    query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, seed: Optional[Tensor], scale: float, allow_tf32: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Launch the backward (dq kernel, then dk/dv kernel); returns ``dq, dk, dv`` in the inputs' shapes, laid out
    as o."""
    dq, dk, dv = map(_empty_output, (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    masks = _mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                       query_padding_mask, window_left, window_right)
    _launch_bwd(do, dlse, q, k, v, o, lse, dq, dk, dv, _Layout.dense(q, k, v), masks, dropout_p, seed, scale,
                allow_tf32)
    return dq, dk, dv


@attention_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal,
      causal_alignment, window_left, window_right, dropout_p, seed, scale, allow_tf32):
    return tuple(map(_empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, seed: Optional[Tensor], scale: float, allow_tf32: bool,
) -> Tuple[Tensor, Tensor]:
    """Launch the forward on packed sequences; q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]`` with contiguous last dims.

    Returns ``o [Tq, H, D]`` (q's dtype) and ``lse [H, Tq]`` (float32).
    """
    _check_inputs(q, k, v)
    total_q, heads, _ = q.shape
    o = _empty_output(q)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return o, lse
    layout = _Layout.packed(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
    masks = _varlen_mask_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                              window_left, window_right)
    _launch_fwd(q, k, v, o, lse, layout, masks, dropout_p, seed, scale, allow_tf32)
    return o, lse


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment, window_left,
      window_right, dropout_p, seed, scale, allow_tf32):
    return _empty_output(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fused_transformer::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
    causal_alignment: str, window_left: Optional[int], window_right: Optional[int], dropout_p: float,
    seed: Optional[Tensor], scale: float, allow_tf32: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Launch the backward on packed sequences; returns ``dq [Tq, H, D], dk, dv [Tk, Hkv, D]``."""
    dq, dk, dv = map(_empty_output, (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    layout = _Layout.packed(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
    masks = _varlen_mask_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                              window_left, window_right)
    _launch_bwd(do, dlse, q, k, v, o, lse, dq, dk, dv, layout, masks, dropout_p, seed, scale, allow_tf32)
    return dq, dk, dv


@attention_varlen_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
      causal_alignment, window_left, window_right, dropout_p, seed, scale, allow_tf32):
    return tuple(map(_empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_weights", mutates_args=())
def attention_weights_fwd(
    q: Tensor, k: Tensor, lse: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], scale: float,
) -> Tensor:
    """Launch the probabilities kernel: ``[B, H, Lq, Lk]`` in q's dtype, zeros where masked."""
    _check_inputs(q, k, k)
    batch, heads, lq, head_dim = q.shape
    layout = _Layout.dense(q, k, k)
    weights = torch.empty((batch, heads, lq, layout.n_keys), dtype=q.dtype, device=q.device)
    if weights.numel() == 0:
        return weights
    masks = _mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                       query_padding_mask, window_left, window_right)
    block_d, use_tma = _head_dim_bucket(head_dim), _loads_through_tma(q, k)
    cfg = config_for("weights", q.dtype, head_dim, q.device, tma=use_tma)
    tiles = triton.cdiv(lq, cfg.block_m) * triton.cdiv(layout.n_keys, cfg.block_n)
    _attention_weights_kernel[_grid(tiles, batch, heads)](
        _tiles_of(q, cfg.block_m, block_d, use_tma), _tiles_of(k, cfg.block_n, block_d, use_tma), lse.contiguous(),
        weights, *masks.pointer_args(), *layout.q_strides, *layout.k_strides,
        *masks.stride_args(), heads, layout.kv_group, lq, layout.n_keys, *masks.offset_args(), scale * LOG2E,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, HEAD_DIM=head_dim,
        **masks.constexprs(), **_dot_args(q.dtype, False), USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return weights


@attention_weights_fwd.register_fake
def _(q, k, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, scale):
    return q.new_empty((*q.shape[:3], k.shape[2]))


# -------------------------------------------------------------------------------------------- autograd


class AttentionFunction(torch.autograd.Function):
    """Autograd over ``attention_fwd`` / ``attention_bwd``. Masks are constants (no gradient); the LSE is
    differentiable (its gradient folds into the backward's row term)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal,
                causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32):
        seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
        o, lse = torch.ops.fused_transformer.attention_fwd(
            q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
            window_left, window_right, dropout_p, seed, scale, allow_tf32,
        )
        ctx.save_for_backward(q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, seed)
        ctx.options = (is_causal, causal_alignment, window_left, window_right, dropout_p)
        ctx.scale, ctx.allow_tf32 = scale, allow_tf32
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None (no zeros to write and read)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, seed = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do  # only the LSE was used
        dq, dk, dv = torch.ops.fused_transformer.attention_bwd(
            do, dlse, q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask,
            *ctx.options, seed, ctx.scale, ctx.allow_tf32,
        )
        return dq, dk, dv, *(None,) * 11


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd over ``attention_varlen_fwd`` / ``attention_varlen_bwd`` (packed sequences), as
    ``AttentionFunction``."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                window_left, window_right, dropout_p, scale, allow_tf32):
        seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
        o, lse = torch.ops.fused_transformer.attention_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
            window_left, window_right, dropout_p, seed, scale, allow_tf32,
        )
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, seed)
        ctx.options = (max_seqlen_q, max_seqlen_k, is_causal, causal_alignment, window_left, window_right, dropout_p)
        ctx.scale, ctx.allow_tf32 = scale, allow_tf32
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None (no zeros to write and read)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, seed = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do  # only the LSE was used
        dq, dk, dv = torch.ops.fused_transformer.attention_varlen_bwd(
            do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, seed, ctx.scale, ctx.allow_tf32,
        )
        return dq, dk, dv, *(None,) * 11


def _window_sides(window: Window) -> Tuple[Optional[int], Optional[int]]:
    return (None, None) if window is None else (window[0], window[1])


def run_attention(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                  query_lengths: Optional[Tensor] = None, allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
    """The Triton backend's entry for ``functional.attention`` (arguments checked there): ``(out, lse)``, out laid out
    as ``[B, Lq, H, D]``, the LSE float32 ``[B, H, Lq]``; ``query_lengths`` and ``allow_tf32`` as in ``attention``."""
    q, k, v = (contiguous_last_dim(t) for t in (q, k, v))
    attn_mask = masks.attn_mask
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("triton attention: attn_mask requires grad, but masks are constants here (no gradient); "
                         "pass attn_mask.detach(), or use the reference backend to differentiate the mask")
    return AttentionFunction.apply(
        q, k, v, attn_mask, masks.key_padding_mask, query_lengths, masks.query_padding_mask, spec.is_causal,
        spec.causal_alignment, *_window_sides(spec.window), spec.dropout_p, spec.scale, bool(allow_tf32),
    )


def run_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, spec: AttentionSpec, allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
    """The Triton backend's entry for ``functional.attention_varlen`` (arguments checked there): ``(out, lse)``."""
    q, k, v = (contiguous_last_dim(t) for t in (q, k, v))
    return AttentionVarlenFunction.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), spec.is_causal,
        spec.causal_alignment, *_window_sides(spec.window), spec.dropout_p, spec.scale, bool(allow_tf32),
    )


def run_attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                          query_lengths: Optional[Tensor] = None) -> Tensor:
    """The Triton backend's entry for ``functional.attention_weights``: the probabilities ``[B, H, Lq, Lk]`` (q's
    dtype, before dropout), recomputed from the LSE by a separate kernel; only modules asked for ``need_weights``
    run it. Not differentiable (``torch.nn`` returns these weights for inspection)."""
    q, k = contiguous_last_dim(q), contiguous_last_dim(k)
    return torch.ops.fused_transformer.attention_weights(
        q, k, lse.float(), masks.attn_mask, masks.key_padding_mask, query_lengths, masks.query_padding_mask,
        spec.is_causal, spec.causal_alignment, *_window_sides(spec.window), spec.scale,
    )


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
    return_lse: bool = False,
    query_lengths: Optional[Tensor] = None,
    allow_tf32: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``fused_transformer.functional.attention`` on Triton, checked as there, plus two kernel-level options.

    Args:
        query_lengths: ``[B]`` integers; rows ``i >= query_lengths[b]`` give zeros (LSE ``-inf``). With a
            ``query_padding_mask`` too, those rows count as padding (also for ``bottom_right`` alignment).
        allow_tf32: float32 products on tensor cores in TF32 (default: full float32 precision).

    Returns:
        ``[B, H, Lq, D]`` in q's dtype, laid out as ``[B, Lq, H, D]`` (``out.transpose(1, 2)`` is contiguous),
        and the float32 LSE ``[B, H, Lq]`` with ``return_lse``. Inputs need only a contiguous last dim (copied
        otherwise); float16 / bfloat16 / float32, head dims 0..256 (float32: 0..128).
    """
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask)
    contract.check_attention_args(q, k, v, masks)
    spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, dropout_p, scale)
    if query_lengths is not None and tuple(query_lengths.shape) != (q.shape[0],):
        raise ValueError(f"query_lengths must be [batch={q.shape[0]}], got shape {tuple(query_lengths.shape)}")
    o, lse = run_attention(q, k, v, masks, spec, query_lengths, allow_tf32)
    return (o, lse) if return_lse else o


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
    return_lse: bool = False,
    allow_tf32: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``fused_transformer.functional.attention_varlen`` on Triton, plus ``allow_tf32`` as in ``attention``.
    Checked as there but for the values of cu_seqlens, which the kernels read on the device (no host sync)."""
    contract.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, dropout_p, scale)
    o, lse = run_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, spec, allow_tf32)
    return (o, lse) if return_lse else o


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
    query_lengths: Optional[Tensor] = None,
) -> Tensor:
    """``fused_transformer.functional.attention_weights`` on Triton (``run_attention_weights``), plus
    ``query_lengths`` as in ``attention``."""
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask)
    contract.check_attention_args(q, k, k, masks)
    spec = contract.attention_spec(q.shape[-1], is_causal, causal_alignment, window, 0.0, scale)
    return run_attention_weights(q, k, lse, masks, spec, query_lengths)


def attention_keep_mask(seed: Tensor, batch: int, heads: int, n_queries: int, n_keys: int, dropout_p: float,
                        device: torch.device) -> Tensor:
    """The bool ``[B, H, Lq, Lk]`` dropout keep-mask the kernels drew with the seed tensor ``seed`` (for the
    reference); for packed sequences ``[B, H, max_seqlen_q, max_seqlen_k]``, sequence b using its top-left
    ``[H, len_q, len_k]`` corner."""
    return dropout_keep_mask(seed, batch * heads * n_queries, n_keys, dropout_p, device).view(
        batch, heads, n_queries, n_keys)


# ------------------------------------------------------------------------------------------------- AOT


# Pointers whose type does not follow the inputs' dtype (the float mask as a float32 additive bias).
_AOT_POINTER_TYPES = {"LSE": "*fp32", "DLSE": "*fp32", "DELTA": "*fp32", "MASK": "*fp32", "PAD": "*u8",
                      "KEY_LENS": "*i32", "QUERY_LENS": "*i32", "QUERY_PAD": "*u8", "CU_SEQLENS_Q": "*i32",
                      "CU_SEQLENS_K": "*i32", "SEED": "*i64"}
# The feature sets compiled for each tile config (config-name suffix -> mask constexprs): dense with every mask
# on, the largest register footprint; and packed sequences, which take no attn_mask or padding but compute their
# bounds and alignment per sequence (not compiled for the weights kernel, which has no packed variant).
_AOT_VARIANTS = {
    "": dict(MASK_KIND=MASK_FLOAT, HAS_PADDING=True, HAS_QUERY_LENS=True, HAS_QUERY_PADDING=True, IS_CAUSAL=True,
             HAS_WINDOW=True, PER_SEQUENCE_OFFSET=True, VARLEN=False),
    "/varlen": dict(MASK_KIND=MASK_NONE, HAS_PADDING=False, HAS_QUERY_LENS=False, HAS_QUERY_PADDING=False,
                    IS_CAUSAL=True, HAS_WINDOW=True, PER_SEQUENCE_OFFSET=True, VARLEN=True),
    # The two-loop path of each kernel (unmasked interior tiles), dense and packed: causal with the most it takes (key
    # padding, query lengths; bounds and alignment per sequence), no dropout.
    "/causal": dict(MASK_KIND=MASK_NONE, HAS_PADDING=True, HAS_QUERY_LENS=True, HAS_QUERY_PADDING=False,
                    IS_CAUSAL=True, HAS_WINDOW=False, PER_SEQUENCE_OFFSET=True, VARLEN=False, HAS_DROPOUT=False),
    "/varlen/causal": dict(MASK_KIND=MASK_NONE, HAS_PADDING=False, HAS_QUERY_LENS=False, HAS_QUERY_PADDING=False,
                           IS_CAUSAL=True, HAS_WINDOW=False, PER_SEQUENCE_OFFSET=True, VARLEN=True,
                           HAS_DROPOUT=False),
    # The most a launch that _wide_tiles_fit takes, dense and packed.
    "/padded": dict(MASK_KIND=MASK_NONE, HAS_PADDING=True, HAS_QUERY_LENS=True, HAS_QUERY_PADDING=True,
                    IS_CAUSAL=True, HAS_WINDOW=True, PER_SEQUENCE_OFFSET=True, VARLEN=False, HAS_DROPOUT=False),
    "/varlen/nodropout": dict(MASK_KIND=MASK_NONE, HAS_PADDING=False, HAS_QUERY_LENS=False, HAS_QUERY_PADDING=False,
                              IS_CAUSAL=True, HAS_WINDOW=True, PER_SEQUENCE_OFFSET=True, VARLEN=True,
                              HAS_DROPOUT=False),
}
# Variants only some kernels have: the others compile them as the dense variant.
_AOT_VARIANT_KERNELS = {"/causal": ("fwd", "bwd_dq", "bwd_dkdv"), "/varlen/causal": ("fwd", "bwd_dq", "bwd_dkdv"),
                        "/padded": ("fwd", "bwd_dq", "bwd_dkdv"),
                        "/varlen/nodropout": ("fwd", "bwd_dq", "bwd_dkdv")}
# Variants compiled only for the targets where they pick other tiles than the variant named (elsewhere they run
# the same tiles with fewer features).
_AOT_TILE_VARIANTS = {"/padded": "", "/varlen/nodropout": "/varlen"}
# Each variant is compiled with the loads the launcher picks on each target: 16-bit inputs through TMA descriptors
# on these (config-name suffix "/tma"), the pointer path elsewhere. The inputs each kernel then loads through TMA,
# in BLOCK_M-row (query) or BLOCK_N-row (key) tiles (and dk / dv, which dense launches store through TMA):
_AOT_TMA_TARGETS = (90,)
_AOT_TMA_INPUTS = {"fwd": ("Q", "K", "V"), "bwd_dq": ("Q", "K", "V", "O", "DO"),
                   "bwd_dkdv": ("Q", "K", "V", "DO", "DK", "DV"), "weights": ("Q", "K")}
_QUERY_TILE_INPUTS = ("Q", "O", "DO")


def aot_configs() -> List[AotKernel]:
    """Every attention kernel × tile config the launchers pick on a GPU, in bfloat16 (16-bit tiles), float32 and
    float32 with tf32 products, for the targets that pick it, in each feature set of ``_AOT_VARIANTS`` (dense
    with every feature on: float mask, key and query padding, query lengths, causal, window, per-sequence
    alignment, dropout; packed sequences with causal, window and dropout; causal without dropout, dense (with key
    padding) and packed, the path that skips masking interior tiles; and, where they pick tiles of their own
    (``_AOT_TILE_VARIANTS``), the most a launch that ``_wide_tiles_fit`` takes, dense and packed), each with TMA
    loads for ``_AOT_TMA_TARGETS`` and the pointer path for the other targets and the precisions
    ``_precision_takes_tma`` keeps off TMA. Each variant gets the tiles its launches pick."""

    kernels = {
        "fwd": _attention_fwd_kernel, "bwd_dq": _attention_bwd_dq_kernel, "bwd_dkdv": _attention_bwd_dkdv_kernel,
        "weights": _attention_weights_kernel,
    }
    shipped = []  # (kernel, bits, head_dim, tiles, targets, dot precision, variant, features, use_tma)
    for (kernel, bits), by_head_dim in _TILES.items():
        for head_dim in by_head_dim:
            # float32 with allow_tf32=True too (never taken by the weights kernel).
            for tf32 in (False, True) if bits == 32 and kernel != "weights" else (False,):
                for variant, features in _AOT_VARIANTS.items():
                    if features["VARLEN"] and kernel == "weights" or kernel not in _AOT_VARIANT_KERNELS.get(
                            variant, (kernel,)):
                        continue
                    wide = _wide_tiles_fit(kernel, head_dim, **{"HAS_DROPOUT": True, **features})
                    picked = {}  # (tiles, TMA loads) -> the targets that pick them, as the launcher does on each
                    for target in TARGETS:
                        use_tma = target.capability in _AOT_TMA_TARGETS and _precision_takes_tma(
                            kernel, torch.bfloat16 if bits == 16 else torch.float32, tf32, head_dim)
                        tiles = _tiles(kernel, bits, head_dim, tf32, target.shared_memory, use_tma, wide,
                                       features["VARLEN"])
                        if variant in _AOT_TILE_VARIANTS and tiles == _tiles(
                                kernel, bits, head_dim, tf32, target.shared_memory, use_tma, False):
                            continue
                        picked.setdefault((tiles, use_tma), []).append(target.capability)
                    shipped.extend((kernel, bits, head_dim, tiles, tuple(targets), "tf32" if tf32 else "ieee",
                                    variant, features, use_tma) for (tiles, use_tma), targets in picked.items())
    configs = []
    for kernel, bits, head_dim, tiles, targets, dot_precision, variant, features, use_tma in shipped:
        elem = "*bf16" if bits == 16 else "*fp32"
        # The launchers' name for it, the config name's too.
        precision = _precision(torch.bfloat16 if bits == 16 else torch.float32, dot_precision == "tf32")
        cfg = AttentionConfig(*tiles)
        fn = kernels[kernel]
        signature = {}
        for name in fn.arg_names:
            if use_tma and name in _AOT_TMA_INPUTS[kernel] and not (features["VARLEN"] and name in ("DK", "DV")):
                rows = cfg.block_m if name in _QUERY_TILE_INPUTS else cfg.block_n
                signature[name] = f"tensordesc<{elem[1:]}[1,1,{rows},{head_dim}]>"
            elif name in _AOT_POINTER_TYPES:
                signature[name] = _AOT_POINTER_TYPES[name]
            elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "W"):
                signature[name] = elem
            elif name in ("qk_scale", "dropout_p"):
                signature[name] = "fp32"
            elif name.islower():
                signature[name] = "i32"
        constexprs = dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, HEAD_DIM=head_dim, MASK_OFFSETS_64=False,
            HAS_DROPOUT=True, HAS_DLSE=True, UPCAST=False, DOT_PRECISION=dot_precision, USE_TMA=use_tma,
        )
        constexprs.update(features)
        constexprs["INTERIOR_LOOP"] = _interior_loop_fits(kernel, precision, head_dim, tiles, use_tma,
                                                          features["VARLEN"])
        constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
        configs.append(AotKernel(
            name=f"attention_{kernel}",
            config=f"{precision}/D{head_dim}"
                   f"/BM{cfg.block_m}_BN{cfg.block_n}"
                   f"_w{cfg.num_warps}_s{cfg.num_stages}{variant}{'/tma' if use_tma else ''}",
            fn=fn, signature=signature, constexprs=constexprs, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, expect_tensor_cores=bits == 16, targets=targets,
            # What the JIT specialises for inputs from torch: aligned pointers and strides, odd lengths.
            divisible_by_16=tuple(n for n, t in signature.items() if t.startswith("*") or n.startswith("stride_")),
        ))
    return configs
