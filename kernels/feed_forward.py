"""Feed-forward ``y = dropout(act(x @ w1^T + b1)) @ w2^T + b2``: the products on torch's GEMMs (cuBLAS on a GPU,
the biases in their epilogue), the activation and dropout of the hidden layer in one Triton pass between them.

On an H200 cuBLAS ran these products at 465-640 TFLOP/s where our own Triton matmul with the epilogue fused reached
260-400, so fusing the epilogue into our GEMM lost more than the memory pass it saved. What cuBLAS cannot fuse is
one elementwise kernel, in two modes:

    forward   pre    = x @ w1^T + b1                        torch (addmm), x's dtype
              hidden = dropout(act(pre))                    _activation_kernel
              y      = hidden @ w2^T + b2                   torch (addmm)
    backward  dpre   = (dy @ w2) * act'(pre) * keep / (1 - p)
              hidden = dropout(act(pre)), again for dw2     _activation_kernel with ACTIVATION_GRAD
              dw2 = dy^T @ hidden,  dw1 = dpre^T @ x,  dx = dpre @ w1     torch
              db2 = sum_rows(dy),   db1 = sum_rows(dpre)                 deterministic reductions

Without dropout there is nothing to fuse: ``fused_transformer.route`` sends such calls of the functional op to ATen,
as ``torch.nn`` does; the kernel entry ``feed_forward`` always runs ours. Between
forward and backward only the pre-activation is kept (x's dtype); with ``recompute=True`` not even that: the backward
recomputes it with one more product. The pre-activation is rounded to x's dtype before the activation, as
``F.linear`` rounds it, so forward and backward agree exactly.

Dropout keep-mask: element (token, unit) of the hidden ``[M, d_ff]`` is kept when lane unit % 4 of the Philox call
of group token * cdiv(d_ff, 4) + unit // 4 says so (``_common.dropout_keep_quads``: a call per four elements);
``fused_transformer.kernels._common.dropout_keep_mask(seed, M, d_ff, p, device, quads=True)`` replays it.
"""
import contextlib
import re
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import contract
from ..contract import Seed, as_rows, seed_tensor
from ._common import (
    cdiv, contiguous_last_dim, dropout_keep_quad_lanes, dropout_keep_quads, dropout_seed, launch_kernel, seed_args,
    sum_rows, traced,
)
from .aot import AotKernel
from .toolchain import Version

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) saturates to +-1 without overflow; tl has no tanh that the interpreter runs.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        # Not tl.maximum(x, 0.0), which may return 0 for NaN: torch.relu keeps NaN.
        return tl.where(x <= 0.0, 0.0, x)
    elif ACTIVATION == "gelu":
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    else:
        return x


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act / dx at x (float32)."""
    if ACTIVATION == "relu":
        return tl.where(x <= 0.0, 0.0, 1.0)  # 1 at NaN, as torch's threshold_backward
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        return cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    else:  # gelu_tanh
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = _tanh(inner)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x)


@triton.jit(do_not_specialize=["host_seed"])
def _activation_kernel(
    PRE,  # [M, N] contiguous: x @ w1^T + b1 in x's dtype
    DHIDDEN,  # [M, N] contiguous: dy @ w2 (ACTIVATION_GRAD)
    OUT,  # [M, N]: dropout(act(PRE)), or with ACTIVATION_GRAD d PRE
    HIDDEN,  # [M, N]: dropout(act(PRE)), written with ACTIVATION_GRAD (for dw2)
    n_elements, n_cols, dropout_p, SEED, host_seed,
    BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, ACTIVATION_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    # The flat index of (token, unit) is token * d_ff + unit (n_cols = d_ff).
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    pre = tl.load(PRE + offsets, mask=mask, other=0.0).to(tl.float32)
    hidden = _activation(pre, ACTIVATION)
    if HAS_DROPOUT:
        seed = dropout_seed(SEED, host_seed)
        if n_cols % 4 == 0:  # every row starts a group, so the block's flat index / 4 is the group
            keep = dropout_keep_quads(seed, tl.program_id(0).to(tl.int64) * (BLOCK // 4), dropout_p, BLOCK)
        else:
            rows = offsets // n_cols
            cols = offsets - rows * n_cols
            keep = dropout_keep_quad_lanes(seed, rows * ((n_cols + 3) // 4) + cols // 4, cols % 4, dropout_p)
        keep_scale = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        hidden *= keep_scale
    if ACTIVATION_GRAD:
        grad = tl.load(DHIDDEN + offsets, mask=mask, other=0.0).to(tl.float32) * _activation_grad(pre, ACTIVATION)
        if HAS_DROPOUT:
            grad *= keep_scale
        tl.store(OUT + offsets, grad.to(OUT.dtype.element_ty), mask=mask)
        tl.store(HIDDEN + offsets, hidden.to(HIDDEN.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT + offsets, hidden.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- launchers

# Elements per program: 8 per thread of 4 warps, one 16-byte load of bfloat16 each.
BLOCK = 1024
NUM_WARPS = 4


def _needs_tf32_switch(x: Tensor, allow_tf32: bool) -> bool:
    return allow_tf32 and x.dtype == torch.float32 and x.is_cuda and not torch.backends.cuda.matmul.allow_tf32


@contextlib.contextmanager
def _tf32_products() -> Iterator[None]:
    """torch's CUDA matmuls in TF32 for the duration (``allow_tf32``), the setting restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _check_dtypes(**tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton feed_forward: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _activation_launch(pre: Tensor, dhidden: Optional[Tensor], out: Tensor, hidden: Optional[Tensor], activation: str,
                       dropout_p: float, seed: Optional[Seed]) -> tuple:
    """``launch_kernel``'s arguments after the kernel for the activation pass over ``pre`` (contiguous): forward,
    ``out = dropout(act(pre))``; with ``dhidden``, ``out`` its gradient and ``hidden`` the forward's again."""
    n = pre.numel()
    args = (pre, dhidden, out, hidden, n, pre.shape[-1], dropout_p, *seed_args(seed, pre.device), BLOCK, activation,
            dhidden is not None, dropout_p > 0.0)
    return (cdiv(n, BLOCK),), args, NUM_WARPS


