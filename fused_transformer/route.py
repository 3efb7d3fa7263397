"""Who runs a call: our kernel, torch's own path computing the same result, or the reference. One place decides,
for every op and every door (the functional ops and the modules above them, torch's SDPA registry, the transformers
interface); the rest of the package asks ``decide`` and never decides itself.

A call is described by ``Call``: the op, the door, the device (``"sm90"`` for a GPU of compute capability 9.0,
``"cpu"``), dtype, head dim, what its mask is (``"none"``, ``"causal"``, or ``"other"`` for anything torch's path
does not compute as ours does), dropout, the op's size (``SIZE_OF``), whether it needs gradients and the LSE,
whether the caller asked for deterministic algorithms, and the features a backend must have for it (score modifiers,
RMSNorm). ``decide(call, choice, ours)`` is a pure function of it, the backend the user chose and the backend whose
kernels serve the device; in order:

1. A named backend (``use_backend("triton")`` / ``"cpu"`` / ``"reference"``) runs the call, on the reference where
   it lacks a feature the call needs (``SUPPORTS``): a call a backend cannot serve falls back, it does not raise.
2. ``"auto"``: float64 runs on the reference (the oracle; the kernels serve the training dtypes), as does a device
   with no kernels of ours.
3. Where torch's path computes the same result (``torch_refuses`` says why not elsewhere), the first row of the
   route table that matches the call decides: torch's path where its highest ``speedup`` (torch's time over ours) is
   below 1, unless the call needs gradients, the caller asked for determinism and the row does not say torch's
   backward is deterministic. Without a matching row, the default (``_default``): ours, but torch's path for
   layer_norm and feed_forward without dropout, where there is nothing to fuse.
4. Otherwise ours, or the reference where ours lacks a feature.

The route table is text, one row a line (``parse_rows``): the rows measured on GPUs (``MEASURED``), after the rows
``python -m fused_transformer tune`` measured on this machine (``tuned_rows``, kept in the user's cache keyed by
device, driver and versions), which come first. A traced attention call (torch.compile, torch.export) runs ours:
one custom op, the same graph on every GPU. The forward's decision is the backward's (autograd differentiates the
path the forward ran).
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import backend
from ._env import computed_once, constant_for_compile, on_facts_forgotten
from .contract import NO_SCORE_MODS, AttentionMasks, AttentionSpec, FeedForwardSpec, LayerNormSpec, ScoreMods

OPS = ("attention", "attention_varlen", "attention_with_kvcache", "layer_norm", "feed_forward")
DOORS = ("functional", "sdpa")  # the transformers interface calls the functional ops: its door is theirs
# What each op's ``size`` counts (the route table's size ranges).
SIZE_OF = {"attention": "keys per sequence", "attention_varlen": "longest sequence's keys",
           "attention_with_kvcache": "keys in the cache", "layer_norm": "elements of x",
           "feed_forward": "rows of x"}

# The features each backend's kernels compute (score modifiers by ScoreMods' field names, "sinks", "rms_norm");
# a call needing another runs on the reference.
SUPPORTS: Dict[str, FrozenSet[str]] = {
    "triton": frozenset(ScoreMods._fields) | {"sinks", "rms_norm", "recompute", "allow_tf32"},
    "cpu": frozenset({"softcap", "alibi_slopes", "sinks"}),
}


class Call(NamedTuple):
    """What decides who runs a call (module docstring)."""

    op: str
    device: str  # "sm90", "cpu", ...: the device's kind and, for a GPU, its compute capability
    dtype: torch.dtype
    door: str = "functional"  # the transformers interface calls the functional ops: its door is theirs
    head_dim: int = 0
    mask: str = "none"  # "none", "causal", "other"; "none" for ops without one
    dropout: bool = False
    size: Optional[int] = None  # SIZE_OF[op]; None where unknown (a traced call's dynamic shape)
    needs_grad: bool = False
    needs_lse: bool = False
    deterministic: bool = False
    needs: FrozenSet[str] = frozenset()  # features a backend must compute (SUPPORTS)
    gqa: bool = False  # fewer key heads than query heads
    torch_cannot: str = ""  # a fact of the call's tensors that torch's path does not compute as ours does


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
_WIDTHS = (12, 8, 6, 15, 8, 11, 7, 10, 14, 9, 9)
HEADER = "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, _WIDTHS)) + "  " + COLUMNS[-1]


def parse_rows(text: str, origin: str = "the route table") -> List[Row]:
    """The rows of a route table: one row a line under ``HEADER``'s columns, cells split on whitespace, the source the
    rest of the line; ``#`` starts a comment. A size is ``lo..hi`` (``hi`` left out: no limit) or ``*``; a speedup
    ``x`` or ``low-high``; lists are comma-separated; ``*`` matches anything."""
    rows = []
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
        if (op not in OPS or passes not in ("forward", "training", "*") or dropout not in ("yes", "no", "*")
                or not all(door in (*DOORS, "*") for door in doors.split(","))
                or det not in ("yes", "no", "-") or (sizes != "*" and match is None) or ratio is None):
            raise ValueError(f"{origin}, line {number}: a cell is out of range (op one of {', '.join(OPS)}; pass "
                             "forward/training/*; dropout yes/no/*; door functional/sdpa/*; size lo..hi or *; "
                             f"speedup x or low-high; torch_det yes/no/-): {raw!r}")
        bounds = (0, None) if match is None else (int(match[1]), int(match[2]) if match[2] else None)
        low = float(ratio[1])
        rows.append(Row(op, passes, device, tuple(dtypes.split(",")), tuple(head_dims.split(",")),
                        tuple(masks.split(",")), dropout, tuple(doors.split(",")), bounds,
                        (low, float(ratio[2]) if ratio[2] else low), det, source))
    return rows


# The rows measured on GPUs, newest first. bench --device cuda (docs/benchmarks.md "On a GPU" holds the runs).
MEASURED = HEADER + """
# H200, torch 2.11 + cuDNN 9.19, triton 3.6, bfloat16; bench --device cuda:0 --quick (16k tokens a batch, L 1024
# and 4096): SDPA picks cuDNN. cuDNN's backward is taken as not deterministic until gpu-check measures it.
attention     forward   sm90    bfloat16         64,128    none,causal  no       *           *               0.55-0.79  -          H200 bench --quick bdb1535 2026-11-28
attention     training  sm90    bfloat16         64,128    none,causal  no       *           *               0.54-0.71  no         H200 bench --quick bdb1535 2026-11-28
# layer_norm + residual, dropout 0.1, d 1024 and 4096, 8k and 32k rows: ours ahead forward from 32M elements
layer_norm    forward   sm90    bfloat16         *         *            yes      *           0..16777216     0.45-0.54  -          H200 bench --quick bdb1535 2026-11-28
layer_norm    forward   sm90    bfloat16         *         *            yes      *           16777216..      1.12-1.28  -          H200 bench --quick bdb1535 2026-11-28
layer_norm    training  sm90    bfloat16         *         *            yes      *           *               0.40-0.94  yes        H200 bench --quick bdb1535 2026-11-28
feed_forward  forward   sm90    bfloat16         *         *            yes      *           *               0.88-1.00  -          H200 bench --quick bdb1535 2026-11-28
feed_forward  training  sm90    bfloat16         *         *            yes      *           *               0.72-0.95  yes        H200 bench --quick bdb1535 2026-11-28
# CPU, at torch's SDPA door (its dispatcher in front of our kernel), against torch's CPU flash kernel, 2 threads,
# B 2, H 8, D 64, register-tiled kernels (docs/integrations.md). The door decides a forward and its
# backward alike from the shapes; where the two disagree the row keeps the forward's figure and the table in
# docs/integrations.md gives both (float32 below 128 keys: training 0.47-1.09; bfloat16 causal 128-256: 1.29-1.82).
# float16 was not measured: its rows are bfloat16's (both convert to float32 at the op boundary).
attention     *         cpu     float32          *         none,causal  *        sdpa        0..128          0.34-0.91  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     float32          *         none,causal  *        sdpa        128..           1.14-1.75  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         none,causal  *        sdpa        0..128          0.65-0.81  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         none         *        sdpa        128..724        1.09-1.87  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         none         *        sdpa        724..1448       0.93-0.96  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         none         *        sdpa        1448..          1.05-1.23  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         causal       *        sdpa        128..362        0.72-0.91  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu     bfloat16,float16 *         causal       *        sdpa        362..           1.11-1.50  -          CPU sdpa door fefb871 2026-12-06
"""


def torch_refuses(call: Call) -> Optional[str]:
    """None where torch's path computes what ours computes for ``call``, else why it does not."""
    if call.door == "sdpa":
        return None  # the kernel the op had before ours: it computes the call as torch always did
    if call.op in ("attention_varlen", "attention_with_kvcache"):
        return "packed sequences or a KV cache (no torch op for them on every device)"
    if call.torch_cannot:
        return call.torch_cannot
    if call.needs:
        return "its " + ", ".join(sorted(call.needs))
    if call.op == "attention":
        if call.mask == "other":
            return "its masks (SDPA's differ on rows with no key left, and cost a dense mask)"
        if call.needs_lse:
            return "the LSE (SDPA returns none)"
        if call.dropout and call.door != "sdpa":
            return "dropout (SDPA's random mask is not our seed's)"
        if call.gqa:
            return "grouped-query heads"
    if call.op == "layer_norm" and call.device == "cpu" and call.dtype != torch.float32:
        return "16 bits on the CPU (ATen's weight gradient misses the 2x rule)"
    return None


