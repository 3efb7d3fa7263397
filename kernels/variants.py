"""Kernel variants: the named alternatives of a kernel that its plan holds, and the measured rows that say which one
each GPU runs where.

A variant is a value in an op's plan (``attention.configs.VARIANTS``, the norm kernels' ``VARIANTS``,
``attention.decode``'s split rules), never a second kernel: a tile row of its own, a constexpr, a grid order. Every op
has a default, the choice it ran before any GPU measured the others. ``python -m fused_transformer bench --suite
variants --device cuda`` times every variant of every op on the bench's shapes and writes ``MEASURED_FILE``: one row
per (op, GPU, shape class) naming the fastest, with its time against the default's and against the vendor's kernel
(cuDNN, cuBLAS, torch). A launcher asks ``choose(op, gpu, shape)``: a row measured on this GPU for this shape class,
else the default. Until a GPU has run the suite, the file holds no row and every plan keeps its default (``status``
says so).

Tests and the bench run one variant on purpose with ``forced``; a variant the plan refuses (no supported Triton
release builds it) raises there with the plan's reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

# The rows the bench wrote, shipped with the package (``bench --suite variants`` rewrites it in a checkout).
MEASURED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variant_rows.json")
ROW_FIELDS = ("op", "gpu", "shape", "variant", "vs_default", "vs_vendor", "vendor", "provenance")


@dataclasses.dataclass(frozen=True)
class VariantRow:
    """One verdict of the variants suite: on ``gpu``, ``op`` at shapes of class ``shape`` runs ``variant``, which
    took ``vs_default`` of the default variant's time and ran at ``vs_vendor`` x the speed of ``vendor``."""

    op: str  # "attention.fwd", "attention.bwd", "decode.split", a norm kernel's ".fwd" / ".bwd", ...
    gpu: str  # ``gpu_name``: "H200", "H100", "A100", ...
    shape: str  # the op's shape class (its plan's ``shape_class``)
    variant: str
    vs_default: float  # the winner's time / the default's (<= 1)
    vs_vendor: float  # the vendor's time / the winner's (> 1: ours is faster)
    vendor: str  # what vs_vendor compares with: "sdpa:cudnn_attention", "torch" (an op's torch path), ...
    provenance: str  # device, torch, triton, commit, date of the run that measured it


def read_rows(path: Optional[str] = None) -> Tuple[VariantRow, ...]:
    """The rows of a variants file (default ``MEASURED_FILE``; none when it does not exist)."""
    path = path or MEASURED_FILE
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        data = json.load(f)
    rows = data.get("rows", []) if isinstance(data, dict) else []
    try:
        return tuple(VariantRow(**{name: row[name] for name in ROW_FIELDS}) for row in rows)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: a variant row lacks a field or has a wrong one ({e}); expected {ROW_FIELDS}") from e


def write_rows(rows: Sequence[VariantRow], path: Optional[str] = None, keep_other_gpus: bool = True) -> None:
    """Write ``rows`` to ``path`` (default ``MEASURED_FILE``), keeping the rows already there of the GPUs ``rows`` do
    not cover."""
    path = path or MEASURED_FILE
    covered = {row.gpu for row in rows}
    kept = [row for row in read_rows(path) if row.gpu not in covered] if keep_other_gpus else []
    ordered = sorted([*kept, *rows], key=lambda r: (r.gpu, r.op, r.shape))
    with open(path, "w") as f:
        json.dump({"about": "bench --suite variants: the fastest variant of each op per GPU and shape class "
                            "(kernels/variants.py)",
                   "rows": [dataclasses.asdict(row) for row in ordered]}, f, indent=1)
        f.write("\n")
    forget_rows()


@functools.lru_cache(maxsize=None)
def measured() -> Dict[Tuple[str, str, str], str]:
    """(op, gpu, shape class) -> the winning variant, from ``MEASURED_FILE``."""
    return {(row.op, row.gpu, row.shape): row.variant for row in read_rows()}


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    """The name the rows give a CUDA device's GPU: "H200" for "NVIDIA H200", "H100" for "NVIDIA H100 80GB HBM3"
    ("cpu" for the CPU, where the interpreter runs the kernels)."""
    if device.type != "cuda":
        return device.type
    words = torch.cuda.get_device_name(device).replace("NVIDIA", "").split()
    return words[0] if words else "cuda"


