"""A language model's head and its loss in one op: ``cross_entropy(softcap(hidden @ weight.T + bias), target)``, in
chunks of rows so that the ``[tokens, vocab]`` logits never exist whole (the memory a causal LM's training step spends
most of: 32k-256k floats a token).

Each chunk's logits are made by torch's GEMM (cuBLAS on a GPU), turned in place into the chunk's loss and, when a
gradient is needed, into the logits' gradient, which two more GEMMs turn into the chunk's ``d hidden`` and its share
of ``d weight`` at once: the forward leaves the gradients (the size of ``hidden`` and of ``weight``), never the
logits, and the backward only scales them by the loss's gradient. With ``reduction="none"`` the rows' gradients are
not known in the forward: the backward computes each chunk's logits again.

The backends' launchers (``LAUNCHERS``) take ``hidden [N, H]`` and ``target [N]``::

    forward(hidden, weight, bias, target, spec, grads) -> (loss, d_hidden, d_weight, d_bias)
    backward(hidden, weight, bias, target, spec, d_loss [N]) -> (d_hidden, d_weight, d_bias)

the gradients None where not asked (``grads``: hidden, weight, bias). The loss is float32 (float64 for float64
inputs); the logits are taken in float32 as Hugging Face's causal LM loss takes them. Differences from torch: none in
the result (``F.cross_entropy`` of ``F.linear``'s logits in float32; a mean over no target is NaN, as there).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import route
from ..autograd import traced_apply
from ..contract import (
    autocast_all, autocast_dtype, check_same, check_tensor, describe, reads_values, stats_dtype,
)
from . import Example, Launchers, Op, TuneSeries, Work, register

Tensor = torch.Tensor
REDUCTIONS = ("mean", "sum", "none")


class LinearCrossEntropySpec(NamedTuple):
    """A call's options, checked."""

    ignore_index: int
    label_smoothing: float
    reduction: str  # one of REDUCTIONS
    softcap: Optional[float]  # logits become softcap * tanh(logits / softcap) (Gemma 2)
    chunk_rows: Optional[int]  # rows a chunk of logits holds; None: chunk_rows_of's choice


# ----------------------------------------------------------------------------------------------- contract


def check(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: object,
          label_smoothing: object, reduction: object, softcap: object, chunk_rows: object) -> LinearCrossEntropySpec:
    """The checked spec of a call: ``hidden [..., H]``, ``weight [V, H]`` (``nn.Linear``'s layout), ``target`` of
    hidden's leading shape, integer class indices."""
    check_tensor("hidden", hidden)
    if hidden.dim() == 0:
        raise ValueError("hidden must have at least 1 dim (the features), got a scalar")
    check_tensor("weight", weight, rank=2)
    check_same("weight", weight, "hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, hidden={hidden.shape[-1]}], got {describe(weight)}")
    if bias is not None:
        check_tensor("bias", bias)
        check_same("bias", bias, "hidden", hidden)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [vocab={weight.shape[0]}], got {describe(bias)}")
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32) or tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise TypeError(f"target must be int64 (or int32) class indices of hidden's leading shape "
                        f"{list(hidden.shape[:-1])}, got {describe(target)}")
    check_same("target", target, "hidden", hidden, dtype=False)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index={ignore_index!r} must be an int")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing={label_smoothing!r} must be a number in [0, 1]")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {REDUCTIONS}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not softcap > 0 or not math.isfinite(softcap)):
        raise ValueError(f"softcap={softcap!r} must be None or a finite number > 0")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows={chunk_rows!r} must be None or an int >= 1")
    if reads_values(target) and target.numel():
        outside = (target != ignore_index) & ((target < 0) | (target >= weight.shape[0]))
        if bool(outside.any()):
            raise ValueError(f"target holds {int(target[outside][0])}, outside [0, vocab={weight.shape[0]}) and not "
                             f"ignore_index={ignore_index}")
    return LinearCrossEntropySpec(int(ignore_index), float(label_smoothing), reduction,
                                  None if softcap is None else float(softcap),
                                  None if chunk_rows is None else int(chunk_rows))


# ---------------------------------------------------------------------------------------------- reference


def _capped(logits: Tensor, softcap: Optional[float]) -> Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def reference(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
              ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
              softcap: Optional[float] = None, chunk_rows: Optional[int] = None) -> Tensor:
    """The float64 oracle and the reference backend: the whole logits, in float32 (float64 for float64), then
    ``F.cross_entropy``."""
    logits = _capped(F.linear(hidden, weight, bias).to(stats_dtype(hidden.dtype)), softcap)
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1).long(), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction).view(
                               target.shape if reduction == "none" else ())


