"""Functional ops: check the arguments once, then run them on the backend ``fused_transformer.backend`` picks.

Every backend implements the same contract, so the checks here are the only ones a user meets for
shapes, dtypes and devices; the kernels' launchers add only the limits of their own hardware path.

Under ``torch.autocast`` the ops follow autocast's own policy for what they replace: ``attention``,
``attention_weights`` and ``feed_forward`` (matrix products) run in the autocast dtype, ``layer_norm`` in
float32; float16 / bfloat16 / float32 tensor arguments are cast (masks and float64 are left alone) and the
op runs with autocast off inside, so each backend sees one dtype.
"""
from __future__ import annotations

import importlib
import numbers
from types import ModuleType
from typing import Callable, Dict, Optional, Tuple, Union

import torch

import fused_transformer as _package

from . import backend, reference

Tensor = torch.Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
ACTIVATIONS = tuple(reference.ACTIVATIONS)

# op name -> module (below this package) that implements it, per backend; the module exports a function of
# the op's name.
_IMPLEMENTATIONS: Dict[str, Dict[str, str]] = {
    "triton": {
        "attention": "kernels.attention",
        "attention_weights": "kernels.attention",
        "attention_varlen": "kernels.attention",
        "layer_norm": "kernels.layer_norm",
        "feed_forward": "kernels.feed_forward",
    },
    "cpu": {
        "attention": "cpu_ops",
        "attention_weights": "cpu_ops",
        "attention_varlen": "cpu_ops",
        "layer_norm": "cpu_ops",
        "feed_forward": "cpu_ops",
    },
}


@backend.constant_for_compile
def _import_backend(name: str) -> bool:
    """Import the modules of backend ``name`` (a no-op after the first call). torch.compile cannot trace an
    import, so it calls this at trace time and then reaches the modules as attributes of the package."""
    for module in set(_IMPLEMENTATIONS[name].values()):
        importlib.import_module(f"{_package.__name__}.{module}")
    return True


# (backend, op) -> the module implementing it, once imported. The module, not its function, so that a function
# replaced on the module (a test's spy, a user's patch) is the one called.
_MODULES: Dict[Tuple[str, str], ModuleType] = {}


def _implementation(op: str, x: Tensor) -> Callable:
    name = backend.current(x.device, x.dtype)
    module = _MODULES.get((name, op))
    if module is None:
        module = _implementing_module(name, op)
    return getattr(module, op)


def _implementing_module(name: str, op: str) -> ModuleType:
    if name == "reference":
        return reference
    _import_backend(name)
    module = _package
    for part in _IMPLEMENTATIONS[name][op].split("."):
        module = getattr(module, part)
    if not torch.compiler.is_compiling():
        _MODULES[(name, op)] = module
    return module


# --------------------------------------------------------------------------------------------- autocast

