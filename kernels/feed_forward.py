"""Fused feed-forward ``y = dropout(act(x @ w1^T + b1)) @ w2^T + b2`` on one tiled Triton matmul.

The matmul ``C = epilogue(A @ B)`` takes A ``[M, K]`` and B ``[K, N]`` through their strides, so the
transposed operands of the linears and of the backward are views, never copies. Its epilogue, chosen by
constexpr flags, serves every product of the op:

    forward   hidden = dropout(act(x @ w1^T + b1))     HAS_BIAS, ACTIVATION, HAS_DROPOUT (+ STORE_PRE: pre)
              y      = hidden @ w2^T + b2             HAS_BIAS
    backward  dpre   = (dy @ w2) * act'(pre) * keep / (1 - p)      ACTIVATION_GRAD, HAS_DROPOUT
                       (the same epilogue rewrites hidden = dropout(act(pre)) for dw2)
              dw2 = dy^T @ hidden,  dw1 = dpre^T @ x,  dx = dpre @ w1         plain
              db2 = sum_rows(dy),   db1 = sum_rows(dpre)                     deterministic reductions

Between forward and backward only the pre-activation ``x @ w1^T + b1`` is kept (x's dtype); with
``recompute=True`` not even that: the backward recomputes it with one more matmul. The pre-activation is
rounded to x's dtype before the activation, as ``F.linear`` would, so forward and backward agree exactly.

Dropout keep-mask: element (token, unit) of the hidden ``[M, d_ff]`` is kept when ``dropout_keep(SEED,
token * d_ff + unit, p)``; ``fused_transformer.kernels._common.dropout_keep_mask(seed, M, d_ff, p, device)``
replays it.
"""
import dataclasses
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import contract
from ..contract import FeedForwardSpec
from ._common import cdiv, contiguous_last_dim, dropout_keep, interpreting, launch_kernel, sum_rows, traced
from .aot import AotKernel
from .targets import TARGETS, Target, target_of
from .toolchain import TRITON_3_7, Version, installed

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