def torch_path(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
               ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
               softcap: Optional[float] = None, chunk_rows: Optional[int] = None) -> Tensor:
    """The call as a causal LM computes it in torch: the head's whole logits, upcast to float32, then the loss."""
    logits = _capped(F.linear(hidden, weight, bias).float() if hidden.dtype != torch.float64 else
                     F.linear(hidden, weight, bias), softcap)
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1).long(), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss


# -------------------------------------------------------------------------------------------- route facts


def _call(hidden: Tensor, weight: Tensor, grad: bool, device: Optional[torch.device] = None) -> route.Call:
    return route.Call("linear_cross_entropy", route.device_tag(hidden.device if device is None else device),
                      hidden.dtype, size=route.size(hidden.numel() // max(hidden.shape[-1], 1)), needs_grad=grad,
                      deterministic=torch.are_deterministic_algorithms_enabled(), backends=_BACKENDS)


# ------------------------------------------------------------------------------------------- the chunks


# On the CPU a GEMM of few rows runs well under its peak: a chunk's logits there may hold up to this many floats
# (64 MiB in float32), measured 1.4x faster than the GPU rule's 64 rows at 2048 x 512 -> 32000.
CPU_CHUNK_FLOATS = 1 << 24


def chunk_rows_of(rows: int, hidden: int, vocab: int, device_type: str = "cuda") -> int:
    """Rows a chunk holds by default: a power of two whose logits hold about as many floats as ``hidden`` (at least
    one row, at most every row), as Liger-Kernel chooses them; on the CPU up to ``CPU_CHUNK_FLOATS`` floats."""
    per_chunk = max(1, math.ceil(rows / max(1, math.ceil(vocab / max(hidden, 1)))))
    power = 1 << (per_chunk - 1).bit_length()  # up to a power of two
    if device_type == "cpu":
        power = max(power, 1 << max(0, (CPU_CHUNK_FLOATS // max(vocab, 1)).bit_length() - 1))  # down to one
    return min(max(rows, 1), power)


def _chunk(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, spec: LinearCrossEntropySpec,
           row_scale: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """One chunk's per-row losses (0 for ignored rows) and, with ``row_scale`` (a number per row, or one for all), the
    logits' gradient scaled by it, in x's dtype."""
    logits = F.linear(x, weight, bias).to(stats_dtype(x.dtype))
    capped = None
    if spec.softcap is not None:
        capped = torch.tanh(logits / spec.softcap)
        logits = capped * spec.softcap
    vocab = logits.shape[1]
    valid = target != spec.ignore_index
    index = torch.where(valid, target, torch.zeros_like(target)).long()[:, None]
    lse = torch.logsumexp(logits, dim=1)
    loss = lse - logits.gather(1, index)[:, 0]
    eps = spec.label_smoothing
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - logits.mean(dim=1))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if row_scale is None:
        return loss, None
    grad = logits.sub_(lse[:, None]).exp_()  # the probabilities, in the logits' memory
    if eps:
        grad.sub_(eps / vocab)
    grad.scatter_add_(1, index, torch.full_like(index, -(1.0 - eps), dtype=grad.dtype))
    grad.mul_((valid.to(grad.dtype) * row_scale)[:, None])
    if capped is not None:
        grad.mul_(1.0 - capped.square_())
    return loss, grad.to(x.dtype)


def _chunks(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, spec: LinearCrossEntropySpec,
            grads: Tuple[bool, bool, bool], scale: Optional[Tensor], loss: Optional[Tensor]):
    """Over the chunks: the per-row losses into ``loss`` (when given) and, with ``scale`` (per row ``[N]`` or one
    number), the gradients asked for in ``grads``."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    step = spec.chunk_rows or chunk_rows_of(rows, hidden.shape[1], vocab, hidden.device.type)
    d_hidden = torch.empty_like(hidden) if grads[0] else None
    d_weight = torch.zeros(weight.shape, dtype=stats_dtype(weight.dtype), device=weight.device) if grads[1] else None
    d_bias = torch.zeros(vocab, dtype=stats_dtype(weight.dtype), device=weight.device) if grads[2] else None
    for start in range(0, rows, step):
        end = min(start + step, rows)
        x, t = hidden[start:end], target[start:end]
        row_scale = None if scale is None else (scale[start:end] if scale.dim() else scale)
        chunk_loss, grad = _chunk(x, weight, bias, t, spec, row_scale)
        if loss is not None:
            loss[start:end] = chunk_loss
        if grad is None:
            continue
        if d_hidden is not None:
            torch.mm(grad, weight, out=d_hidden[start:end])
        if d_weight is not None:
            _add_product(d_weight, grad.t(), x)
        if d_bias is not None:
            d_bias.add_(grad.sum(0, dtype=d_bias.dtype))
    return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(weight.dtype))


_MM_TO_FLOAT32 = {}  # device type -> whether torch.mm takes out_dtype=float32 for 16-bit inputs there


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 and 16-bit ``a``, ``b``: the product summed in float32 and never rounded
    to 16 bits (a chunk's share of ``d weight`` may be larger than the whole, which one rounding of the whole, as in
    torch's unchunked product, would not see). On CUDA ``mm``'s ``out_dtype``; on the CPU, whose 16-bit GEMMs are no
    faster, the operands in float32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    device = a.device.type
    if device != "cpu" and _MM_TO_FLOAT32.get(device, True):
        try:
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
            _MM_TO_FLOAT32[device] = True
            return
        except (NotImplementedError, RuntimeError, TypeError):
            _MM_TO_FLOAT32[device] = False  # the 16-bit product then, summed in float32 (Liger-Kernel's way)
    if device == "cpu":
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:
        acc.add_(a.mm(b))


def _reduced(loss: Tensor, target: Tensor, spec: LinearCrossEntropySpec) -> Tuple[Tensor, Optional[Tensor]]:
    """``loss`` reduced as asked, and the factor each row's loss enters it with (None for "none")."""
    if spec.reduction == "none":
        return loss, None
    if spec.reduction == "sum":
        return loss.sum(), torch.ones((), dtype=loss.dtype, device=loss.device)
    count = (target != spec.ignore_index).sum().to(loss.dtype)
    return loss.sum() / count, 1.0 / count


def chunked_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                    spec: LinearCrossEntropySpec, grads: Tuple[bool, bool, bool]) -> Tuple[Optional[Tensor], ...]:
    """The loss and, where the reduction lets them be known now, the gradients asked for (``grads``), chunk by
    chunk (the launchers of every backend: the GEMMs are torch's, the chunks' epilogue torch's ops in place)."""
    loss = torch.empty(hidden.shape[0], dtype=stats_dtype(hidden.dtype), device=hidden.device)
    if spec.reduction == "none" or not any(grads):
        _chunks(hidden, weight, bias, target, spec, (False, False, False), None, loss)
        return (_reduced(loss, target, spec)[0], None, None, None)
    scale = 1.0 / (target != spec.ignore_index).sum().to(loss.dtype) if spec.reduction == "mean" else \
        torch.ones((), dtype=loss.dtype, device=loss.device)
    d_hidden, d_weight, d_bias = _chunks(hidden, weight, bias, target, spec, grads, scale, loss)
    return (_reduced(loss, target, spec)[0], d_hidden, d_weight, d_bias)


def chunked_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                     spec: LinearCrossEntropySpec, d_loss: Tensor,
                     grads: Tuple[bool, bool, bool]) -> Tuple[Optional[Tensor], ...]:
    """The gradients of a ``reduction="none"`` call: each chunk's logits again, each row's by its loss's gradient."""
    return _chunks(hidden, weight, bias, target, spec, grads, d_loss.to(stats_dtype(hidden.dtype)), None)


LAUNCHERS = Launchers(triton=f"{__name__}:chunked_forward,chunked_backward",
                      cpu=f"{__name__}:chunked_forward,chunked_backward")
_BACKENDS = frozenset(LAUNCHERS.where)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd over a backend's launchers on ``hidden [N, H]``: the gradients made in the forward are scaled in the
    backward (``reduction="none"``: computed there)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, spec: LinearCrossEntropySpec, name: str):
        grads = tuple(bool(g) for g in ctx.needs_input_grad[:3])
        loss, d_hidden, d_weight, d_bias = LAUNCHERS(name)[0](hidden, weight, bias, target, spec, grads)
        ctx.spec, ctx.name, ctx.grads = spec, name, grads
        if spec.reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target)
        else:
            ctx.save_for_backward(d_hidden, d_weight, d_bias)
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        if ctx.spec.reduction == "none":
            hidden, weight, bias, target = ctx.saved_tensors
            found = LAUNCHERS(ctx.name)[1](hidden, weight, bias, target, ctx.spec, d_loss, ctx.grads)
        else:
            found = tuple(None if g is None else g * d_loss.to(g.dtype) for g in ctx.saved_tensors)
        return (*found, None, None, None)


