"""Who runs a call: our kernel, torch's own path computing the same result, or the reference. One place decides,
for every op and every door (the functional ops and the modules above them, torch's SDPA registry, the transformers
interface); the rest of the package asks ``decide`` and never decides itself.

A call is described by ``Call``: the op, the door, the device (its tag, ``DeviceFacts``: ``"H200"`` for a GPU by its
model, ``"cpu-avx512-t2"`` for a CPU by instruction set and threads), dtype, head dim, what its mask is (``"none"``,
``"causal"``, ``"alibi"``, ``"causal+alibi"``, or ``"other"`` for anything torch's path does not compute as ours does), dropout, the op's size (its ``Op.size_of``), whether
it needs gradients and the LSE, whether the caller asked for deterministic algorithms, the features a backend must
have for it (score modifiers, sinks) and the backends that compute the op at all (``Call.backends``). ``decide(call,
choice, ours)`` is a pure function of it, the backend the user chose and the backend whose kernels serve the device;
in order:

0. At a door in front of a kernel torch already had (torch's SDPA registry, ``at_door``): a fact of the call only
   that kernel serves (``Call.torch_keeps``: its dtypes, a debug mask, ALiBi slopes, a paged cache, ...) sends the
   call to it, and a call torch has no kernel for there (``Call.torch_cannot`` at a door: the varlen ops on the CPU)
   runs ours, whatever backend was named.
1. A named backend (``use_backend("triton")`` / ``"cpu"`` / ``"reference"``) runs the call, on the reference where
   it lacks a feature the call needs (``SUPPORTS``): a call a backend cannot serve falls back, it does not raise.
2. ``"auto"``: float64 runs on the reference (the oracle; the kernels serve the training dtypes), as does a device
   with no kernels of ours.
3. Where torch's path computes the same result (``torch_refuses`` says why not elsewhere), the first row of the
   route table that matches the call decides: torch's path where its highest ``speedup`` (torch's time over ours) is
   below 1, unless the call needs gradients, the caller asked for determinism and the row does not say torch's
   backward is deterministic. Without a matching row, the default (``_default``): ours, unless the op says torch's
   (``Call.torch_default``: an op with nothing to fuse in this call, a norm without dropout).
4. Otherwise ours; torch's path where ours does not compute the op, the reference where it lacks a feature.

Each op's facts (how its ``Call`` is made, its measured rows) live in its own module (``fused_transformer.ops``);
``explain()`` shows a user who ran each call of their own model, and why.

The doors, and what each records in ``explain()`` (``Record.door``):

- the functional ops (``"functional"``), and the modules and the transformers interface, which call them: each
  call's decision. The interface hands a trainable float mask it cannot differentiate beside the kernel (with
  dropout, softcap or sinks) to ``attention`` as it is: the call needs "attn_mask gradients", which no backend of
  ours computes, so it runs on the reference; its ``output_attentions`` weights are an ``attention_weights`` call
  (capped ones on the reference).
- a module that hands an input it does not fuse (nested tensors, parameters of mixed dtypes) to torch.nn's
  ``forward`` (``"module"``): ``ran_elsewhere``, backend ``"torch"``.
- torch's SDPA registry (``"sdpa"``): ``at_door``, every call of its ops, forward and backward alike: ours, or
  ``"torch"`` for the kernel torch had, whether the route chose it or the call needs it (``torch_keeps``), whatever
  backend was named.

The route table is text, one row a line (``parse_rows``), each naming the device it was measured on: the rows
``python -m fused_transformer tune`` measured on this machine (``tuned_rows``, kept in the user's cache keyed by
device, driver and versions) first, then the built-in rows of this device (each op's ``Op.measured``), then those of
the nearest measured device as priors (``with_priors``, ``nearest``; docs/route.md). A traced attention call (torch.compile, torch.export) runs ours:
one custom op, the same graph on every GPU. The forward's decision is the backward's (autograd differentiates the
path the forward ran).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import backend
from ._env import computed_once, constant_for_compile, on_facts_forgotten
from .contract import ScoreMods

DOORS = ("functional", "sdpa")  # the transformers interface calls the functional ops: its door is theirs


def op_names() -> Tuple[str, ...]:
    """Every op a route row may name: the registry's (``fused_transformer.ops``)."""
    from . import ops

    return ops.names()