@triton.jit
def _matmul_kernel(
    A,  # [M, K] any strides
    B,  # [K, N] any strides
    C,  # [M, N] output
    BIAS,  # [N] (HAS_BIAS)
    PRE,  # [M, N] like C: pre-activation, written (STORE_PRE) or read (ACTIVATION_GRAD)
    HIDDEN,  # [M, N] like C: dropout(act(PRE)), written with ACTIVATION_GRAD
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    dropout_p, SEED,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACTIVATION_GRAD: tl.constexpr, STORE_PRE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-tiles share each column-tile of B while it is still in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_tile_m = (pid // tiles_per_group) * GROUP_M
    group_size_m = tl.minimum(tiles_m - first_tile_m, GROUP_M)
    pid_m = first_tile_m + (pid % tiles_per_group) % group_size_m
    pid_n = (pid % tiles_per_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Edges are masked (rows / columns past M / N load zeros and are never stored): unlike wrapping the
    # indices around, this keeps the offsets contiguous, so the loads stay vectorised.
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if UPCAST_OPERANDS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = mask_m[:, None] & mask_n[None, :]
    c_offsets = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        keep = dropout_keep(SEED, offs_m[:, None].to(tl.int64) * N + offs_n[None, :], dropout_p)
        keep_scale = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
    if ACTIVATION_GRAD:
        pre = tl.load(PRE + c_offsets, mask=mask, other=0.0).to(tl.float32)
        hidden = _activation(pre, ACTIVATION)
        acc *= _activation_grad(pre, ACTIVATION)
        if HAS_DROPOUT:
            hidden *= keep_scale
            acc *= keep_scale
        tl.store(HIDDEN + c_offsets, hidden.to(HIDDEN.dtype.element_ty), mask=mask)
    elif ACTIVATION != "none":
        acc = acc.to(C.dtype.element_ty).to(tl.float32)
        if STORE_PRE:
            tl.store(PRE + c_offsets, acc.to(PRE.dtype.element_ty), mask=mask)
        acc = _activation(acc, ACTIVATION)
        if HAS_DROPOUT:
            acc *= keep_scale
    tl.store(C + c_offsets, acc.to(C.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- launchers


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (GPU generation, dtype, fused epilogue) -> tile config. Hopper (sm_90) has the larger shared memory; the other
# targets (sm_80 / 86 / 89) get the Ampere configs (``generation_of``). float32 tiles are smaller: ieee float32 runs
# on the CUDA cores.
# The fused epilogue (activation, its derivative, Philox dropout on 64-bit offsets) needs many registers per
# output element, so those products take half-width tiles: full ones spill (python -m fused_transformer report).
MATMUL_CONFIGS = {
    ("sm_90", torch.float16, False): MatmulConfig(128, 128, 64, 8, 8, 4),
    ("sm_90", torch.bfloat16, False): MatmulConfig(128, 128, 64, 8, 8, 4),
    ("sm_90", torch.float32, False): MatmulConfig(128, 64, 32, 8, 8, 3),
    ("sm_80", torch.float16, False): MatmulConfig(128, 128, 32, 8, 8, 4),
    ("sm_80", torch.bfloat16, False): MatmulConfig(128, 128, 32, 8, 8, 4),
    ("sm_80", torch.float32, False): MatmulConfig(128, 64, 16, 8, 8, 3),
    ("sm_90", torch.float16, True): MatmulConfig(128, 64, 64, 8, 8, 4),
    ("sm_90", torch.bfloat16, True): MatmulConfig(128, 64, 64, 8, 8, 4),
    ("sm_90", torch.float32, True): MatmulConfig(64, 64, 32, 8, 4, 3),
    ("sm_80", torch.float16, True): MatmulConfig(128, 64, 32, 8, 8, 4),
    ("sm_80", torch.bfloat16, True): MatmulConfig(128, 64, 32, 8, 8, 4),
    ("sm_80", torch.float32, True): MatmulConfig(64, 64, 32, 8, 4, 3),
}
# (Triton releases, generation, dtype, fused epilogue) -> the config that replaces MATMUL_CONFIGS' there: an older
# register allocator spills some of the tiles tuned under 3.9 (kernels/toolchain.py). sm_90's float32 weight-gradient
# product stacks 8 B under 3.7 with 32-wide K steps; 16-wide ones keep its output tile and compile clean.
RELEASE_CONFIGS = {
    (TRITON_3_7, "sm_90", torch.float32, False): MatmulConfig(128, 64, 16, 8, 8, 3),
}
INTERPRETER_CONFIG = MatmulConfig(64, 64, 64, 8, 1, 1)


def generation_of(target: Target) -> str:
    """The MATMUL_CONFIGS generation ``target`` runs (a newer GPU runs its closest target's: ``target_of``)."""
    return "sm_90" if target.capability >= 90 else "sm_80"


def config_name(cfg: MatmulConfig) -> str:
    return (f"BM{cfg.block_m}_BN{cfg.block_n}_BK{cfg.block_k}_G{cfg.group_m}"
            f"_w{cfg.num_warps}_s{cfg.num_stages}")


def matmul_config_for(generation: str, dtype: torch.dtype, fused_epilogue: bool,
                      triton: Optional[Version] = None) -> MatmulConfig:
    """The tile config of a ``generation`` GPU's product in ``dtype`` under Triton release ``triton`` (default: the
    installed one): ``RELEASE_CONFIGS``' where one holds for that release, else ``MATMUL_CONFIGS``'."""
    version = installed() if triton is None else triton
    for (releases, *key), cfg in RELEASE_CONFIGS.items():
        if tuple(key) == (generation, dtype, fused_epilogue) and version in releases:
            return cfg
    return MATMUL_CONFIGS[(generation, dtype, fused_epilogue)]


def matmul_config(device: torch.device, dtype: torch.dtype, fused_epilogue: bool) -> MatmulConfig:
    if interpreting():
        return INTERPRETER_CONFIG
    return matmul_config_for(generation_of(target_of(device)), dtype, fused_epilogue)


def _matmul(
    a: Tensor, b: Tensor, out_dtype: torch.dtype, *, bias: Optional[Tensor] = None, activation: str = "none",
    activation_grad: bool = False, pre: Optional[Tensor] = None, hidden: Optional[Tensor] = None,
    dropout_p: float = 0.0, seed: Optional[Tensor] = None, allow_tf32: bool = False,
) -> Tensor:
    """``epilogue(a @ b)`` for ``a [M, K]``, ``b [K, N]`` of any strides; returns a new ``[M, N]``.

    ``pre`` / ``hidden`` are ``[M, N]`` contiguous: ``pre`` is written when an activation is applied
    (forward), read and ``hidden`` written with ``activation_grad`` (backward).
    """
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    cfg = matmul_config(a.device, a.dtype, fused_epilogue=activation != "none")
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    launch_kernel(
        _matmul_kernel, grid,
        (a, b, out, bias, pre, hidden, m, n, k,
         a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
         dropout_p, seed), cfg.num_warps, cfg.num_stages,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, ACTIVATION=activation, ACTIVATION_GRAD=activation_grad,
        STORE_PRE=pre is not None and not activation_grad, HAS_DROPOUT=dropout_p > 0.0,
        DOT_PRECISION="tf32" if allow_tf32 else "ieee",
        UPCAST_OPERANDS=interpreting() and a.dtype != torch.float32,  # tl.dot on bf16 is wrong when interpreted
    )
    return out


def _check_dtypes(**tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton feed_forward: {name} must be float16, bfloat16 or float32, got {t.dtype}")


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _launch_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
                dropout_p: float, seed: Optional[Tensor], store_pre: bool, allow_tf32: bool) -> Tuple[Tensor, Tensor]:
    """Forward on ``x [M, d_model]`` (last dim contiguous); returns ``y [M, d_out]`` and the pre-activation
    ``[M, d_ff]`` (empty unless ``store_pre``)."""
    _check_dtypes(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    pre = torch.empty((x.shape[0], w1.shape[0]), dtype=x.dtype, device=x.device) if store_pre else None
    hidden = _matmul(x, w1.t(), x.dtype, bias=b1, activation=activation, pre=pre, dropout_p=dropout_p, seed=seed,
                     allow_tf32=allow_tf32)
    y = _matmul(hidden, w2.t(), x.dtype, bias=b2, allow_tf32=allow_tf32)
    return y, pre if store_pre else _empty(x)


def _launch_bwd(dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, pre: Optional[Tensor],
                has_b2: bool, activation: str, dropout_p: float, seed: Optional[Tensor],
                allow_tf32: bool) -> Tuple[Tensor, ...]:
    """Backward from ``dy [M, d_out]``; ``pre`` is the forward's pre-activation, or None to recompute it.

    Returns ``dx, dw1, db1, dw2, db2`` (a bias gradient is empty when that bias is absent).
    """
    if pre is None:
        pre = _matmul(x, w1.t(), x.dtype, bias=b1, allow_tf32=allow_tf32)
    hidden = torch.empty_like(pre)
    dpre = _matmul(dy, w2, x.dtype, activation=activation, activation_grad=True, pre=pre, hidden=hidden,
                   dropout_p=dropout_p, seed=seed, allow_tf32=allow_tf32)
    dw2 = _matmul(dy.t(), hidden, w2.dtype, allow_tf32=allow_tf32)
    dw1 = _matmul(dpre.t(), x, w1.dtype, allow_tf32=allow_tf32)
    dx = _matmul(dpre, w1, x.dtype, allow_tf32=allow_tf32)
    db1 = sum_rows(dpre, b1.dtype) if b1 is not None else _empty(x)
    db2 = sum_rows(dy, dy.dtype) if has_b2 else _empty(x)
    return dx, dw1, db1, dw2, db2


# ---------------------------------------------------------------------------------- the backend's entries
# No composed forms here: every call runs the kernels.
feed_forward_composed = None


def feed_forward_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                     spec: FeedForwardSpec, seed: Optional[Tensor], keep: bool) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``y`` of rows ``x [M, d_model]`` and, with ``keep``, ``(pre,)`` for the backward (``_launch_fwd``); traced
    through the custom op."""
    _check_dtypes(x=x)
    args = (contiguous_last_dim(x), w1, b1, w2, b2, spec.activation, spec.dropout_p, seed, keep, spec.allow_tf32)
    y, pre = torch.ops.fused_transformer.feed_forward_fwd(*args) if traced() else _launch_fwd(*args)
    return y, ((pre,) if keep else ())


def feed_forward_bwd(dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, saved: Tuple[Tensor, ...],
                     has_b2: bool, spec: FeedForwardSpec, seed: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """``dx, dw1, db1, dw2, db2`` (``_launch_bwd``; without ``saved``, the pre-activation is recomputed); traced
    through the custom op."""
    args = (contiguous_last_dim(dy), x, w1, b1, w2, saved[0] if saved else None, has_b2, spec.activation,
            spec.dropout_p, seed, spec.allow_tf32)
    return torch.ops.fused_transformer.feed_forward_bwd(*args) if traced() else _launch_bwd(*args)


@torch.library.custom_op("fused_transformer::feed_forward_fwd", mutates_args=())
def _feed_forward_fwd_op(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
    dropout_p: float, seed: Optional[Tensor], store_pre: bool, allow_tf32: bool,
) -> Tuple[Tensor, Tensor]:
    """``_launch_fwd`` as torch.compile and torch.export trace it."""
    return _launch_fwd(x, w1, b1, w2, b2, activation, dropout_p, seed, store_pre, allow_tf32)


@_feed_forward_fwd_op.register_fake
def _(x, w1, b1, w2, b2, activation, dropout_p, seed, store_pre, allow_tf32):
    pre = x.new_empty((x.shape[0], w1.shape[0])) if store_pre else _empty(x)
    return x.new_empty((x.shape[0], w2.shape[0])), pre


@torch.library.custom_op("fused_transformer::feed_forward_bwd", mutates_args=())
def _feed_forward_bwd_op(
    dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, pre: Optional[Tensor], has_b2: bool,
    activation: str, dropout_p: float, seed: Optional[Tensor], allow_tf32: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``_launch_bwd`` as torch.compile and torch.export trace it."""
    return _launch_bwd(dy, x, w1, b1, w2, pre, has_b2, activation, dropout_p, seed, allow_tf32)


@_feed_forward_bwd_op.register_fake
def _(dy, x, w1, b1, w2, pre, has_b2, activation, dropout_p, seed, allow_tf32):
    db1 = b1.new_empty(b1.shape) if b1 is not None else _empty(x)
    db2 = dy.new_empty((dy.shape[1],)) if has_b2 else _empty(x)
    return torch.empty_like(x), torch.empty_like(w1), db1, torch.empty_like(w2), db2


def feed_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
                 recompute: bool = False, allow_tf32: bool = False, **options: object) -> Tensor:
    """``fused_transformer.functional.feed_forward`` on fused Triton matmuls, checked as there (``options``:
    ``activation``, ``dropout_p``), plus two kernel-level options.

    Args:
        recompute: keep nothing but the inputs for the backward, which recomputes the pre-activation
            ``[tokens, d_ff]`` with one more matmul (saves that much memory between forward and backward).
        allow_tf32: float32 products on tensor cores in TF32 (default: exact float32).

    Inputs in float16 / bfloat16 / float32; dropout's mask comes from a Philox seed drawn from torch's generator,
    so ``torch.manual_seed`` reproduces it. Its autograd is ``fused_transformer.autograd``'s (imported at call time).
    """
    options = contract.options_of("feed_forward", options, contract.FEED_FORWARD_OPTIONS)
    spec = contract.feed_forward_spec(x, w1, b1, w2, b2, options["activation"], options["dropout_p"])
    _check_dtypes(x=x)
    from ..autograd import feed_forward as feed_forward_on

    return feed_forward_on("triton", x, w1, b1, w2, b2,
                           spec._replace(recompute=bool(recompute), allow_tf32=bool(allow_tf32)))


# ------------------------------------------------------------------------------------------------------ AOT


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """Every matmul variant the op launches on a GPU with Triton release ``triton`` (default: the installed one),
    for each (generation, dtype) config, with the memory layouts of the real calls (unit strides as constants) and
    GELU, the costliest activation."""
    # (variant, fused epilogue, epilogue constexprs, A's unit stride, B's unit stride)
    variants = (
        ("linear1_fwd", True, {"HAS_BIAS": True, "ACTIVATION": "gelu", "ACTIVATION_GRAD": False, "STORE_PRE": True,
                               "HAS_DROPOUT": True}, "stride_ak", "stride_bk"),
        ("linear2_fwd", False, {"HAS_BIAS": True, "ACTIVATION": "none", "ACTIVATION_GRAD": False,
                                "STORE_PRE": False, "HAS_DROPOUT": False}, "stride_ak", "stride_bk"),
        ("dpre_bwd", True, {"HAS_BIAS": False, "ACTIVATION": "gelu", "ACTIVATION_GRAD": True, "STORE_PRE": False,
                            "HAS_DROPOUT": True}, "stride_ak", "stride_bn"),
        ("weight_grad", False, {"HAS_BIAS": False, "ACTIVATION": "none", "ACTIVATION_GRAD": False,
                                "STORE_PRE": False, "HAS_DROPOUT": False}, "stride_am", "stride_bn"),
        ("input_grad", False, {"HAS_BIAS": False, "ACTIVATION": "none", "ACTIVATION_GRAD": False,
                               "STORE_PRE": False, "HAS_DROPOUT": False}, "stride_ak", "stride_bn"),
    )
    type_names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    configs = []
    for generation, dtype, fused in MATMUL_CONFIGS:
        cfg = matmul_config_for(generation, dtype, fused, triton)
        ptr = "*" + type_names[dtype]
        for variant, variant_fused, epilogue, unit_a, unit_b in variants:
            if variant_fused != fused:
                continue
            signature = {
                "A": ptr, "B": ptr, "C": ptr, "BIAS": ptr, "PRE": ptr, "HIDDEN": ptr, "M": "i32", "N": "i32",
                "K": "i32", "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32",
                "stride_cm": "i32", "stride_cn": "constexpr", "dropout_p": "fp32", "SEED": "*i64",
            }
            signature[unit_a] = signature[unit_b] = "constexpr"
            configs.append(AotKernel(
                name=f"ffn_matmul_{variant}", config=f"{generation}/{type_names[dtype]}/{config_name(cfg)}",
                fn=_matmul_kernel, signature=signature,
                constexprs={
                    unit_a: 1, unit_b: 1, "stride_cn": 1, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                    "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "DOT_PRECISION": "ieee",
                    "UPCAST_OPERANDS": False, **epilogue,
                },
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                targets=tuple(t.capability for t in TARGETS if generation_of(t) == generation),
                expect_tensor_cores=dtype != torch.float32,
            ))
    return configs
