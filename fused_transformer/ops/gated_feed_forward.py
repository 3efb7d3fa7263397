"""The gated feed-forward of Llama, Gemma and Phi-3: ``down(dropout(act(x Wg^T + bg) * (x Wu^T + bu))) + bd``, the
products on torch's GEMMs, the gating and dropout between them one pass of ours, and the backward keeping only x and
the gate and up products (never act(g) nor the gated product h, which torch's own ops keep: two ``[tokens, d_ff]``
tensors less between forward and backward).

Phi-3's packed projection (``gate_up_proj``, ``Linear(d_model, 2 d_ff)`` whose output ``chunk(2, -1)`` gives gate then
up) is ``up_weight=None`` with the packed weight as ``gate_weight`` (and its bias as ``gate_bias``): one product
forward, one for dx and one for its weight's gradient backward.

The backends' launchers (``LAUNCHERS``) take ``x [..., d_model]``::

    forward(x, wg, wu, wd, bg, bu, bd, activation, dropout_p, seed) -> (y, saved)
    backward(dy, x, wg, wu, wd, saved, has_bg, has_bu, has_bd, activation, dropout_p, seed)
        -> (dx, dwg, dwu, dwd, dbg, dbu, dbd)

``saved`` the gate and up products ``(g, u)`` as rows ``[M, d_ff]``, or packed the one ``[M, 2 d_ff]`` product;
``dx`` shaped as ``x``; an absent weight's or bias's gradient None. Differences from torch (``torch_path``: F.linear,
F.silu / F.gelu, F.dropout): in 16 bits the Triton pass computes act(g) * u in float32 and rounds once, where torch
rounds act(g) first (ours is the closer to the float64 reference); dropout draws its own mask (a Philox stream, not
torch's generator's sequence), reproducible from ``torch.manual_seed`` and replayed by the backward.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import route
from ..autograd import backward_seed, draw_seed, saved_seed, traced_apply
from ..contract import (
    FLOAT_DTYPES, Seed, as_rows, autocast_all, autocast_dtype, check_dropout, check_same, check_tensor, describe,
    stats_dtype, traced,
)
from . import Example, Launchers, Op, TuneSeries, Work, register

Tensor = torch.Tensor
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
OPTIONS = dict(activation="silu", dropout_p=0.0)

_ACTIVATION_FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


class GatedFeedForwardSpec(NamedTuple):
    """A call's options, checked."""

    activation: str  # one of ACTIVATIONS
    dropout_p: float
    packed: bool  # gate_weight is [2 d_ff, d_model]: gate rows, then up rows (Phi-3's gate_up_proj)


# ----------------------------------------------------------------------------------------------- contract


