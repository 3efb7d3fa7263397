"""Rotary position embeddings on q and k, Hugging Face's ``apply_rotary_pos_emb`` (modeling_llama) in one pass:
``q * cos + rotate_half(q) * sin`` and the same for k, cos / sin unsqueezed at ``unsqueeze_dim`` to broadcast.

With ``x1, x2`` the halves of the first ``rotary_dim = cos.shape[-1]`` features of a row (``interleaved=True``: its
even and odd features, GLM's ``rotate_every_two``) and ``c1, c2, s1, s2`` cos and sin at the same features::

    y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2

the features past ``rotary_dim`` passed unchanged (partial rotary, as modeling_phi3's). The backends' launchers
(``LAUNCHERS``) take q ``[.., D]``, k (q's rank and dtype) and cos / sin already unsqueezed to q's rank::

    forward(q, k, cos, sin, interleaved) -> (q_embed, k_embed)
    backward(dq_embed, dk_embed, cos, sin, interleaved) -> (dq, dk)      (the rotation by -sin)

Differences from Hugging Face's: the result is in q's dtype whatever cos / sin's float dtype (their rotary modules
cast them to it), computed in float32 and rounded once (theirs rounds each product in q's dtype); a cos / sin that
requires a gradient sends the call to torch's path, which autograd differentiates (ours differentiates q and k only).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .. import route
from ..autograd import traced_apply
from ..contract import FLOAT_DTYPES, check_tensor, describe
from . import Example, Launchers, Op, TuneSeries, Work, register

Tensor = torch.Tensor


class RotarySpec(NamedTuple):
    """A call's options, checked."""

    unsqueeze_dim: int  # where cos / sin get the dim they broadcast over (the heads' dim)
    interleaved: bool  # pairs (2i, 2i+1) rather than halves (i, i + rotary_dim / 2)
    rotary_dim: int  # cos.shape[-1]: the features rotated, the rest passed


# ----------------------------------------------------------------------------------------------- contract


def check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: object, unsqueeze_dim: object,
          interleaved: object) -> RotarySpec:
    """The checked ``RotarySpec`` of a call: q ``[B, H, S, D]`` (2 to 4 dims), k q's rank, dtype and head dim, cos and
    sin one shape, ``[.., rotary_dim]`` with ``rotary_dim`` even and at most D, broadcasting to q and k once
    unsqueezed at ``unsqueeze_dim``."""
    if (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)
            and position_ids is None and interleaved.__class__ is bool and unsqueeze_dim.__class__ is int
            and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and cos.dtype in FLOAT_DTYPES and sin.dtype == cos.dtype
            and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and q.device == k.device == cos.device == sin.device and q.shape[-1] == k.shape[-1]
            and cos.shape[-1] % 2 == 0 and 0 < cos.shape[-1] <= q.shape[-1]
            and (unsqueeze_dim == 1 or unsqueeze_dim == 2) and _broadcasts(cos.shape, unsqueeze_dim, q.shape, k.shape)):
        return RotarySpec(unsqueeze_dim, interleaved, cos.shape[-1])  # checked: the common case, in one expression
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(name, t)
    if position_ids is not None and not isinstance(position_ids, Tensor):
        # transformers 5's own signature has no position_ids: its unsqueeze_dim passed by position lands here
        raise TypeError(f"position_ids must be a Tensor or None (it is unused), got {position_ids!r}; pass "
                        f"unsqueeze_dim by keyword")
    if not 2 <= q.dim() <= 4:
        raise ValueError(f"q must be [B, H, S, D] (2 to 4 dims), got {describe(q)}")
    if k.dim() != q.dim() or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's rank and head dim ({q.dim()} dims, D={q.shape[-1]}), got {describe(k)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; expected one dtype")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {describe(sin)}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin has dtype {sin.dtype} but cos has {cos.dtype}; expected one dtype")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) \
            or not -cos.dim() - 1 <= unsqueeze_dim <= cos.dim():
        raise ValueError(f"unsqueeze_dim={unsqueeze_dim!r} must be an int in [{-cos.dim() - 1}, {cos.dim()}] "
                         f"(a dim of cos {tuple(cos.shape)} unsqueezed)")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    rotary_dim, head_dim = cos.shape[-1], q.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos and sin must be [..., rotary_dim] with rotary_dim even, in (0, head_dim={head_dim}], "
                         f"got {describe(cos)}")
    table = cos.shape[:-1]
    table = table[:unsqueeze_dim] + (1,) + table[unsqueeze_dim:] if unsqueeze_dim >= 0 else \
        table[:len(table) + unsqueeze_dim + 1] + (1,) + table[len(table) + unsqueeze_dim + 1:]
    for name, t in (("q", q), ("k", k)):
        lead = t.shape[:-1]
        if len(table) > len(lead) or any(n != 1 and n != m for n, m in zip(table[::-1], lead[::-1])):
            raise ValueError(f"cos and sin {tuple(cos.shape)} unsqueezed at {unsqueeze_dim} give {tuple(table)}, "
                             f"which does not broadcast to {name}'s leading dims {tuple(lead)} ({describe(t)})")
    return RotarySpec(unsqueeze_dim, interleaved, rotary_dim)