def feed_forward_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
                     dropout_p: float, seed: Optional[Seed], keep: bool,
                     allow_tf32: bool) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """Forward on ``x [..., d_model]``, launched here in eager mode, through the custom op when traced; returns ``y
    [..., d_out]`` and, with ``keep``, ``(pre,)`` for the backward, the pre-activation ``[..., d_ff]``."""
    _check_dtypes(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    if traced():
        y, pre = torch.ops.fused_transformer.feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p,
                                                              seed_tensor(seed, x.device), keep, allow_tf32)
        return y, ((pre,) if keep else ())
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    with _tf32_products() if _needs_tf32_switch(x, allow_tf32) else contextlib.nullcontext():
        pre = F.linear(x, w1, b1)
        hidden = torch.empty_like(pre)
        if pre.numel():
            launch_kernel(_activation_kernel, *_activation_launch(pre, None, hidden, None, activation, dropout_p, seed))
        return F.linear(hidden, w2, b2), ((pre,) if keep else ())


def feed_forward_bwd(dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, saved: Tuple[Tensor, ...],
                     has_b2: bool, activation: str, dropout_p: float, seed: Optional[Seed],
                     allow_tf32: bool) -> Tuple[Optional[Tensor], ...]:
    """Backward from ``dy [..., d_out]``; ``saved`` the forward's ``(pre,)``, or ``()`` to recompute it. Launched here
    in eager mode, through the custom op when traced.

    Returns ``dx`` (x's shape), ``dw1, db1, dw2, db2`` (a bias gradient None when that bias is absent; the custom op
    returns empty tensors for them).
    """
    pre = saved[0] if saved else None
    if traced():
        return torch.ops.fused_transformer.feed_forward_bwd(dy, x, w1, b1, w2, pre, has_b2, activation, dropout_p,
                                                            seed_tensor(seed, x.device), allow_tf32)
    with _tf32_products() if _needs_tf32_switch(x, allow_tf32) else contextlib.nullcontext():
        if pre is None:
            pre = F.linear(x, w1, b1)
        dy = contiguous_last_dim(as_rows(dy))
        dhidden = dy.mm(w2)
        dpre, hidden = torch.empty_like(dhidden), torch.empty_like(dhidden)
        if dhidden.numel():
            launch_kernel(_activation_kernel, *_activation_launch(pre, dhidden, dpre, hidden, activation, dropout_p,
                                                                   seed))
        db1 = sum_rows(dpre, b1.dtype) if b1 is not None else None
        db2 = sum_rows(dy, dy.dtype) if has_b2 else None
        dx = dpre.mm(w1)
        return (dx.view(x.shape) if x.dim() != 2 else dx), dpre.t().mm(as_rows(x)), db1, \
            dy.t().mm(hidden), db2