def _default(call: Call) -> Tuple[bool, str]:
    """Whether torch's path runs a call no row matches, and why."""
    if call.op in ("layer_norm", "feed_forward") and not call.dropout:
        return True, "no dropout: nothing to fuse (ATen's ops)"
    return False, "no measured row: ours (the default)"


def decide(call: Call, choice: str, ours: Optional[str], rows: Optional[Iterable[Row]] = None) -> Decision:
    """Who runs ``call`` (module docstring): ``choice`` the backend the user chose (``"auto"`` or a name), ``ours``
    the backend of our kernels on the call's device (None where there is none), ``rows`` the route table (default:
    ``table()``)."""
    if choice != "auto":
        if choice == "reference":
            return Decision("reference", "use_backend('reference')")
        missing = call.needs - SUPPORTS[choice]
        if missing:
            return Decision("reference", f"backend {choice!r} does not compute {', '.join(sorted(missing))}")
        return Decision(choice, f"use_backend({choice!r})")
    if ours not in SUPPORTS:  # backend.current's answer for "auto": float64, or a device without kernels of ours
        why = "float64" if call.dtype == torch.float64 else f"{call.device} (no kernels of ours there)"
        return Decision("reference", f"{why} runs on the reference")
    missing = call.needs - SUPPORTS[ours]
    refused = torch_refuses(call)
    if refused is None and call.op.startswith("attention") and call.door == "functional" and call.size is None:
        refused = "a traced call (ours there: one custom op, the same graph on every device)"
    if refused is not None:
        if missing:
            return Decision("reference", f"{ours} does not compute {', '.join(sorted(missing))}")
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
        return Decision("reference", f"{ours} does not compute {', '.join(sorted(missing))}")
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


