"""``python -m fused_transformer check``: every op and module, on every backend usable here, against float64.

A check runs one op (its output and the gradient of every input) or one module (its output, the attention
weights where it returns them, the gradients of its inputs and of every parameter) in one precision on one
backend, and compares each result with the same computation in float64 on the reference backend. The float64
run starts from the very inputs, parameters and output gradients the checked run got (rounded to its
precision), so the comparison measures the computation, not the rounding of its inputs. Everything is drawn at
random from fixed seeds (never zeros; module biases and LayerNorm weights are perturbed off their 0 / 1
initialisation); modules run in eval mode with dropout 0.

The grid (``--quick`` takes a small-shape subset that still runs every op and module on every backend, in
float32 and bfloat16; the full grid adds float16): ``attention`` forward and dq, dk, dv with no mask, causal
top-left, causal bottom-right + key padding, a bool and a float ``attn_mask``, key padding with holes, Lq != Lk
both ways, grouped-query k/v, head dims 64 and 48; ``attention_weights`` with its LSE; ``layer_norm`` with and
without residual, prenorm, and every gradient; ``feed_forward`` with relu, gelu and gelu_tanh and every gradient;
``MultiheadAttention`` (self with padding and ``need_weights``, cross with a bool mask and per-head weights),
``TransformerEncoderLayer`` (post-LN and pre-LN, key padding), ``TransformerDecoderLayer`` (causal + memory
padding) and ``Transformer``. Modules use GELU: through relu, a last-bit difference upstream flips the mask of a
pre-activation near 0 and changes gradients by O(1) in PyTorch's own low-precision run as much as in a kernel's.

The rule, the project's (``tests/numerics.py`` applies the same one through this module): with ``err`` the
largest absolute difference from float64, and ``torch err`` the same for PyTorch's own computation in that
precision (the reference backend: what ``torch`` does with these dtypes), a result passes when

    err <= 2 * torch err + floor[dtype]          floor: float32 2e-5, float16 2e-3, bfloat16 1.6e-2

and it is finite wherever the float64 result is. A check passes when every one of its results passes. Gradients
follow the same rule: PyTorch's own error grows with a gradient's magnitude, so the limit scales with it, and the
floor only matters for results of magnitude about 1 or below.

Table columns: ``max err`` and ``torch err`` are those of the check's worst result, named in the last column;
``ratio`` is ``err / (torch err + floor / 2)``, so 1.0 means "as accurate as PyTorch in this precision" (below 1:
more accurate) and a check passes exactly when its ratio is at most 2.0. The reference backend's own rows
compare PyTorch with itself (ratio below 1 by construction): they check the dispatch and the module wiring.

Under the Triton interpreter (no GPU) the interpreter's float32 -> bfloat16 casts are made to round to nearest,
as a GPU does (the interpreter truncates), so interpreted kernels are held to the GPU's rounding error; and
buffers allocated with ``torch.empty`` start as NaN during the checked runs, so an element a kernel forgets to
write fails the check instead of passing by luck.

Test-only hook: ``CORRUPT`` (a set of ``(op, backend)``) and the environment variable
``FUSED_TRANSFORMER_CHECK_CORRUPT=op:backend[,op:backend...]`` make every check of that op on that backend add
``CORRUPT_SCALE * max|out|`` to one element of its real output before the comparison, as a broken kernel
would; the header says so. Nothing else uses them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import math
import os
import platform
import shutil
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, TextIO, Tuple

import torch
from torch import Tensor, nn

import fused_transformer as ft
from fused_transformer import backend

FACTOR = 2.0
# Absolute floor added to the allowed error, per dtype: round-off of a handful of ulps near 1.
ATOL_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUICK_DTYPES = ("float32", "bfloat16")
BACKENDS = ("triton", "cpu", "reference")
OPS = ("attention", "attention_weights", "layer_norm", "feed_forward")
MODULES = ("MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "Transformer")
CHECKS = OPS + MODULES

# Test-only (see the module docstring): (op, backend) pairs whose output is perturbed before the comparison.
CORRUPT: Set[Tuple[str, str]] = set()
CORRUPT_ENV = "FUSED_TRANSFORMER_CHECK_CORRUPT"
# Large enough to break the rule in every dtype, bfloat16 modules included.
CORRUPT_SCALE = 0.5

Results = Dict[str, Optional[Tensor]]


# ------------------------------------------------------------------------------------------- the rule


def max_error(x: Tensor, ref64: Tensor) -> float:
    """Largest ``|x - ref64|``, in float64; positions where both hold the same infinity agree."""
    if x.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference shape {tuple(ref64.shape)}")
    x, ref64 = x.detach().double(), ref64.detach().double()
    diff = (x - ref64).abs()
    # inf - inf is NaN: positions where both are the same infinity agree.
    same_inf = torch.isinf(x) & (x == ref64)
    return float(torch.where(same_inf, torch.zeros_like(diff), diff).max()) if diff.numel() else 0.0


def allowed_error(baseline_error: float, dtype: torch.dtype) -> float:
    """The most a result of ``dtype`` may differ from float64, given PyTorch's own error in that dtype."""
    return FACTOR * baseline_error + ATOL_FLOOR[dtype]


