"""The grid of ``python -m fused_transformer check``: every op and module on fixed random inputs.

A case runs one op (its output and the gradient of every input) or one module (its output, the attention
weights where it returns them, the gradients of its inputs and of every parameter) in one precision, from the
inputs rounded to that precision, or in float64 after that rounding (the oracle). Everything is drawn at random
from seeds derived from the case's label (never zeros; module biases and LayerNorm weights are perturbed off
their 0 / 1 initialisation); modules run in eval mode with dropout 0.

``--quick`` takes a small-shape subset that still runs every op and module, in float32 and bfloat16; the full
grid adds float16 and the shapes and masks of ``ATTENTION_GRID``, every registered op's ``Op.check`` and the
module builders below. Modules use GELU: through relu, a last-bit difference upstream flips the mask of a
pre-activation near 0 and changes gradients by O(1) in PyTorch's own low-precision run as much as in a
kernel's.
"""
from __future__ import annotations

import copy
import functools
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

import fused_transformer as ft
from fused_transformer import ops as registry
from fused_transformer.tools.numerics import outputs_and_grads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUICK_DTYPES = ("float32", "bfloat16")
OPS = ("attention", "attention_weights", *registry.names())  # then every registered op (fused_transformer.ops)
MODULES = ("MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "Transformer")
CHECKS = OPS + MODULES

Results = Dict[str, Optional[Tensor]]


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


# Arguments that stay float32 in every precision (float64 for the oracle): the ALiBi slopes and the sinks.
FLOAT32_ARGUMENTS = ("alibi_slopes", "sinks")


def _attention_masks(kind: str, rng: _Random, b: int, h: int, lq: int, lk: int) -> Dict[str, object]:
    """The functional ``attention`` mask (and score modifier) arguments for ``kind``, a '+'-joined list of names."""
    kwargs: Dict[str, object] = {}
    for part in kind.split("+"):
        if part == "softcap":
            kwargs["softcap"] = 2.0
        elif part == "alibi":  # per batch and head
            kwargs["alibi_slopes"] = rng.rand(b, h) * 0.5
        elif part == "sinks":  # differentiated, as an input
            kwargs["sinks"] = rng.randn(h, scale=2.0)
        elif part == "causal":
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
    (True, 2, 4, 2, 33, 47, 64, "causal-br+padding+softcap+alibi+sinks"),
    (False, 2, 4, 2, 77, 130, 64, "causal+softcap+alibi+sinks"),
]
ATTENTION_WEIGHTS_GRID = [
    (True, 2, 2, 1, 33, 47, 64, "causal-br+padding"),
    (False, 2, 4, 2, 77, 130, 64, "causal-br+padding"),
    (False, 2, 3, 3, 63, 63, 48, "float"),
]


def _attention_label(b: int, h: int, hkv: int, lq: int, lk: int, d: int, masks: str) -> str:
    return f"B{b} H{h}/{hkv} L{lq}x{lk} D{d} {masks}"


def _cast_argument(cast: Callable[[Tensor], Tensor], name: str, value: object, exact: bool) -> object:
    """A mask or score argument in the case's precision; the float32 ones in float32 (float64 for the oracle)."""
    if not isinstance(value, Tensor):
        return value
    if name in FLOAT32_ARGUMENTS:
        return value.to(torch.float32).to(torch.float64 if exact else torch.float32)
    return cast(value)


def _attention_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, b, h, hkv, lq, lk, d, masks in ATTENTION_GRID:
        label = _attention_label(b, h, hkv, lq, lk, d, masks)
        rng = _Random("attention " + label, device)
        inputs = {"q": rng.randn(b, h, lq, d), "k": rng.randn(b, hkv, lk, d), "v": rng.randn(b, hkv, lk, d)}
        dout, mask_args = rng.randn(b, h, lq, d), _attention_masks(masks, rng, b, h, lq, lk)
        if "sinks" in mask_args:
            inputs["sinks"] = mask_args.pop("sinks")

        def run(dtype, exact, inputs=inputs, dout=dout, mask_args=mask_args):
            cast = _caster(dtype, exact)
            kwargs = {n: _cast_argument(cast, n, t, exact) for n, t in mask_args.items()}
            differentiated = {n: _cast_argument(cast, n, t, exact) for n, t in inputs.items()}
            (out,), grads = outputs_and_grads(lambda **qkv: ft.attention(**qkv, **kwargs), differentiated, [cast(dout)])
            return {"out": out, **{f"d{n}": g for n, g in grads.items()}}

        cases.append(Case("attention", label, quick, run))
    return cases


def _attention_weights_cases(device: torch.device) -> List[Case]:
    cases = []
    for quick, b, h, hkv, lq, lk, d, masks in ATTENTION_WEIGHTS_GRID:
        label = _attention_label(b, h, hkv, lq, lk, d, masks)
        rng = _Random("attention_weights " + label, device)
        q, k, v = rng.randn(b, h, lq, d), rng.randn(b, hkv, lk, d), rng.randn(b, hkv, lk, d)
        mask_args = _attention_masks(masks, rng, b, h, lq, lk)

        def run(dtype, exact, q=q, k=k, v=v, mask_args=mask_args):
            cast = _caster(dtype, exact)
            kwargs = {n: cast(t) if isinstance(t, Tensor) else t for n, t in mask_args.items()}
            out, lse = ft.attention(cast(q), cast(k), cast(v), return_lse=True, **kwargs)
            return {"weights": ft.attention_weights(cast(q), cast(k), lse, **kwargs), "lse": lse, "out": out}

        cases.append(Case("attention_weights", f"{label} (with its lse)", quick, run))
    return cases


def _op_cases(op: registry.Op, device: torch.device) -> List[Case]:
    """A registered op's check grid (``Op.check``): its output(s) and the gradient of every input."""
    cases = []
    for example in op.check:
        rng = _Random(f"{op.name} {example.label}", device)
        inputs = example.draw(rng.randn)
        shapes = op.reference(**inputs, **example.options)
        shapes = shapes if isinstance(shapes, tuple) else (shapes,)
        out_grads = [rng.randn(*t.shape) for t in shapes]

        def run(dtype, exact, inputs=inputs, out_grads=out_grads, example=example, op=op):
            cast = _caster(dtype, exact)
            outs, grads = outputs_and_grads(
                lambda **tensors: op.function(**tensors, **example.options),
                {n: cast(t) if isinstance(t, Tensor) else t for n, t in inputs.items()}, [cast(g) for g in out_grads])
            return {**dict(zip(op.outputs, outs)), **{f"d{n}": g for n, g in grads.items()}}

        cases.append(Case(op.name, example.label, example.quick, run))
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
# the comparison would measure luck. relu itself is checked on identical inputs by the feed-forward op cases.
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
        "attention": _attention_cases, "attention_weights": _attention_weights_cases,
        **{op.name: functools.partial(_op_cases, op) for op in registry.registered()},
        "MultiheadAttention": _multihead_attention_cases, "TransformerEncoderLayer": _encoder_layer_cases,
        "TransformerDecoderLayer": _decoder_layer_cases, "Transformer": _transformer_cases,
    }
    cases = []
    for op in CHECKS:
        if op in ops:
            cases += [case for case in builders[op](device) if case.quick or not quick]
    return cases
