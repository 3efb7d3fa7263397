"""Did the priors hold? The rows ``tune`` measured on a device against the table the device ran under before (its
built-in rows and the nearest measured device's as priors, ``route.with_priors``; never the user's tuned rows).

For each measured row, one call it matches (``matching_call``: the row's first value of every list, a size inside its
range, and what the op's own call of that shape says of torch's path) is decided twice with ``route.decide``, choice
``"auto"``: under the table before and under the measured row alone. The verdict: ``"prior held"`` (the same backend),
``"prior wrong"`` (another backend), ``"no prior"`` (no row decided it before, and no named prior either: the plain
default, ours, or the op's own reason for torch's path). A row of the table before decides it as a prior when its
source says ``prior from <device>``, as the device's own row otherwise; a default whose reason starts with ``prior:``
(``ops.attention.facts.DENSE_PRIOR``) is a prior too.

gpu-check's ``tune`` part writes the verdicts to ``DIR/priors.md`` (``markdown``) and their count to the summary
(``counts_line``). Pure functions of rows, but ``matching_call``, which asks the op how its call reads.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from fused_transformer import ops, route

HELD, WRONG, NONE = "prior held", "prior wrong", "no prior"
PRIOR_REASON = "prior: "  # a default that names itself a prior (ops.attention.facts.DENSE_PRIOR)


class Verdict(NamedTuple):
    """One measured row against the table before."""

    call: route.Call
    before: route.Decision  # under the table the device ran under before
    prior: str  # what decided it before: "prior from <tag>", "own row", "prior (default)", "default"
    measured: route.Decision  # under the measured row
    verdict: str  # HELD, WRONG or NONE
    row: route.Row  # the measured row


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, "float32" if name == "*" else name)


def _example_call(row: route.Row, needs_grad: bool, device_type: str) -> Optional[route.Call]:
    """The op's own call of the example ``tune`` measured in ``row``'s range (its ``Op.tune`` series of the row's head
    dim, mask and dropout), None where the op has no such example or cannot say its call on ``device_type``."""
    op = ops.get(row.op)
    if op.call_of is None:
        return None
    lo, hi = row.sizes
    for quick in (False, True):
        for series in op.tune(device_type, _dtype(row.dtypes[0]), quick):
            if (series.head_dim, series.mask, series.dropout) != (row.head_dims[0], row.masks[0], row.dropout):
                continue
            for example in series.examples:
                if example.size >= lo and (hi is None or example.size < hi):
                    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
                        return torch.empty(shape, device="meta", dtype=_dtype(row.dtypes[0]))
                    try:
                        return op.call_of(example.draw(draw), example.options, torch.device(device_type), needs_grad)
                    except (RuntimeError, AssertionError):  # a CUDA device asked of a machine without one
                        return None
    return None


def matching_call(row: route.Row, needs_grad: bool, device_type: str = "cpu") -> route.Call:
    """A call ``row`` matches: the op's own call of the example ``tune`` measured there (``_example_call``), else one
    as tests/test_route.py builds it (the first value of every list, a size inside its range) with what the op's own
    call says of torch's path (``torch_default``, ``torch_cannot``, ``needs``) where it can say it."""
    lo, hi = row.sizes
    call = route.Call(row.op, row.device, _dtype(row.dtypes[0]),
                      door="functional" if row.doors == ("*",) else row.doors[0],
                      head_dim=64 if row.head_dims == ("*",) else int(row.head_dims[0]),
                      mask="none" if row.masks == ("*",) else row.masks[0], dropout=row.dropout == "yes",
                      size=lo or (4096 if hi is None else max(1, hi // 2)), needs_grad=needs_grad)
    own = _example_call(row, needs_grad, device_type)
    if own is not None:
        own = own._replace(device=row.device, door=call.door, needs_grad=needs_grad, deterministic=False)
        if row.matches(own):
            return own  # the shape tune measured, as the op's module makes its call
        call = call._replace(torch_default=own.torch_default, torch_cannot=own.torch_cannot, needs=own.needs,
                             backends=own.backends)
    return call


def _decided_by(call: route.Call, decision: route.Decision, before: Sequence[route.Row]) -> str:
    row = next((r for r in before if r.matches(call)), None)
    if row is not None:
        return row.source.split(":", 1)[0] if row.source.startswith("prior from ") else "own row"
    return "prior (default)" if decision.reason.startswith(PRIOR_REASON) else "default"


def compare(measured: Sequence[route.Row], before: Sequence[route.Row], ours: str,
            call_for: Callable[[route.Row, bool], route.Call] = matching_call) -> List[Verdict]:
    """Each measured row's call (``call_for(row, needs_grad)``) decided under ``before`` and under the row; ``ours``
    the backend of our kernels on the device (``"triton"``, ``"cpu"``)."""
    verdicts = []
    for row in measured:
        for needs_grad in {"forward": (False,), "training": (True,), "*": (False, True)}[row.passes]:
            call = call_for(row, needs_grad)
            old = route.decide(call, "auto", ours, before)
            new = route.decide(call, "auto", ours, [row])
            prior = _decided_by(call, old, before)
            verdict = NONE if prior == "default" else HELD if old.backend == new.backend else WRONG
            verdicts.append(Verdict(call, old, prior, new, verdict, row))
    return verdicts


def counts_line(verdicts: Sequence[Verdict], device_tag: str, near: Optional[str]) -> str:
    """``priors: N held, M wrong, K without a prior (from <device tag>'s nearest: <tag>)``."""
    count = lambda what: sum(v.verdict == what for v in verdicts)  # noqa: E731
    return (f"priors: {count(HELD)} held, {count(WRONG)} wrong, {count(NONE)} without a prior (from {device_tag}'s "
            f"nearest: {near or 'none'})")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(verdicts: Sequence[Verdict], device_tag: str, near: Optional[str], source: str = "") -> str:
    """``priors.md``: the counts, then one table row per measured call."""
    lines = [f"# Priors on {device_tag}", "", counts_line(verdicts, device_tag, near) + ".", "",
             "Each row `tune` measured" + (f" ({_cell(source)})" if source else "") + ", one call it matches, decided "
             "under the table the device ran under before (its built-in rows, then the nearest measured device's as "
             "priors; not the user's tuned rows) and under the measurement.", "",
             "| op | pass | dtype | head dim | mask | dropout | size | before | decided by | before's reason "
             "| measured | measured's reason | verdict |", "|---" * 13 + "|"]
    for v in verdicts:
        c = v.call
        lines.append(f"| {c.op} | {'training' if c.needs_grad else 'forward'} | {str(c.dtype).replace('torch.', '')} "
                     f"| {c.head_dim} | {c.mask} | {'yes' if c.dropout else 'no'} | {c.size} | {v.before.backend} "
                     f"| {v.prior} | {_cell(v.before.reason)} | {v.measured.backend} | {_cell(v.measured.reason)} "
                     f"| {v.verdict} |")
    return "\n".join(lines) + "\n"


def before_table(device: route.DeviceFacts) -> tuple:
    """The table ``device`` ran under before it was tuned: the built-in rows of it and the nearest measured device's
    as priors (``route.with_priors``), without the user's tuned rows."""
    return route.with_priors(device, route._measured())


def nearest_tag(device: route.DeviceFacts) -> Optional[str]:
    """The tag of the measured device ``device`` takes its priors from (None: none)."""
    near = route.nearest_in(device, route._measured())
    return near.tag if near else None


def write_report(rows_path: str, device: route.DeviceFacts, ours: str, out_md: str,
                 device_type: Optional[str] = None) -> dict:
    """Compare the rows ``tune`` wrote to ``rows_path`` (on ``device``, ours ``ours``) with ``device``'s table before;
    write ``out_md``; return the figures gpu-check keeps: the counts, ``line`` (``counts_line``), ``nearest``,
    ``device`` and ``priors_md``."""
    measured = route.parse_rows(open(rows_path).read(), rows_path)
    kind = device_type or device.kind
    verdicts = compare(measured, before_table(device), ours, lambda row, grad: matching_call(row, grad, kind))
    near = nearest_tag(device)
    sources = sorted({row.source for row in measured})
    with open(out_md, "w") as f:
        f.write(markdown(verdicts, device.tag, near, ", ".join(sources)))
    return {"held": sum(v.verdict == HELD for v in verdicts), "wrong": sum(v.verdict == WRONG for v in verdicts),
            "without": sum(v.verdict == NONE for v in verdicts), "line": counts_line(verdicts, device.tag, near),
            "nearest": near, "device": device.tag, "priors_md": out_md, "rows": len(measured)}