def run(name: str, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
        spec: LinearCrossEntropySpec) -> Tensor:
    """The loss of checked arguments on backend ``name`` (``"torch"``: torch's path; ``"reference"``: the
    reference), on rows."""
    options = dict(ignore_index=spec.ignore_index, label_smoothing=spec.label_smoothing, reduction=spec.reduction,
                   softcap=spec.softcap)
    if name in ("torch", "reference"):
        return (torch_path if name == "torch" else reference)(hidden, weight, target, bias, **options)
    shape = target.shape
    rows, targets = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if route.needs_grad(hidden, weight, bias):
        apply = LinearCrossEntropyFunction.apply if traced_apply() else _autograd_apply
        loss = apply(rows, weight, bias, targets, spec, name)
    else:
        loss = LAUNCHERS(name)[0](rows, weight, bias, targets, spec, (False, False, False))[0]
    return loss.view(shape) if spec.reduction == "none" else loss


_autograd_apply = super(torch.autograd.Function, LinearCrossEntropyFunction).apply


# --------------------------------------------------------------------------------------------- the op


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         softcap: Optional[float] = None, chunk_rows: Optional[int] = None) -> Tensor:
    """``F.cross_entropy(softcap(F.linear(hidden, weight, bias)), target)``, the logits never whole: a causal LM's head
    and loss, in chunks of rows.

    Args:
        hidden: ``[..., H]``, the last hidden states (already shifted as the labels are, for a causal LM).
        weight: ``[V, H]``, the head's (``lm_head.weight``); bias ``[V]`` or None.
        target: int64 (or int32) class indices of hidden's leading shape; ``ignore_index`` rows count for nothing.
            Its values are checked where ``fused_transformer.contract.reads_values`` allows (on the host; on a GPU
            only when asked: a read waits for the GPU), as torch's own check on a GPU is a device assert.
        label_smoothing, reduction: as in ``F.cross_entropy`` (``"mean"`` over the targets not ignored).
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the loss (Gemma 2's final softcap).
        chunk_rows: rows of logits made at a time (None: about as many floats as ``hidden`` holds; on the CPU
            up to 2**24 floats).

    Returns:
        The loss, float32 (float64 for float64 inputs): a scalar, or target's shape with ``reduction="none"``. The
        gradients of hidden, weight and bias are made in the forward (``"none"``: in the backward), so the logits
        are never kept. Under ``torch.autocast`` the head's product runs in the autocast dtype.
    """
    cast = autocast_dtype(hidden, matmul=True)
    if cast is not None:
        hidden, weight, bias = autocast_all(cast, hidden, weight, bias)
    spec = check(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, chunk_rows)
    name = route.choose(_call(hidden, weight, route.needs_grad(hidden, weight, bias)), hidden.device).backend
    if cast is None:
        return run(name, hidden, weight, bias, target, spec)
    with torch.autocast(hidden.device.type, enabled=False):
        return run(name, hidden, weight, bias, target, spec)