_FORCED: Dict[str, str] = {}
# Each op's variants, registered by its plan: op -> (default, {name: reason the plan refuses it, or ""}).
_REGISTERED: Dict[str, Tuple[str, Dict[str, str]]] = {}


def register(op: str, default: str, variants: Mapping[str, str]) -> None:
    """Declare ``op``'s variants (name -> the reason its plan refuses it, "" when it builds) and its default."""
    if default not in variants or variants[default]:
        raise ValueError(f"variants of {op}: the default {default!r} must be one that builds")
    _REGISTERED[op] = (default, dict(variants))


def registered() -> Dict[str, Tuple[str, Dict[str, str]]]:
    """op -> (default, {variant: refusal reason or ""}) for every op that has variants."""
    return dict(_REGISTERED)


def default_of(op: str) -> str:
    return _REGISTERED[op][0]


@functools.lru_cache(maxsize=None)
def _measured_ops() -> frozenset:
    return frozenset(op for op, _, _ in measured())


def deciding(op: str) -> bool:
    """Whether ``choose`` may pick another variant than ``op``'s default (one is forced, or rows name one): the
    launchers skip working out a shape class otherwise."""
    return bool(_FORCED) or op in _measured_ops()


def choose(op: str, gpu: str, shape: str) -> str:
    """The variant ``op`` runs on ``gpu`` at shapes of class ``shape``: the forced one, a measured winner, or the
    op's default."""
    if _FORCED:
        forced_variant = _FORCED.get(op)
        if forced_variant is not None:
            return forced_variant
    rows = measured()
    if rows:
        found = rows.get((op, gpu, shape))
        if found is not None and found in _REGISTERED[op][1] and not _REGISTERED[op][1][found]:
            return found
    return _REGISTERED[op][0]


def chosen(op: str, device: torch.device, shape: Callable[[], str]) -> str:
    """``choose`` for a launch on ``device``, whose shape class ``shape()`` gives: the launchers ask on every call, so
    the shape class is worked out only when something (a forced variant, a measured row) can change the answer."""
    if not deciding(op):
        return _REGISTERED[op][0]
    return choose(op, gpu_name(device), shape())


@contextlib.contextmanager
def forced(choices: Mapping[str, str]) -> Iterator[None]:
    """Run ``choices`` (op -> variant) whatever the rows say, for the span of the block (tests, the bench)."""
    for op, name in choices.items():
        if op not in _REGISTERED:
            raise ValueError(f"variants: no op {op!r}; ops with variants: {', '.join(sorted(_REGISTERED))}")
        refusals = _REGISTERED[op][1]
        if name not in refusals:
            raise ValueError(f"variants: {op} has no variant {name!r}; it has {', '.join(refusals)}")
        if refusals[name]:
            raise ValueError(f"variants: the plan refuses {op} variant {name!r}: {refusals[name]}")
    saved = dict(_FORCED)
    _FORCED.update(choices)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def forcing() -> Dict[str, str]:
    """The variants forced now (op -> name)."""
    return dict(_FORCED)


def forget_rows() -> None:
    """Read ``MEASURED_FILE`` again at the next ``choose`` (after it, or where it points, changed)."""
    measured.cache_clear()
    _measured_ops.cache_clear()


def status() -> List[str]:
    """One line per op: its variants, the refused ones with why, and the GPUs whose measured rows pick among them (or
    that no GPU has measured them, so the default runs)."""
    rows = read_rows()
    lines = []
    for op, (default, refusals) in sorted(_REGISTERED.items()):
        gpus = sorted({row.gpu for row in rows if row.op == op})
        buildable = [name for name, reason in refusals.items() if not reason]
        where = (f"measured on {', '.join(gpus)}" if gpus
                 else f"unmeasured: no GPU has run bench --suite variants, the default {default!r} runs")
        lines.append(f"{op}: {', '.join(buildable)} ({where})")
        lines.extend(f"  {name}: refused: {reason}" for name, reason in refusals.items() if reason)
    return lines