# ------------------------------------------------------------------------------------ traced: the custom ops


@torch.library.custom_op("fused_transformer::feed_forward_fwd", mutates_args=())
def _feed_forward_fwd_op(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
    dropout_p: float, seed: Optional[Tensor], store_pre: bool, allow_tf32: bool,
) -> Tuple[Tensor, Tensor]:
    """``feed_forward_fwd`` as torch.compile and torch.export trace it."""
    y, saved = feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, seed, store_pre, allow_tf32)
    return y, saved[0] if saved else _empty(x)


@_feed_forward_fwd_op.register_fake
def _(x, w1, b1, w2, b2, activation, dropout_p, seed, store_pre, allow_tf32):
    pre = x.new_empty((*x.shape[:-1], w1.shape[0])) if store_pre else _empty(x)
    return x.new_empty((*x.shape[:-1], w2.shape[0])), pre


@torch.library.custom_op("fused_transformer::feed_forward_bwd", mutates_args=())
def _feed_forward_bwd_op(
    dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, pre: Optional[Tensor], has_b2: bool,
    activation: str, dropout_p: float, seed: Optional[Tensor], allow_tf32: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``feed_forward_bwd`` as torch.compile and torch.export trace it."""
    grads = feed_forward_bwd(dy, x, w1, b1, w2, (pre,) if pre is not None else (), has_b2, activation, dropout_p,
                             seed, allow_tf32)
    return tuple(_empty(x) if g is None else g for g in grads)


@_feed_forward_bwd_op.register_fake
def _(dy, x, w1, b1, w2, pre, has_b2, activation, dropout_p, seed, allow_tf32):
    db1 = b1.new_empty(b1.shape) if b1 is not None else _empty(x)
    db2 = dy.new_empty((dy.shape[-1],)) if has_b2 else _empty(x)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, torch.empty_like(w1), db1, torch.empty_like(w2), db2


def feed_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
                 recompute: bool = False, allow_tf32: bool = False, **options: object) -> Tensor:
    """``fused_transformer.functional.feed_forward`` on this backend (torch's products, the Triton activation pass),
    checked as there (``options``: ``activation``, ``dropout_p``), plus two kernel-level options.

    Args:
        recompute: keep nothing but the inputs for the backward, which recomputes the pre-activation
            ``[tokens, d_ff]`` with one more product (saves that much memory between forward and backward).
        allow_tf32: float32 products on tensor cores in TF32 (default: exact float32).

    Inputs in float16 / bfloat16 / float32; dropout's mask comes from a Philox seed drawn from torch's generator,
    so ``torch.manual_seed`` reproduces it. Its autograd is the op module's (``fused_transformer.ops``, imported at
    call time).
    """
    from ..ops import feed_forward as op

    options = contract.options_of("feed_forward", options, op.OPTIONS)
    spec = op.check(x, w1, b1, w2, b2, options["activation"], options["dropout_p"])
    _check_dtypes(x=x)
    return op.run("triton", x, w1, b1, w2, b2, spec._replace(recompute=bool(recompute), allow_tf32=bool(allow_tf32)))


# ------------------------------------------------------------------------------------------------------ AOT

# The configs docs/report.md shows (the report prints every one): the activation pass in bfloat16.
MARKDOWN_ROWS = re.compile(r"^bf16/")


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """The activation pass as the op launches it on a GPU (``triton``, the release, changes nothing here), forward and
    backward, in each dtype, with GELU and dropout (the costliest epilogue)."""
    configs = []
    for ty in ("fp16", "bf16", "fp32"):
        for grad in (False, True):
            ptr = "*" + ty
            signature = {"PRE": ptr, "DHIDDEN": ptr if grad else "constexpr", "OUT": ptr,
                         "HIDDEN": ptr if grad else "constexpr", "n_elements": "i32", "n_cols": "i32",
                         "dropout_p": "fp32", "SEED": "*i64", "host_seed": "i32"}
            constexprs = {"BLOCK": BLOCK, "ACTIVATION": "gelu", "ACTIVATION_GRAD": grad, "HAS_DROPOUT": True}
            if not grad:
                constexprs.update(DHIDDEN=None, HIDDEN=None)
            configs.append(AotKernel(
                name="ffn_activation_bwd" if grad else "ffn_activation_fwd", config=f"{ty}/BLOCK={BLOCK}",
                fn=_activation_kernel, signature=signature, constexprs=constexprs, num_warps=NUM_WARPS, num_stages=1,
            ))
    return configs
