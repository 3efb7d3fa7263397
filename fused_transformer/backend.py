"""The one place that decides which implementation an op runs on: the backend's name (``current``) and the
functions that backend runs the ops with (``ops``).

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
import importlib
import os
import sys
import threading
import types
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ._env import computed_once, constant_for_compile, on_facts_forgotten, triton_interpreting

BACKENDS = ("auto", "triton", "cpu", "reference")
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


@computed_once
def triton_unavailable_reason() -> Optional[str]:
    """None when the Triton kernels can be imported, else why not."""
    try:
        triton = importlib.import_module("triton")
    except ImportError as exc:
        return f"triton is not installed ({exc}); pip install triton"
    try:
        from .kernels.toolchain import unsupported_reason
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.kernels":
            raise
        # kernels/ joins the package at install time (setup.py's package_dir): a checkout run in place lacks it.
        raise ImportError(
            f"{exc.name} is missing: {sys.executable} imports {__package__} from {os.path.dirname(__file__)}, a "
            "source checkout not installed into this python; install it with the same interpreter: "
            f"{os.path.basename(sys.executable)} -m pip install -e .") from exc

    return unsupported_reason(triton.__version__)


@computed_once
def cpu_unavailable_reason() -> Optional[str]:
    """None when the C++ CPU kernels are built and load, else why not."""
    try:
        importlib.import_module("fused_transformer._C")
    except ImportError as exc:
        return f"the C++ extension fused_transformer._C is not built or does not load ({exc})"
    return None


@computed_once
def _auto_cpu_backend() -> str:
    """``"cpu"`` when the C++ kernels load, else ``"reference"`` with a warning (once)."""
    reason = cpu_unavailable_reason()
    if reason is None:
        return "cpu"
    warnings.warn(f"fused_transformer: CPU tensors run on the reference ops: {reason}", stacklevel=4)
    return "reference"


# (choice, device type, dtype) -> the backend ``current`` resolved them to, in eager calls: the facts it reads are
# computed once (forgetting one forgets these), and the choice is in the key.
_RESOLVED: Dict[tuple, str] = {}
on_facts_forgotten(_RESOLVED.clear)


def current(device: "torch.device | str | None" = None, dtype: Optional[torch.dtype] = None) -> str:
    """The backend an op would run on for tensors on ``device`` (default: the CPU) of ``dtype``.

    ``"auto"`` sends float64 to the reference (the kernels serve the training dtypes).
    Raises ``RuntimeError`` when the chosen backend cannot run there, saying why.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device if device is not None else "cpu")
    name = _scoped_choice if _scoped_choice is not None else _global_choice  # get_backend(), one call less
    if torch.compiler.is_compiling():  # a traced call guards on the choice, not on this cache
        return _resolve(name, device, dtype)
    key = (name, device.type, dtype)
    found = _RESOLVED.get(key)
    if found is None:
        found = _RESOLVED[key] = _resolve(name, device, dtype)
    return found


def _resolve(name: str, device: torch.device, dtype: Optional[torch.dtype]) -> str:
    device_type = device.type
    if name == "auto":
        if dtype == torch.float64:
            return "reference"
        if device_type == "cuda":
            return "triton" if triton_unavailable_reason() is None else "reference"
        if device_type != "cpu":
            return "reference"
        return _auto_cpu_backend()
    if name == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend 'triton' is unavailable: {reason}")
        if device_type == "cuda":
            return name
        if device_type == "cpu" and not triton_interpreting():
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


# The names of a backend's attention functions (contract.py writes down their interface; what each computes is
# route.SUPPORTS); the reference has the composed ops instead of the forward / backward pairs, autograd
# differentiating them. The other ops find their launchers themselves (``fused_transformer.ops.Launchers``).
INTERFACE = ("attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd", "attention_weights",
             "attention_with_kvcache", "DIFFERENTIABLE_LSE")
REFERENCE_OPS = ("attention", "attention_varlen", "attention_weights", "attention_with_kvcache")
# backend -> its functions, filled on its first use: importing the C++ extension or triton is its first use's cost,
# not the package's.
_OPS: Dict[str, types.SimpleNamespace] = {}


def _import_ops(name: str) -> types.SimpleNamespace:
    if name == "triton":
        from .kernels import backend as triton_backend

        return types.SimpleNamespace(**{n: getattr(triton_backend, n) for n in INTERFACE})
    if name == "cpu":
        from . import cpu_ops

        return types.SimpleNamespace(**{n: getattr(cpu_ops, n) for n in INTERFACE})
    if name != "reference":
        raise ValueError(f"backend {name!r} has no ops of its own: name one of triton, cpu, reference")
    from . import reference

    return types.SimpleNamespace(**{n: getattr(reference, "run_" + n) for n in REFERENCE_OPS})


@constant_for_compile
def _load(name: str) -> bool:
    """Import backend ``name``'s ops (once). torch.compile cannot trace an import: it calls this at trace time."""
    if name not in _OPS:
        _OPS[name] = _import_ops(_check_name(name, "backend"))
    return True


def ops(name: str) -> types.SimpleNamespace:
    """The functions backend ``name`` (not ``"auto"``) runs the ops with, imported on first use: for triton and cpu
    ``INTERFACE``'s, for the reference ``REFERENCE_OPS``'. A function replaced here (a test's spy, a user's patch) is
    the one the ops call."""
    if torch.compiler.is_compiling():
        _load(name)  # first: a trace whose process has not imported them yet then reads _OPS after the import
    found = _OPS.get(name)
    if found is None:
        _load(name)
        found = _OPS[name]
    return found