# The features each backend's kernels compute (score modifiers by ScoreMods' field names, "sinks", the kernel-level
# options); a call needing another runs on the reference.
SUPPORTS: Dict[str, FrozenSet[str]] = {
    "triton": frozenset(ScoreMods._fields) | {"sinks", "recompute", "allow_tf32"},
    "cpu": frozenset({"softcap", "alibi_slopes", "sinks", "float32 head dims above 128", "head dims above 256"}),
}
# Features that torch's path computes as ours does: the widths of the operands (a backend of ours may lack them),
# ALiBi (SDPA with the float bias).
TORCH_COMPUTES = frozenset({"float32 head dims above 128", "head dims above 256", "alibi_slopes"})


class Call(NamedTuple):
    """What decides who runs a call (module docstring)."""

    op: str
    device: str  # the device's tag (DeviceFacts.tag): "H200", "cpu-avx512-t2", ...
    dtype: torch.dtype
    door: str = "functional"  # the transformers interface calls the functional ops: its door is theirs
    head_dim: int = 0
    mask: str = "none"  # "none", "causal", "other"; "none" for ops without one
    dropout: bool = False
    size: Optional[int] = None  # what the op's size counts; None where unknown (a traced call's dynamic shape)
    needs_grad: bool = False
    needs_lse: bool = False
    deterministic: bool = False
    needs: FrozenSet[str] = frozenset()  # features a backend must compute (SUPPORTS)
    torch_cannot: str = ""  # a fact of the call's tensors that torch's path does not compute as ours does; at a
    # door, that torch has no kernel for the call there (ours runs it, whatever backend was named)
    torch_default: str = ""  # why torch's path runs the call when no row matches ("": ours by default)
    backends: FrozenSet[str] = frozenset()  # the backends of ours that compute the op (empty: every one)
    torch_keeps: str = ""  # at a door, a fact of the call only the kernel torch had there serves (its dtypes, ...)


class Decision(NamedTuple):
    """Who runs the call: ``"torch"``, ``"reference"`` or a backend of ours (``"triton"``, ``"cpu"``), and why."""

    backend: str
    reason: str

    @property
    def ours(self) -> bool:
        return self.backend in SUPPORTS


class Row(NamedTuple):
    """One line of the route table: calls it matches, and what was measured there."""

    op: str
    passes: str  # "forward" (no gradients), "training" (forward + backward) or "*"
    device: str
    dtypes: Tuple[str, ...]  # dtype names ("bfloat16") or ("*",)
    head_dims: Tuple[str, ...]
    masks: Tuple[str, ...]
    dropout: str  # "yes", "no", "*"
    doors: Tuple[str, ...]
    sizes: Tuple[int, Optional[int]]  # [lo, hi): hi None for no limit
    speedup: Tuple[float, float]  # torch's time over ours, lowest and highest measured
    torch_deterministic: str  # "yes", "no", "-" (forward rows)
    source: str

    def matches(self, call: Call) -> bool:
        passes = "training" if call.needs_grad else "forward"
        lo, hi = self.sizes
        return (self.op == call.op and self.passes in ("*", passes) and self.device in ("*", call.device)
                and _in(self.dtypes, str(call.dtype).replace("torch.", "")) and _in(self.head_dims, str(call.head_dim))
                and _in(self.masks, call.mask) and self.dropout in ("*", "yes" if call.dropout else "no")
                and _in(self.doors, call.door) and ((lo == 0 and hi is None) or (
                    call.size is not None and lo <= call.size and (hi is None or call.size < hi))))

    def line(self) -> str:
        """The row as ``parse_rows`` reads it."""
        lo, hi = self.sizes
        sizes = "*" if lo == 0 and hi is None else f"{lo}..{'' if hi is None else hi}"
        low, high = self.speedup
        speedup = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
        cells = (self.op, self.passes, self.device, ",".join(self.dtypes), ",".join(self.head_dims),
                 ",".join(self.masks), self.dropout, ",".join(self.doors), sizes, speedup, self.torch_deterministic)
        return "  ".join(f"{c:<{w}}" for c, w in zip(cells, _WIDTHS)) + "  " + self.source


