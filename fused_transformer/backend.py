"""The one place that decides which implementation an op runs on.

Backends:
  ``"triton"``     Triton kernels (``fused_transformer.kernels``). CUDA tensors, or CPU tensors under the
                   Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
  ``"cpu"``        C++ kernels from ``csrc/`` (built by setup.py when a compiler is present).
  ``"reference"``  plain PyTorch (``fused_transformer.reference``): always available, differentiable.
  ``"auto"``       the default: CUDA tensors -> triton, CPU tensors -> cpu if built, else reference.

The choice comes, from strongest to weakest, from ``use_backend(name)`` (a context manager),
``set_backend(name)``, and the environment variable ``FUSED_TRANSFORMER_BACKEND`` read at import. Like
``torch.backends`` flags and ``sdpa_kernel``, the choice is process-wide (not per thread): plain module
globals, which ``torch.compile`` reads at trace time and guards on, so changing it recompiles. ``use_backend``
blocks may overlap across threads: the innermost block still open decides, and each block's exit removes only
its own choice, so once every block has closed ``set_backend``'s choice holds again.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import threading
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

BACKENDS = ("auto", "triton", "cpu", "reference")
T = TypeVar("T")
ENV_VAR = "FUSED_TRANSFORMER_BACKEND"


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a backend; expected one of {', '.join(BACKENDS)}")
    return name.lower()


_global_choice = _check_name(os.environ.get(ENV_VAR, "auto"), ENV_VAR)
# The open use_backend blocks, oldest first, as (token, name); _scoped_choice is the newest one's name, the one
# value traced code reads (a plain string, so torch.compile guards on the choice, not on the blocks).
_open_blocks: List[Tuple[object, str]] = []
_scoped_choice: Optional[str] = None
_blocks_lock = threading.Lock()


def set_backend(name: str) -> None:
    """Choose the backend for every op from now on (overridden inside ``use_backend`` blocks while they are open)."""
    global _global_choice
    _global_choice = _check_name(name, "backend")


def get_backend() -> str:
    """The backend name as chosen (possibly ``"auto"``), before resolution for a device."""
    return _scoped_choice if _scoped_choice is not None else _global_choice


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops inside the ``with`` block on backend ``name``."""
    global _scoped_choice
    token = (object(), _check_name(name, "backend"))
    with _blocks_lock:
        _open_blocks.append(token)
        _scoped_choice = token[1]
    try:
        yield
    finally:
        with _blocks_lock:
            _open_blocks.remove(token)
            _scoped_choice = _open_blocks[-1][1] if _open_blocks else None


# What cannot change while a process runs (an import that worked, the interpreter switch read before triton is
# imported) is a constant to torch.compile: it calls these at trace time instead of tracing into them.


def constant_for_compile(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without its import of ``torch._dynamo``
    (0.8 s, which would double the import time of this package and import triton before ``python -m
    fused_transformer`` can switch the interpreter on). tests/test_drop_in.py fails if torch stops honouring it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def _computed_once(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn()`` computed at the first call only (``cache_clear()`` forgets it), and a constant to torch.compile.
    Not ``functools.lru_cache``: torch.compile traces through that wrapper into ``fn``."""
    results: Dict[str, T] = {}

    @functools.wraps(fn)
    def once() -> T:
        if "value" not in results:
            results["value"] = fn()
        return results["value"]

    once.cache_clear = results.clear  # type: ignore[attr-defined]
    return constant_for_compile(once)


@constant_for_compile
def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def draw_dropout_seed(device: torch.device) -> torch.Tensor:
    """A dropout (Philox) seed: one int64 element on ``device``, drawn from torch's generator for that device.

    ``torch.manual_seed`` reproduces dropout on every backend. The draw is an ordinary tensor op, as in torch's
    own fused dropout: it stays inside a ``torch.compile`` graph (no host value to specialise on, so no
    recompile per step) and inside a CUDA graph, whose every replay draws a new seed. The kernels read it
    themselves."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., N]`` as ``[rows, N]`` for the row-wise kernels (a view when the strides allow); unlike
    ``reshape(-1, N)``, also when N = 0."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def heads_interleaved_strides(shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """The strides of a ``[B, H, L, D]`` tensor whose memory is ``[B, L, H, D]``: what the attention kernels write,
    so that merging the heads (``out.transpose(1, 2).flatten(2)``) is a view, not a copy."""
    _, heads, length, head_dim = shape
    return (length * heads * head_dim, head_dim, heads * head_dim, 1)


def empty_heads_interleaved(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``like`` ``[B, H, L, D]`` with ``heads_interleaved_strides``."""
    return torch.empty_strided(like.shape, heads_interleaved_strides(like.shape), dtype=like.dtype,
                               device=like.device)


@_computed_once
def triton_unavailable_reason() -> Optional[str]:
    """None when the Triton kernels can be imported, else why not."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return f"triton is not installed ({exc}); pip install triton"
    return None


@_computed_once
def cpu_unavailable_reason() -> Optional[str]:
    """None when the C++ CPU kernels are built and load, else why not."""
    try:
        importlib.import_module("fused_transformer._C")
    except ImportError as exc:
        return f"the C++ extension fused_transformer._C is not built or does not load ({exc})"
    return None


@_computed_once
def _auto_cpu_backend() -> str:
    """``"cpu"`` when the C++ kernels load, else ``"reference"`` with a warning (once)."""
    reason = cpu_unavailable_reason()
    if reason is None:
        return "cpu"
    warnings.warn(f"fused_transformer: CPU tensors run on the reference ops: {reason}", stacklevel=4)
    return "reference"


def current(device: "torch.device | str | None" = None, dtype: Optional[torch.dtype] = None) -> str:
    """The backend an op would run on for tensors on ``device`` (default: the CPU) of ``dtype``.

    ``"auto"`` sends float64 to the reference (the kernels serve the training dtypes).
    Raises ``RuntimeError`` when the chosen backend cannot run there, saying why.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device if device is not None else "cpu")
    name = get_backend()
    if name == "auto":
        if dtype == torch.float64:
            return "reference"
        if device.type == "cuda":
            return "triton" if triton_unavailable_reason() is None else "reference"
        if device.type != "cpu":
            return "reference"
        return _auto_cpu_backend()
    if name == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend 'triton' is unavailable: {reason}")
        if device.type == "cpu" and not triton_interpreting():
            raise RuntimeError(
                "backend 'triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before importing triton, or move the tensors to a CUDA device"
            )
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"backend 'triton' does not run on device {device}")
    if name == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"backend 'cpu' got tensors on {device}; it runs on CPU tensors only")
        reason = cpu_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend 'cpu' is unavailable: {reason}")
    return name