def check(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
          gate_bias: Optional[Tensor], up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: object,
          dropout_p: object) -> GatedFeedForwardSpec:
    """The checked spec of a call: x ``[..., d_model]``, weights in ``nn.Linear`` layout (gate / up ``[d_ff,
    d_model]``, down ``[d_out, d_ff]``; packed, ``up_weight=None`` and gate ``[2 d_ff, d_model]``)."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim (the features), got a scalar")
    d_model = x.shape[-1]
    packed = up_weight is None
    for name, w in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)):
        if w is not None:
            check_tensor(name, w, rank=2)
            check_same(name, w, "x", x)
            if name != "down_weight" and w.shape[1] != d_model:
                raise ValueError(f"{name} must be [d_ff, d_model={d_model}], got {describe(w)}")
    if packed:
        if gate_weight.shape[0] % 2:
            raise ValueError(f"with up_weight=None gate_weight is gate and up packed, [2 * d_ff, d_model], so its rows "
                             f"must be even; got {describe(gate_weight)}")
        if up_bias is not None:
            raise ValueError("up_bias must be None when up_weight is None (packed: gate_bias holds gate and up, "
                             f"[2 * d_ff]); got {describe(up_bias)}")
        d_ff = gate_weight.shape[0] // 2
    else:
        d_ff = gate_weight.shape[0]
        if up_weight.shape != gate_weight.shape:
            raise ValueError(f"up_weight must be gate_weight's shape {tuple(gate_weight.shape)}, got "
                             f"{describe(up_weight)}")
    if down_weight.shape[1] != d_ff:
        raise ValueError(f"down_weight must be [d_out, d_ff={d_ff}] to follow gate_weight "
                         f"{tuple(gate_weight.shape)}{' (packed)' if packed else ''}, got {describe(down_weight)}")
    for name, b, size in (("gate_bias", gate_bias, gate_weight.shape[0]), ("up_bias", up_bias, d_ff),
                          ("down_bias", down_bias, down_weight.shape[0])):
        if b is not None:
            check_tensor(name, b)
            check_same(name, b, "x", x)
            if tuple(b.shape) != (size,):
                raise ValueError(f"{name} must be [{size}], got {describe(b)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    return GatedFeedForwardSpec(activation, check_dropout(dropout_p), packed)


# ---------------------------------------------------------------------------------------------- reference


def _gate_and_up(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], gate_bias: Optional[Tensor],
                 up_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    if up_weight is None:
        gate, up = F.linear(x, gate_weight, gate_bias).chunk(2, dim=-1)
        return gate, up
    return F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)


def reference(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
              gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
              down_bias: Optional[Tensor] = None, *, activation: str = "silu", dropout_p: float = 0.0,
              keep_mask: Optional[Tensor] = None) -> Tensor:
    """The float64 oracle and the reference backend: ``linear(dropout(act(g) * u), down_weight, down_bias)`` with
    ``g, u`` the gate and up products (``keep_mask``: the op's own dropout mask of ``[..., d_ff]``, replayed)."""
    from ..reference import dropout

    gate, up = _gate_and_up(x, gate_weight, up_weight, gate_bias, up_bias)
    return F.linear(dropout(_ACTIVATION_FUNCTIONS[activation](gate) * up, dropout_p, keep_mask), down_weight,
                    down_bias)


def torch_path(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
               gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
               down_bias: Optional[Tensor] = None, *, activation: str = "silu", dropout_p: float = 0.0) -> Tensor:
    """The call as Hugging Face's LlamaMLP / Phi3MLP computes it: ATen's ``linear``, activation, product, dropout
    and ``linear``."""
    gate, up = _gate_and_up(x, gate_weight, up_weight, gate_bias, up_bias)
    hidden = _ACTIVATION_FUNCTIONS[activation](gate) * up
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, dropout_p)
    return F.linear(hidden, down_weight, down_bias)


# -------------------------------------------------------------------------------------------- route facts


def decide(x: Tensor, weights: Tuple[Optional[Tensor], ...], spec: GatedFeedForwardSpec) -> route.Decision:
    """Who runs a call of checked arguments (``weights``: every weight and bias)."""
    grad = route.needs_grad(x, *weights)
    if torch.compiler.is_compiling():
        return route.choose(_call(x, spec, grad), x.device)
    key = ("gated_feed_forward", x.device, x.dtype, x.shape, spec, grad, torch.are_deterministic_algorithms_enabled(),
           route.backend.get_backend())
    return route.remembered(key, lambda: (_call(x, spec, grad), x.device))


def _call(x: Tensor, spec: GatedFeedForwardSpec, grad: bool, device: Optional[torch.device] = None) -> route.Call:
    device = x.device if device is None else device
    # On the CPU ours runs ATen's own elementwise ops and, to keep less, runs act(g) again in the backward: without
    # dropout (whose mask ATen draws and keeps as a tensor) that is torch's path and more.
    torch_default = "no dropout on the CPU: ATen's ops, less recomputed" if (
        device.type == "cpu" and spec.dropout_p == 0.0) else ""
    return route.Call("gated_feed_forward", route.device_tag(device), x.dtype, dropout=spec.dropout_p > 0.0,
                      size=route.size(x.numel() // max(x.shape[-1], 1)), needs_grad=grad,
                      deterministic=torch.are_deterministic_algorithms_enabled(), torch_default=torch_default,
                      backends=_BACKENDS)


# -------------------------------------------------------------------------------------------- the backends
# The CPU backend: ATen's products and elementwise ops, in place where they can be, keeping what the Triton backend
# keeps (x, g, u); its dropout mask is the C++ kernels' stream (``cpu_ops.dropout_keep_mask``), made again in the
# backward from the seed.


def cpu_keep_mask(seed: Seed, rows: int, cols: int, dropout_p: float) -> Tensor:
    """The bool ``[rows, cols]`` keep-mask the CPU backend draws with ``seed`` (True = kept)."""
    if traced():
        return torch.ops.fused_transformer.gated_cpu_keep_mask(seed, rows, cols, dropout_p)
    from .. import cpu_ops

    return cpu_ops.dropout_keep_mask(seed, (rows, cols), dropout_p)


@torch.library.custom_op("fused_transformer::gated_cpu_keep_mask", mutates_args=())
def _cpu_keep_mask_op(seed: Tensor, rows: int, cols: int, dropout_p: float) -> Tensor:
    """``cpu_keep_mask`` as torch.compile traces it (the seed's value is read on the host)."""
    from .. import cpu_ops

    return cpu_ops.dropout_keep_mask(seed, (rows, cols), dropout_p)


@_cpu_keep_mask_op.register_fake
def _(seed, rows, cols, dropout_p):
    return seed.new_empty((rows, cols), dtype=torch.bool)


def _cpu_products(rows: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], gate_bias: Optional[Tensor],
                  up_bias: Optional[Tensor]) -> Tuple[Tensor, ...]:
    if up_weight is None:
        return (F.linear(rows, gate_weight, gate_bias),)
    return F.linear(rows, gate_weight, gate_bias), F.linear(rows, up_weight, up_bias)


