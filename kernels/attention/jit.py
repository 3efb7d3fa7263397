"""The ``@triton.jit`` helpers the attention kernels share: masks, where each sequence lies, and row indexing.

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
Score modifiers (``contract.ScoreMods``), before the masks, in log2 units as the scores: softcap (``softcap * tanh(s /
softcap)``) and ALiBi (``-slope |i + o - j|``, o the alignment offset above); a launch with any masks every key tile
(no interior loop). Each is written here once, host side and device side (below: the kernels take them as one tuple,
MODS, and one constexpr tuple of flags, SCORE_MODS). Attention sinks (a logit per head in each real row's softmax
denominator) enter the forward's last step and its LSE only.
Variable lengths (VARLEN): q [Tq, H, D], k/v [Tk, Hkv, D] hold B sequences packed end to end, cu_seqlens_q/k
[B + 1] their offsets. The grid is sized by the longest sequence; each program reads its sequence's bounds from
cu_seqlens (no host sync) and returns at once when its tile lies past the sequence's end.
Loads: with USE_TMA (``configs.plan``) the q/k/v/o/do tiles come through host-side TMA descriptors (``_tma_tile``),
whose out-of-bounds rows and columns read as zeros; elsewhere through pointers and masks (cp.async when pipelined).
"""
from typing import Tuple

import triton
import triton.language as tl