def _broadcasts(table: torch.Size, unsqueeze_dim: int, q_shape: torch.Size, k_shape: torch.Size) -> bool:
    """Whether a 3-dim cos unsqueezed at 1 or 2 broadcasts to 4-dim q and k without growing them."""
    b, s = table[0], table[1]
    at = 2 if unsqueeze_dim == 1 else 1
    return ((b == 1 or b == q_shape[0] == k_shape[0]) and (s == 1 or s == q_shape[at] == k_shape[at]))


# ---------------------------------------------------------------------------------------------- reference


def _halves(x: Tensor, rotary_dim: int, interleaved: bool) -> Tuple[Tensor, Tensor]:
    """The two views rotated together: features ``[:r/2]`` and ``[r/2:r]``, or (``interleaved``) the even and the odd
    ones of ``[:r]`` (by ATen's own split / unbind: ``Tensor.split`` and ``unflatten`` cost microseconds of Python)."""
    head_dim, half = x.shape[-1], rotary_dim // 2
    if interleaved:
        pairs = x if rotary_dim == head_dim else x.narrow(-1, 0, rotary_dim)
        return pairs.view(x.shape[:-1] + (half, 2)).unbind(-1)
    return x.split_with_sizes((half, half, head_dim - rotary_dim), -1)[:2]


def rotate_half(x: Tensor) -> Tensor:
    """Hugging Face's ``rotate_half``: ``[-x2, x1]`` of the halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: Tensor) -> Tensor:
    """GLM's ``rotate_every_two``: ``(-x[2i+1], x[2i])`` for each pair."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _embed(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    turn = rotate_every_two if interleaved else rotate_half
    embedded = rotated * cos + turn(rotated) * sin
    return embedded if passed.shape[-1] == 0 else torch.cat((embedded, passed), dim=-1)


def torch_path(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None,
               unsqueeze_dim: int = 1, *, interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """The call as Hugging Face computes it (modeling_llama's and modeling_phi3's ``apply_rotary_pos_emb``:
    ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` features, the rest concatenated), cos / sin in q's
    dtype as their rotary modules return them."""
    cos, sin = cos.to(q.dtype).unsqueeze(unsqueeze_dim), sin.to(q.dtype).unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, interleaved), _embed(k, cos, sin, interleaved)


def reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None,
              unsqueeze_dim: int = 1, *, interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """The float64 oracle (float64 tensors given) and the reference backend: torch's path, in q's dtype."""
    return torch_path(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved=interleaved)


# -------------------------------------------------------------------------------------------- route facts