def _in(cells: Tuple[str, ...], value: str) -> bool:
    return cells == ("*",) or value in cells


COLUMNS = ("op", "pass", "device", "dtype", "head_dim", "mask", "dropout", "door", "size", "speedup", "torch_det",
           "source")
_WIDTHS = (12, 8, 13, 16, 8, 11, 7, 10, 14, 9, 9)
HEADER = "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, _WIDTHS)) + "  " + COLUMNS[-1]


def parse_rows(text: str, origin: str = "the route table") -> List[Row]:
    """The rows of a route table: one row a line under ``HEADER``'s columns, cells split on whitespace, the source the
    rest of the line; ``#`` starts a comment. A size is ``lo..hi`` (``hi`` left out: no limit) or ``*``; a speedup
    ``x`` or ``low-high``; lists are comma-separated; ``*`` matches anything."""
    rows, names = [], op_names()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.split()[0] == COLUMNS[0]:
            continue
        cells = line.split(None, len(COLUMNS) - 1)
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{origin}, line {number}: expected {len(COLUMNS)} cells ({' '.join(COLUMNS)}), got "
                             f"{len(cells)}: {raw!r}")
        op, passes, device, dtypes, head_dims, masks, dropout, doors, sizes, speedup, det, source = cells
        match = re.fullmatch(r"(\d+)\.\.(\d*)", sizes)
        ratio = re.fullmatch(r"(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?", speedup)
        if (op not in names or passes not in ("forward", "training", "*") or dropout not in ("yes", "no", "*")
                or not all(door in (*DOORS, "*") for door in doors.split(","))
                or det not in ("yes", "no", "-") or (sizes != "*" and match is None) or ratio is None):
            raise ValueError(f"{origin}, line {number}: a cell is out of range (op one of {', '.join(names)}; "
                             "pass "
                             "forward/training/*; dropout yes/no/*; door functional/sdpa/*; size lo..hi or *; "
                             f"speedup x or low-high; torch_det yes/no/-): {raw!r}")
        bounds = (0, None) if match is None else (int(match[1]), int(match[2]) if match[2] else None)
        low = float(ratio[1])
        rows.append(Row(op, passes, device, tuple(dtypes.split(",")), tuple(head_dims.split(",")),
                        tuple(masks.split(",")), dropout, tuple(doors.split(",")), bounds,
                        (low, float(ratio[2]) if ratio[2] else low), det, source))
    return rows


def torch_refuses(call: Call) -> Optional[str]:
    """None where torch's path computes what ours computes for ``call``, else why it does not."""
    if call.door == "sdpa":
        return None  # the kernel the op had before ours: it computes the call as torch always did
    if call.torch_cannot:
        return call.torch_cannot
    if call.needs - TORCH_COMPUTES:
        return "its " + ", ".join(sorted(call.needs - TORCH_COMPUTES))
    if call.mask == "other":
        return "its masks (SDPA's differ on rows with no key left, and cost a dense mask)"
    if call.needs_lse:
        return "the LSE (SDPA returns none)"
    return None


def _default(call: Call) -> Tuple[bool, str]:
    """Whether torch's path runs a call no row matches, and why."""
    if call.torch_default:
        return True, call.torch_default
    return False, "no measured row: ours (the default)"


def _missing(call: Call, backend_name: str) -> str:
    """What of ``call`` backend ``backend_name`` does not compute, in words ("" where it computes it all)."""
    if call.backends and backend_name not in call.backends:
        return call.op
    return ", ".join(sorted(call.needs - SUPPORTS[backend_name]))


