"""The gated feed-forward ``y = dropout(act(x @ Wg^T + bg) * (x @ Wu^T + bu)) @ Wd^T + bd`` (Llama's, Gemma's and
Phi-3's MLP): the three products on torch's GEMMs (cuBLAS on a GPU, the biases in their epilogue), the gating and its
dropout one Triton pass between them, its backward one more:

    forward   g = x @ Wg^T + bg,  u = x @ Wu^T + bu          torch (addmm; Phi-3's packed [Wg; Wu]: one product)
              h = dropout(act(g) * u)                         _gated_fwd_kernel
              y = h @ Wd^T + bd                               torch (addmm)
    backward  dh = dy @ Wd                                    torch
              dg = dh * keep/(1-p) * u * act'(g)              _gated_bwd_kernel, one pass: act(g) recomputed,
              du = dh * keep/(1-p) * act(g)                   h written again for dWd
              h  = dropout(act(g) * u)
              dWd = dy^T @ h,  dWg = dg^T @ x,  dWu = du^T @ x,  dx = dg @ Wg + du @ Wu      torch
              dbd = sum_rows(dy),  dbg = sum_rows(dg),  dbu = sum_rows(du)             deterministic reductions

Between forward and backward only x, g and u are kept (``[tokens, d_ff]`` twice, or the packed ``[tokens, 2 d_ff]``
product), never act(g) nor h, which torch's own ops keep beside them. Packed, dg and du are written side by side into
one ``[tokens, 2 d_ff]`` buffer: dx and d[Wg; Wu] are one product each.

Dropout keep-mask: element (token, unit) of h ``[M, d_ff]`` is kept as the feed-forward's (``kernels.feed_forward``):
lane unit % 4 of the Philox call of group token * cdiv(d_ff, 4) + unit // 4;
``fused_transformer.kernels._common.dropout_keep_mask(seed, M, d_ff, p, device, quads=True)`` replays it.
"""
import re
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..contract import Seed, as_rows, seed_tensor
from ._common import (
    cdiv, contiguous_last_dim, dropout_keep_quads, dropout_seed, launch_kernel, next_power_of_2, seed_args, sum_rows,
    traced,
)
from .aot import AotKernel
from .feed_forward import _activation, _activation_grad
from .toolchain import Version

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@triton.jit
def _gate(g, ACTIVATION: tl.constexpr):
    """act(g) in float32."""
    if ACTIVATION == "silu":
        return g / (1.0 + tl.exp(-g))
    else:
        return _activation(g, ACTIVATION)


@triton.jit
def _gate_grad(g, ACTIVATION: tl.constexpr):
    """d act / dg at g (float32)."""
    if ACTIVATION == "silu":
        sigmoid = 1.0 / (1.0 + tl.exp(-g))
        return sigmoid * (1.0 + g * (1.0 - sigmoid))
    else:
        return _activation_grad(g, ACTIVATION)