def device_tag(device: torch.device) -> str:
    """``Call.device`` for ``device``: ``"sm90"`` for a GPU of capability 9.0, else the device's type."""
    if device.type != "cuda":
        return device.type
    return _cuda_tag(device.index if device.index is not None else torch.cuda.current_device())


_CUDA_TAGS: Dict[int, str] = {}


@constant_for_compile
def _cuda_tag(index: int) -> str:
    found = _CUDA_TAGS.get(index)
    if found is None:
        major, minor = torch.cuda.get_device_capability(index)
        found = _CUDA_TAGS[index] = f"sm{major}{minor}"
    return found


def tuned_rows(device: torch.device) -> List[Row]:
    """The rows ``tune`` measured on ``device`` ([] where it has not run), read from the user's cache (``table``
    keeps them for the process)."""
    path = tuned_path(device)
    return parse_rows(open(path).read(), path) if os.path.exists(path) else []


@computed_once
def _measured() -> Tuple[Row, ...]:
    return tuple(parse_rows(MEASURED, "route.MEASURED"))


def table(device: Optional[torch.device] = None) -> Tuple[Row, ...]:
    """The route table for calls on ``device`` (default: the CPU and every GPU's built-in rows): the rows ``tune``
    measured there, then ``MEASURED``."""
    if device is None:
        device = torch.device("cpu")
    return _with_tuned(device.type, device.index)


_TABLES: Dict[Tuple[str, Optional[int]], Tuple[Row, ...]] = {}