def decide(call: Call, choice: str, ours: Optional[str], rows: Optional[Iterable[Row]] = None) -> Decision:
    """Who runs ``call`` (module docstring): ``choice`` the backend the user chose (``"auto"`` or a name), ``ours``
    the backend of our kernels on the call's device (None where there is none), ``rows`` the route table (default:
    ``table()``)."""
    if call.door != "functional" and (call.torch_keeps or call.torch_cannot):  # a door: the rule before the rules
        if call.torch_keeps:
            return Decision("torch", f"the kernel torch had: ours does not serve {call.torch_keeps}")
        if ours in SUPPORTS:
            return Decision(ours, f"torch has no kernel for {call.torch_cannot}")
    if choice != "auto":
        if choice == "reference":
            return Decision("reference", "use_backend('reference')")
        missing = _missing(call, choice)
        if missing:
            return Decision("reference", f"backend {choice!r} does not compute {missing}")
        return Decision(choice, f"use_backend({choice!r})")
    if ours not in SUPPORTS:  # backend.current's answer for "auto": float64, or a device without kernels of ours
        why = "float64" if call.dtype == torch.float64 else f"{call.device} (no kernels of ours there)"
        return Decision("reference", f"{why} runs on the reference")
    missing = _missing(call, ours)
    refused = torch_refuses(call)
    if refused is not None:
        if missing:
            return Decision("reference", f"{ours} does not compute {missing}")
        return Decision(ours, f"torch's path does not serve {refused}")
    row = next((r for r in (table() if rows is None else rows) if r.matches(call)), None)
    if row is None:
        to_torch, why = _default(call)
    else:
        low, high = row.speedup
        to_torch = high < 1.0
        why = f"ours {low:.2f}{'' if low == high else f'-{high:.2f}'}x torch ({row.source})"
        if to_torch and call.needs_grad and call.deterministic and row.torch_deterministic != "yes":
            return Decision(ours, why + "; torch's backward is not deterministic and determinism was asked for")
    if to_torch:
        return Decision("torch", why)
    if missing:
        if call.backends and ours not in call.backends:  # torch's path computes it (``refused`` is None here)
            return Decision("torch", f"{ours} does not compute {call.op}: torch's path")
        return Decision("reference", f"{ours} does not compute {missing}")
    return Decision(ours, why)


# --------------------------------------------------------------------------------------------------- the table


def cache_dir() -> str:
    """Where ``tune`` keeps its rows: ``$FUSED_TRANSFORMER_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, under
    ``fused_transformer/routes``."""
    root = os.environ.get("FUSED_TRANSFORMER_CACHE")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "fused_transformer")
    return os.path.join(root, "routes")


