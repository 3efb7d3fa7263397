"""The grid of ``python -m fused_transformer check``: every op and module on fixed random inputs.

A case runs one op (its outputs and the gradient of every input it differentiates, none for an op whose check
takes none) or one module (its output, the attention weights where it returns them, the gradients of its inputs
and of every parameter) in one precision, from the inputs rounded to that precision, or in float64 after that
rounding (the oracle); an op's ``Op.float32`` arguments stay float32 (float64 for the oracle), masks and integer
tensors as they are. Everything is drawn at random from seeds derived from the case's label (never zeros; module
biases and LayerNorm weights are perturbed off their 0 / 1 initialisation); modules run in eval mode with dropout 0.

The ops are the registry's (``fused_transformer.ops``): every registered op with a grid (``Op.check``), none named
here. ``--quick`` takes a small-shape subset that still runs every op and module, in float32 and bfloat16; the full
grid adds float16, the rest of each op's ``Op.check`` and the module builders below. Modules use GELU: through
relu, a last-bit difference upstream flips the mask of a pre-activation near 0 and changes gradients by O(1) in
PyTorch's own low-precision run as much as in a kernel's.
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
OPS = tuple(op.name for op in registry.registered() if op.check)  # every registered op with a grid (Op.check)
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
        return (torch.randn(shape, generator=self.g, dtype=torch.float64) * scale).to(self.device)

    def rand(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.g, dtype=torch.float64).to(self.device)


def _padding(lengths: Sequence[int], length: int, device: torch.device) -> Tensor:
    """Right-padded ``[B, length]`` bool mask, True = padding."""
    return (torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]).to(device)


def _in_precision(op: registry.Op, cast: Callable[[Tensor], Tensor], exact: bool,
                  tensors: Dict[str, Optional[Tensor]]) -> Dict[str, Optional[Tensor]]:
    """An example's tensors in the case's precision: floating ones cast (constants too: a float mask), those of
    ``Op.float32`` kept float32 (float64 for the oracle); bool and integer tensors as they are."""
    found = {}
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.is_floating_point() and name in op.float32:
            t = t.to(torch.float32).to(torch.float64 if exact else torch.float32)
        elif isinstance(t, Tensor):
            t = cast(t)
        found[name] = t
    return found


def _op_cases(op: registry.Op, device: torch.device) -> List[Case]:
    """A registered op's check grid (``Op.check``): its outputs (``Op.outputs``) and, where ``Op.differentiable``,
    the gradient of every input it differentiates (``Op.differentiated``: not its constants), named ``d<input>``."""
    cases = []
    for example in op.check:
        rng = _Random(f"{op.name} {example.label}", device)
        tensors = example.draw(rng.randn)
        out_grads = []
        if op.differentiable:
            shapes = op.reference(**tensors, **example.options)
            out_grads = [rng.randn(*t.shape) for t in (shapes if isinstance(shapes, tuple) else (shapes,))]

        def run(dtype, exact, tensors=tensors, out_grads=out_grads, example=example):
            cast = _caster(dtype, exact)
            given = _in_precision(op, cast, exact, tensors)
            wanted = {id(t) for t in op.differentiated(given)} if op.differentiable else set()
            inputs = {n: t for n, t in given.items() if id(t) in wanted}
            others = {n: t for n, t in given.items() if id(t) not in wanted}
            outs, grads = outputs_and_grads(lambda **leaves: op.function(**leaves, **others, **example.options),
                                            inputs, [cast(g) for g in out_grads])
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
        **{op.name: functools.partial(_op_cases, op) for op in registry.registered()},
        "MultiheadAttention": _multihead_attention_cases, "TransformerEncoderLayer": _encoder_layer_cases,
        "TransformerDecoderLayer": _decoder_layer_cases, "Transformer": _transformer_cases,
    }
    cases = []
    for op in CHECKS:
        if op in ops:
            cases += [case for case in builders[op](device) if case.quick or not quick]
    return cases