def error_ratio(err: float, baseline_error: float, dtype: torch.dtype) -> float:
    """``err / (baseline_error + floor / FACTOR)``: 1 is PyTorch's own accuracy, the rule passes up to FACTOR."""
    return FACTOR * err / allowed_error(baseline_error, dtype)


def _non_finite(x: Tensor, ref64: Tensor) -> int:
    """How many elements of ``x`` are NaN or infinite where ``ref64`` is not that same value."""
    x = x.detach().double()
    return int((~torch.isfinite(x) & ~(x == ref64.detach().double())).sum())


@dataclass
class Verdict:
    """One result of a check (an output or a gradient) against float64."""

    name: str
    err: float
    baseline_err: float
    ratio: float
    ok: bool
    note: str = ""


def judge(name: str, out: Optional[Tensor], ref64: Optional[Tensor], baseline: Optional[Tensor]) -> Verdict:
    """``out`` (the backend's) against ``ref64`` (float64), with ``baseline`` PyTorch's own in ``out``'s dtype."""
    nan = float("nan")
    if ref64 is None or baseline is None:
        return Verdict(name, nan, nan, math.inf, False, "no float64 / baseline result")
    if out is None:
        return Verdict(name, nan, nan, math.inf, False, "missing (no gradient?)")
    if out.shape != baseline.shape or out.dtype != baseline.dtype:
        return Verdict(name, nan, nan, math.inf, False, f"got {tuple(out.shape)} {out.dtype}, expected "
                       f"{tuple(baseline.shape)} {baseline.dtype}")
    bad = _non_finite(out, ref64)
    err, base = max_error(out, ref64), max_error(baseline, ref64)
    ratio = error_ratio(err, base, out.dtype) if bad == 0 else math.inf
    ok = bad == 0 and err <= allowed_error(base, out.dtype)
    return Verdict(name, err, base, ratio, ok, f"{bad} non-finite" if bad else "")


# -------------------------------------------------------------------- running ops under the interpreter


@contextlib.contextmanager
def interpreter_rounds_to_nearest() -> Iterator[None]:
    """Under the Triton interpreter, make float32 -> bfloat16 casts round to nearest even, as a GPU does (the
    interpreter truncates), so interpreted kernels are held to the GPU's rounding error, not twice that.
    Does nothing when the interpreter is off."""
    if not backend.triton_interpreting() or backend.triton_unavailable_reason() is not None:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_rounding(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            bits = np.ascontiguousarray(data).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).reshape(data.shape)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_rounding
    try:
        yield
    finally:
        interpreter._convert_float = convert


@contextlib.contextmanager
def unwritten_elements_are_nan() -> Iterator[None]:
    """Every floating buffer allocated with ``torch.empty`` / ``torch.empty_like`` starts as NaN, so an element a
    kernel forgets to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty, torch.empty_like = nan_empty, nan_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def outputs_and_grads(fn: Callable, inputs: Dict[str, object], out_grads: Sequence[Tensor],
                      dtype: Optional[torch.dtype] = None) -> Tuple[Tuple[Tensor, ...], Dict[str, Optional[Tensor]]]:
    """Run ``fn(**inputs)`` (floating tensors cast to ``dtype`` if given) and backpropagate ``out_grads`` into its
    first outputs; returns the outputs and the gradient of every floating input, by name (none without
    ``out_grads``). Non-tensors and non-floating tensors (masks) are passed as they are."""
    leaves = {}
    for name, t in inputs.items():
        if isinstance(t, Tensor):
            t = t.detach().to(dtype if dtype is not None and t.is_floating_point() else t.dtype)
            leaves[name] = t.requires_grad_(t.is_floating_point() and len(out_grads) > 0)
        else:
            leaves[name] = t
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not out_grads:
        return outs, {}
    torch.autograd.backward(outs[:len(out_grads)], [g.to(o.dtype) for o, g in zip(outs, out_grads)])
    grads = {name: t.grad for name, t in leaves.items() if isinstance(t, Tensor) and t.is_floating_point()}
    return outs, grads


# ------------------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Case:
    """One op or module on fixed inputs. ``compute(dtype, exact)`` runs it on the current backend from the inputs
    rounded to ``dtype`` (in float64 after that rounding when ``exact``) and returns its results by name, the op's
    own output first."""

    op: str
    label: str
    quick: bool
    compute: Callable[[torch.dtype, bool], Results]

    def run(self, dtype: torch.dtype, exact: bool) -> Results:
        """``compute``'s results, detached from the autograd graph."""
        return {n: None if t is None else t.detach() for n, t in self.compute(dtype, exact).items()}