def device_key(device: torch.device) -> str:
    """The name of a device's tuned rows: its model, capability or instruction set, driver and the versions of
    torch and triton (rows measured under others do not apply)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = torch.version.cuda or "none"
        name = f"{props.name}-sm{props.major}{props.minor}-cuda{driver}"
    else:
        import platform
        name = f"{platform.processor() or platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    key = f"{device.type}-{name}-torch{torch.__version__}-triton{triton_version}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", key)


def tuned_path(device: torch.device) -> str:
    return os.path.join(cache_dir(), device_key(device) + ".txt")


# ------------------------------------------------------------------------------------------------- devices


class DeviceFacts(NamedTuple):
    """What the route knows of a device: ``tag`` names it in the rows (``Call.device``, a row's device cell); the
    rest is what ``nearest`` compares."""

    tag: str  # a GPU's model ("H200", "RTX5090"); a CPU's "cpu-<instruction set>-t<threads>" ("cpu-avx512-t2")
    kind: str  # "cuda" or "cpu"
    capability: Tuple[int, int] = (0, 0)  # a GPU's compute capability
    bandwidth: float = 0.0  # a GPU's memory bandwidth in GB/s (0: unknown)
    isa: str = ""  # a CPU's instruction set, as torch dispatches on it ("avx512", "avx2", "default", ...)
    threads: int = 0  # a CPU's threads (torch.get_num_threads())


# The devices the built-in rows were measured on (their rows' device cell is the tag). A GPU's figures are its
# vendor's: capability, HBM bandwidth.
MEASURED_DEVICES: Dict[str, DeviceFacts] = {facts.tag: facts for facts in (
    DeviceFacts("H200", "cuda", (9, 0), 4800.0),
    DeviceFacts("cpu-avx512-t2", "cpu", isa="avx512", threads=2),
    DeviceFacts("cpu-avx2-t2", "cpu", isa="avx2", threads=2),
)}
# Threads a CPU's rows stretch to: a factor of this either way (rows taken on 2 threads route 1 to 4, not 64).
CPU_THREADS_FACTOR = 2


def gpu_tag(name: str) -> str:
    """The tag of a GPU from its device name: the model, without the vendor's and the product line's words
    (``"NVIDIA H200"`` -> ``"H200"``, ``"NVIDIA GeForce RTX 5090"`` -> ``"RTX5090"``, ``"Tesla T4"`` -> ``"T4"``)."""
    words = [w for w in re.split(r"\s+", name.strip()) if w not in ("NVIDIA", "GeForce", "Tesla", "Quadro")]
    return re.sub(r"[^A-Za-z0-9.-]+", "", "".join(words)) or "gpu"


def gpu_facts(props) -> DeviceFacts:
    """``DeviceFacts`` of a GPU from its properties (``torch.cuda.get_device_properties``, or anything with their
    ``name``, ``major``, ``minor`` and, where torch reports them, ``memory_clock_rate`` (kHz) and
    ``memory_bus_width`` (bits)): bandwidth = 2 transfers a clock x the bus's bytes."""
    clock, width = getattr(props, "memory_clock_rate", 0) or 0, getattr(props, "memory_bus_width", 0) or 0
    bandwidth = 2.0 * clock * 1e3 * width / 8 / 1e9
    return DeviceFacts(gpu_tag(props.name), "cuda", (int(props.major), int(props.minor)), round(bandwidth, 1))


def cpu_facts(threads: Optional[int] = None, isa: Optional[str] = None) -> DeviceFacts:
    """``DeviceFacts`` of this CPU: the instruction set torch dispatches on (``ATEN_CPU_CAPABILITY`` lowers it) and
    the threads it runs on (default: now); both given, that CPU's. ``$FUSED_TRANSFORMER_ROUTE_CPU``
    (``cpu-<isa>-t<threads>``) routes this CPU's calls as that CPU's instead: the tests name one no row was measured
    on, so that what they check does not rest on the CPU they run on."""
    if threads is None and isa is None:
        named = os.environ.get("FUSED_TRANSFORMER_ROUTE_CPU")
        if named:
            found = _cpu_of_tag(named)
            if found is None:
                raise ValueError(f"FUSED_TRANSFORMER_ROUTE_CPU={named!r}: expected cpu-<instruction set>-t<threads>, "
                                 "e.g. cpu-avx512-t2")
            return found
    isa = (torch.backends.cpu.get_cpu_capability() if isa is None else isa).lower()
    threads = torch.get_num_threads() if threads is None else threads
    return DeviceFacts(f"cpu-{isa}-t{threads}", "cpu", isa=isa, threads=threads)


def facts_of_tag(tag: str) -> Optional[DeviceFacts]:
    """The facts behind a row's device cell: a measured device's, or a CPU's read from its tag (a row ``tune``
    wrote); None for a tag that names neither."""
    found = MEASURED_DEVICES.get(tag)
    return found if found is not None else _cpu_of_tag(tag)


def _cpu_of_tag(tag: str) -> Optional[DeviceFacts]:
    """The CPU a ``cpu-<instruction set>-t<threads>`` tag names; None for another tag."""
    match = re.fullmatch(r"cpu-([a-z0-9_]+)-t(\d+)", tag)
    return cpu_facts(int(match[2]), match[1]) if match else None


def nearest(device: DeviceFacts, measured: Iterable[DeviceFacts]) -> Optional[DeviceFacts]:
    """The measured device whose rows ``device`` takes as priors (docs/route.md, "Devices nobody measured").

    A GPU: any measured GPU, the same architecture (the capability's major) first, then the closest capability,
    then the closest memory bandwidth (by ratio; unknown counts as no difference), then the tag. A CPU: only one
    with the same instruction set and threads within ``CPU_THREADS_FACTOR`` either way, the closest threads first;
    None where there is none (a 64-thread machine takes no rows measured on 2).
    """
    def gap(a: float, b: float) -> float:
        return abs(math.log(a / b)) if a > 0 and b > 0 else 0.0

    if device.kind == "cuda":
        capability = device.capability[0] * 10 + device.capability[1]
        candidates = [(other.capability[0] != device.capability[0],
                       abs(other.capability[0] * 10 + other.capability[1] - capability),
                       gap(other.bandwidth, device.bandwidth), other.tag, other)
                      for other in measured if other.kind == "cuda" and other.tag != device.tag]
    else:
        candidates = [(gap(other.threads, device.threads), other.tag, other) for other in measured
                      if other.kind == "cpu" and other.tag != device.tag and other.isa == device.isa
                      and device.threads <= other.threads * CPU_THREADS_FACTOR
                      and other.threads <= device.threads * CPU_THREADS_FACTOR]
    return min(candidates)[-1] if candidates else None


def with_priors(device: DeviceFacts, rows: Iterable[Row]) -> Tuple[Row, ...]:
    """The rows that route calls on ``device``: its own (and those of every device, ``*``, or of its kind, ``cpu`` or
    ``cuda``), then the nearest measured device's as priors, retagged for it, their source saying ``prior from
    <device>``. Rows of other devices are dropped."""
    rows = tuple(rows)
    own = [row._replace(device=device.tag) if row.device == device.kind else row for row in rows
           if row.device in ("*", device.kind, device.tag)]
    near = nearest_in(device, rows)
    if near is None:
        return tuple(own)
    priors = [row._replace(device=device.tag, source=f"prior from {near.tag}: {row.source}")
              for row in rows if row.device == near.tag]
    return tuple(own + priors)


def nearest_in(device: DeviceFacts, rows: Iterable[Row]) -> Optional[DeviceFacts]:
    """``nearest`` among the devices ``rows`` name (``facts_of_tag``), other than ``device`` itself and its kind."""
    others = {row.device for row in rows} - {"*", device.kind, device.tag}
    return nearest(device, [facts for facts in map(facts_of_tag, sorted(others)) if facts is not None])


def device_facts(device: torch.device) -> DeviceFacts:
    """``DeviceFacts`` of ``device`` (a CUDA device's are read once)."""
    if device.type == "cuda":
        return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return cpu_facts()
    return DeviceFacts(device.type, device.type)


def device_tag(device: torch.device) -> str:
    """``Call.device`` for ``device``: its ``DeviceFacts.tag`` (a GPU's model, ``cpu-<isa>-t<threads>``), else the
    device's type."""
    if device.type == "cuda":
        return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device()).tag
    if device.type == "cpu":
        return _cpu_tag()
    return device.type