# ------------------------------------------------------------------------------------------------ cases


def example(label: str, rows: Sequence[int], hidden: int, vocab: int, *, bias: bool = False, ignored: float = 0.1,
            quick: bool = False, **options: object) -> Example:
    """A call on ``hidden [*rows, hidden]`` over a vocabulary of ``vocab``, about ``ignored`` of the targets
    ignored (-100)."""
    def tensors(draw):
        x = draw(*rows, hidden)
        target = (torch.special.ndtr(draw(*rows)) * vocab).long().clamp_(0, vocab - 1)
        target[torch.special.ndtr(draw(*rows)) < ignored] = -100
        found = {"hidden": x, "weight": draw(vocab, hidden, scale=hidden ** -0.5), "target": target}
        if bias:
            found["bias"] = draw(vocab, scale=0.1)
        return found

    batch, length = (rows[0], rows[1]) if len(rows) > 1 else (1, rows[0])
    return Example(label, tensors, options, quick, {"batch": batch, "seq_len": length, "d_model": hidden,
                                                    "vocab": vocab}, size=batch * length)


CHECK = (
    example("N2x37 H64 V300", (2, 37), 64, 300, quick=True),
    example("N2x37 H64 V300 bias smoothing 0.1 chunk 16", (2, 37), 64, 300, bias=True, quick=True,
            label_smoothing=0.1, chunk_rows=16),
    example("N77 H96 V1000 softcap 30 sum", (77,), 96, 1000, softcap=30.0, reduction="sum"),
    example("N2x19 H64 V257 none", (2, 19), 64, 257, reduction="none"),
)