@constant_for_compile  # torch.compile calls it at trace time: it reads a file the first time
def _with_tuned(device_type: str, index: Optional[int]) -> Tuple[Row, ...]:
    found = _TABLES.get((device_type, index))
    if found is None:
        device = torch.device(device_type, index) if index is not None else torch.device(device_type)
        found = _TABLES[(device_type, index)] = tuple(tuned_rows(device)) + _measured()
    return found


def forget_tuned() -> None:
    """Read the tuned rows again at the next call (after ``tune`` wrote them)."""
    _TABLES.clear()
    _DECISIONS.clear()


# ------------------------------------------------------------------------------------------------- decisions

# Decisions of eager calls: by (call, device, choice, ours) (decide_for), and by the hot ops' own keys of plain values
# (_remembered, with the call). Forgotten with the facts they rest on (backend availability) and the tuned rows.
_DECISIONS: Dict[tuple, object] = {}
on_facts_forgotten(_DECISIONS.clear)


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


# The open ``recording`` blocks' lists.
_RECORDERS: List[List[Tuple[Call, Decision]]] = []


@contextlib.contextmanager
def recording() -> Iterator[List[Tuple[Call, Decision]]]:
    """The ``(call, decision)`` of every call decided inside the block, in order (bench and check print them)."""
    seen: List[Tuple[Call, Decision]] = []
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)


def _decided(call: Call, decision: Decision) -> Decision:
    for seen in _RECORDERS:
        seen.append((call, decision))
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


def _size(n: int) -> Optional[int]:
    """A size as the route reads it: None in a traced call, where it may be symbolic (rows with a size range then
    do not match)."""
    return None if torch.compiler.is_compiling() else int(n)


def _needs(mods: ScoreMods, sinks: Optional[torch.Tensor]) -> FrozenSet[str]:
    if mods is NO_SCORE_MODS and sinks is None:
        return frozenset()
    given = frozenset(mods.given)
    return given | {"sinks"} if sinks is not None else given


def mask_kind(query_len: int, key_len: int, masks: Optional[AttentionMasks], spec: AttentionSpec) -> str:
    """``"none"`` or ``"causal"`` where SDPA computes our masking from ``is_causal`` alone, else ``"other"``."""
    if (masks is not None and not masks.unmasked) or spec.window is not None:
        return "other"
    if not spec.is_causal:
        return "none"
    return "causal" if not spec.bottom_right or query_len == key_len else "other"


def _remembered(key: tuple, make_call) -> Decision:
    """The decision of an eager call whose facts are ``key`` (plain values, cheap to hash), ``make_call()``'s
    ``choose``d where it is new: the hot ops' path to a decision in a dictionary lookup."""
    found = _DECISIONS.get(key)
    if found is None:
        call, device = make_call()
        decision = choose(call, device)
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        _DECISIONS[key] = found = (call, decision)
    elif _RECORDERS:
        _decided(*found)
    return found[1]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: AttentionMasks, spec: AttentionSpec,
              mods: ScoreMods, sinks: Optional[torch.Tensor], needs_lse: bool) -> Decision:
    """Who runs a dense attention call of checked arguments ``q [B, H, Lq, D]``, ``k, v [B, Hkv, Lk, D]``."""
    if mods is NO_SCORE_MODS and sinks is None and masks.unmasked and not torch.compiler.is_compiling():
        key = ("attention", q.device, q.dtype, q.shape, k.shape[1], k.shape[2], spec, needs_grad(q, k, v),
               needs_lse, torch.are_deterministic_algorithms_enabled(), backend.get_backend())
        return _remembered(key, lambda: (_attention_call(q, k, v, masks, spec, mods, sinks, needs_lse), q.device))
    return choose(_attention_call(q, k, v, masks, spec, mods, sinks, needs_lse), q.device)


def _attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: AttentionMasks, spec: AttentionSpec,
                    mods: ScoreMods, sinks: Optional[torch.Tensor], needs_lse: bool) -> Call:
    empty = min(q.shape[2], k.shape[2], q.shape[3]) == 0
    call = Call("attention", device_tag(q.device), q.dtype, head_dim=q.shape[3],
                mask=mask_kind(q.shape[2], k.shape[2], masks, spec), dropout=spec.dropout_p > 0.0,
                size=_size(k.shape[2]), needs_grad=needs_grad(q, k, v, sinks), needs_lse=needs_lse,
                deterministic=torch.are_deterministic_algorithms_enabled(), needs=_needs(mods, sinks),
                gqa=q.shape[1] != k.shape[1], torch_cannot="empty dims" if empty else "")
    return call