_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def _autocast_dtype(anchor: object, matmul: bool) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` runs the op in on ``anchor``'s device, None when autocast is off there:
    the autocast dtype for matrix products, float32 for normalisation."""
    if not isinstance(anchor, Tensor) or not torch.is_autocast_enabled(anchor.device.type):
        return None
    return torch.get_autocast_dtype(anchor.device.type) if matmul else torch.float32


def _autocast_all(dtype: Optional[torch.dtype], *args: object) -> Tuple[object, ...]:
    """``args`` with their float16 / bfloat16 / float32 tensors cast to ``dtype`` (None: autocast is off)."""
    if dtype is None:
        return args
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.dtype in _AUTOCAST_ELIGIBLE else t for t in args)


def _run(op: str, anchor: Tensor, autocast_dtype: Optional[torch.dtype], *args: object, **kwargs: object) -> object:
    """``op`` on the backend for ``anchor``; with autocast switched off inside when it was on (the arguments
    are already in the dtype it chose)."""
    implementation = _implementation(op, anchor)
    if autocast_dtype is None:
        return implementation(*args, **kwargs)
    with torch.autocast(anchor.device.type, enabled=False):
        return implementation(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- checks


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def _check_tensor(name: str, t: object, rank: Optional[int] = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {_describe(t)}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got {_describe(t)}")
    return t


def _check_same(name: str, t: Tensor, ref_name: str, ref: Tensor, dtype: bool = True) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; expected one device")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; expected one dtype")


def _check_dropout(p: object) -> float:
    if type(p) is float and 0.0 <= p < 1.0:
        return p
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_p={p!r} must be a number in [0, 1)")
    return float(p)


def _check_padding_mask(name: str, mask: object, batch: int, length: int, anchor: Tensor) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be bool (True = padding), got {mask.dtype}")
    _check_same(name, mask, "q", anchor, dtype=False)
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must be [batch, seq_{name[0]}] = {[batch, length]}, got {tuple(mask.shape)}")


def _check_window(window: object) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """``window`` as a ``(left, right)`` tuple of non-negative ints or None, or None for no window."""
    if window is None:
        return None
    def bound(x: object) -> bool:
        return x is None or (isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(bound(x) for x in window):
        raise ValueError(f"window={window!r} must be None or (left, right), each a non-negative int or None")
    left, right = window
    return (None if left is None else int(left), None if right is None else int(right))


def _check_common_flags(is_causal: object, causal_alignment: object, scale: object) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment={causal_alignment!r} must be one of {CAUSAL_ALIGNMENTS}")
    if scale is not None and type(scale) is not float and (
            isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")


def _check_attention_args(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    is_causal: bool, causal_alignment: str, scale: Optional[float], query_padding_mask: Optional[Tensor] = None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank=4)
    _check_same("k", k, "q", q)
    _check_same("v", v, "q", q)
    (batch, heads, lq, dim), (kb, kv_heads, lk, kd) = q.shape, k.shape
    if kb != batch or kd != dim:
        raise ValueError(
            f"k must be [batch={batch}, kv_heads, seq_k, head_dim={dim}] to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k/v's heads ({kv_heads})")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added), got {attn_mask.dtype}")
        _check_same("attn_mask", attn_mask, "q", q, dtype=False)
        target = (batch, heads, lq, lk)
        shape = tuple(attn_mask.shape)
        if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
            raise ValueError(f"attn_mask of shape {shape} does not broadcast to [B, H, Lq, Lk] = {list(target)}")
    _check_padding_mask("key_padding_mask", key_padding_mask, batch, lk, q)
    _check_padding_mask("query_padding_mask", query_padding_mask, batch, lq, q)
    _check_common_flags(is_causal, causal_alignment, scale)


def _check_varlen_args(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object,
    max_seqlen_k: object, is_causal: bool, causal_alignment: str, scale: Optional[float],
) -> None:
    """``attention_varlen``'s arguments but the values of cu_seqlens (``_check_cu_seqlens_values`` reads them)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank=3)
    _check_same("k", k, "q", q)
    _check_same("v", v, "q", q)
    (_, heads, dim), (_, kv_heads, kd) = q.shape, k.shape
    if kd != dim:
        raise ValueError(f"k must be [total_k, kv_heads, head_dim={dim}] to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k/v's heads ({kv_heads})")
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must hold the same number of sequences")
    _check_common_flags(is_causal, causal_alignment, scale)


def _check_cu_seqlens(name: str, cu: object, max_seqlen: object, anchor: Tensor) -> None:
    """Type, rank and device of ``cu`` and the type of its max_seqlen; ``_check_cu_seqlens_values`` reads it."""
    max_name = "max_seqlen_" + name[-1]
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        raise TypeError(f"{name} must be int32 [batch + 1] (sequence start offsets, then the total), got "
                        f"{_describe(cu)}")
    _check_same(name, cu, "q", anchor, dtype=False)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0:
        raise TypeError(f"{max_name}={max_seqlen!r} must be a non-negative int")


def _check_cu_seqlens_values(name: str, cu: Tensor, total: int, max_seqlen: int) -> None:
    max_name = "max_seqlen_" + name[-1]
    if torch.compiler.is_compiling():  # the values are data; reading them would break the graph
        return
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got {values[0]} .. "
                         f"{values[-1]}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name} holds a sequence of {max(lengths)} tokens, more than {max_name}={max_seqlen}")


# -------------------------------------------------------------------------------------------------- ops


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
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Scaled dot-product attention, ``softmax(q @ k^T * scale + mask) @ v``.

    Args:
        q: ``[B, H, Lq, D]``.
        k, v: ``[B, Hkv, Lk, D]``; ``H`` a multiple of ``Hkv`` (grouped-query attention: query head ``h``
            reads key/value head ``h // (H // Hkv)``).
        attn_mask: broadcastable to ``[B, H, Lq, Lk]``, as in ``scaled_dot_product_attention``: bool with
            True = may attend, or floating and added to the scores.
        key_padding_mask: ``[B, Lk]`` bool, True = padding (the ``nn.MultiheadAttention`` convention).
        query_padding_mask: ``[B, Lq]`` bool, True = padding: those query rows give zeros (LSE ``-inf``) and
            pass no gradient.
        is_causal: mask keys after the query. With ``causal_alignment="top_left"`` query ``i`` sees keys
            ``j <= i``; with ``"bottom_right"`` it sees ``j <= i + Lk - Lq`` (the last query sees every key,
            as in incremental decoding)::

                top_left, Lq=2, Lk=4     bottom_right, Lq=2, Lk=4
                  1 0 0 0                  1 1 1 0
                  1 1 0 0                  1 1 1 1

            With ``query_padding_mask`` given, ``bottom_right`` aligns each sequence on its own: its last real
            query with its last real key (``Lk - Lq`` becomes ``key_end - query_end``, one past the last
            position that is not padding, ``key_end = Lk`` without ``key_padding_mask``).
        window: ``(left, right)``, local attention: query ``i`` sees only keys ``i + o - left <= j <= i + o +
            right``, ``o`` the offset of the causal alignment above (0 for ``top_left``) whether or not
            ``is_causal``; None on a side (or ``window=None``) means no limit there. Key tiles wholly outside
            the window are skipped.

        dropout_p: probability of dropping an attention probability (always applied when > 0).
        scale: multiplies the scores; default ``1 / sqrt(D)`` (1 for ``D = 0``, whose scores are all 0).
        return_lse: also return the log-sum-exp ``[B, H, Lq]`` (float32, float64 for float64 inputs) of the
            scaled, masked scores.

    Returns:
        ``[B, H, Lq, D]`` in q's dtype, and the LSE if asked. Edges as ``scaled_dot_product_attention`` (math
        backend) has them: a query row with no key left to attend (every key masked by ``is_causal``, a bool
        or ``-inf`` float ``attn_mask`` or ``key_padding_mask``, or ``Lk = 0``) gives zeros (LSE ``-inf``) and
        zero gradients; a NaN score (from q, k or a float ``attn_mask``) makes that row of the output and of
        the LSE NaN, and the NaN flows back into the gradients as in torch; ``Lq = 0`` and ``D = 0`` give empty
        outputs (with ``D = 0`` every score is 0, and the LSE and ``attention_weights`` follow the masks
        alone). A float ``attn_mask`` is added as SDPA adds it, so a NaN score at a ``-inf`` key still makes
        the row NaN. One difference, on purpose: a key that a bool mask, padding or the causal mask hides is
        out of the softmax whatever its score (the kernels skip such key blocks), so a NaN there does not
        reach the row, where SDPA, which adds those masks as ``-inf``, gives NaN.
    """
    cast = _autocast_dtype(q, matmul=True)
    q, k, v = _autocast_all(cast, q, k, v)
    _check_attention_args(q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment, scale, query_padding_mask)
    window = _check_window(window)
    dropout_p = _check_dropout(dropout_p)
    return _run(
        "attention", q, cast, q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, is_causal=is_causal, causal_alignment=causal_alignment,
        window=_no_limit_as_none(window), dropout_p=dropout_p, scale=scale, return_lse=bool(return_lse),
    )


def _no_limit_as_none(window: Optional[Tuple[Optional[int], Optional[int]]]) -> Optional[tuple]:
    return None if window == (None, None) else window


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
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a batch of sequences of different lengths, packed without padding.

    Sequence ``b`` holds queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and keys / values
    ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]`` and attends only within itself, exactly as ``attention``
    would on that sequence alone; no work is done for padding.

    Args:
        q: ``[Tq, H, D]``; k, v: ``[Tk, Hkv, D]``, ``H`` a multiple of ``Hkv`` (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on q's device: 0, the running sums of the lengths, and
            ``Tq`` / ``Tk`` (``torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))``).
        max_seqlen_q, max_seqlen_k: at least every sequence's length (they size the kernels' grids).
        is_causal, causal_alignment, window, scale: as in ``attention``, per sequence: with ``bottom_right``
            each sequence's last query is aligned with its last key.
        dropout_p: as in ``attention``.
        return_lse: also return the LSE ``[H, Tq]`` (float32, float64 for float64 inputs).

    Returns:
        ``[Tq, H, D]`` in q's dtype, and the LSE if asked. Edges as in ``attention``: a query with no visible
        key gives zeros. The values of ``cu_seqlens_*`` are checked (one read of them) except under
        ``torch.compile``.
    """
    cast = _autocast_dtype(q, matmul=True)
    q, k, v = _autocast_all(cast, q, k, v)
    _check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                       scale)
    _check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    _check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    window = _check_window(window)
    dropout_p = _check_dropout(dropout_p)
    return _run(
        "attention_varlen", q, cast, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        is_causal=is_causal, causal_alignment=causal_alignment, window=_no_limit_as_none(window),
        dropout_p=dropout_p, scale=scale, return_lse=bool(return_lse),
    )


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
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """The attention probabilities ``[B, H, Lq, Lk]`` (before dropout) that ``attention`` used, recomputed
    from its ``lse`` (``return_lse=True``); same masks and scale as that call. For ``need_weights=True``.
    """
    cast = _autocast_dtype(q, matmul=True)
    q, k = _autocast_all(cast, q, k)
    _check_attention_args(q, k, k, attn_mask, key_padding_mask, is_causal, causal_alignment, scale, query_padding_mask)
    if not isinstance(lse, Tensor) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must be a tensor of shape [B, H, Lq] = {list(q.shape[:3])}")
    return _run(
        "attention_weights", q, cast, q, k, lse, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, is_causal=is_causal, causal_alignment=causal_alignment,
        window=_no_limit_as_none(_check_window(window)), scale=scale,
    )


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float = 1e-5,
    *,
    residual: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    prenorm: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``y = LayerNorm(dropout(x) + residual) * weight + bias`` over the last dim of ``x``.

    Args:
        x: ``[..., N]``.
        weight, bias: ``[N]`` or None.
        residual: x's shape and dtype, or None.
        dropout_p: dropout on ``x`` before the residual add (always applied when > 0).
        prenorm: also return ``z = dropout(x) + residual``, the residual stream of a pre-LN block.

    Returns:
        ``y`` (x's dtype), or ``(y, z)`` with ``prenorm``. Mean and variance are computed in float32. As with
        ``torch.nn.functional.layer_norm``, ``N = 0`` or no rows give empty results (the weight and bias
        gradients then empty or zeros).
    """
    cast = _autocast_dtype(x, matmul=False)
    x, weight, bias, residual = _autocast_all(cast, x, weight, bias, residual)
    _check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (the normalised one), got a scalar")
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check_tensor(name, p)
            _check_same(name, p, "x", x, dtype=False)
            if tuple(p.shape) != (n,):
                raise ValueError(f"{name} must be [{n}] (x's last dim), got {_describe(p)}")
    if residual is not None:
        _check_tensor("residual", residual)
        _check_same("residual", residual, "x", x)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {_describe(residual)}")
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a non-negative number")
    dropout_p = _check_dropout(dropout_p)
    return _run("layer_norm", x, cast, x, weight, bias, float(eps), residual=residual, dropout_p=dropout_p,
                prenorm=bool(prenorm))


def feed_forward(
    x: Tensor,
    w1: Tensor,
    b1: Optional[Tensor],
    w2: Tensor,
    b2: Optional[Tensor],
    *,
    activation: str = "gelu",
    dropout_p: float = 0.0,
) -> Tensor:
    """The position-wise feed-forward ``linear2(dropout(act(linear1(x))))``.

    Args:
        x: ``[..., d_model]``.
        w1: ``[d_ff, d_model]`` and b1 ``[d_ff]`` or None (``nn.Linear`` layout).
        w2: ``[d_out, d_ff]`` and b2 ``[d_out]`` or None.
        activation: ``"relu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``; NaN passes through each, as in
            torch (``relu``'s gradient at NaN is the incoming one, as ``torch.relu``'s).
        dropout_p: dropout on the activation (always applied when > 0).

    Returns:
        ``[..., d_out]`` in x's dtype.
    """
    cast = _autocast_dtype(x, matmul=True)
    x, w1, b1, w2, b2 = _autocast_all(cast, x, w1, b1, w2, b2)
    _check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (the features), got a scalar")
    d_model = x.shape[-1]
    for name, w in (("w1", w1), ("w2", w2)):
        _check_tensor(name, w, rank=2)
        _check_same(name, w, "x", x)
    d_ff = w1.shape[0]
    if w1.shape[1] != d_model:
        raise ValueError(f"w1 must be [d_ff, d_model={d_model}], got {_describe(w1)}")
    if w2.shape[1] != d_ff:
        raise ValueError(f"w2 must be [d_out, d_ff={d_ff}] to follow w1 {tuple(w1.shape)}, got {_describe(w2)}")
    for name, b, size in (("b1", b1, d_ff), ("b2", b2, w2.shape[0])):
        if b is not None:
            _check_tensor(name, b)
            _check_same(name, b, "x", x)
            if tuple(b.shape) != (size,):
                raise ValueError(f"{name} must be [{size}], got {_describe(b)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    dropout_p = _check_dropout(dropout_p)
    return _run("feed_forward", x, cast, x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p)
