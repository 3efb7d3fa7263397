"""Fused LayerNorm / RMSNorm with residual add and dropout, one pass per row.

Forward, per row of N features:
    z = dropout(x) + residual                      (each part optional; z is rounded to x's dtype)
    LayerNorm: y = (z - mean(z)) * rstd * weight + bias,   rstd = 1 / sqrt(mean((z - mean)^2) + eps)
    RMSNorm:   y = z * rstd * weight + bias,                rstd = 1 / sqrt(mean(z^2) + eps)
Mean and rstd are kept in float32 for the backward. With ``prenorm`` z is returned too, so a pre-LN block
never reads the residual stream twice.

Backward, with xhat = (z - mean) * rstd (or z * rstd) and g = dy * weight:
    dz = (g - xhat * mean(g * xhat) - mean(g)) * rstd      (RMSNorm: no mean(g) term)  [+ dz from prenorm]
    dresidual = dz,   dx = dropout(dz) with the forward's mask, regenerated from its seed
    dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy)
Each backward program walks a contiguous block of rows and writes one float32 partial row of dweight and one of
dbias, side by side in one buffer; a second small kernel (``sum_rows``) adds the partials of both in a fixed order:
deterministic, no atomics. A whole 16384-wide row and its dweight / dbias sums need more than the 64 registers a
thread of a 1024-thread block may have (stack frames of 100..270 bytes), so rows wider than 8192 (``bwd_launch``)
are held by a cluster of two blocks on sm_90 and later, each holding half the row with 128 registers a thread, the
row sums reduced across the pair through distributed shared memory (Triton's ``num_ctas``; one program as the kernel
sees it). Before sm_90 (no clusters), and where the installed Triton cannot build the cluster launch
(``toolchain.cluster_launches``), they are split over programs of 8192 columns (SPLIT_COLS), each of which also
reads the row's other block to get the row sums. ``python -m fused_transformer report`` checks the shipped configs.

Variants (``variants``: the default until ``bench --suite variants`` measured a GPU, then its winner per
``shape_class``): "row" normalises one row per program, and the backward's programs take one row per step of their
loop; "rows" takes BLOCK_M rows as one [BLOCK_M, BLOCK_N] tile instead (``rows_per_tile``: up to ROWS_TILE elements,
MAX_BLOCK_M rows), which gives short rows' programs more bytes to move. It applies to rows narrower than ROWS_TILE
columns, in the forward and the backward's whole-row path; wider rows run "row"'s launch in either. Both draw the
same dropout mask (below).

Bytes moved per element of z (element size s: 2 for bf16, 4 for fp32): read dy and z, write dx (3s), plus dz (s)
and dresidual (s) when present; with SPLIT_COLS over C column blocks dy and z are read C times (+2s(C - 1)).
Each program writes 4 bytes per column per partial (dweight, dbias) and walks at least MIN_ROWS_PER_PROGRAM
rows: at most 8 / 8 = 1 byte per element (``sum_rows`` reads them once more).

Without dropout there is nothing to fuse that ATen does not: ``fused_transformer.route`` sends such calls of the
functional op to ATen's add + ``F.layer_norm``, as torch.nn does; the kernel entry ``layer_norm`` always runs the
kernels.

Dropout keep-mask: element (row, col) of x viewed as [rows, N] is kept when ``dropout_keep(seed, row * N + col,
p)``; ``fused_transformer.kernels._common.dropout_keep_mask(seed, rows, N, p, device)`` replays it.
"""
import dataclasses
import functools
import math
import re
from typing import List, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .. import contract
from ..contract import Seed, seed_tensor
from ._common import (
    SUM_ROWS_BLOCK_COLS, SUM_ROWS_BLOCK_ROWS, _sum_rows_kernel, cdiv, contiguous_last_dim, dropout_keep, dropout_seed,
    interpreting, launch_kernel, next_power_of_2, seed_args, sum_rows, traced,
)
from . import variants
from .aot import AotKernel
from .targets import TARGETS, Target, target_of
from .toolchain import Version, cluster_launches, installed

Tensor = torch.Tensor