def attention_packed(op: str, q: torch.Tensor, max_keys: int, mods: ScoreMods, sinks: Optional[torch.Tensor],
                     needs_grad_: bool = False) -> Decision:
    """Who runs ``attention_varlen`` or ``attention_with_kvcache`` (``op``) on queries ``q`` (head dim last)."""
    call = Call(op, device_tag(q.device), q.dtype, head_dim=q.shape[-1], size=_size(max_keys),
                needs_grad=needs_grad_, needs=_needs(mods, sinks))
    return choose(call, q.device)


def sdpa_door(q: torch.Tensor, key_len: int, is_causal: bool, ours: str) -> Decision:
    """Who runs a call of torch's SDPA / FlashAttention ops once our implementation is activated: ``ours`` (the
    backend behind the door on this device) or ``"torch"``, the kernel the op had before. The forward and its
    backward decide alike, from the shapes alone (the door cannot see whether autograd will differentiate)."""
    call = Call("attention", device_tag(q.device), q.dtype, door="sdpa", head_dim=q.shape[-1],
                mask="causal" if is_causal else "none", size=_size(key_len),
                deterministic=torch.are_deterministic_algorithms_enabled())
    choice = backend.get_backend()  # a backend named at this door is ours, the one behind it
    decision = decide_for(call, q.device, choice if choice in ("auto", "reference") else ours, ours)
    return _decided(call, decision) if _RECORDERS else decision


def describe(decisions: Iterable[Tuple[Call, Decision]]) -> str:
    """The distinct decisions of a ``recording``, one clause each: ``op -> backend (reason)``."""
    seen = dict.fromkeys(f"{call.op} -> {decision.backend} ({decision.reason})" for call, decision in decisions)
    return "; ".join(seen)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               residual: Optional[torch.Tensor], spec: LayerNormSpec) -> Decision:
    """Who runs a ``layer_norm`` call of checked arguments."""
    grad = needs_grad(x, weight, bias, residual)
    if torch.compiler.is_compiling():
        return choose(_layer_norm_call(x, weight, bias, spec, grad), x.device)
    key = ("layer_norm", x.device, x.dtype, x.shape, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, spec, grad, torch.are_deterministic_algorithms_enabled(),
           backend.get_backend())
    return _remembered(key, lambda: (_layer_norm_call(x, weight, bias, spec, grad), x.device))


def _layer_norm_call(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     spec: LayerNormSpec, grad: bool) -> Call:
    cannot = ""
    if x.shape[-1] <= 1:
        cannot = "rows of one feature (ATen's backward cancels 1/sqrt(eps)-sized terms)"
    elif any(p is not None and p.dtype != x.dtype for p in (weight, bias)):
        cannot = "parameters in another dtype than x's"
    return Call("layer_norm", device_tag(x.device), x.dtype, dropout=spec.dropout_p > 0.0, size=_size(x.numel()),
                needs_grad=grad, deterministic=torch.are_deterministic_algorithms_enabled(),
                needs=frozenset({"rms_norm"}) if spec.rms_norm else frozenset(), torch_cannot=cannot)


def feed_forward(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                 b2: Optional[torch.Tensor], spec: FeedForwardSpec) -> Decision:
    """Who runs a ``feed_forward`` call of checked arguments."""
    grad = needs_grad(x, w1, b1, w2, b2)
    if torch.compiler.is_compiling():
        return choose(_feed_forward_call(x, spec, grad), x.device)
    key = ("feed_forward", x.device, x.dtype, x.shape, spec, grad, torch.are_deterministic_algorithms_enabled(),
           backend.get_backend())
    return _remembered(key, lambda: (_feed_forward_call(x, spec, grad), x.device))


def _feed_forward_call(x: torch.Tensor, spec: FeedForwardSpec, grad: bool) -> Call:
    needs = frozenset(name for name in ("recompute", "allow_tf32") if getattr(spec, name))
    return Call("feed_forward", device_tag(x.device), x.dtype, dropout=spec.dropout_p > 0.0,
                size=_size(x.numel() // max(x.shape[-1], 1)), needs_grad=grad,
                deterministic=torch.are_deterministic_algorithms_enabled(), needs=needs)