_CUDA_FACTS: Dict[int, DeviceFacts] = {}
_CPU_TAGS: Dict[int, str] = {}


@constant_for_compile
def _cuda_facts(index: int) -> DeviceFacts:
    found = _CUDA_FACTS.get(index)
    if found is None:
        found = _CUDA_FACTS[index] = gpu_facts(torch.cuda.get_device_properties(index))
    return found


@constant_for_compile
def _cpu_tag() -> str:
    threads = torch.get_num_threads()
    found = _CPU_TAGS.get(threads)
    if found is None:
        found = _CPU_TAGS[threads] = cpu_facts().tag
    return found


def tuned_rows(device: torch.device) -> List[Row]:
    """The rows ``tune`` measured on ``device`` ([] where it has not run), read from the user's cache (``table``
    keeps them for the process)."""
    path = tuned_path(device)
    return parse_rows(open(path).read(), path) if os.path.exists(path) else []


@computed_once
def _measured() -> Tuple[Row, ...]:
    from . import ops

    rows = []
    for op in ops.registered():
        rows += parse_rows(op.measured, f"{op.name}'s measured rows")
    return tuple(rows)


def table(device: Optional[torch.device] = None) -> Tuple[Row, ...]:
    """The route table for calls on ``device``: the rows ``tune`` measured there, then the ops' measured rows of that
    device, then the nearest measured device's as priors (``with_priors``). Without ``device``: the CPU's tuned rows
    and every built-in row, of every device, as written."""
    if device is None:
        return tuple(tuned_rows(torch.device("cpu"))) + _measured()
    return _with_tuned(device.type, device.index)


_TABLES: Dict[Tuple[str, object], Tuple[Row, ...]] = {}


