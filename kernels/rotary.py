"""Rotary position embeddings on q and k in one launch: each program rotates a block of rows of q or of k (the
programs of q first, then k's), forward and backward alike.

With ``x1, x2`` the two halves of a row's first ``rotary_dim`` features (``interleaved``: its even and odd features)
and ``c1, c2, s1, s2`` cos and sin at the same features::

    forward   y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2      (HF: x * cos + rotate_half(x) * sin)
    backward  dx1 = g1 * c1 + g2 * s2       dx2 = g2 * c2 - g1 * s1     (the transpose: rotation by -sin)

and the features past ``rotary_dim`` copied as they are (partial rotary). Rows are indexed by three leading dims
(``[B, H, S]`` or ``[B, S, H]``) through strides: q and k come as the transposed views of a projection, and cos /
sin ``[B or 1, ..., rotary_dim]`` are read at stride 0 along the dims they broadcast over. Arithmetic in float32,
one rounding at the store.
"""
import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, launch_kernel, next_power_of_2, traced
from .aot import AotKernel
from .toolchain import Version

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _row_offsets(rows, n1, n2, stride0, stride1, stride2):
    """Offsets of the rows ``rows`` (flat indices over three leading dims of sizes ``[*, n1, n2]``)."""
    i2 = rows % n2
    rest = rows // n2
    return (rest // n1) * stride0 + (rest % n1) * stride1 + i2 * stride2


@triton.jit
def _pairs(rows, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The even and the odd features of ``rows`` ``[BLOCK_ROWS, 2 * BLOCK_HALF]``, in float32."""
    return tl.split(tl.reshape(rows.to(tl.float32), (BLOCK_ROWS, BLOCK_HALF, 2)))


@triton.jit
def _rotary_kernel(
    Q, K,  # [*, n1, n2, head_dim], last dim contiguous: x (forward) or the outputs' gradients (BACKWARD)
    Q_OUT, K_OUT,  # q's and k's shapes, last dim contiguous
    COS, SIN,  # [*, *, *, rotary_dim], last dim contiguous, stride 0 along the dims they broadcast over
    q_rows, k_rows, q_programs, q_n1, q_n2, k_n1, k_n2,
    q_s0, q_s1, q_s2, k_s0, k_s1, k_s2,
    qo_s0, qo_s1, qo_s2, ko_s0, ko_s1, ko_s2,
    cos_s0, cos_s1, cos_s2, sin_s0, sin_s1, sin_s2,
    head_dim, half,  # half = rotary_dim // 2
    BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    # One grid over both tensors: q's programs, then k's. Selected by tl.where, not by branches: a size of 1 comes as
    # a constexpr, and both branches of an if must give a name one type.
    is_q = pid < q_programs
    X, OUT = tl.where(is_q, Q, K), tl.where(is_q, Q_OUT, K_OUT)
    block = tl.where(is_q, pid, pid - q_programs)
    n_rows, n1, n2 = tl.where(is_q, q_rows, k_rows), tl.where(is_q, q_n1, k_n1), tl.where(is_q, q_n2, k_n2)
    s0, s1, s2 = tl.where(is_q, q_s0, k_s0), tl.where(is_q, q_s1, k_s1), tl.where(is_q, q_s2, k_s2)
    o0, o1, o2 = tl.where(is_q, qo_s0, ko_s0), tl.where(is_q, qo_s1, ko_s1), tl.where(is_q, qo_s2, ko_s2)
    rows = block.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, n1, n2, s0, s1, s2)[:, None]
    out_row = _row_offsets(rows, n1, n2, o0, o1, o2)[:, None]
    cos_row = _row_offsets(rows, n1, n2, cos_s0, cos_s1, cos_s2)[:, None]
    sin_row = _row_offsets(rows, n1, n2, sin_s0, sin_s1, sin_s2)[:, None]

    if INTERLEAVED:
        # Whole rows loaded contiguous (vector loads), then split into even and odd features: stride-2 loads would
        # address each element on its own (twice the registers).
        cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = row_mask[:, None] & (cols < 2 * half)
        x1, x2 = _pairs(tl.load(X + x_row + cols, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_HALF)
        c1, c2 = _pairs(tl.load(COS + cos_row + cols, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_HALF)
        s1, s2 = _pairs(tl.load(SIN + sin_row + cols, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_HALF)
    else:
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        mask = row_mask[:, None] & (cols < half)
        x1 = tl.load(X + x_row + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(COS + cos_row + cols, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + cos_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + sin_row + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + sin_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    if INTERLEAVED:
        y = tl.reshape(tl.join(y1, y2), (BLOCK_ROWS, 2 * BLOCK_HALF))
        tl.store(OUT + out_row + cols, y.to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT + out_row + cols, y1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + out_row + half + cols, y2.to(OUT.dtype.element_ty), mask=mask)
    if HAS_PASS:  # the features past rotary_dim, as they are (their gradient too: the identity's)
        passed = 2 * half + tl.arange(0, BLOCK_PASS)
        pass_mask = row_mask[:, None] & (passed < head_dim)[None, :]
        x = tl.load(X + x_row + passed[None, :], mask=pass_mask, other=0.0)
        tl.store(OUT + out_row + passed[None, :], x, mask=pass_mask)


# --------------------------------------------------------------------------------------------- the plan

# Elements a program moves per tensor row block: 4096 keeps a 4-warp program at 32 elements a thread.
TILE_ELEMENTS = 4096


class RotaryPlan(NamedTuple):
    """The tile of a launch, read by the launcher and the AOT report alike."""

    block_rows: int
    block_half: int
    block_pass: int
    num_warps: int


def plan_of(head_dim: int, rotary_dim: int) -> RotaryPlan:
    """The tile for rows of ``head_dim`` features, ``rotary_dim`` of them rotated: the next powers of two of the half
    and of the passed features, rows to fill ``TILE_ELEMENTS`` (a power of two, at most 64), 4 warps (2 for a tile of
    1024 or less)."""
    block_half = next_power_of_2(max(rotary_dim // 2, 1))
    block_pass = next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 1
    width = 2 * block_half + (block_pass if head_dim > rotary_dim else 0)
    block_rows = 1 << (max(1, min(64, TILE_ELEMENTS // width)).bit_length() - 1)  # a power of two (tl.arange)
    return RotaryPlan(block_rows, block_half, block_pass, 4 if block_rows * width > 1024 else 2)


# --------------------------------------------------------------------------------------------- launchers


def _check_dtypes(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton rotary: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def output_like(x: Tensor) -> Tensor:
    """An output of ``x``'s shape in ``x``'s layout (``empty_like``), contiguous where that layout's last dim is not."""
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 or out.shape[-1] <= 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def leading3(t: Tensor) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """Sizes and strides of the three dims before the last (size 1, stride 0 for the missing ones)."""
    pad = 4 - t.dim()
    return (1,) * pad + tuple(t.shape[:-1]), (0,) * pad + tuple(t.stride()[:-1])


def broadcast_strides(table: Tensor) -> Tuple[int, int, int]:
    """cos's or sin's strides over the three leading dims of q and k: 0 along the dims it broadcasts over."""
    sizes, strides = leading3(table)
    return tuple(0 if n == 1 else s for n, s in zip(sizes, strides))


# The integer arguments of a launch by its tensors' layouts (the key below): an eager model calls the op with the same
# few layouts every step, and working them out again is most of the op's host time.
_LAUNCH_INTS: Dict[tuple, Optional[tuple]] = {}


def _launch_ints(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
                 backward: bool) -> Optional[tuple]:
    """``(grid, the kernel's arguments after its six tensors, num_warps)``, None where there is nothing to launch."""
    head_dim, rotary_dim = q.shape[-1], cos.shape[-1]
    (_, q_n1, q_n2), q_strides = leading3(q)
    (_, k_n1, k_n2), k_strides = leading3(k)
    q_rows, k_rows = q.numel() // max(head_dim, 1), k.numel() // max(head_dim, 1)
    if q_rows + k_rows == 0 or head_dim == 0:
        return None
    plan = plan_of(head_dim, rotary_dim)
    q_programs = cdiv(q_rows, plan.block_rows)
    grid = (q_programs + cdiv(k_rows, plan.block_rows),)
    ints = (q_rows, k_rows, q_programs, q_n1, q_n2, k_n1, k_n2, *q_strides, *k_strides, *leading3(q_out)[1],
            *leading3(k_out)[1], *broadcast_strides(cos), *broadcast_strides(sin), head_dim, rotary_dim // 2,
            plan.block_rows, plan.block_half, plan.block_pass, interleaved, backward, head_dim > rotary_dim)
    return grid, ints, plan.num_warps


def _prepared(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
              backward: bool) -> Tuple[Tensor, Tensor, Optional[tuple]]:
    """The outputs and ``launch_kernel``'s arguments after the kernel (None where there is nothing to launch)."""
    q, k, cos, sin = (last_dim_contiguous(t) for t in (q, k, cos, sin))
    q_out, k_out = output_like(q), output_like(k)
    key = (q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(), cos.shape, cos.stride(),
           sin.shape, sin.stride(), interleaved, backward)
    found = _LAUNCH_INTS.get(key, key)
    if found is key:
        if len(_LAUNCH_INTS) >= 256:
            _LAUNCH_INTS.clear()
        found = _LAUNCH_INTS[key] = _launch_ints(q, k, q_out, k_out, cos, sin, interleaved, backward)
    if found is None:
        return q_out, k_out, None
    grid, ints, num_warps = found
    return q_out, k_out, (grid, (q, k, q_out, k_out, cos, sin, *ints), num_warps)


def rotary_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tuple[Tensor, Tensor]:
    """``(q_embed, k_embed)`` of checked ``q [.., H, .., D]``, ``k`` (q's rank and dtype) and ``cos`` / ``sin`` with
    q's rank (unsqueezed), broadcasting to both; in q's layout. Launched here in eager mode, through the custom op when
    traced."""
    _check_dtypes(q=q, k=k)
    if traced():
        return torch.ops.fused_transformer.rotary(q, k, cos, sin, interleaved, False)
    q_embed, k_embed, launch = _prepared(q, k, cos, sin, interleaved, False)
    if launch is not None:
        launch_kernel(_rotary_kernel, *launch)
    return q_embed, k_embed


def rotary_bwd(dq_embed: Tensor, dk_embed: Tensor, cos: Tensor, sin: Tensor,
               interleaved: bool) -> Tuple[Tensor, Tensor]:
    """``(dq, dk)`` from the outputs' gradients, in one launch (through the custom op when traced)."""
    if traced():
        return torch.ops.fused_transformer.rotary(dq_embed, dk_embed, cos, sin, interleaved, True)
    dq, dk, launch = _prepared(dq_embed, dk_embed, cos, sin, interleaved, True)
    if launch is not None:
        launch_kernel(_rotary_kernel, *launch)
    return dq, dk


# ------------------------------------------------------------------------------------ traced: the custom op


@torch.library.custom_op("fused_transformer::rotary", mutates_args=())
def _rotary_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
               backward: bool) -> Tuple[Tensor, Tensor]:
    """The launch as torch.compile and torch.export trace it (forward, or with ``backward`` the gradients)."""
    q_out, k_out, launch = _prepared(q, k, cos, sin, interleaved, backward)
    if launch is not None:
        launch_kernel(_rotary_kernel, *launch)
    return q_out, k_out


@_rotary_op.register_fake
def _(q, k, cos, sin, interleaved, backward):
    return output_like(last_dim_contiguous(q)), output_like(last_dim_contiguous(k))


# ------------------------------------------------------------------------------------------------------ AOT

# The configs docs/report.md shows: bfloat16, head dim 128, both directions.
MARKDOWN_ROWS = re.compile(r"^bf16/D128/R128")

# (head_dim, rotary_dim) the op is built for: Llama (64, 128), Phi-3 (96), Gemma (256), a partial rotary (Phi's 0.5).
AOT_SHAPES: Sequence[Tuple[int, int]] = ((64, 64), (96, 96), (128, 128), (256, 256), (128, 64))


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """The rotary kernel as the launcher plans it (``plan_of``) for ``AOT_SHAPES`` in each dtype, forward and backward,
    halves and interleaved pairs (cos / sin in q's dtype, as Hugging Face's rotary modules return them); ``triton``,
    the release, changes nothing here."""
    configs = []
    for ty in ("fp16", "bf16", "fp32"):
        for head_dim, rotary_dim in AOT_SHAPES:
            plan = plan_of(head_dim, rotary_dim)
            for interleaved in (False, True):
                for backward in (False, True):
                    ptr = "*" + ty
                    signature = {name: ptr for name in ("Q", "K", "Q_OUT", "K_OUT", "COS", "SIN")}
                    signature.update({name: "i32" for name in (
                        "q_rows", "k_rows", "q_programs", "q_n1", "q_n2", "k_n1", "k_n2", "q_s0", "q_s1", "q_s2",
                        "k_s0", "k_s1", "k_s2", "qo_s0", "qo_s1", "qo_s2", "ko_s0", "ko_s1", "ko_s2", "cos_s0",
                        "cos_s1", "cos_s2", "sin_s0", "sin_s1", "sin_s2", "head_dim", "half")})
                    constexprs = {"BLOCK_ROWS": plan.block_rows, "BLOCK_HALF": plan.block_half,
                                  "BLOCK_PASS": plan.block_pass, "INTERLEAVED": interleaved, "BACKWARD": backward,
                                  "HAS_PASS": head_dim > rotary_dim}
                    configs.append(AotKernel(
                        name="rotary_bwd" if backward else "rotary_fwd",
                        config=f"{ty}/D{head_dim}/R{rotary_dim}/{'pairs' if interleaved else 'halves'}"
                               f"/ROWS={plan.block_rows}",
                        fn=_rotary_kernel, signature=signature, constexprs=constexprs, num_warps=plan.num_warps,
                        num_stages=1,
                    ))
    return configs