def _cpu_halves(saved: Tuple[Tensor, ...]) -> Tuple[Tensor, Tensor]:
    if len(saved) == 2:
        return saved[0], saved[1]
    d_ff = saved[0].shape[1] // 2
    return saved[0][:, :d_ff], saved[0][:, d_ff:]


def cpu_forward(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
                gate_bias: Optional[Tensor], up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str,
                dropout_p: float, seed: Optional[Seed]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``y`` and what the backward keeps: ``(g, u)`` rows ``[M, d_ff]``, or packed ``(gu,)``."""
    saved = _cpu_products(as_rows(x), gate_weight, up_weight, gate_bias, up_bias)
    gate, up = _cpu_halves(saved)
    hidden = _ACTIVATION_FUNCTIONS[activation](gate).mul_(up)
    if dropout_p > 0.0:
        hidden.mul_(1.0 / (1.0 - dropout_p)).masked_fill_(~cpu_keep_mask(seed, *hidden.shape, dropout_p), 0.0)
    return F.linear(hidden, down_weight, down_bias).view(*x.shape[:-1], down_weight.shape[0]), saved


def cpu_backward(dy: Tensor, x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
                 saved: Tuple[Tensor, ...], has_gate_bias: bool, has_up_bias: bool, has_down_bias: bool,
                 activation: str, dropout_p: float, seed: Optional[Seed]) -> Tuple[Optional[Tensor], ...]:
    """``dx, d gate_weight, d up_weight, d down_weight`` and the biases' (None where absent; packed, the up ones
    None); act(g) and the dropout mask made again from g and the seed. At most three ``[M, d_ff]`` temporaries live
    at once (each freed as soon as it is read for the last time), as few as torch's own backward holds."""
    rows, dy = as_rows(x), as_rows(dy)
    gate, up = _cpu_halves(saved)
    d_ff, packed = gate.shape[1], len(saved) == 1
    d_hidden = dy.mm(down_weight)
    act = _ACTIVATION_FUNCTIONS[activation](gate)
    if dropout_p > 0.0:
        drop = ~cpu_keep_mask(seed, *d_hidden.shape, dropout_p)
        d_hidden.mul_(1.0 / (1.0 - dropout_p)).masked_fill_(drop, 0.0)
    d_gu = saved[0].new_empty(saved[0].shape) if packed else None  # dg | du: dx and d gate_up one product each
    d_up = _product_into(d_hidden, act, d_gu[:, d_ff:] if packed else None)
    hidden = act.mul_(up)
    del act
    if dropout_p > 0.0:
        hidden.mul_(1.0 / (1.0 - dropout_p)).masked_fill_(drop, 0.0)
    d_down = dy.t().mm(hidden)
    del hidden
    d_gate = _activation_backward(activation, d_hidden.mul_(up), gate, d_gu[:, :d_ff] if packed else None)
    del d_hidden
    d_down_bias = dy.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_down_bias else None
    if packed:
        dx, d_gate_weight = d_gu.mm(gate_weight), d_gu.t().mm(rows)
        d_gate_bias = d_gu.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_gate_bias else None
        d_up_weight = d_up_bias = None
    else:
        dx = d_gate.mm(gate_weight).addmm_(d_up, up_weight)
        d_gate_weight, d_up_weight = d_gate.t().mm(rows), d_up.t().mm(rows)
        d_gate_bias = d_gate.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_gate_bias else None
        d_up_bias = d_up.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_up_bias else None
    return dx.view(x.shape), d_gate_weight, d_up_weight, d_down, d_gate_bias, d_up_bias, d_down_bias