def decide(q: Tensor, k: Tensor, spec: RotarySpec) -> route.Decision:
    """Who runs a call of checked arguments (whose cos / sin need no gradient)."""
    grad = route.needs_grad(q, k)
    if torch.compiler.is_compiling():
        return route.choose(_call(q, k, grad), q.device)
    key = ("apply_rotary_pos_emb", q.device, q.dtype, q.shape, k.shape, spec, grad, route.backend.get_backend())
    return route.remembered(key, lambda: (_call(q, k, grad), q.device))


def _call(q: Tensor, k: Tensor, grad: bool, device: Optional[torch.device] = None) -> route.Call:
    rows = (q.numel() + k.numel()) // max(q.shape[-1], 1)
    return route.Call("apply_rotary_pos_emb", route.device_tag(q.device if device is None else device), q.dtype,
                      head_dim=q.shape[-1], size=route.size(rows), needs_grad=grad,
                      deterministic=torch.are_deterministic_algorithms_enabled(), backends=_BACKENDS)


# -------------------------------------------------------------------------------------------- the backends
# The CPU backend: torch's ops written into the outputs (a product, then a fused multiply-add in place), in q's
# dtype: no rotated copy, no concatenation, no intermediate of q's size beyond the outputs.


def _rotate_into(x: Tensor, cos: Tensor, sin_halves: Tuple[Tensor, Tensor], interleaved: bool,
                 backward: bool) -> Tensor:
    """``x * cos`` (in x's layout; a new contiguous tensor for a partial rotary), then the other halves' products
    added in place."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(x[..., :rotary_dim], cos, out=out[..., :rotary_dim])
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    else:
        out = torch.mul(x, cos)
    x1, x2 = _halves(x, rotary_dim, interleaved)
    y1, y2 = _halves(out, rotary_dim, interleaved)
    s1, s2 = sin_halves
    if backward:  # dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
        y1.addcmul_(x2, s2)
        y2.addcmul_(x1, s1, value=-1)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        y1.addcmul_(x2, s1, value=-1)
        y2.addcmul_(x1, s2)
    return out


def _rotated(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool) -> Tensor:
    """``_rotate_into``'s result from functional ops, for a trace (dynamo takes no ``out=`` into a strided view; the
    compiler fuses these)."""
    rotary_dim = cos.shape[-1]
    x1, x2 = _halves(x, rotary_dim, interleaved)
    c1, c2 = _halves(cos, rotary_dim, interleaved)
    s1, s2 = _halves(sin, rotary_dim, interleaved)
    if backward:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return y if rotary_dim == x.shape[-1] else torch.cat((y, x[..., rotary_dim:]), dim=-1)


def _cpu_pass(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
              backward: bool) -> Tuple[Tensor, Tensor]:
    if cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    if torch.compiler.is_compiling():
        return tuple(_rotated(x, cos, sin, interleaved, backward) for x in (q, k))
    rotary_dim, head_dim = cos.shape[-1], q.shape[-1]
    if interleaved or rotary_dim < head_dim:
        sin_halves = _halves(sin, rotary_dim, interleaved)
        return (_rotate_into(q, cos, sin_halves, interleaved, backward),
                _rotate_into(k, cos, sin_halves, interleaved, backward))
    # The common case inline (the host's microseconds count at small sizes): halves over the whole head dim.
    halves = (rotary_dim // 2, rotary_dim // 2)
    s1, s2 = sin.split_with_sizes(halves, -1)
    first, first_sign, second, second_sign = (s2, 1, s1, -1) if backward else (s1, -1, s2, 1)
    outs = []
    for x in (q, k):
        out = torch.mul(x, cos)
        x1, x2 = x.split_with_sizes(halves, -1)
        y1, y2 = out.split_with_sizes(halves, -1)
        y1.addcmul_(x2, first, value=first_sign)
        y2.addcmul_(x1, second, value=second_sign)
        outs.append(out)
    return outs[0], outs[1]


def cpu_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tuple[Tensor, Tensor]:
    """``(q_embed, k_embed)`` in q's and k's layouts (contiguous for a partial rotary)."""
    return _cpu_pass(q, k, cos, sin, interleaved, False)


def cpu_backward(dq_embed: Tensor, dk_embed: Tensor, cos: Tensor, sin: Tensor,
                 interleaved: bool) -> Tuple[Tensor, Tensor]:
    """``(dq, dk)``: the rotation by -sin."""
    return _cpu_pass(dq_embed, dk_embed, cos, sin, interleaved, True)


LAUNCHERS = Launchers(triton="fused_transformer.kernels.rotary:rotary_fwd,rotary_bwd",
                      cpu=f"{__name__}:cpu_forward,cpu_backward")
_BACKENDS = frozenset(LAUNCHERS.where)


class RotaryFunction(torch.autograd.Function):
    """Autograd over a backend's launchers: q and k forward in one pass, their gradients in one pass (cos and sin are
    constants here: a call whose cos or sin needs a gradient runs on torch's path)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved: bool, name: str):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.name = interleaved, name
        return LAUNCHERS(name)[0](q, k, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        dq, dk = LAUNCHERS(ctx.name)[1](dq_embed, dk_embed, cos, sin, ctx.interleaved)
        return dq, dk, None, None, None, None


_autograd_apply = super(torch.autograd.Function, RotaryFunction).apply  # autograd's own (C++) apply: no frame


def run(name: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, spec: RotarySpec) -> Tuple[Tensor, Tensor]:
    """The op of checked arguments on backend ``name`` (``"torch"``: ``torch_path``; ``"reference"``:
    ``reference``)."""
    if name == "torch" or name == "reference":
        path = torch_path if name == "torch" else reference
        return path(q, k, cos, sin, None, spec.unsqueeze_dim, interleaved=spec.interleaved)
    cos, sin = cos.unsqueeze(spec.unsqueeze_dim), sin.unsqueeze(spec.unsqueeze_dim)
    if route.needs_grad(q, k):
        apply = RotaryFunction.apply if traced_apply() else _autograd_apply
        return apply(q, k, cos, sin, spec.interleaved, name)
    return LAUNCHERS(name)[0](q, k, cos, sin, spec.interleaved)


# --------------------------------------------------------------------------------------------- the op

_TABLE_GRAD = "cos or sin requires grad: torch's path (autograd differentiates it)"


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None,
                         unsqueeze_dim: int = 1, *, interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Rotary position embeddings on q and k: Hugging Face's ``apply_rotary_pos_emb`` (modeling_llama), the same call
    and result, q and k in one pass.

    With ``x1, x2`` the halves of the first ``rotary_dim = cos.shape[-1]`` features of each row of q and of k, and
    ``c1, c2, s1, s2`` cos and sin at those features::

        y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2        (x * cos + rotate_half(x) * sin)

    and the features past ``rotary_dim`` unchanged (partial rotary, as modeling_phi3's ``apply_rotary_pos_emb``).

    Args:
        q: ``[B, H, S, D]`` (``unsqueeze_dim=2``: ``[B, S, H, D]``), any strides.
        k: ``[B, Hkv, S, D]`` (or ``[B, S, Hkv, D]``), q's dtype; ``Hkv`` may be fewer than ``H`` (grouped-query).
        cos, sin: ``[B or 1, S, rotary_dim]``, whatever the model's rotary module made (default, llama3, yarn,
            longrope scaling alike), any float dtype; unsqueezed at ``unsqueeze_dim`` they broadcast to q and k.
            ``rotary_dim`` is even and at most ``D``.
        position_ids: unused (as in Hugging Face's; cos and sin are already at the positions).
        unsqueeze_dim: the dim of ``cos.unsqueeze`` that broadcasts over the heads: 1 for ``[B, H, S, D]``, 2 for
            ``[B, S, H, D]``.
        interleaved: rotate adjacent pairs ``(2i, 2i + 1)`` instead of halves: ``y[2i] = x[2i] c[2i] - x[2i+1] s[2i]``,
            ``y[2i+1] = x[2i+1] c[2i+1] + x[2i] s[2i+1]`` (GLM / Cohere's ``rotate_every_two``; cos and sin given at
            full width, each frequency repeated twice, ``repeat_interleave(2)``).

    Returns:
        ``(q_embed, k_embed)`` of q's and k's shapes, in q's dtype (computed in float32, rounded once; under
        ``torch.autocast`` too, as Hugging Face's elementwise code runs), in q's and k's layouts (contiguous where
        a layout's last dim is not). The gradients of q and k are made in one pass (the rotation by ``-sin``); a cos
        or sin that requires a gradient sends the call to torch's path, which autograd differentiates.
    """
    spec = check(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
    if route.needs_grad(cos, sin):
        route.ran_elsewhere("apply_rotary_pos_emb", "functional", _TABLE_GRAD)
        name = "torch"
    else:
        name = decide(q, k, spec).backend
    return run(name, q, k, cos, sin, spec)


# ------------------------------------------------------------------------------------------------ cases


def bytes_moved(q_elements: int, k_elements: int, table_elements: int, element_size: int) -> float:
    """q and k read and written, cos and sin read once (a pass; the backward moves as much)."""
    return float((2 * (q_elements + k_elements) + 2 * table_elements) * element_size)


def example(label: str, batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, *,
            rotary_dim: Optional[int] = None, table_batch: Optional[int] = None, quick: bool = False,
            **options: object) -> Example:
    """A call on q ``[batch, heads, seq_len, head_dim]`` (``unsqueeze_dim=2``: ``[batch, seq_len, heads, head_dim]``),
    k with ``kv_heads``, cos / sin ``[table_batch, seq_len, rotary_dim]`` (default ``batch`` and ``head_dim``)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    table_batch = batch if table_batch is None else table_batch
    heads_last = options.get("unsqueeze_dim", 1) == 2

    def shape(h):
        return (batch, seq_len, h, head_dim) if heads_last else (batch, h, seq_len, head_dim)

    def tensors(draw):
        angles = draw(table_batch, seq_len, rotary_dim, scale=3.0)
        return {"q": draw(*shape(heads)), "k": draw(*shape(kv_heads)), "cos": angles.cos(), "sin": angles.sin()}

    return Example(label, tensors, options, quick,
                   {"batch": batch, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                    "rotary_dim": rotary_dim, "table_batch": table_batch},
                   size=batch * seq_len * (heads + kv_heads))


CHECK = (
    example("B2 H4/2 S19 D64", 2, 4, 2, 19, 64, quick=True),
    example("B2 H4/4 S19 D64 pairs", 2, 4, 4, 19, 64, interleaved=True, quick=True),
    example("B2 S13 H3/1 D96 R32 heads-last", 2, 3, 1, 13, 96, rotary_dim=32, unsqueeze_dim=2),
    example("B3 H2/1 S7 D128 R64 cos batch 1", 3, 2, 1, 7, 128, rotary_dim=64, table_batch=1),
    example("B1 H2/2 S5 D256 pairs", 1, 2, 2, 5, 256, interleaved=True),
)


def _bench(gpu: bool, lengths: Sequence[int]) -> Sequence[Example]:
    if gpu:
        shapes = ((1, 32, 8, 128), (4, 32, 8, 128), (2, 32, 32, 64), (2, 32, 32, 96), (2, 8, 4, 256))
    else:
        shapes = ((1, 8, 2, 64), (2, 8, 8, 96), (1, 4, 1, 256))
    return [example(f"B{b} H{h}/{hkv} D{d}", b, h, hkv, length, d) for b, h, hkv, d in shapes for length in lengths]


def _work(example: Example, itemsize: int, backward: bool) -> Work:
    s = example.shape
    rows = s["batch"] * s["seq_len"]
    return Work(nbytes=bytes_moved(rows * s["heads"] * s["head_dim"], rows * s["kv_heads"] * s["head_dim"],
                                   s["table_batch"] * s["seq_len"] * s["rotary_dim"], itemsize)
                * (2 if backward else 1))


def _describe(gpu: bool) -> str:
    shapes = ("B1/4 H32/8 D128, B2 H32/32 D64 and D96, B2 H8/4 D256" if gpu
              else "B1 H8/2 D64, B2 H8/8 D96, B1 H4/1 D256")
    return f"q/k heads {shapes}, cos/sin per batch, halves"


def _tune(device_type: str, dtype: torch.dtype, quick: bool) -> Sequence[TuneSeries]:
    """q 8 heads, k 2 (32 and 8 on a GPU), head dim 64 (128), halves; sizes counted in rows of q and k."""
    heads, kv_heads, head_dim = (32, 8, 128) if device_type == "cuda" else (8, 2, 64)
    lengths = (64,) if quick else ((1024, 4096, 16384) if device_type == "cuda" else (64, 512, 2048))
    return (TuneSeries("no", tuple(example(f"S{n}", 1, heads, kv_heads, n, head_dim) for n in lengths)),)


class ThinRotary(torch.autograd.Function):
    """The least the op can cost on the host (the overhead suite's thin): autograd's bookkeeping and the two outputs
    allocated, the two gradients in backward; no check, route or arithmetic."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        return torch.empty_like(q), torch.empty_like(k)

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        return torch.empty_like(dq_embed), torch.empty_like(dk_embed), None, None


def _thin(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    return ThinRotary.apply(q, k, cos, sin)


MEASURED = """
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
apply_rotary_pos_emb  forward   cpu-avx512-t2  float32           *         *            no       functional  *               1.51-2.54  -          CPU tune f0f0518 (AVX-512) 2026-12-07
apply_rotary_pos_emb  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  *               1.27-1.56  -          CPU tune f0f0518 (AVX-512) 2026-12-07
apply_rotary_pos_emb  training  cpu-avx512-t2  float32           *         *            no       functional  *               1.58-2.09  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
apply_rotary_pos_emb  training  cpu-avx512-t2  bfloat16          *         *            no       functional  *               1.27-1.76  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
apply_rotary_pos_emb  forward   cpu-avx2-t2    float32           *         *            no       functional  *               1.70-2.82  -          CPU tune f0f0518 (avx2) 2026-12-07
apply_rotary_pos_emb  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  *               1.30-1.98  -          CPU tune f0f0518 (avx2) 2026-12-07
apply_rotary_pos_emb  training  cpu-avx2-t2    float32           *         *            no       functional  *               1.50-2.31  yes        CPU tune f0f0518 (avx2) 2026-12-07
apply_rotary_pos_emb  training  cpu-avx2-t2    bfloat16          *         *            no       functional  *               1.40-1.54  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""


OP = register(Op(
    name="apply_rotary_pos_emb", function=apply_rotary_pos_emb, torch_path=torch_path, reference=reference,
    size_of="rows of q and k", outputs=("q_embed", "k_embed"), check=CHECK, bench=_bench,
    lengths={"cpu": ((128, 512), (128,)), "cuda": ((512, 1024, 2048, 4096), (1024, 4096))},
    work=_work, describe=_describe,
    overhead=(example("B2 H4/2 S8 D32", 2, 4, 2, 8, 32),), overhead_target={"fwd": 2.5, "fwd+bwd": 2.5},
    constants=("cos", "sin"),
    call_of=lambda tensors, options, device, grad: _call(tensors["q"], tensors["k"], grad, device),
    route_examples=(example("Llama", 1, 32, 8, 1024, 128),), launchers=LAUNCHERS, overhead_thin=_thin, tune=_tune,
    measured=MEASURED,
))