@triton.jit
def _keep_scale(SEED, host_seed, row, n_cols, dropout_p, BLOCK: tl.constexpr):
    """1 / (1 - p) where this program's columns of ``row`` survive dropout, else 0. A block starts at a multiple of
    four columns, so its groups are consecutive: one Philox call per four columns."""
    seed = dropout_seed(SEED, host_seed)
    first_group = row * ((n_cols + 3) // 4) + tl.program_id(1) * (BLOCK // 4)
    keep = dropout_keep_quads(seed, first_group, dropout_p, BLOCK)
    return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit(do_not_specialize=["host_seed"])
def _gated_fwd_kernel(
    G,  # [M, n_cols], rows stride_g apart: x @ Wg^T + bg in x's dtype
    U,  # [M, n_cols], rows stride_u apart: x @ Wu^T + bu
    H,  # [M, n_cols] contiguous: dropout(act(G) * U)
    n_cols, stride_g, stride_u, dropout_p, SEED, host_seed,
    BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = _gate(g, ACTIVATION) * u
    if HAS_DROPOUT:
        h *= _keep_scale(SEED, host_seed, row, n_cols, dropout_p, BLOCK)
    tl.store(H + row * n_cols + cols, h.to(H.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["host_seed"])
def _gated_bwd_kernel(
    DH,  # [M, n_cols] contiguous: dy @ Wd, the gradient of h
    G,  # [M, n_cols], rows stride_g apart
    U,  # [M, n_cols], rows stride_u apart
    DG,  # [M, n_cols], rows stride_dg apart: the gradient of G
    DU,  # [M, n_cols], rows stride_du apart: the gradient of U
    H,  # [M, n_cols] contiguous: dropout(act(G) * U) again, for dWd
    n_cols, stride_g, stride_u, stride_dg, stride_du, dropout_p, SEED, host_seed,
    BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = _gate(g, ACTIVATION)
    h = act * u
    if HAS_DROPOUT:
        keep_scale = _keep_scale(SEED, host_seed, row, n_cols, dropout_p, BLOCK)
        dh *= keep_scale
        h *= keep_scale
    tl.store(DG + row * stride_dg + cols, (dh * u * _gate_grad(g, ACTIVATION)).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dh * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(H + row * n_cols + cols, h.to(H.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- launchers


class GatedPlan(NamedTuple):
    """The tile of both passes: ``block`` columns of one row a program, ``num_warps`` warps."""

    block: int
    num_warps: int


def plan(n_cols: int) -> GatedPlan:
    """The tile for rows of ``n_cols``: the next power of two up to 1024 columns (eight bfloat16 a thread of four
    warps, one 16-byte load each), at least 16 (whole Philox groups of four), a warp per 256 columns."""
    block = max(16, min(1024, next_power_of_2(max(n_cols, 1))))
    return GatedPlan(block, max(1, min(4, block // 256)))


# The plans the AOT report compiles: Llama's d_ff (every row 11 blocks of 1024) and a small one.
AOT_PLANS = (plan(11008), plan(128))


def _check_dtypes(**tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton gated_feed_forward: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _halves(packed: Tensor) -> Tuple[Tensor, Tensor]:
    """The gate and up halves (views) of a packed ``[M, 2 d_ff]``."""
    d_ff = packed.shape[1] // 2
    return packed[:, :d_ff], packed[:, d_ff:]


def gate_products(rows: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], gate_bias: Optional[Tensor],
                  up_bias: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """What the backward keeps of the forward's products on ``rows [M, d_model]``: ``(g, u)``, or packed (no
    up_weight) the one ``[M, 2 d_ff]`` product ``(gu,)``."""
    if up_weight is None:
        return (F.linear(rows, gate_weight, gate_bias),)
    return F.linear(rows, gate_weight, gate_bias), F.linear(rows, up_weight, up_bias)


def gate_and_up(saved: Tuple[Tensor, ...]) -> Tuple[Tensor, Tensor]:
    """g and u ``[M, d_ff]`` of ``gate_products``' result (views of the packed product)."""
    return _halves(saved[0]) if len(saved) == 1 else (saved[0], saved[1])


def gated_feed_forward_fwd(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
                           gate_bias: Optional[Tensor], up_bias: Optional[Tensor], down_bias: Optional[Tensor],
                           activation: str, dropout_p: float,
                           seed: Optional[Seed]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """Forward on ``x [..., d_model]``, launched here in eager mode, through the custom op when traced; returns ``y
    [..., d_out]`` and what the backward reads (``gate_products``: ``(g, u)`` or the packed ``(gu,)``)."""
    _check_dtypes(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    if traced():
        y, first, second = torch.ops.fused_transformer.gated_feed_forward_fwd(
            x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, dropout_p,
            seed_tensor(seed, x.device))
        return y, ((first,) if up_weight is None else (first, second))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    saved = gate_products(as_rows(x), gate_weight, up_weight, gate_bias, up_bias)
    g, u = gate_and_up(saved)
    h = g.new_empty(g.shape)
    if h.numel():
        tile = plan(h.shape[1])
        launch_kernel(_gated_fwd_kernel, (h.shape[0], cdiv(h.shape[1], tile.block)),
                      (g, u, h, h.shape[1], g.stride(0), u.stride(0), dropout_p, *seed_args(seed, x.device),
                       tile.block, activation, dropout_p > 0.0), tile.num_warps)
    return F.linear(h, down_weight, down_bias).view(*x.shape[:-1], down_weight.shape[0]), saved


def gated_feed_forward_bwd(dy: Tensor, x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor],
                           down_weight: Tensor, saved: Tuple[Tensor, ...], has_gate_bias: bool, has_up_bias: bool,
                           has_down_bias: bool, activation: str, dropout_p: float,
                           seed: Optional[Seed]) -> Tuple[Optional[Tensor], ...]:
    """Backward from ``dy [..., d_out]`` and the forward's ``saved``, launched here in eager mode, through the custom
    op when traced. Returns ``dx`` (x's shape), ``d gate_weight, d up_weight, d down_weight, d gate_bias, d up_bias,
    d down_bias`` (None where absent; packed, d up_weight and d up_bias are None and the gate's are ``[2 d_ff, ...]``;
    the custom op returns empty tensors for them)."""
    if traced():
        second = saved[1] if len(saved) == 2 else None
        return torch.ops.fused_transformer.gated_feed_forward_bwd(
            dy, x, gate_weight, up_weight, down_weight, saved[0], second, has_gate_bias, has_up_bias, has_down_bias,
            activation, dropout_p, seed_tensor(seed, x.device))
    rows, dy = as_rows(x), contiguous_last_dim(as_rows(dy))
    g, u = gate_and_up(saved)
    dh = dy.mm(down_weight)
    packed = len(saved) == 1
    if packed:
        d_gu = saved[0].new_empty(saved[0].shape)
        dg, du = _halves(d_gu)
    else:
        dg, du = g.new_empty(g.shape), u.new_empty(u.shape)
    h = torch.empty_like(dh)
    if h.numel():
        tile = plan(h.shape[1])
        launch_kernel(_gated_bwd_kernel, (h.shape[0], cdiv(h.shape[1], tile.block)),
                      (dh, g, u, dg, du, h, h.shape[1], g.stride(0), u.stride(0), dg.stride(0), du.stride(0),
                       dropout_p, *seed_args(seed, x.device), tile.block, activation, dropout_p > 0.0),
                      tile.num_warps)
    d_down = dy.t().mm(h)
    d_down_bias = sum_rows(dy, dy.dtype) if has_down_bias else None
    if packed:
        dx, d_gate = d_gu.mm(gate_weight), d_gu.t().mm(rows)
        d_gate_bias = sum_rows(d_gu, d_gu.dtype) if has_gate_bias else None
        d_up = d_up_bias = None
    else:
        dx = dg.mm(gate_weight).addmm_(du, up_weight)
        d_gate, d_up = dg.t().mm(rows), du.t().mm(rows)
        d_gate_bias = sum_rows(dg, dg.dtype) if has_gate_bias else None
        d_up_bias = sum_rows(du, du.dtype) if has_up_bias else None
    return dx.view(x.shape), d_gate, d_up, d_down, d_gate_bias, d_up_bias, d_down_bias


# ------------------------------------------------------------------------------------ traced: the custom ops


@torch.library.custom_op("fused_transformer::gated_feed_forward_fwd", mutates_args=())
def _gated_feed_forward_fwd_op(
    x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor, gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, dropout_p: float, seed: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """``gated_feed_forward_fwd`` as torch.compile and torch.export trace it: y, then g and u (packed: the product
    and an empty tensor)."""
    y, saved = gated_feed_forward_fwd(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                      activation, dropout_p, seed)
    return y, saved[0], saved[1] if len(saved) == 2 else _empty(x)


@_gated_feed_forward_fwd_op.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, dropout_p, seed):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    first = x.new_empty((rows, gate_weight.shape[0]))
    second = _empty(x) if up_weight is None else x.new_empty((rows, up_weight.shape[0]))
    return x.new_empty((*x.shape[:-1], down_weight.shape[0])), first, second


@torch.library.custom_op("fused_transformer::gated_feed_forward_bwd", mutates_args=())
def _gated_feed_forward_bwd_op(
    dy: Tensor, x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor, first: Tensor,
    second: Optional[Tensor], has_gate_bias: bool, has_up_bias: bool, has_down_bias: bool, activation: str,
    dropout_p: float, seed: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``gated_feed_forward_bwd`` as torch.compile and torch.export trace it (empty tensors for absent gradients)."""
    saved = (first,) if second is None else (first, second)
    grads = gated_feed_forward_bwd(dy, x, gate_weight, up_weight, down_weight, saved, has_gate_bias, has_up_bias,
                                   has_down_bias, activation, dropout_p, seed)
    return tuple(_empty(x) if grad is None else grad for grad in grads)


@_gated_feed_forward_bwd_op.register_fake
def _(dy, x, gate_weight, up_weight, down_weight, first, second, has_gate_bias, has_up_bias, has_down_bias,
      activation, dropout_p, seed):
    def bias(present, weight):
        return x.new_empty((weight.shape[0],)) if present and weight is not None else _empty(x)

    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(gate_weight),
            _empty(x) if up_weight is None else torch.empty_like(up_weight), torch.empty_like(down_weight),
            bias(has_gate_bias, gate_weight), bias(has_up_bias, up_weight), bias(has_down_bias, down_weight))


# ------------------------------------------------------------------------------------------------------ AOT

# The configs docs/report.md would show of this module: the passes in bfloat16.
MARKDOWN_ROWS = re.compile(r"^bf16/")


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """Both passes as the launchers pick them on a GPU (``AOT_PLANS``; ``triton``, the release, changes nothing here)
    in each dtype with dropout, SiLU (Llama) and, in bfloat16, GELU-tanh (Gemma)."""
    configs = []
    for tile in AOT_PLANS:
        for ty in ("fp16", "bf16", "fp32"):
            for activation in ("silu", "gelu_tanh") if ty == "bf16" else ("silu",):
                for grad in (False, True):
                    ptr = "*" + ty
                    tensors = ("DH", "G", "U", "DG", "DU", "H") if grad else ("G", "U", "H")
                    strides = ("stride_g", "stride_u", "stride_dg", "stride_du") if grad else ("stride_g", "stride_u")
                    signature = {**{name: ptr for name in tensors}, "n_cols": "i32",
                                 **{name: "i32" for name in strides}, "dropout_p": "fp32", "SEED": "*i64",
                                 "host_seed": "i32"}
                    configs.append(AotKernel(
                        name="gated_ffn_bwd" if grad else "gated_ffn_fwd",
                        config=f"{ty}/{activation}/BLOCK={tile.block}/warps={tile.num_warps}",
                        fn=_gated_bwd_kernel if grad else _gated_fwd_kernel, signature=signature,
                        constexprs={"BLOCK": tile.block, "ACTIVATION": activation, "HAS_DROPOUT": True},
                        num_warps=tile.num_warps, num_stages=1,
                    ))
    return configs