def _bench(gpu: bool, lengths: Sequence[int]) -> Sequence[Example]:
    shapes = ((4096, 32000), (4096, 128256)) if gpu else ((512, 32000),)
    return [example(f"H{h} V{v}", (2, length), h, v) for h, v in shapes for length in lengths]


def _work(example: Example, itemsize: int, backward: bool) -> Work:
    shape = example.shape
    return Work(flops=2.0 * shape["batch"] * shape["seq_len"] * shape["d_model"] * shape["vocab"]
                * (3 if backward else 1))


# On the CPU, in float32 training ours measured 1.03-1.06x torch's path alone, and in a Llama training step, where
# torch's [tokens, vocab] logits cost their pages, 1.03-1.06x transformers' own at 0.52-0.55x the memory
# (benchmarks/llama_memory.py); where a row below says torch's path is faster (forward, small bfloat16 batches) it
# runs torch's, whose logits then are whole.
MEASURED = """
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
linear_cross_entropy  forward   cpu-avx512-t2  float32           *         *            no       functional  *               0.78-0.80  -          CPU tune f0f0518 (AVX-512) 2026-12-07
linear_cross_entropy  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  0..724          0.88       -          CPU tune f0f0518 (AVX-512) 2026-12-07
linear_cross_entropy  forward   cpu-avx512-t2  bfloat16          *         *            no       functional  724..           1.33       -          CPU tune f0f0518 (AVX-512) 2026-12-07
linear_cross_entropy  training  cpu-avx512-t2  float32           *         *            no       functional  *               0.91-0.93  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
linear_cross_entropy  training  cpu-avx512-t2  bfloat16          *         *            no       functional  *               0.76-0.99  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
linear_cross_entropy  forward   cpu-avx2-t2    float32           *         *            no       functional  0..724          1.06       -          CPU tune f0f0518 (avx2) 2026-12-07
linear_cross_entropy  forward   cpu-avx2-t2    float32           *         *            no       functional  724..           0.84       -          CPU tune f0f0518 (avx2) 2026-12-07
linear_cross_entropy  forward   cpu-avx2-t2    bfloat16          *         *            no       functional  *               0.93-0.94  -          CPU tune f0f0518 (avx2) 2026-12-07
linear_cross_entropy  training  cpu-avx2-t2    float32           *         *            no       functional  0..724          0.81       yes        CPU tune f0f0518 (avx2) 2026-12-07
linear_cross_entropy  training  cpu-avx2-t2    float32           *         *            no       functional  724..           1.02       yes        CPU tune f0f0518 (avx2) 2026-12-07
linear_cross_entropy  training  cpu-avx2-t2    bfloat16          *         *            no       functional  *               0.67-0.92  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""


def _tune(device_type: str, dtype: torch.dtype, quick: bool) -> Sequence[TuneSeries]:
    """Hidden 512, vocab 32000 (4096 / 128256 on a GPU); sizes counted in rows."""
    hidden, vocab = (4096, 128256) if device_type == "cuda" else (512, 32000)
    rows = (64,) if quick else ((1024, 8192) if device_type == "cuda" else (256, 2048))
    return (TuneSeries("no", tuple(example(f"{n}x{hidden}", (n,), hidden, vocab) for n in rows)),)


OP = register(Op(
    name="linear_cross_entropy", function=linear_cross_entropy, torch_path=torch_path, reference=reference,
    size_of="rows of hidden", outputs=("loss",), check=CHECK, bench=_bench,
    lengths={"cpu": ((512, 1024), (512,)), "cuda": ((1024, 4096, 8192), (4096,))}, work=_work,
    throughput=("tflops", "TFLOP/s"),
    describe=lambda gpu: f"batch 2, hidden/vocab {'4096/32000, 4096/128256' if gpu else '512/32000'}, 10% ignored",
    constants=("target",), call_of=lambda tensors, options, device, grad: _call(
        tensors["hidden"], tensors["weight"], grad, device),
    route_examples=(example("", (2, 1024), 512, 32000),), launchers=LAUNCHERS, tune=_tune, measured=MEASURED,
))