def _product_into(a: Tensor, b: Tensor, out: Optional[Tensor]) -> Tensor:
    """``a * b``, written into ``out`` (a view of the packed gradient) when given."""
    if out is None:
        return a * b
    if traced():
        return out.copy_(a * b)  # Dynamo refuses an out= view with strides
    return torch.mul(a, b, out=out)


def _activation_backward(activation: str, grad: Tensor, gate: Tensor, out: Optional[Tensor]) -> Tensor:
    """``grad * act'(gate)`` by ATen's own backward of the activation, written into ``out`` when given."""
    if activation == "silu":
        op, options = torch.ops.aten.silu_backward, {}
    else:
        op, options = torch.ops.aten.gelu_backward, {"approximate": "tanh" if activation == "gelu_tanh" else "none"}
    if out is None:
        return op(grad, gate, **options)
    if traced():
        return out.copy_(op(grad, gate, **options))
    return op.grad_input(grad, gate, **options, grad_input=out)


LAUNCHERS = Launchers(
    triton="fused_transformer.kernels.gated_feed_forward:gated_feed_forward_fwd,gated_feed_forward_bwd",
    cpu=f"{__name__}:cpu_forward,cpu_backward")
_BACKENDS = frozenset(LAUNCHERS.where)


class GatedFeedForwardFunction(torch.autograd.Function):
    """Autograd over a backend's launchers on ``x [..., d_model]``: keeps x, the gate and up products and the seed."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                spec: GatedFeedForwardSpec, name: str):
        seed = draw_seed(spec.dropout_p, x.device)
        y, saved = LAUNCHERS(name)[0](x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                      spec.activation, spec.dropout_p, seed)
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, saved_seed(ctx, seed), *saved)
        ctx.spec, ctx.name = spec, name
        ctx.biases = (gate_bias is not None, up_bias is not None, down_bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_weight, up_weight, down_weight, seed, *saved = ctx.saved_tensors
        spec = ctx.spec
        grads = LAUNCHERS(ctx.name)[1](dy, x, gate_weight, up_weight, down_weight, tuple(saved), *ctx.biases,
                                       spec.activation, spec.dropout_p, backward_seed(ctx, seed))
        dx, d_gate, d_up, d_down, d_gate_bias, d_up_bias, d_down_bias = grads
        has_gate_bias, has_up_bias, has_down_bias = ctx.biases
        return (dx, d_gate, d_up if up_weight is not None else None, d_down,
                d_gate_bias if has_gate_bias else None, d_up_bias if has_up_bias else None,
                d_down_bias if has_down_bias else None, None, None)


_autograd_apply = super(torch.autograd.Function, GatedFeedForwardFunction).apply  # autograd's C++ apply: no frame


def run(name: str, x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
        gate_bias: Optional[Tensor], up_bias: Optional[Tensor], down_bias: Optional[Tensor],
        spec: GatedFeedForwardSpec) -> Tensor:
    """The op of checked arguments on backend ``name`` (``"torch"``: ``torch_path``; ``"reference"``:
    ``reference``)."""
    if name == "torch" or name == "reference":
        path = torch_path if name == "torch" else reference
        return path(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                    activation=spec.activation, dropout_p=spec.dropout_p)
    if route.needs_grad(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        apply = GatedFeedForwardFunction.apply if traced_apply() else _autograd_apply
        return apply(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, spec, name)
    return LAUNCHERS(name)[0](x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, spec.activation,
                              spec.dropout_p, draw_seed(spec.dropout_p, x.device))[0]


# --------------------------------------------------------------------------------------------- the op


def gated_feed_forward(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
                       gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
                       down_bias: Optional[Tensor] = None, *, activation: str = "silu",
                       dropout_p: float = 0.0) -> Tensor:
    """The gated feed-forward ``down(dropout(act(x Wg^T + bg) * (x Wu^T + bu))) + bd`` of Llama (SiLU), Gemma
    (``"gelu_tanh"``) and Phi-3 (packed), keeping for the backward only x and the gate and up products.

    Args:
        x: ``[..., d_model]``.
        gate_weight, up_weight: ``[d_ff, d_model]`` (``nn.Linear`` layout); gate_bias, up_bias ``[d_ff]`` or None.
            Packed (Phi-3's ``gate_up_proj``): ``up_weight=None``, gate_weight ``[2 * d_ff, d_model]``, gate rows then
            up rows (``chunk(2, dim=-1)``'s order), gate_bias ``[2 * d_ff]`` packed alike and up_bias None.
        down_weight: ``[d_out, d_ff]``; down_bias ``[d_out]`` or None.
        activation: of the gate: ``"silu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``.
        dropout_p: dropout on the gated product ``act(g) * u`` (always applied when > 0); its mask is drawn from
            torch's generator (``torch.manual_seed`` reproduces it) and replayed by the backward.

    Returns:
        ``[..., d_out]`` in x's dtype. Under ``torch.autocast`` it runs in the autocast dtype (matrix products).
    """
    cast = autocast_dtype(x, matmul=True)
    if cast is not None:
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = autocast_all(
            cast, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    spec = check(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, dropout_p)
    name = decide(x, (gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias), spec).backend
    if cast is None:
        return run(name, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, spec)
    with torch.autocast(x.device.type, enabled=False):
        return run(name, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, spec)


# ------------------------------------------------------------------------------------------------ cases

BENCH_DROPOUT = 0.0  # Llama's MLP has none


def flops(tokens: int, d_model: int, d_ff: int, d_out: int, *, backward: bool = False) -> float:
    """The three products, ``2 * tokens * d_ff * (2 d_model + d_out)`` forward; the backward does twice that."""
    return 2.0 * tokens * d_ff * (2 * d_model + d_out) * (3.0 if backward else 1.0)


def example(label: str, lead: Sequence[int], d_model: int, d_ff: int, d_out: Optional[int] = None, *,
            activation: str = "silu", dropout_p: float = 0.0, packed: bool = False, bias: bool = False,
            quick: bool = False) -> Example:
    """A call on ``x [*lead, d_model]`` (``packed``: Phi-3's one gate-and-up weight)."""
    d_out = d_model if d_out is None else d_out

    def tensors(draw):
        found = {"x": draw(*lead, d_model),
                 "gate_weight": draw((2 if packed else 1) * d_ff, d_model, scale=d_model ** -0.5),
                 "down_weight": draw(d_out, d_ff, scale=d_ff ** -0.5)}
        if not packed:
            found["up_weight"] = draw(d_ff, d_model, scale=d_model ** -0.5)
        if bias:
            found["gate_bias"] = draw((2 if packed else 1) * d_ff, scale=0.1)
            if not packed:
                found["up_bias"] = draw(d_ff, scale=0.1)
            found["down_bias"] = draw(d_out, scale=0.1)
        if packed:
            found["up_weight"] = None
        return found

    return Example(label, tensors, {"activation": activation, "dropout_p": dropout_p}, quick,
                   {"batch": lead[0], "seq_len": lead[1] if len(lead) > 1 else 1, "d_model": d_model, "d_ff": d_ff,
                    "d_out": d_out}, size=math.prod(lead))


# No dropout: check compares with an oracle that cannot replay a backend's mask (the tests replay it).
CHECK = (
    example("x 2x19x64 64-96-64 silu", (2, 19), 64, 96, quick=True),
    example("x 2x19x64 64-96-64 silu packed bias", (2, 19), 64, 96, packed=True, bias=True, quick=True),
    example("x 2x37x64 64-176-64 gelu bias", (2, 37), 64, 176, activation="gelu", bias=True),
    example("x 77x48 48-200-40 gelu_tanh", (77,), 48, 200, 40, activation="gelu_tanh"),
    example("x 2x37x64 64-176-64 silu packed", (2, 37), 64, 176, packed=True),
)


def _bench(gpu: bool, lengths: Sequence[int]) -> Sequence[Example]:
    shapes = ((4096, 11008, False), (3072, 8192, True)) if gpu else ((512, 1408, False), (512, 1408, True))
    return [example(f"d{d_model} ff{d_ff}{' packed' if packed else ''}", (2, length), d_model, d_ff, packed=packed)
            for d_model, d_ff, packed in shapes for length in lengths]


def _work(example: Example, itemsize: int, backward: bool) -> Work:
    shape = example.shape
    return Work(flops=flops(shape["batch"] * shape["seq_len"], shape["d_model"], shape["d_ff"], shape["d_out"],
                            backward=backward))


def _describe(gpu: bool) -> str:
    shapes = "4096/11008 (Llama 2 7B), 3072/8192 packed (Phi-3 mini)" if gpu else "512/1408, and packed"
    return f"batch 2, d_model/d_ff {shapes}, SiLU, no dropout"


def _tune(device_type: str, dtype: torch.dtype, quick: bool) -> Sequence[TuneSeries]:
    """Rows of d_model 512 / d_ff 1408 (4096 / 11008 on a GPU), with dropout and without; sizes counted in rows."""
    d_model, d_ff = (4096, 11008) if device_type == "cuda" else (512, 1408)
    rows = (64,) if quick else ((1024, 8192) if device_type == "cuda" else (64, 1024, 4096))
    return tuple(TuneSeries("yes" if p else "no", tuple(
        example(f"{n}x{d_model}", (n,), d_model, d_ff, dropout_p=p) for n in rows)) for p in (0.1, 0.0))


class ThinGatedFeedForward(torch.autograd.Function):
    """The least the op can cost on the host (the overhead suite's thin): torch's products, which no implementation
    skips, with the gating pass's outputs allocated and not computed; no check, route or seed."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight):
        rows = as_rows(x)
        gate, up = F.linear(rows, gate_weight), F.linear(rows, up_weight)
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        return F.linear(torch.empty_like(gate), down_weight).view(*x.shape[:-1], down_weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
        dy, rows = as_rows(dy), as_rows(x)
        d_hidden = dy.mm(down_weight)
        d_gate, d_up, hidden = torch.empty_like(d_hidden), torch.empty_like(d_hidden), torch.empty_like(d_hidden)
        dx = d_gate.mm(gate_weight).addmm_(d_up, up_weight)
        return (dx.view(x.shape), d_gate.t().mm(rows), d_up.t().mm(rows), dy.t().mm(hidden))


def _thin(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor) -> Tensor:
    return ThinGatedFeedForward.apply(x, gate_weight, up_weight, down_weight)


MEASURED = """
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
gated_feed_forward  forward   cpu-avx512-t2  float32           *         *            yes      functional  *               1.17-1.51  -          CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  0..2048         0.98-0.99  -          CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  forward   cpu-avx512-t2  float32           *         *            no       functional  2048..          1.11       -          CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  forward   cpu-avx512-t2  bfloat16          *         *            yes      functional  *               1.41-2.45  -          CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  *               0.92-0.98  -          CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  float32           *         *            yes      functional  0..256          0.97       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  float32           *         *            yes      functional  256..2048       1.07       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  float32           *         *            yes      functional  2048..          0.80       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  float32           *         *            no       functional  0..256          0.98       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  float32           *         *            no       functional  256..           1.04-1.23  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  bfloat16          *         *            yes      functional  0..256          0.96       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  bfloat16          *         *            yes      functional  256..           1.07-1.75  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  training  cpu-avx512-t2  bfloat16          *         *            no       functional  *               0.93-0.98  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    float32           *         *            yes      functional  *               1.23-1.71  -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    float32           *         *            no       functional  0..256          1.01       -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    float32           *         *            no       functional  256..           0.84-0.97  -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            yes      functional  *               1.22-1.74  -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  0..256          1.05       -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  256..2048       0.97       -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  2048..          1.02       -          CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    float32           *         *            yes      functional  0..2048         1.01-1.04  yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    float32           *         *            yes      functional  2048..          0.99       yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    float32           *         *            no       functional  0..256          0.97       yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    float32           *         *            no       functional  256..           1.05-1.07  yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    bfloat16          *         *            yes      functional  0..2048         0.94-0.96  yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    bfloat16          *         *            yes      functional  2048..          1.08       yes        CPU tune f0f0518 (avx2) 2026-12-07
gated_feed_forward  training  cpu-avx2-t2    bfloat16          *         *            no       functional  *               0.94-0.98  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""


OP = register(Op(
    name="gated_feed_forward", function=gated_feed_forward, torch_path=torch_path, reference=reference,
    size_of="rows of x", outputs=("out",), check=CHECK, bench=_bench,
    lengths={"cpu": ((128, 512), (128,)), "cuda": ((512, 2048, 4096), (2048,))},
    work=_work, throughput=("tflops", "TFLOP/s"), describe=_describe,
    overhead=(example("B2 L8 d32 ff64", (2, 8), 32, 64, dropout_p=0.1),),  # dropout: ours on the CPU too
    overhead_target={"fwd": 2.5, "fwd+bwd": 2.5},
    call_of=lambda tensors, options, device, grad: _call(
        tensors["x"], GatedFeedForwardSpec(options["activation"], options["dropout_p"], tensors["up_weight"] is None),
        grad, device),
    route_examples=(example("dropout", (1024,), 512, 1408, dropout_p=0.1),),
    launchers=LAUNCHERS, overhead_thin=_thin, tune=_tune,
    measured=MEASURED,
))
