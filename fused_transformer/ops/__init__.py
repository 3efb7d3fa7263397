"""The ops, each described once in a module of its own (``fused_transformer.ops.<op>``), and the registry the tools
read: ``check``, ``bench`` (every suite), ``tune``, the overhead suite and ``gpu-check`` iterate ``registered()``, so
registering an op puts it in every tool. Nothing here names an op.

An op module reads top-down: its contract (spec, checks, errors), its float64 reference and torch's own path
computing the same result, the facts the route decides on, its ``autograd.Function`` over the backends' launchers
(``Launchers``: a backend provides the op by defining them), its public function, and its cases (``Example``).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .._env import constant_for_compile

Tensor = torch.Tensor
# ``draw(*shape, scale=1.0)``: random numbers of ``shape`` (never zeros), float64, from the tool's own generator.
Draw = Callable[..., Tensor]


@dataclass(frozen=True)
class Example:
    """One call of an op on random tensors, as a tool runs it: ``tensors(draw)`` the tensor arguments by name,
    ``options`` the others. The op's ``function`` and ``torch_path`` take ``(**tensors, **options)`` alike.
    ``shape`` names the sizes a table shows (``batch``, ``seq_len``, ``d_model``, ``d_ff``); ``size`` is the route's
    size of the call (``Op.size_of``)."""

    label: str
    tensors: Callable[[Draw], Dict[str, Tensor]]
    options: Mapping[str, object] = field(default_factory=dict)
    quick: bool = False
    shape: Mapping[str, int] = field(default_factory=dict)
    size: int = 0

    def draw(self, draw: Draw) -> Dict[str, Tensor]:
        return self.tensors(draw)


@dataclass(frozen=True)
class TuneSeries:
    """What one series of ``tune``'s route rows measures: the rows' cells but the size, an example per size."""

    dropout: str  # "yes" or "no"
    examples: Tuple[Example, ...]
    head_dim: str = "*"
    mask: str = "*"
    passes: Tuple[str, ...] = ("forward", "training")  # forward only for an op without a backward


@dataclass(frozen=True)
class VariantCases:
    """Where ``bench --suite variants`` measures the variants of one of the op's kernels (``kernels.variants``): the
    name they are registered under there, whether the backward is timed, the examples by ``(gpu, quick)`` and the
    shape class each falls in (the rows' key). ``choose(example, device, dtype, names)``: those of the buildable
    variants ``names`` (the default first) whose launch differs from the default's on the example (None: every one);
    ``vendor(device)``: the vendor's kernel the variants race, ``(name, call)`` taking the example's arguments (None:
    the op's torch path, named "torch"); ``dtype``: the precision of the CPU's interpreted case (None: the suite's)."""

    variant_op: str
    backward: bool
    examples: Callable[[bool, bool], Sequence[Example]]
    shape_class: Callable[[Example, torch.dtype], str]
    choose: Optional[Callable[[Example, torch.device, torch.dtype, Sequence[str]], Sequence[str]]] = None
    vendor: Optional[Callable[[torch.device], Tuple[str, Callable[..., Tensor]]]] = None
    dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class Work:
    """What a bench case counts (``None`` where it does not): floating-point operations and bytes moved."""

    flops: Optional[float] = None
    nbytes: Optional[float] = None


class Launchers:
    """Where each backend defines an op's launchers: ``{backend: "module:forward_name,backward_name"}``, imported on
    first use. A backend that does not define them does not compute the op (``route.Call.backends``): the route falls
    back."""

    def __init__(self, prepare: Optional[Callable[[str], None]] = None, **where: str):
        self.where = where
        self.prepare = prepare  # called with a backend's name before its first use (registers what it needs)
        self._found: Dict[str, Tuple[Callable, Callable]] = {}

    def __call__(self, backend: str) -> Tuple[Callable, Callable]:
        """``(forward, backward)`` of ``backend``."""
        if torch.compiler.is_compiling():
            _load(self, backend)  # first: a trace whose process has not imported them reads _found after the import
        found = self._found.get(backend)
        if found is None:
            _load(self, backend)
            found = self._found[backend]
        return found


@constant_for_compile  # torch.compile cannot trace an import: it calls this at trace time
def _load(launchers: Launchers, backend: str) -> bool:
    """Import ``backend``'s launchers of ``launchers`` (once)."""
    if backend not in launchers._found:
        if launchers.prepare is not None:
            launchers.prepare(backend)
        module, names = launchers.where[backend].split(":")
        loaded = importlib.import_module(module)
        launchers._found[backend] = tuple(getattr(loaded, name) for name in names.split(","))
    return True


class Rivals:
    """What ``bench`` also times beside an op's torch path and ours: implementations from elsewhere (other libraries,
    each of torch's own kernels), prepared outside the timed calls. An op without rivals is timed against its torch
    path alone."""

    def names(self, example: Example, device: torch.device) -> Tuple[str, ...]:
        """The rivals of ``example`` on ``device`` that can run there (installed, on this device type)."""
        return ()

    def calls(self, example: Example, tensors: Dict[str, Tensor], names: Sequence[str],
              backward: bool) -> "RivalCalls":
        """The calls of ``names`` on ``tensors``, and of the op's baseline where the bench must time it prepared (a
        mask it takes in another form, made here outside the timed call)."""
        return RivalCalls({})

    def may_refuse(self, impl: str) -> bool:
        """Whether ``impl`` may refuse a case (left out of it with a note) rather than fail the run."""
        return False

    def about(self, device: torch.device) -> List[str]:
        """What bench prints before a run on ``device``: what the rivals are, which are left out and why."""
        return []


@dataclass
class RivalCalls:
    """``calls``: implementation -> a call of it; ``leaves``: further tensors it differentiates (copies in its layout);
    ``grads``: implementation -> its output gradient made from the baseline's (the same numbers, in its layout);
    ``notes``: implementation -> a remark for the bench's table."""

    calls: Dict[str, Callable[[], Tensor]]
    leaves: List[Tensor] = field(default_factory=list)
    grads: Dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Op:
    """An op as the tools see it.

    ``function`` is the public op, ``torch_path`` torch's own ops computing the same result (the baseline of bench,
    tune and the overhead suite, named ``baseline`` in bench's tables), both called as ``(**example.tensors,
    **example.options)``; ``outputs`` names what ``function`` returns (one tensor, or a tuple); ``constants`` the
    tensor arguments no gradient flows to (masks, offsets, constants), ``float32`` those kept in float32 in every
    precision (float64 for the oracle). ``check``: check's grid; ``bench(gpu, lengths)``: bench's cases over sequence
    lengths (None: no bench suite; ``suite`` its name, default the op's), ``lengths`` their defaults by device type
    (full, quick), ``rivals`` what else it times; ``work(example, itemsize, backward)`` what a case counts;
    ``throughput`` the plots' metric; ``overhead``: the tiny calls of the overhead suite (the first named as the op,
    the others ``op (label)``) with their modes and the target for ours / thin of the first (None: no target);
    ``tune(device_type, dtype, quick)`` the series ``tune`` measures; ``routes`` a few calls whose route ``check``
    prints (label, example); ``describe(gpu)`` the bench suite's shapes in words; ``reference`` the float64 oracle
    (``function``'s arguments, plus ``keep_mask``: a dropout mask to replay), also
    ``fused_transformer.reference.<name>``. A tool skips an op that gives it nothing to run."""

    name: str
    function: Callable[..., object]
    torch_path: Optional[Callable[..., object]]
    size_of: str
    outputs: Tuple[str, ...]
    check: Tuple[Example, ...] = ()
    bench: Optional[Callable[[bool, Sequence[int]], Sequence[Example]]] = None
    lengths: Mapping[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=dict)
    work: Callable[[Example, int, bool], Work] = lambda example, itemsize, backward: Work()
    throughput: Tuple[str, str] = ("tokens_per_s", "tokens/s")
    describe: Callable[[bool], str] = lambda gpu: ""
    overhead: Tuple[Example, ...] = ()
    overhead_target: Mapping[str, Optional[float]] = field(default_factory=dict)
    tune: Callable[[str, torch.dtype, bool], Sequence[TuneSeries]] = lambda device_type, dtype, quick: ()
    reference: Optional[Callable[..., object]] = None
    call_of: Optional[Callable[..., object]] = None  # (tensors, options, device, needs_grad) -> its route.Call
    route_examples: Tuple[Example, ...] = ()
    launchers: Optional[Launchers] = None
    measured: str = ""  # the op's rows of the route table measured on GPUs (``route.parse_rows``), newest first
    variants: Tuple[VariantCases, ...] = ()
    # The overhead suite's thin for an op whose launches include torch's own (the products of the feed-forward): an
    # autograd.Function that makes those and allocates the rest, taking the example's tensors; None: the suite's
    # ThinFunction, which allocates the outputs only.
    overhead_thin: Optional[Callable[..., Tensor]] = None
    constants: Tuple[str, ...] = ()
    float32: Tuple[str, ...] = ()
    baseline: str = "torch"
    rivals: Rivals = Rivals()
    suite: str = ""  # bench's suite of the op ("": its name)
    bench_modes: Tuple[str, ...] = ("fwd", "fwd+bwd")  # "fwd+bwd" times the backward too
    differentiable: bool = True  # whether check takes the gradients of its inputs

    @property
    def bench_suite(self) -> Optional[str]:
        """The name of the op's bench suite, None where it has none."""
        return None if self.bench is None else (self.suite or self.name)

    def differentiated(self, tensors: Mapping[str, Optional[Tensor]]) -> List[Tensor]:
        """The tensors of a call that a gradient flows to: the floating ones, but ``constants``."""
        return [t for name, t in tensors.items()
                if t is not None and name not in self.constants and t.is_floating_point()]

    def route_call(self, example: Example, device: torch.device, dtype: torch.dtype) -> object:
        """The ``route.Call`` of ``example`` on ``device`` in ``dtype``, with gradients, made without any data (its
        tensors on the meta device): what ``check`` prints the route of."""
        def draw(*shape: int, scale: float = 1.0) -> Tensor:
            return torch.empty(shape, device="meta", dtype=dtype)

        return self.call_of(example.draw(draw), example.options, device, True)


_REGISTERED: Dict[str, Op] = {}


def register(op: Op) -> Op:
    """Make ``op`` known to every tool."""
    _REGISTERED[op.name] = op
    return op


_loaded = []


def _load_all() -> None:
    """Import every op module of this package (each registers itself), once."""
    if not _loaded:
        _loaded.append(True)
        for info in pkgutil.iter_modules(__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{__name__}.{info.name}")


def registered() -> List[Op]:
    """Every op, in the order the modules registered them."""
    _load_all()
    return list(_REGISTERED.values())


def get(name: str) -> Op:
    """The registered op ``name``."""
    _load_all()
    if name not in _REGISTERED:
        raise ValueError(f"{name!r} is not an op; expected one of {', '.join(_REGISTERED)}")
    return _REGISTERED[name]


def names() -> Tuple[str, ...]:
    return tuple(op.name for op in registered())