@constant_for_compile  # torch.compile calls it at trace time: it reads a file the first time
def _with_tuned(device_type: str, index: Optional[int]) -> Tuple[Row, ...]:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    key = (device_type, index if device_type == "cuda" else device_tag(device))  # a CPU's rows follow its threads
    found = _TABLES.get(key)
    if found is None:
        found = _TABLES[key] = with_priors(device_facts(device), tuple(tuned_rows(device)) + _measured())
    return found


def forget_tuned() -> None:
    """Read the tuned rows again at the next call (after ``tune`` wrote them)."""
    _TABLES.clear()
    _forget_decisions()


# ------------------------------------------------------------------------------------------------- decisions

# Decisions of eager calls: by (call, device, choice, ours) (decide_for), and by the hot ops' own keys of plain values
# (_remembered, with the call). Forgotten with the facts they rest on (backend availability) and the tuned rows.
_DECISIONS: Dict[tuple, object] = {}
# Bumped whenever the decisions are forgotten: the modules' verdicts (``module_verdicts``) carry the generation they
# were made in.
_GENERATION = [0]


def _forget_decisions() -> None:
    _DECISIONS.clear()
    _GENERATION[0] += 1


on_facts_forgotten(_forget_decisions)


def decide_for(call: Call, device: torch.device, choice: str, ours: Optional[str]) -> Decision:
    """``decide`` over the route table of ``device``, remembered per call in eager mode."""
    if torch.compiler.is_compiling():
        return decide(call, choice, ours, _with_tuned(device.type, device.index))
    key = (call, device.type, device.index, choice, ours)
    found = _DECISIONS.get(key)
    if found is None:
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        found = _DECISIONS[key] = decide(call, choice, ours, _with_tuned(device.type, device.index))
    return found


class Record(NamedTuple):
    """One decided call, as ``explain()`` lists it."""

    op: str
    door: str  # "functional" (the ops, the modules and the transformers interface above them), "sdpa", or "module"
    # (a module's own call of torch.nn's forward)
    backend: str  # what ran it: "triton", "cpu", "torch" (torch's own ops) or "reference"
    reason: str

    def __str__(self) -> str:
        return f"{self.op} ({self.door}) -> {self.backend}: {self.reason}"


# The open ``explain`` blocks' lists.
_RECORDERS: List[List[Record]] = []


@contextlib.contextmanager
def explain() -> Iterator[List[Record]]:
    """Which kernel ran each call, and why: a context manager yielding a list that fills with one ``Record`` per call
    decided inside the block (``op``, ``door``, ``backend``, ``reason``; ``str()`` a line of them), in order::

        with fused_transformer.explain() as calls:
            model(x).sum().backward()
        print("\n".join(map(str, calls)))

    Every op records its forward: the functional ops, the modules' calls of them and the doors from torch's SDPA and
    transformers (the module docstring's doors). A backward follows its forward's decision (autograd differentiates
    what the forward ran), so it records nothing of its own, but for the SDPA door's backward ops, which torch's
    dispatcher calls on their own: the door decides them from the forward's facts, and records them. ``bench``
    prints its cases' records (``describe``)."""
    seen: List[Record] = []
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:  # by identity: an inner block's list may equal an outer one's
        del _RECORDERS[next(i for i, recorder in enumerate(_RECORDERS) if recorder is seen)]


def ran_elsewhere(op: str, door: str, reason: str) -> None:
    """Record, for ``explain()``, a call that torch's own code ran without asking the route: a module that hands an
    input it does not fuse (nested tensors, parameters of mixed dtypes) to torch.nn's ``forward``."""
    if _RECORDERS:
        _decided(Call(op, "", torch.float32, door=door), Decision("torch", reason))


def _decided(call: Call, decision: Decision) -> Decision:
    record = Record(call.op, call.door, decision.backend, decision.reason)
    for seen in _RECORDERS:
        seen.append(record)
    return decision