from ...contract import ScoreMods


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The interpreter computes bfloat16 dots wrongly: upcast there (the operands are already rounded to
    # bfloat16, so the products are the ones a GPU forms).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x):
    # tanh through exp2 (no tanh in tl.math that the interpreter runs too); saturates to +-1 for large |x|.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


# ------------------------------------------------------------------------------------------ score modifiers
# SCORE_MODS: a constexpr flag per field of contract.ScoreMods, in its order (``score_mod_flags``). MODS: the
# modifiers' runtime arguments (``score_mod_args``): softcap in log2 units (1.0 without it), then ALiBi's slopes
# (float32 [H] or [B, H], None without them) and their batch and head strides (0 on a broadcast dim).
SOFTCAP, ALIBI = tl.constexpr(0), tl.constexpr(1)  # places in SCORE_MODS
MODS_SIGNATURE = ("fp32", "*fp32", "i32", "i32")  # MODS' types, for the AOT report
LOG2E = 1.4426950408889634  # the scores' unit: exp2 is the fast exponential


def score_mod_flags(mods: ScoreMods) -> Tuple[bool, ...]:
    """SCORE_MODS of a launch with ``mods``."""
    return tuple(value is not None for value in mods)


NO_SCORE_MOD = score_mod_flags(ScoreMods())  # SCORE_MODS without a modifier, and with every one (the AOT report's)
EVERY_SCORE_MOD = tuple(True for _ in ScoreMods._fields)


def score_mod_args(mods: ScoreMods) -> tuple:
    """MODS of a launch with ``mods``, in the units the kernels keep scores in (log2)."""
    slopes = mods.alibi_slopes
    strides = (0, 0) if slopes is None else slopes.stride() if slopes.dim() == 2 else (0, slopes.stride(0))
    return (1.0 if mods.softcap is None else mods.softcap * LOG2E, slopes, *strides)


@triton.constexpr_function
def _modifies_scores(SCORE_MODS):
    """Whether a launch has a score modifier (a compile-time bool)."""
    return any(SCORE_MODS)


@triton.constexpr_function
def _scales_gradient(SCORE_MODS):
    """Whether ``_score_mods_grad`` changes ds (a compile-time bool): softcap's derivative is not 1."""
    return bool(SCORE_MODS[SOFTCAP])


@triton.jit
def _score_mod_values(MODS, batch, head, SCORE_MODS: tl.constexpr):
    """What the modifiers read once per program, as ``_modified_scores`` takes them: (softcap, slope), in log2 units.
    ``head`` is a program's head, or a column of heads (one per row) whose values broadcast over the keys."""
    slope = 0.0
    if SCORE_MODS[ALIBI]:
        slope = tl.load(MODS[1] + batch * MODS[2] + head * MODS[3]).to(tl.float32) * 1.4426950408889634
    return MODS[0], slope


@triton.jit
def _modified_scores(s, rows, cols, offset, values, SCORE_MODS: tl.constexpr):
    """Scores ``s`` (log2 units) with the modifiers applied in their order: capped, ``softcap * tanh(s / softcap)``,
    then biased by ALiBi, ``- slope |i + offset - j|``; rows / cols: query / key indices broadcastable to s,
    ``values`` from ``_score_mod_values``. Also returns what ``_score_mods_grad`` reads (tanh(s / softcap))."""
    capped = 0.0
    if SCORE_MODS[SOFTCAP]:
        capped = _tanh(s / values[0])
        s = values[0] * capped
    if SCORE_MODS[ALIBI]:
        s -= values[1] * tl.abs(rows + offset - cols).to(tl.float32)
    return s, capped


@triton.jit
def _score_mods_grad(ds, values, saved, SCORE_MODS: tl.constexpr):
    """The gradient ``ds`` of the modified scores as that of the scores before them: times softcap's derivative
    ``1 - tanh^2`` (``saved``: ``_modified_scores``' second result, ``values`` as it took them); ALiBi's bias has
    derivative 1."""
    if SCORE_MODS[SOFTCAP]:
        ds *= 1.0 - saved * saved
    return ds


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
def _row_index(head, n_heads, rows, n_rows, start, VARLEN: tl.constexpr, PER_ROW_INT64: tl.constexpr, batch,
               BATCH_GIVEN: tl.constexpr):
    """Each row's index in an output seen as rows of HEAD_DIM elements, [T, H] (VARLEN: packed [T, H, D], the
    sequence starting at row ``start``) or [B L, H] (dense: [B, H, L, D] laid out as [B, L, H, D]). The batch is the
    program's (``_batch_head``), read here rather than held in registers through the main loop (BATCH_GIVEN: ``batch``,
    for programs that walk several tiles). Within one batch
    element the index fits in int32 (the launcher checks Lq H < 2**31): PER_ROW_INT64 computes it in int64 anyway,
    the form ptxas allocates without spills in the dk/dv kernel, where the forward's and dq's need the int32 one."""
    if VARLEN:
        return (start + rows) * n_heads + head
    if BATCH_GIVEN:
        first = batch.to(tl.int64) * n_rows
    else:
        first = tl.program_id(2).to(tl.int64) * n_rows
    if PER_ROW_INT64:
        return (first + rows) * n_heads + head
    return first * n_heads + (rows * n_heads + head.to(tl.int32))


@triton.jit
def _stat_base(batch_head, head, n_queries, q_start, CU_SEQLENS_Q, VARLEN: tl.constexpr, n_batch,
               BATCH_GIVEN: tl.constexpr):
    """Index of query row 0 of this (batch, head) in the float32 row statistics (LSE, its gradient, delta):
    [B, H, Lq], or [H, Tq] with VARLEN (Tq, the packed length, is cu_seqlens_q's last element; B the grid's axis 2, or
    with BATCH_GIVEN ``n_batch``)."""
    if VARLEN:
        if BATCH_GIVEN:
            return head * tl.load(CU_SEQLENS_Q + n_batch) + q_start
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
def _leading_real_keys(KEY_LENS, batch, k_len, HAS_PADDING: tl.constexpr, n_batch, BATCH_GIVEN: tl.constexpr):
    """How many keys of sequence ``batch`` come before its first padding key (k_len when it has padding only at the
    end, or none): key tiles below that need no padding mask. KEY_LENS is [2, B] int32
    (``lengths.padding_lengths``), this the second row; B is the grid's axis 2, or with BATCH_GIVEN ``n_batch``."""
    if HAS_PADDING:
        if BATCH_GIVEN:
            return tl.load(KEY_LENS + n_batch + batch)
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