def _caster(dtype: torch.dtype, exact: bool) -> Callable[[Tensor], Tensor]:
    def cast(t: Tensor) -> Tensor:
        if not t.is_floating_point():
            return t
        t = t.to(dtype)
        return t.to(torch.float64) if exact else t

    return cast


class _Random:
    """Float64 draws from a generator seeded by the case's label, so a case gets the same numbers whatever else
    is selected."""

    def __init__(self, label: str, device: torch.device):
        self.seed = zlib.crc32(label.encode())
        self.g = torch.Generator().manual_seed(self.seed)
        self.device = device

    def randn(self, *shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=self.g, dtype=torch.float64) * scale).to(self.device)

    def rand(self, *shape: int) -> Tensor:
        return torch.rand(*shape, generator=self.g, dtype=torch.float64).to(self.device)


def _padding(lengths: Sequence[int], length: int, device: torch.device) -> Tensor:
    """Right-padded ``[B, length]`` bool mask, True = padding."""
    return (torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]).to(device)


def _attention_masks(kind: str, rng: _Random, b: int, lq: int, lk: int) -> Dict[str, object]:
    """The functional ``attention`` mask arguments for ``kind``, a '+'-joined list of mask names."""
    kwargs: Dict[str, object] = {}
    for part in kind.split("+"):
        if part == "causal":
            kwargs["is_causal"] = True
        elif part == "causal-br":
            kwargs.update(is_causal=True, causal_alignment="bottom_right")
        elif part == "padding":
            kwargs["key_padding_mask"] = _padding([lk - 3 * i * lk // 10 for i in range(b)], lk, rng.device)
        elif part == "holes":  # a key padding mask that is not right-padded: the kernels cannot skip it
            holes = rng.rand(b, lk) < 0.25
            holes[:, 0] = False
            kwargs["key_padding_mask"] = holes
        elif part == "bool":  # True = may attend; broadcast over heads
            keep = rng.rand(b, 1, lq, lk) > 0.3
            keep[..., 0] = True
            kwargs["attn_mask"] = keep
        elif part == "float":  # added to the scores, some -inf; broadcast over batch and heads
            bias = rng.randn(lq, lk)
            blocked = rng.rand(lq, lk) < 0.1
            blocked[:, 0] = False
            kwargs["attn_mask"] = bias.masked_fill(blocked, float("-inf"))
        elif part != "none":
            raise ValueError(f"unknown mask {part!r}")
    return kwargs


# (quick, B, H, H_kv, Lq, Lk, D, masks)
ATTENTION_GRID = [
    (True, 2, 2, 1, 33, 47, 64, "causal-br+padding"),
    (True, 1, 2, 2, 47, 33, 48, "bool"),
    (True, 1, 2, 2, 31, 31, 64, "causal+float"),
    (False, 2, 4, 2, 77, 130, 64, "none"),
    (False, 2, 4, 2, 77, 130, 64, "causal"),
    (False, 2, 4, 2, 77, 130, 64, "causal-br+padding"),
    (False, 2, 4, 2, 77, 130, 64, "bool"),
    (False, 2, 4, 2, 77, 130, 64, "float"),
    (False, 2, 3, 3, 130, 77, 48, "causal-br"),  # Lq > Lk: the first 53 queries see no key (zeros)
    (False, 2, 3, 1, 63, 63, 48, "holes+float"),
]
ATTENTION_WEIGHTS_GRID = [
    (True, 2, 2, 1, 33, 47, 64, "causal-br+padding"),
    (False, 2, 4, 2, 77, 130, 64, "causal-br+padding"),
    (False, 2, 3, 3, 63, 63, 48, "float"),
]


def _attention_label(b: int, h: int, hkv: int, lq: int, lk: int, d: int, masks: str) -> str:
    return f"B{b} H{h}/{hkv} L{lq}x{lk} D{d} {masks}"


def _attention_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, b, h, hkv, lq, lk, d, masks in ATTENTION_GRID:
        label = _attention_label(b, h, hkv, lq, lk, d, masks)
        rng = _Random("attention " + label, device)
        inputs = {"q": rng.randn(b, h, lq, d), "k": rng.randn(b, hkv, lk, d), "v": rng.randn(b, hkv, lk, d)}
        dout, mask_args = rng.randn(b, h, lq, d), _attention_masks(masks, rng, b, lq, lk)

        def run(dtype, exact, inputs=inputs, dout=dout, mask_args=mask_args):
            cast = _caster(dtype, exact)
            kwargs = {n: cast(t) if isinstance(t, Tensor) else t for n, t in mask_args.items()}
            (out,), grads = outputs_and_grads(
                lambda **qkv: ft.attention(**qkv, **kwargs), {n: cast(t) for n, t in inputs.items()}, [cast(dout)])
            return {"out": out, **{f"d{n}": g for n, g in grads.items()}}

        cases.append(Case("attention", label, quick, run))
    return cases


def _attention_weights_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, b, h, hkv, lq, lk, d, masks in ATTENTION_WEIGHTS_GRID:
        label = _attention_label(b, h, hkv, lq, lk, d, masks)
        rng = _Random("attention_weights " + label, device)
        q, k, v = rng.randn(b, h, lq, d), rng.randn(b, hkv, lk, d), rng.randn(b, hkv, lk, d)
        mask_args = _attention_masks(masks, rng, b, lq, lk)

        def run(dtype, exact, q=q, k=k, v=v, mask_args=mask_args):
            cast = _caster(dtype, exact)
            kwargs = {n: cast(t) if isinstance(t, Tensor) else t for n, t in mask_args.items()}
            out, lse = ft.attention(cast(q), cast(k), cast(v), return_lse=True, **kwargs)
            return {"weights": ft.attention_weights(cast(q), cast(k), lse, **kwargs), "lse": lse, "out": out}

        cases.append(Case("attention_weights", f"{label} (with its lse)", quick, run))
    return cases


# (quick, shape of x, residual, prenorm)
LAYER_NORM_GRID = [
    (True, (2, 19, 300), True, True),
    (False, (2, 37, 1000), True, True),
    (False, (77, 1023), False, False),
    (False, (5, 4096), True, False),
]


def _layer_norm_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, shape, has_residual, prenorm in LAYER_NORM_GRID:
        label = "x " + "x".join(map(str, shape)) + " +residual" * has_residual + " prenorm" * prenorm
        rng = _Random("layer_norm " + label, device)
        n = shape[-1]
        inputs = {"x": rng.randn(*shape), "weight": 1 + rng.randn(n, scale=0.5), "bias": rng.randn(n)}
        if has_residual:
            inputs["residual"] = rng.randn(*shape)
        out_grads = [rng.randn(*shape) for _ in range(2 if prenorm else 1)]

        def run(dtype, exact, inputs=inputs, out_grads=out_grads, prenorm=prenorm):
            cast = _caster(dtype, exact)
            outs, grads = outputs_and_grads(
                lambda x, weight, bias, **rest: ft.layer_norm(x, weight, bias, prenorm=prenorm, **rest),
                {n: cast(t) for n, t in inputs.items()}, [cast(g) for g in out_grads])
            return {**dict(zip(("y", "z"), outs)), **{f"d{n}": g for n, g in grads.items()}}

        cases.append(Case("layer_norm", label, quick, run))
    return cases


# (quick, leading dims of x, d_model, d_ff, d_out, activation)
FEED_FORWARD_GRID = [
    (True, (2, 19), 64, 128, 64, "gelu"),
    (False, (2, 37), 64, 256, 64, "relu"),
    (False, (2, 37), 64, 256, 64, "gelu"),
    (False, (2, 37), 64, 256, 64, "gelu_tanh"),
    (False, (77,), 48, 200, 40, "gelu_tanh"),
]


def _feed_forward_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, lead, d_model, d_ff, d_out, activation in FEED_FORWARD_GRID:
        label = f"x {'x'.join(map(str, lead))}x{d_model} {d_model}-{d_ff}-{d_out} {activation}"
        rng = _Random("feed_forward " + label, device)
        inputs = {
            "x": rng.randn(*lead, d_model),
            "w1": rng.randn(d_ff, d_model, scale=d_model ** -0.5), "b1": rng.randn(d_ff, scale=0.5),
            "w2": rng.randn(d_out, d_ff, scale=d_ff ** -0.5), "b2": rng.randn(d_out, scale=0.5),
        }
        dout = rng.randn(*lead, d_out)

        def run(dtype, exact, inputs=inputs, dout=dout, activation=activation):
            cast = _caster(dtype, exact)
            (out,), grads = outputs_and_grads(
                lambda **w: ft.feed_forward(**w, activation=activation), {n: cast(t) for n, t in inputs.items()},
                [cast(dout)])
            return {"out": out, **{f"d{n}": g for n, g in grads.items()}}

        cases.append(Case("feed_forward", label, quick, run))
    return cases


def _module_case(
    op: str, label: str, quick: bool, device: torch.device, build: Callable[[], nn.Module],
    inputs: Callable[[_Random], Dict[str, Tensor]], call: Callable[..., object],
) -> Case:
    """A module check: ``build()`` in float64 from a seed (1-D parameters moved off their 0 / 1 initialisation),
    in eval mode; ``inputs(rng)`` its differentiable inputs, the first one shaped like the output;
    ``call(module, cast, **inputs)`` runs it (``cast`` for masks) and returns the output or (output, weights)."""
    rng = _Random(f"{op} {label}", device)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn's notes about its nested-tensor fast path, which we never take
        torch.manual_seed(rng.seed)
        master = build().to(device=device, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in master.parameters():
            if p.dim() == 1:
                p.add_(rng.randn(*p.shape, scale=0.1))
    tensors = inputs(rng)
    dout = rng.randn(*next(iter(tensors.values())).shape)

    def run(dtype: torch.dtype, exact: bool) -> Results:
        cast = _caster(dtype, exact)
        module = copy.deepcopy(master).to(dtype)
        if exact:
            module.to(torch.float64)
        leaves = {n: cast(t).requires_grad_() for n, t in tensors.items()}
        outs = call(module, cast, **leaves)
        out, weights = outs if isinstance(outs, tuple) else (outs, None)
        out.backward(cast(dout))
        results = {"out": out}
        if weights is not None:
            results["weights"] = weights
        results.update({f"d({n})": t.grad for n, t in leaves.items()})
        results.update({f"d({n})": p.grad for n, p in module.named_parameters()})
        return results

    return Case(op, label, quick, run)


def _causal(length: int, device: torch.device) -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(length, device=device, dtype=torch.float64)


def _norm(norm_first: bool) -> str:
    return "pre-LN" if norm_first else "post-LN"


# Modules run a smooth activation: through relu, a last-bit difference upstream flips the sign of a pre-activation
# near 0 and changes that unit's gradients by O(1), in PyTorch's own low-precision run as much as in a kernel's, so
# the comparison would measure luck. relu itself is checked on identical inputs by the feed_forward op cases.
ACTIVATION_MODULES = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


def _multihead_attention_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, length, e in ((True, 19, 32), (False, 37, 64)):
        padding = _padding([length, length - 7], length, device)

        def self_attention(m, cast, x, padding=padding):
            return m(x, x, x, key_padding_mask=padding, need_weights=True)

        cases.append(_module_case(
            "MultiheadAttention", f"self B2 L{length} E{e} H4 +padding need_weights", quick, device,
            lambda e=e: ft.MultiheadAttention(e, 4, batch_first=True),
            lambda rng, length=length, e=e: {"x": rng.randn(2, length, e)}, self_attention))

    tgt, src = 29, 41
    blocked = _Random("MultiheadAttention cross mask", device).rand(tgt, src) < 0.3
    blocked[:, 0] = False  # torch.nn's bool attn_mask: True = may NOT attend

    def cross_attention(m, cast, query, key, value):
        return m(query, key, value, attn_mask=blocked, average_attn_weights=False)

    cases.append(_module_case(
        "MultiheadAttention", f"cross seq-first B2 L{tgt}x{src} E64 kdim48 vdim40 +bool mask, per-head weights", False,
        device, lambda: ft.MultiheadAttention(64, 4, kdim=48, vdim=40),
        lambda rng: {"query": rng.randn(tgt, 2, 64), "key": rng.randn(src, 2, 48), "value": rng.randn(src, 2, 40)},
        cross_attention))
    return cases


def _encoder_layer_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, norm_first, d, ff, length, activation in (
        (True, True, 32, 64, 19, "gelu"), (False, False, 64, 128, 37, "gelu_tanh"), (False, True, 64, 128, 37, "gelu"),
    ):
        padding = _padding([length, length - 7], length, device)

        def build(d=d, ff=ff, norm_first=norm_first, activation=activation):
            return ft.TransformerEncoderLayer(d, 4, ff, dropout=0.0, activation=ACTIVATION_MODULES[activation](),
                                              batch_first=True, norm_first=norm_first)

        cases.append(_module_case(
            "TransformerEncoderLayer", f"B2 L{length} d{d} H4 ff{ff} {_norm(norm_first)} {activation} +padding", quick,
            device, build, lambda rng, length=length, d=d: {"src": rng.randn(2, length, d)},
            lambda m, cast, src, padding=padding: m(src, src_key_padding_mask=padding)))
    return cases


def _decoder_layer_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, norm_first, d, ff, tgt, src in (
        (True, False, 32, 64, 17, 19), (False, False, 64, 128, 29, 37), (False, True, 64, 128, 29, 37),
    ):
        mask, padding = _causal(tgt, device), _padding([src, src - 7], src, device)

        def call(m, cast, tgt, memory, mask=mask, padding=padding):
            return m(tgt, memory, tgt_mask=cast(mask), memory_key_padding_mask=padding, tgt_is_causal=True)

        label = f"B2 L{tgt}x{src} d{d} H4 ff{ff} {_norm(norm_first)} gelu causal +memory padding"
        cases.append(_module_case(
            "TransformerDecoderLayer", label, quick, device,
            lambda d=d, ff=ff, norm_first=norm_first: ft.TransformerDecoderLayer(
                d, 4, ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first),
            lambda rng, tgt=tgt, src=src, d=d: {"tgt": rng.randn(2, tgt, d), "memory": rng.randn(2, src, d)}, call))
    return cases


def _transformer_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, layers, d, ff, tgt, src in ((True, 1, 32, 64, 17, 19), (False, 2, 64, 128, 29, 37)):
        mask, padding = _causal(tgt, device), _padding([src, src - 7], src, device)

        def call(m, cast, tgt, src, mask=mask, padding=padding):
            return m(src, tgt, tgt_mask=cast(mask), src_key_padding_mask=padding, memory_key_padding_mask=padding)

        label = f"{layers}+{layers} layers B2 L{tgt}x{src} d{d} H4 ff{ff} gelu causal +padding"
        cases.append(_module_case(
            "Transformer", label, quick, device,
            lambda layers=layers, d=d, ff=ff: ft.Transformer(
                d, 4, layers, layers, ff, dropout=0.0, activation="gelu", batch_first=True),
            lambda rng, tgt=tgt, src=src, d=d: {"tgt": rng.randn(2, tgt, d), "src": rng.randn(2, src, d)}, call))
    return cases


def build_cases(device: torch.device, ops: Sequence[str] = CHECKS, quick: bool = False) -> List[Case]:
    """The grid for ``ops`` (in ``CHECKS`` order): every case, or those marked quick."""
    builders = {
        "attention": _attention_cases, "attention_weights": _attention_weights_cases, "layer_norm": _layer_norm_cases,
        "feed_forward": _feed_forward_cases, "MultiheadAttention": _multihead_attention_cases,
        "TransformerEncoderLayer": _encoder_layer_cases, "TransformerDecoderLayer": _decoder_layer_cases,
        "Transformer": _transformer_cases,
    }
    cases = []
    for op in CHECKS:
        if op in ops:
            cases += [case for case in builders[op](device) if case.quick or not quick]
    return cases


# ------------------------------------------------------------------------------------------ the check


def backend_status(device: torch.device) -> Dict[str, Optional[str]]:
    """Backend name -> None when it runs on ``device`` here, else why not."""
    status = {}
    for name in BACKENDS:
        try:
            with ft.use_backend(name):
                ft.current(device)
            status[name] = None
        except RuntimeError as exc:
            status[name] = str(exc)
    return status


def usable_backends(device: torch.device) -> List[str]:
    return [name for name, reason in backend_status(device).items() if reason is None]


def corrupted_checks() -> Set[Tuple[str, str]]:
    """Test-only: the (op, backend) pairs to perturb, from ``CORRUPT`` and ``FUSED_TRANSFORMER_CHECK_CORRUPT``."""
    pairs = set(CORRUPT)
    for item in os.environ.get(CORRUPT_ENV, "").split(","):
        if item.strip():
            op, _, name = item.strip().partition(":")
            if op not in CHECKS or name not in BACKENDS:
                raise ValueError(f"{CORRUPT_ENV}={os.environ[CORRUPT_ENV]!r}: expected op:backend[,...] with op one "
                                 f"of {', '.join(CHECKS)} and backend one of {', '.join(BACKENDS)}")
            pairs.add((op, name))
    return pairs


def _corrupt(results: Results) -> None:
    """Test-only: a wrong element in the check's own output (its first result), as a broken kernel would write."""
    out = next(iter(results.values()))
    out.view(-1)[0] += CORRUPT_SCALE * float(out.abs().max())


def _describe_backend(name: str, device: torch.device) -> str:
    if name == "triton":
        if device.type == "cpu":
            return ("triton (Triton interpreter on CPU tensors, TRITON_INTERPRET=1: slow; "
                    "bfloat16 casts round as on a GPU)")
        return f"triton (Triton kernels on {torch.cuda.get_device_name(device)})"
    if name == "cpu":
        return "cpu (C++ kernels of fused_transformer._C; 16-bit inputs computed in float32)"
    return "reference (plain PyTorch, the baseline)"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class ProgressBar:
    """``[#####-----] 12/54  31 s  attention triton bfloat16`` on stderr, redrawn in place on a terminal; on
    anything else (a log, a pipe, pytest's capture) a plain line every ``every_s`` seconds at most. Call ``clear``
    before writing a table row, so that the bar never lands inside the table when both share a terminal."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, enabled: bool = True, every_s: float = 30.0):
        self.total, self.stream, self.every_s = total, stream or sys.stderr, every_s
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.sparse = enabled and not self.tty
        self.start = self.last = time.perf_counter()
        self.visible = False

    def show(self, done: int, what: str) -> None:
        elapsed = time.perf_counter() - self.start
        if self.tty:
            filled = 30 * done // max(self.total, 1)
            line = f"[{'#' * filled}{'-' * (30 - filled)}] {done}/{self.total}  {elapsed:.0f} s  {what}"
            width = shutil.get_terminal_size().columns - 1  # a wrapped line could not be redrawn in place
            self.stream.write("\r\x1b[K" + line[:width])
            self.stream.flush()
            self.visible = True
        elif self.sparse and time.perf_counter() - self.last >= self.every_s:
            self.stream.write(f"check: {done}/{self.total} done, {elapsed:.0f} s\n")
            self.stream.flush()
            self.last = time.perf_counter()

    def clear(self) -> None:
        if self.visible:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.visible = False


@dataclass
class Row:
    """One check: an op or module, on one backend, in one dtype, on one case of the grid."""

    op: str
    backend: str
    dtype: str
    label: str
    worst: Verdict
    failed: List[str]
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failed


def _error_row(case: Case, name: str, dtype_name: str, error: str) -> Row:
    return Row(case.op, name, dtype_name, case.label, Verdict("-", math.nan, math.nan, math.inf, False), [], error)


def _check_one(case: Case, name: str, dtype_name: str, oracle: Results, baseline: Results, corrupt: bool) -> Row:
    """Run ``case`` on backend ``name`` and judge every result; an exception becomes a row with ``error``."""
    try:
        with ft.use_backend(name), unwritten_elements_are_nan():
            results = case.run(DTYPES[dtype_name], False)
        if corrupt:
            _corrupt(results)
    except Exception as exc:  # noqa: BLE001 (reported as a failed check, never swallowed)
        return _error_row(case, name, dtype_name, f"{type(exc).__name__}: {exc}")
    verdicts = [judge(n, results.get(n), ref, baseline.get(n)) for n, ref in oracle.items()]
    verdicts += [Verdict(n, math.nan, math.nan, math.inf, False, "unexpected") for n in results if n not in oracle]
    worst = max(verdicts, key=lambda v: (not v.ok, math.inf if math.isnan(v.ratio) else v.ratio))
    failed = [v.name + (f" ({v.note})" if v.note else "") for v in verdicts if not v.ok]
    return Row(case.op, name, dtype_name, case.label, worst, failed)


def _header(device: torch.device, quick: bool, status: Dict[str, Optional[str]], requested: Sequence[str],
            corrupt: Set[Tuple[str, str]]) -> List[str]:
    threads = f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""
    lines = [
        f"fused_transformer {ft.__version__} check ({'quick' if quick else 'full'} grid): torch {torch.__version__}, "
        f"triton {_version('triton')}, python {platform.python_version()}, device {device}{threads}",
        "backends: " + "; ".join(_describe_backend(n, device) for n in requested if status[n] is None),
    ]
    for name in BACKENDS:
        if status[name] is not None:
            lines.append(f"not usable here{' (requested)' if name in requested else ''}: {status[name]}")
    with ft.use_backend("auto"):
        auto = ", ".join(f"{n} -> {backend.current(device, DTYPES[n])}" for n in DTYPES)
    lines.append(f"auto picks: {auto}; every backend takes all three dtypes (none is skipped)")
    floors = ", ".join(f"{n} {ATOL_FLOOR[DTYPES[n]]:.1e}" for n in DTYPES)
    lines.append(f"rule: pass iff err <= {FACTOR:g} x torch err + floor ({floors}) for the output and every gradient; "
                 f"ratio = err / (torch err + floor/{FACTOR:g}), pass iff <= {FACTOR:g}")
    if corrupt:
        pairs = ", ".join(f"{op} on {name}" for op, name in sorted(corrupt))
        lines.append(f"TEST HOOK: outputs perturbed before comparison for {pairs}")
    return lines


def _summary(rows: List[Row], failures: int, dtype_names: Sequence[str], unchecked: Sequence[str],
             seconds: float) -> str:
    worst = []
    for dtype_name in dtype_names:
        mine = [row for row in rows if row.dtype == dtype_name]
        if mine:
            top = max(mine, key=lambda r: math.inf if math.isnan(r.worst.ratio) else r.worst.ratio)
            worst.append(f"{dtype_name} {top.worst.ratio:.2f} ({top.op} on {top.backend}, {top.worst.name})")
    missing = f" (requested backend {', '.join(unchecked)} not usable here)" if unchecked else ""
    return (f"summary: {len(rows)} checks, {failures} failed{missing}; worst ratio {'; '.join(worst) or '-'} "
            f"(limit {FACTOR:g}); {seconds:.1f} s")


def check(
    device: torch.device, quick: bool = False, *, ops: Sequence[str] = CHECKS, backends: Optional[Sequence[str]] = None,
    dtypes: Optional[Sequence[str]] = None, progress: bool = True, out: Optional[TextIO] = None,
) -> int:
    """Print the header, the table and the summary to ``out`` (stdout); return the number of failed checks.
    ``backends`` None: every backend usable here; a named one that is not usable counts as a failure."""
    out = out or sys.stdout
    started = time.perf_counter()
    status = backend_status(device)
    corrupt = corrupted_checks()
    requested = list(backends) if backends else [name for name in BACKENDS if status[name] is None]
    names = [name for name in requested if status[name] is None]
    unchecked = [name for name in requested if status[name] is not None]
    dtype_names = list(dtypes) if dtypes else list(QUICK_DTYPES if quick else DTYPES)
    cases = build_cases(device, ops, quick)

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    for line in _header(device, quick, status, requested, corrupt):
        say(line)
    op_w = max([len("op")] + [len(c.op) for c in cases]) + 2
    label_w = max([len("case")] + [len(c.label) for c in cases]) + 2
    header = (f"{'op':<{op_w}}{'backend':<11}{'dtype':<10}{'case':<{label_w}}{'max err':>10}{'torch err':>11}"
              f"{'ratio':>8}  result  worst")
    say()
    say(header)
    say("-" * len(header))

    rows: List[Row] = []
    notes: List[str] = []
    bar = ProgressBar(len(cases) * len(dtype_names) * len(names), enabled=progress)
    with interpreter_rounds_to_nearest():
        for case in cases:
            for dtype_name in dtype_names:
                bar.show(len(rows), f"{case.op} {case.label} {dtype_name}: float64 and torch")
                try:
                    with ft.use_backend("reference"):
                        oracle = case.run(DTYPES[dtype_name], True)
                        baseline = case.run(DTYPES[dtype_name], False)
                    reference_error = None
                except Exception as exc:  # noqa: BLE001 (every row of this case and dtype reports it)
                    oracle, baseline, reference_error = {}, {}, f"reference: {type(exc).__name__}: {exc}"
                for name in names:
                    bar.show(len(rows), f"{case.op} {name} {dtype_name} {case.label}")
                    hooked = (case.op, name) in corrupt
                    if reference_error is None:
                        row = _check_one(case, name, dtype_name, oracle, baseline, hooked)
                    else:
                        row = _error_row(case, name, dtype_name, reference_error)
                    rows.append(row)
                    if row.error:
                        notes.append(f"[{len(notes) + 1}] {case.op} {name} {dtype_name} {case.label}: {row.error}")
                        detail = f"see [{len(notes)}]"
                    elif row.failed:
                        more = len(row.failed) - 3
                        detail = ", ".join(row.failed[:3]) + (f" and {more} more" if more > 0 else "")
                    else:
                        detail = row.worst.name
                    result = "pass" if row.ok else ("ERROR" if row.error else "FAIL")
                    bar.clear()
                    w = row.worst
                    say(f"{row.op:<{op_w}}{row.backend:<11}{row.dtype:<10}{row.label:<{label_w}}{w.err:>10.2e}"
                        f"{w.baseline_err:>11.2e}{w.ratio:>8.2f}  {result:<6}  {detail}" + " (test hook)" * hooked)
    bar.clear()

    failures = sum(not row.ok for row in rows) + len(unchecked)
    say()
    for note in notes:
        say(note)
    say(_summary(rows, failures, dtype_names, unchecked, time.perf_counter() - started))
    return failures


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer check", description=__doc__.splitlines()[0],
        epilog="Exit code 1 when any check fails. See the docstring of fused_transformer.selfcheck for the rule.",
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller grid: small shapes, fewer masks, {' and '.join(QUICK_DTYPES)} only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: %(default)s")
    parser.add_argument("--backend", action="append", choices=BACKENDS, metavar="NAME",
                        help=f"check only this backend (repeatable; {', '.join(BACKENDS)}); default: all usable here")
    parser.add_argument("--op", action="append", choices=CHECKS, metavar="NAME",
                        help=f"check only this op or module (repeatable; one of {', '.join(CHECKS)}); default: all")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), metavar="NAME",
                        help=f"check only this dtype (repeatable; one of {', '.join(DTYPES)})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    try:
        corrupted_checks()
    except ValueError as exc:
        parser.error(str(exc))
    dedup = lambda names: list(dict.fromkeys(names)) if names else None  # noqa: E731
    failures = check(device, args.quick, ops=dedup(args.op) or CHECKS, backends=dedup(args.backend),
                     dtypes=dedup(args.dtype), progress=not args.no_progress)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