def choose(call: Call, device: torch.device) -> Decision:
    """Who runs ``call`` on ``device`` under the backend the user chose (``backend.get_backend()``): the one question
    the ops ask. Raises ``RuntimeError`` where a backend the user named cannot run there (``backend.current``)."""
    decision = decide_for(call, device, backend.get_backend(), backend.current(device, call.dtype))
    return _decided(call, decision) if _RECORDERS else decision


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a call: grad mode is on and one of ``tensors`` requires a gradient."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


def size(n: int) -> Optional[int]:
    """A size as the route reads it: None in a traced call, where it may be symbolic (rows with a size range then
    do not match)."""
    return None if torch.compiler.is_compiling() else int(n)


def remembered(key: tuple, make_call, *facts: object) -> Decision:
    """The decision of an eager call whose facts are ``key`` (plain values, cheap to hash), ``make_call()``'s
    ``choose``d where it is new: the hot ops' path to a decision in a dictionary lookup. ``facts``: what the caller
    derived from the call before deciding, kept beside the decision (``recall``)."""
    found = _DECISIONS.get(key)
    if found is None:
        call, device = make_call()
        decision = choose(call, device)
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        _DECISIONS[key] = found = (call, decision, *facts)
    elif _RECORDERS:
        _decided(*found[:2])
    return found[1]


def recall(key: tuple) -> Optional[tuple]:
    """``(call, decision, *facts)`` that ``remembered`` kept under ``key``, the decision recorded for ``explain()``
    as if made again; None where nothing was kept (or forgotten since, with the facts it rested on)."""
    found = _DECISIONS.get(key)
    if found is not None and _RECORDERS:
        _decided(*found[:2])
    return found


def at_door(call: Call, device: torch.device, ours: str) -> Decision:
    """Who runs ``call``, made at a door in front of a kernel torch already had (``call.door``): ``ours`` (the backend
    behind the door on this device) or ``"torch"``, that kernel, whatever else the route says: where the call needs
    it (``call.torch_keeps``), where the route prefers it, and where the reference would run the call elsewhere
    (``use_backend("reference")`` included). Recorded for ``explain()`` as it is decided."""
    choice = backend.get_backend()  # a backend named at a door is ours, the one behind it
    decision = decide_for(call, device, choice if choice in ("auto", "reference") else ours, ours)
    if not decision.ours:
        decision = Decision("torch", decision.reason)
    return _decided(call, decision) if _RECORDERS else decision


# ----------------------------------------------------------------------------------------------- the modules' door

TORCH_NN = "every op of this call runs torch's path: torch.nn's own forward runs it whole (its fused fast path)"


def torch_nn_runs(records: Iterable[Record]) -> bool:
    """Whether a fused module's call, whose ops the route decided as ``records``, is torch.nn's own forward's to run:
    every op went to torch's path (no kernel of ours, no reference), so torch.nn's forward computes the same thing, in
    one native op where it has a fast path (an encoder layer, MultiheadAttention in eval)."""
    records = list(records)
    return bool(records) and all(record.backend == "torch" for record in records)


def module_verdicts(owner: dict) -> Dict[tuple, bool]:
    """The verdicts (``torch_nn_runs``) a module keeps in its ``__dict__`` (``owner``), by its calls' keys: empty
    again once the decisions they rest on are forgotten (tuned rows read, backends found again)."""
    kept = owner.get("_route_verdicts")
    if kept is None or kept[0] != _GENERATION[0] or len(kept[1]) > 256:
        kept = owner["_route_verdicts"] = (_GENERATION[0], {})
    return kept[1]


def module_state() -> tuple:
    """What besides a call's tensors its ops' decisions rest on most: grad mode, the backend chosen (a named one runs
    ours) and autocast (the ops' dtypes; on any device, one C call as torch.nn's RNN asks it, not a device's name). A
    verdict that outlives another fact (determinism asked for, the threads) costs speed, never the result: torch.nn's
    forward computes the call either way."""
    return torch.is_grad_enabled(), backend.get_backend(), torch._C._is_any_autocast_enabled()


def describe(records: Iterable[Record]) -> str:
    """The distinct decisions of an ``explain`` block, one clause each: ``op -> backend (reason)``."""
    seen = dict.fromkeys(f"{record.op} -> {record.backend} ({record.reason})" for record in records)
    return "; ".join(seen)