MAX_HIDDEN = 16384
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["host_seed"])
def _layer_norm_fwd_kernel(
    X,  # [rows, N] input
    RESIDUAL,  # [rows, N] (HAS_RESIDUAL)
    W,  # [N] (HAS_WEIGHT)
    B,  # [N] (HAS_BIAS)
    Y,  # [rows, N] output, x's dtype
    Z,  # [rows, N] dropout(x) + residual, x's dtype (STORE_Z)
    MEAN,  # [rows] float32 (STORE_STATS; not written for RMSNorm)
    RSTD,  # [rows] float32 (STORE_STATS)
    stride_x_row, stride_res_row, stride_y_row, stride_z_row,
    n_rows, n_cols, eps, dropout_p, SEED, host_seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_Z: tl.constexpr, IS_RMS_NORM: tl.constexpr, STORE_STATS: tl.constexpr,
):
    # Program i normalises rows [i * BLOCK_M, (i + 1) * BLOCK_M) as one [BLOCK_M, BLOCK_N] tile, each row's
    # statistics reduced along axis 1 (BLOCK_M = 1: the "row" variant; "rows" gives a short row's program more work).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    z = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = dropout_keep(dropout_seed(SEED, host_seed), rows[:, None] * n_cols + cols[None, :], dropout_p)
        z = tl.where(keep, z * (1.0 / (1.0 - dropout_p)), 0.0)
    if HAS_RESIDUAL:
        z += tl.load(RESIDUAL + rows[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL or HAS_DROPOUT:
        # Normalise exactly the z that is returned and that the backward reads back.
        z = z.to(X.dtype.element_ty).to(tl.float32)
    if STORE_Z:
        tl.store(Z + rows[:, None] * stride_z_row + cols[None, :], z.to(Z.dtype.element_ty), mask=mask)

    if IS_RMS_NORM:
        centered = z
    else:
        mean = tl.sum(z, axis=1) / n_cols
        if STORE_STATS:
            tl.store(MEAN + rows, mean, mask=row_mask)
        centered = tl.where(mask, z - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    if STORE_STATS:
        tl.store(RSTD + rows, rstd, mask=row_mask)

    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_sums(Z, DY, W, rows, row_mask, stride_z_row, stride_dy_row, n_cols, mean, rstd, col_start,
              BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS_NORM: tl.constexpr):
    """(xhat, g, dy) on the columns ``col_start + [0, BLOCK_N)`` of ``rows`` (``[BLOCK_M]``, with their ``mean`` and
    ``rstd``), ``[BLOCK_M, BLOCK_N]`` tiles zero past the row's end and on the rows outside ``row_mask``."""
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    z = tl.load(Z + rows[:, None] * stride_z_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS_NORM:
        xhat = z * rstd[:, None]
    else:
        xhat = tl.where(mask, (z - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_WEIGHT:
        # Read per row (from L1) rather than held across the row loop: a register row more spills at 8192.
        g *= tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return xhat, g, dy


@triton.jit(do_not_specialize=["host_seed"])
def _layer_norm_bwd_kernel(
    Z,  # [rows, N] the normalised input (x itself when there is no residual and no dropout)
    DY,  # [rows, N] gradient of y
    DZ,  # [rows, N] gradient of the returned z (HAS_DZ)
    W,  # [N] (HAS_WEIGHT)
    MEAN,  # [rows] float32 (not read for RMSNorm)
    RSTD,  # [rows] float32
    DX,  # [rows, N] gradient of x
    DRESIDUAL,  # [rows, N] gradient of residual (HAS_RESIDUAL)
    PARTIALS,  # [programs, N (HAS_WEIGHT) + N (HAS_BIAS)] float32, rows stride_partial_row apart: this program's sum
    # of dy * xhat (dweight's, columns [0, N)), then of dy (dbias's, the N columns after dweight's or the first N)
    stride_z_row, stride_dy_row, stride_dz_row, stride_dx_row, stride_dres_row, stride_partial_row,
    n_rows, n_cols, rows_per_program, dropout_p, SEED, host_seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DZ: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_RMS_NORM: tl.constexpr, SPLIT_COLS: tl.constexpr,
):
    # Program (i, j) walks rows [i * rows_per_program, ...), BLOCK_M at a time as a [BLOCK_M, BLOCK_N] tile ("rows";
    # one at a time: "row"), on columns [j * BLOCK_N, ...). Without SPLIT_COLS one block holds the whole row (j = 0).
    # With it (the widest rows, one at a time, whose partial sums would not fit in registers next to the row) the
    # row sums also need the row's other column blocks.
    program = tl.program_id(0).to(tl.int64)
    col_start = tl.program_id(1) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    row_start = program * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first_row in range(row_start, row_end, BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean = 0.0
        if not IS_RMS_NORM:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        xhat, g, dy = _row_sums(Z, DY, W, rows, row_mask, stride_z_row, stride_dy_row, n_cols, mean, rstd, col_start,
                                BLOCK_N, HAS_WEIGHT, IS_RMS_NORM)
        # Summed before the row sums, so dy is not held across SPLIT_COLS's reads of the other blocks (the split
        # kernel at 8192 columns otherwise kept a pointer on the stack on sm_80, and the whole-row one at 1024 on
        # sm_86 / sm_89).
        if HAS_WEIGHT:
            dw_sum += dy * xhat
        if HAS_BIAS:
            db_sum += dy
        if SPLIT_COLS:
            # Summed block by block in column order, the own block from registers: every program of the row gets
            # bit-identical sums and reads each other block of the row once.
            sum_gx = tl.zeros((BLOCK_M,), dtype=tl.float32)
            sum_g = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for block_start in range(0, n_cols, BLOCK_N):
                if block_start == col_start:
                    sum_gx += tl.sum(g * xhat, axis=1)
                    sum_g += tl.sum(g, axis=1)
                else:
                    xhat_o, g_o, _ = _row_sums(Z, DY, W, rows, row_mask, stride_z_row, stride_dy_row, n_cols, mean,
                                               rstd, block_start, BLOCK_N, HAS_WEIGHT, IS_RMS_NORM)
                    sum_gx += tl.sum(g_o * xhat_o, axis=1)
                    sum_g += tl.sum(g_o, axis=1)
        else:
            sum_gx = tl.sum(g * xhat, axis=1)
            sum_g = tl.sum(g, axis=1)
        dz = g - xhat * (sum_gx / n_cols)[:, None]
        if not IS_RMS_NORM:
            dz -= (sum_g / n_cols)[:, None]
        dz *= rstd[:, None]
        if HAS_DZ:
            dz += tl.load(DZ + rows[:, None] * stride_dz_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(DRESIDUAL + rows[:, None] * stride_dres_row + cols[None, :], dz.to(DRESIDUAL.dtype.element_ty),
                     mask=mask)
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed(SEED, host_seed), rows[:, None] * n_cols + cols[None, :], dropout_p)
            dz = tl.where(keep, dz * (1.0 / (1.0 - dropout_p)), 0.0)
        tl.store(DX + rows[:, None] * stride_dx_row + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)

    if HAS_WEIGHT or HAS_BIAS:
        partials = PARTIALS + program * stride_partial_row
        if HAS_WEIGHT:
            tl.store(partials + cols, tl.sum(dw_sum, axis=0), mask=col_mask)
            partials += n_cols  # dbias's partials follow
        if HAS_BIAS:
            tl.store(partials + cols, tl.sum(db_sum, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------- launchers


def block_width(n_cols: int) -> int:
    return max(next_power_of_2(n_cols), 16)


def warps_for(block_n: int) -> int:
    """GPU warps for a row block: enough that each thread holds at most ~16-32 float32 values of the row."""
    if block_n <= 1024:
        return 4
    return 8 if block_n <= 4096 else (16 if block_n <= 8192 else 32)


# The variants (``variants``): "row", one row per program (forward) or per step of a program's row loop (backward);
# "rows", BLOCK_M rows as one tile of at most ROWS_TILE elements, so that a short row's program moves more bytes per
# step (the forward on the warps of its tile: 16-32 float32 values a thread). Rows of ROWS_TILE columns and more take
# one row either way: "rows" launches "row"'s kernel there.
FWD, BWD = "layer_norm.fwd", "layer_norm.bwd"
VARIANTS = ("row", "rows")
variants.register(FWD, "row", {name: "" for name in VARIANTS})
variants.register(BWD, "row", {name: "" for name in VARIANTS})
ROWS_TILE = 4096
MAX_BLOCK_M = 16


def rows_per_tile(block_n: int) -> int:
    """BLOCK_M of the "rows" variant for rows of ``block_n`` columns (1 from ROWS_TILE columns on)."""
    return max(1, min(MAX_BLOCK_M, ROWS_TILE // block_n))


@dataclasses.dataclass(frozen=True)
class FwdLaunch:
    """How the forward covers rows of a given width."""

    block_m: int  # rows one program normalises
    block_n: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def fwd_launch(n_cols: int, variant: str = "row") -> FwdLaunch:
    """The forward's launch for rows of ``n_cols`` in ``variant`` ("row": one row a program; "rows": rows_per_tile)."""
    block_n = block_width(n_cols)
    block_m = rows_per_tile(block_n) if variant == "rows" else 1
    return FwdLaunch(block_m, block_n, warps_for(block_m * block_n))


# Row-count classes of ``shape_class``: fewer than 4096 rows, fewer than 65536, the rest.
ROW_CLASS_BOUNDS = (4096, 65536)
ROW_CLASS_NAMES = ("R<4k", "R<64k", "R64k+")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def shape_class(n_cols: int, n_rows: int, dtype: torch.dtype) -> str:
    """The shape class a call on ``n_rows`` rows of ``n_cols`` in ``dtype`` is measured and chosen by (the rows of
    ``bench --suite variants``): dtype, the row width's power of two, a row-count class, e.g. "bf16/N1024/R64k+"."""
    rows_class = 0 if n_rows < ROW_CLASS_BOUNDS[0] else (1 if n_rows < ROW_CLASS_BOUNDS[1] else 2)
    return _shape_class(dtype, n_cols, rows_class)


@functools.lru_cache(maxsize=None)
def _shape_class(dtype: torch.dtype, n_cols: int, rows_class: int) -> str:
    return f"{DTYPE_NAMES.get(dtype, str(dtype))}/N{block_width(n_cols)}/{ROW_CLASS_NAMES[rows_class]}"


def _variant(op: str, n_rows: int, n_cols: int, t: Tensor) -> str:
    """The variant of ``op`` that runs on ``n_rows`` rows of ``n_cols`` like ``t``: forced, measured on its GPU, or
    the default (the launchers ask on every call: no shape class is worked out while nothing can change the answer)."""
    return variants.chosen(op, t.device, lambda: shape_class(n_cols, n_rows, t.dtype))


@functools.lru_cache(maxsize=None)
def backward_programs(device: torch.device) -> int:
    """Backward grid size: a few programs per SM keep the GPU busy while the partial sums stay small."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


# Every backward program writes a float32 partial row of dweight and one of dbias (8 bytes per column); spread
# over at least this many rows they add at most 1 byte per element to the 6 of a bfloat16 backward.
MIN_ROWS_PER_PROGRAM = 8


def backward_rows_per_program(n_rows: int, device: torch.device, block_m: int = 1) -> int:
    """Rows one backward program walks: a multiple of the ``block_m`` rows of each step of its loop."""
    rows = max(cdiv(n_rows, backward_programs(device)), MIN_ROWS_PER_PROGRAM)
    return cdiv(rows, block_m) * block_m


def _check_dtype(name: str, t: Optional[Tensor]) -> None:
    if t is not None and t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton layer_norm: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_dtypes(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor]) -> None:
    if not (x.dtype in SUPPORTED_DTYPES and (weight is None or weight.dtype in SUPPORTED_DTYPES)
            and (bias is None or bias.dtype in SUPPORTED_DTYPES)
            and (residual is None or residual.dtype in SUPPORTED_DTYPES)):
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
            _check_dtype(name, t)


# Backward rows wider than MAX_BWD_BLOCK do not fit in one block's registers next to the per-program dweight /
# dbias sums: a cluster of BWD_CLUSTER_CTAS blocks holds each row where the GPU has clusters (sm_90+); elsewhere
# they are split over programs of MAX_BWD_BLOCK columns (SPLIT_COLS), each reading every block of its rows (dy and
# z read C = cdiv(N, MAX_BWD_BLOCK) = 2 times).
MAX_BWD_BLOCK = 8192
BWD_CLUSTER_CTAS = 2


@dataclasses.dataclass(frozen=True)
class BwdLaunch:
    """How the backward covers rows of a given width."""

    block_n: int  # columns one program holds
    col_blocks: int  # programs per row (SPLIT_COLS when > 1)
    num_ctas: int  # blocks per program (a cluster when > 1)
    num_warps: int  # per block
    block_m: int = 1  # rows each step of a program's row loop takes


# The backward of 1024-column rows on 4 warps put 8 B on the stack on sm_86 / sm_89 under Triton 3.6 (72 registers:
# not their pressure; with 8 warps every release builds it clean).
BWD_WARPS = {1024: 8}


@functools.lru_cache(maxsize=None)
def bwd_launch(n_cols: int, clusters: bool, variant: str = "row") -> BwdLaunch:
    """The backward's launch for rows of ``n_cols`` on a GPU with thread-block ``clusters`` or not, in ``variant``.
    "rows" takes rows_per_tile rows a step where that is more than one (rows narrower than ROWS_TILE, all on the
    whole-row path), on the warps of a tile twice as large: it holds about twice the forward's float32 tiles live (z,
    dy, g and the dweight and dbias sums). Wider rows, those of the cluster and SPLIT_COLS launches among them, take
    one a step as in "row"."""
    block_n = block_width(n_cols)
    block_m = rows_per_tile(block_n) if variant == "rows" else 1
    if block_m > 1:
        return BwdLaunch(block_n, 1, 1, warps_for(2 * block_m * block_n), block_m)
    if block_n <= MAX_BWD_BLOCK:
        return BwdLaunch(block_n, 1, 1, BWD_WARPS.get(block_n, warps_for(block_n)))
    if clusters:
        return BwdLaunch(block_n, 1, BWD_CLUSTER_CTAS, warps_for(block_n) // BWD_CLUSTER_CTAS)
    return BwdLaunch(MAX_BWD_BLOCK, cdiv(n_cols, MAX_BWD_BLOCK), 1, warps_for(MAX_BWD_BLOCK))


def clusters_on(target: Target, triton: Optional[Version] = None) -> bool:
    """Whether the backward launches clusters on ``target`` when compiled by Triton release ``triton`` (default:
    the installed one): the GPU must have them and that Triton must build the launch."""
    return target.clusters and cluster_launches(installed() if triton is None else triton)


def launches_clusters(device: torch.device) -> bool:
    """Whether the backward may launch clusters on ``device`` (under the interpreter, which runs a program's
    blocks as one: when CLUSTERS_UNDER_INTERPRETER, for the tests)."""
    if interpreting():
        return CLUSTERS_UNDER_INTERPRETER
    return device.type == "cuda" and clusters_on(target_of(device))


CLUSTERS_UNDER_INTERPRETER = False


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _row_major(t: Tensor) -> Tensor:
    """``t`` as the kernels read rows: ``[rows, N]`` with any row stride and the last dim contiguous, or contiguous
    of another rank (copied only where it is neither)."""
    if t.dim() == 2:
        return contiguous_last_dim(t)
    return t if t.is_contiguous() else t.contiguous()


def _rows(t: Tensor) -> Tuple[int, int]:
    """``(rows, row stride)`` of a ``_row_major`` ``t``."""
    n_cols = t.shape[-1]
    if t.dim() == 2:
        return t.shape[0], t.stride(0)
    return (t.numel() // n_cols if n_cols else math.prod(t.shape[:-1])), n_cols


def layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   eps: float, dropout_p: float, seed: Optional[Seed], rms_norm: bool, store_z: bool,
                   store_stats: bool = True) -> Tuple[Optional[Tensor], ...]:
    """The forward on rows of ``x`` / ``residual`` (``[rows, N]`` with any row stride, or contiguous ``[..., N]``;
    the last dim is copied only if it is not contiguous), launched here in eager mode, through the custom op when
    traced.

    Returns ``y`` (x's shape), ``z`` (x's shape; None unless ``store_z``), ``mean [rows]`` (float32; None for
    RMSNorm) and ``rstd [rows]`` (float32); the statistics None unless ``store_stats`` (a forward with no
    backward). The custom op returns empty tensors for the Nones.
    """
    _check_dtypes(x, weight, bias, residual)
    x = _row_major(x)
    residual = _row_major(residual) if residual is not None else None
    if traced():
        return torch.ops.fused_transformer.layer_norm_fwd(x, weight, bias, residual, eps, dropout_p,
                                                          seed_tensor(seed, x.device), rms_norm, store_z, store_stats)
    n_cols = x.shape[-1]
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"triton layer_norm supports hidden sizes up to {MAX_HIDDEN}, got {n_cols}")
    n_rows, stride_x = _rows(x)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    z = torch.empty_like(y) if store_z else None
    # Sizes as ints, not a tuple, which new_empty parses more slowly.
    mean = x.new_empty(n_rows, dtype=torch.float32) if store_stats and not rms_norm else None
    rstd = x.new_empty(n_rows, dtype=torch.float32) if store_stats else None
    if n_rows == 0 or n_cols == 0:  # nothing to normalise; the statistics of an empty row are NaN (0 / 0)
        return y, z, *(None if t is None else t.fill_(float("nan")) for t in (mean, rstd))
    launch = fwd_launch(n_cols, _variant(FWD, n_rows, n_cols, x))
    # The constexprs by position (BLOCK_M, BLOCK_N, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_DROPOUT, STORE_Z,
    # IS_RMS_NORM, STORE_STATS): by name they cost the launch more on the host (``positional_constexprs``).
    launch_kernel(
        _layer_norm_fwd_kernel, (cdiv(n_rows, launch.block_m),),
        (x, residual, weight, bias, y, z, mean, rstd, stride_x, _rows(residual)[1] if residual is not None else 0,
         n_cols, n_cols, n_rows, n_cols, eps, dropout_p, *seed_args(seed, x.device),
         launch.block_m, launch.block_n, residual is not None, weight is not None, bias is not None, dropout_p > 0.0,
         store_z, rms_norm, store_stats),
        1 if interpreting() else launch.num_warps,
    )
    return y, z, mean, rstd


def layer_norm_bwd(dy: Tensor, dz: Optional[Tensor], z: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   mean: Optional[Tensor], rstd: Tensor, dropout_p: float, seed: Optional[Seed], rms_norm: bool,
                   has_residual: bool, one_sum: bool = True) -> Tuple[Optional[Tensor], ...]:
    """The backward; ``dy``, ``dz`` shaped as ``z``, the forward's (rows as ``layer_norm_fwd`` takes them), launched
    here in eager mode, through the custom op when traced.

    Returns ``dx`` (z's shape), ``dresidual`` (None without a residual), ``dweight`` and ``dbias`` (None when
    absent, else in the parameter's dtype); the custom op returns empty tensors for the Nones. ``one_sum``: dweight
    and dbias of one dtype summed by one launch, the two rows of its ``[2, N]`` result (not for a custom op, whose
    outputs may not alias each other).
    """
    dy = _row_major(dy)
    dz = _row_major(dz) if dz is not None else None
    if traced():
        return torch.ops.fused_transformer.layer_norm_bwd(dy, dz, z, weight, bias,
                                                          mean if mean is not None else _empty(rstd), rstd,
                                                          dropout_p, seed_tensor(seed, z.device), rms_norm,
                                                          has_residual)
    n_cols = z.shape[-1]
    n_rows, stride_z = _rows(z)
    dx = torch.empty_like(z, memory_format=torch.contiguous_format)
    dresidual = torch.empty_like(dx) if has_residual else None
    if n_cols == 0:  # every result is empty: no column block to launch
        return dx, dresidual, *(torch.empty_like(p) if p is not None else None for p in (weight, bias))
    launch = bwd_launch(n_cols, launches_clusters(z.device), _variant(BWD, n_rows, n_cols, z))
    rows_per_program = backward_rows_per_program(n_rows, z.device, launch.block_m)
    programs = max(cdiv(n_rows, rows_per_program), 1)
    # One buffer holds both partials side by side, [programs, dweight's N | dbias's N] (the kernel writes dbias's at
    # column N itself: no view to make), so that one reduction sums both.
    width = n_cols * ((weight is not None) + (bias is not None))
    partials = z.new_empty(programs, width, dtype=torch.float32) if width else None
    # Launched even for zero rows: every program writes its (possibly zero) partial sums. The constexprs by position
    # as in the forward (BLOCK_M, BLOCK_N, HAS_DZ, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, HAS_DROPOUT, IS_RMS_NORM,
    # SPLIT_COLS).
    launch_kernel(
        _layer_norm_bwd_kernel, (programs, launch.col_blocks),
        (z, dy, dz, weight, None if rms_norm else mean, rstd, dx, dresidual, partials,
         stride_z, _rows(dy)[1], _rows(dz)[1] if dz is not None else 0, n_cols, n_cols if has_residual else 0, width,
         n_rows, n_cols, rows_per_program, dropout_p, *seed_args(seed, z.device),
         launch.block_m, launch.block_n, dz is not None, has_residual, weight is not None, bias is not None,
         dropout_p > 0.0, rms_norm, launch.col_blocks > 1),
        1 if interpreting() else launch.num_warps, num_ctas=launch.num_ctas,
    )
    if weight is not None and bias is not None:
        if one_sum and weight.dtype == bias.dtype:
            dweight, dbias = sum_rows(partials, weight.dtype, parts=2).unbind()
            return dx, dresidual, dweight, dbias
        return dx, dresidual, sum_rows(partials[:, :n_cols], weight.dtype), sum_rows(partials[:, n_cols:], bias.dtype)
    dweight = sum_rows(partials, weight.dtype) if weight is not None else None
    dbias = sum_rows(partials, bias.dtype) if bias is not None else None
    return dx, dresidual, dweight, dbias


def _or_empty(outputs: Tuple[Optional[Tensor], ...], like: Tensor) -> Tuple[Tensor, ...]:
    """The custom ops' outputs: an empty tensor (of its own) for each None."""
    return tuple(_empty(like) if t is None else t for t in outputs)


# ------------------------------------------------------------------------------------ traced: the custom ops


@torch.library.custom_op("fused_transformer::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
    dropout_p: float, seed: Optional[Tensor], rms_norm: bool, store_z: bool, store_stats: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``layer_norm_fwd`` as torch.compile and torch.export trace it."""
    y, z, mean, rstd = layer_norm_fwd(x, weight, bias, residual, eps, dropout_p, seed, rms_norm, store_z, store_stats)
    stats = x.new_empty((0,), dtype=torch.float32)
    return y, _empty(x) if z is None else z, stats if mean is None else mean, stats.clone() if rstd is None else rstd


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, dropout_p, seed, rms_norm, store_z, store_stats=True):
    n_rows = math.prod(x.shape[:-1])
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    z = torch.empty_like(y) if store_z else _empty(x)
    mean = x.new_empty((n_rows if store_stats and not rms_norm else 0,), dtype=torch.float32)
    return y, z, mean, x.new_empty((n_rows if store_stats else 0,), dtype=torch.float32)


@torch.library.custom_op("fused_transformer::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    dy: Tensor, dz: Optional[Tensor], z: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
    mean: Tensor, rstd: Tensor, dropout_p: float, seed: Optional[Tensor], rms_norm: bool, has_residual: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``layer_norm_bwd`` as torch.compile and torch.export trace it."""
    return _or_empty(layer_norm_bwd(dy, dz, z, weight, bias, mean, rstd, dropout_p, seed, rms_norm, has_residual,
                                    one_sum=False), z)


@_layer_norm_bwd_op.register_fake
def _(dy, dz, z, weight, bias, mean, rstd, dropout_p, seed, rms_norm, has_residual):
    dx = torch.empty_like(z, memory_format=torch.contiguous_format)
    dresidual = torch.empty_like(z) if has_residual else _empty(z)
    dweight = torch.empty_like(weight) if weight is not None else _empty(z)
    dbias = torch.empty_like(bias) if bias is not None else _empty(z)
    return dx, dresidual, dweight, dbias


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
               rms_norm: bool = False, **options: object) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``fused_transformer.functional.layer_norm`` on Triton, one pass per row, checked as there (``options``:
    ``residual``, ``dropout_p``, ``prenorm``), plus ``rms_norm``: RMSNorm (no mean subtraction) instead of LayerNorm.

    x ``[..., N]`` in float16 / bfloat16 / float32 with ``N <= 16384``, rows of any stride (the last dim is copied
    only if it is not contiguous); weight and bias in any of the three dtypes. Statistics are float32; dropout's
    mask comes from a Philox seed drawn from torch's generator, so ``torch.manual_seed`` reproduces it. Its autograd
    is the op module's (``fused_transformer.ops``, imported at call time: the one module above the kernels this
    calls).
    """
    from ..ops import layer_norm as op

    options = contract.options_of("layer_norm", options, op.OPTIONS)
    spec = op.check(x, weight, bias, eps, options["residual"], options["dropout_p"], options["prenorm"],
                    bool(rms_norm))
    _check_dtype("x", x)
    return op.run("triton", x, weight, bias, options["residual"], spec)


# ------------------------------------------------------------------------------------------------------ AOT

# The configs docs/report.md shows (the report prints every one): the row widths around each launch change.
MARKDOWN_ROWS = re.compile(r"^BLOCK_N=(1024|8192|16384)\b")

AOT_BLOCK_SIZES = tuple(2**i for i in range(4, 15))  # 16 .. 16384, every bucket block_width can pick


def _variant_suffix(block_m: int) -> str:
    """The config name's mark of the "rows" variant's tile (none for one row, the "row" variant's launch)."""
    return f",BLOCK_M={block_m}/rows" if block_m > 1 else ""


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """Every LayerNorm kernel this module launches on a GPU with Triton release ``triton`` (default: the installed
    one), one per block-size bucket and variant ("rows" where its tile holds more than one row: ".../rows"), in
    bfloat16 with all features on (the largest register footprint), plus the partial-sum reduction."""
    fwd_signature = {
        "X": "*bf16", "RESIDUAL": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "Z": "*bf16",
        "MEAN": "*fp32", "RSTD": "*fp32", "stride_x_row": "i32", "stride_res_row": "i32", "stride_y_row": "i32",
        "stride_z_row": "i32", "n_rows": "i32", "n_cols": "i32", "eps": "fp32", "dropout_p": "fp32", "SEED": "*i64",
        "host_seed": "i32",
    }
    bwd_signature = {
        "Z": "*bf16", "DY": "*bf16", "DZ": "*bf16", "W": "*bf16", "MEAN": "*fp32", "RSTD": "*fp32",
        "DX": "*bf16", "DRESIDUAL": "*bf16", "PARTIALS": "*fp32",
        "stride_z_row": "i32", "stride_dy_row": "i32", "stride_dz_row": "i32", "stride_dx_row": "i32",
        "stride_dres_row": "i32", "stride_partial_row": "i32", "n_rows": "i32", "n_cols": "i32",
        "rows_per_program": "i32", "dropout_p": "fp32", "SEED": "*i64", "host_seed": "i32",
    }
    features = {"HAS_RESIDUAL": True, "HAS_WEIGHT": True, "HAS_BIAS": True, "HAS_DROPOUT": True, "IS_RMS_NORM": False}
    configs = []
    for launch in dict.fromkeys(fwd_launch(block_n, variant) for variant in VARIANTS for block_n in AOT_BLOCK_SIZES):
        configs.append(AotKernel(
            name="layer_norm_fwd", config=f"BLOCK_N={launch.block_n}" + _variant_suffix(launch.block_m),
            fn=_layer_norm_fwd_kernel, signature=fwd_signature,
            constexprs={"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "STORE_Z": True, "STORE_STATS": True,
                **features},
            num_warps=launch.num_warps, num_stages=1,
        ))
    # Every launch bwd_launch gives, for the targets that take it: whole rows up to MAX_BWD_BLOCK everywhere, wider
    # ones on a cluster from sm_90 (clusters, where this Triton builds them) and split elsewhere.
    targets_of = {}
    for variant in VARIANTS:
        for block_n in AOT_BLOCK_SIZES:
            for target in TARGETS:
                launch = bwd_launch(block_n, clusters_on(target, triton), variant)
                targets = targets_of.setdefault(launch, [])
                if target.capability not in targets:
                    targets.append(target.capability)
    for launch, targets in targets_of.items():
        config = f"BLOCK_N={launch.block_n}" + (",SPLIT_COLS" if launch.col_blocks > 1 else "") + (
            f",CTAS={launch.num_ctas}" if launch.num_ctas > 1 else "") + _variant_suffix(launch.block_m)
        configs.append(AotKernel(
            name="layer_norm_bwd", config=config, fn=_layer_norm_bwd_kernel, signature=bwd_signature,
            constexprs={"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "HAS_DZ": True,
                        "SPLIT_COLS": launch.col_blocks > 1, **features},
            num_warps=launch.num_warps, num_stages=1, num_ctas=launch.num_ctas, targets=tuple(targets),
        ))
    # The partial-sum reduction: float32 partials here, bfloat16 / float16 gradients in the feed-forward's bias grads.
    for ty in ("fp32", "bf16"):
        configs.append(AotKernel(
            name="sum_rows", config=f"{ty}/BLOCK_ROWS={SUM_ROWS_BLOCK_ROWS},BLOCK_COLS={SUM_ROWS_BLOCK_COLS}",
            fn=_sum_rows_kernel,
            signature={
                "X": "*" + ty, "OUT": "*" + ty, "n_rows": "i32", "n_cols": "i32", "stride_x_row": "i32",
                "stride_out_row": "i32", "rows_per_program": "i32",
            },
            constexprs={"BLOCK_ROWS": SUM_ROWS_BLOCK_ROWS, "BLOCK_COLS": SUM_ROWS_BLOCK_COLS}, num_warps=4,
            num_stages=1,
        ))
    return configs
