"""``python -m fused_transformer tune``: measure the route table's rows on this machine (fused_transformer/route.py).

For each registered op (``fused_transformer.ops``: the series of its ``Op.tune``, none named here), dtype, mask or
dropout, and pass (forward without gradients; forward + backward; ``TuneSeries.passes``: forward alone for an op
without a backward), ours (the backend of the device, named) and torch's path (``Op.torch_path``: SDPA, ATen's
LayerNorm, ATen's Linear products) are timed side by side at a few sizes (``bench_timing.time_ms``); each size's
speed-up (torch's time over ours) becomes a row whose size range reaches halfway, in log scale, to the next size
measured, adjacent rows with the same winner merged. Training rows
say whether torch's backward gave bitwise equal gradients twice (``torch_det``). The rows go to the user's cache
(``route.tuned_path``: one file per device, driver and versions), which the route reads before its built-in rows;
a second run replaces them. ``--budget`` bounds the time (default 110 s: the cases measured when it runs out are
kept, the rest stay on the built-in rows and the default).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

import fused_transformer as ft
from fused_transformer import ops, route
from fused_transformer.tools import add_device_option, positive_seconds
from fused_transformer.tools.bench_timing import time_ms


class Group(NamedTuple):
    """The calls one series of sizes measures: a route row's cells but the size, and an example per size."""

    op: str
    passes: str
    dtype: torch.dtype
    head_dim: str
    mask: str
    dropout: str
    examples: Tuple[Tuple[int, ops.Example], ...]  # (size, example)


def _groups(device: torch.device, quick: bool) -> Iterator[Group]:
    """Every registered op's series (``Op.tune``), per pass and dtype."""
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32, torch.bfloat16)
    for passes in ("forward", "training"):
        for dtype in dtypes[:1] if quick else dtypes:
            for op in ops.registered():
                for series in op.tune(device.type, dtype, quick):
                    if passes not in series.passes:
                        continue
                    yield Group(op.name, passes, dtype, series.head_dim, series.mask, series.dropout,
                                tuple((example.size, example) for example in series.examples))


def _inputs(group: Group, example: ops.Example,
            device: torch.device) -> Tuple[Callable[[], Tensor], Callable[[], Tensor], List[Tensor]]:
    """``(ours, torch's, leaves)`` for one size: ``ours`` the op's public function on the backend named, ``torch's``
    its torch path (``Op.torch_path``: the path the route would run instead), ``leaves`` the tensors it
    differentiates (``Op.differentiated``). Floating tensors in the group's dtype, ``Op.float32`` ones in float32."""
    op = ops.get(group.op)
    make = dict(device=device, dtype=group.dtype)
    tensors = example.draw(lambda *shape, scale=1.0: torch.randn(*shape, **make) * scale)
    tensors = {name: t.float() if name in op.float32 and t is not None and t.is_floating_point() else t
               for name, t in tensors.items()}
    leaves = [t.requires_grad_(group.passes == "training") for t in op.differentiated(tensors)]
    return (lambda: op.function(**tensors, **example.options), lambda: op.torch_path(**tensors, **example.options),
            leaves)


def _with_backward(fn: Callable[[], Tensor], leaves: List[Tensor]) -> Callable[[], object]:
    def step() -> object:
        out = fn()
        outs = [t for t in out if t is not None and t.requires_grad] if isinstance(out, tuple) else [out]
        return torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs])
    return step


def _deterministic(fn: Callable[[], Tensor], leaves: List[Tensor]) -> bool:
    """Whether torch's forward + backward gave bitwise equal gradients twice from the same seed."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(_with_backward(fn, leaves)())
    return all(torch.equal(a, b) for a, b in zip(*runs))


def measure(group: Group, example: ops.Example, device: torch.device, ours: str,
            min_time: float) -> Tuple[float, str]:
    """``(speed-up of ours over torch's path, torch_det)`` at one size."""
    mine, theirs, leaves = _inputs(group, example, device)
    fns = {"ours": mine, "torch": theirs}
    if group.passes == "training":
        fns = {name: _with_backward(fn, leaves) for name, fn in fns.items()}
    # The backend is named once around the timing, not per call: a context manager's microseconds, which torch's
    # path does not pay, would weigh on the tiny sizes. One call each first: the timing's first block must not hold
    # a first call's allocations and caches.
    with ft.use_backend(ours):
        for fn in fns.values():
            fn()
        times = time_ms(fns, [], device, min_time)
    det = "-"
    if group.passes == "training":
        det = "yes" if _deterministic(theirs, leaves) else "no"
    return times["torch"] / times["ours"], det


def rows_of(group: Group, device_tag: str, measured: Sequence[Tuple[int, float, str]], source: str) -> List[route.Row]:
    """The route rows of one group's sizes: each size's range reaches halfway (log scale) to its neighbours;
    neighbours with the same winner are merged."""
    bounds = [0] + [int(math.sqrt(a[0] * b[0])) for a, b in zip(measured, measured[1:])] + [None]
    rows: List[route.Row] = []
    for (size, speedup, det), lo, hi in zip(measured, bounds, bounds[1:]):
        last = rows[-1] if rows else None
        if last is not None and (last.speedup[1] < 1.0) == (speedup < 1.0):
            low, high = min(last.speedup[0], speedup), max(last.speedup[1], speedup)
            merged_det = "yes" if last.torch_deterministic == det == "yes" else ("-" if det == "-" else "no")
            rows[-1] = last._replace(sizes=(last.sizes[0], hi), speedup=(low, high), torch_deterministic=merged_det)
            continue
        rows.append(route.Row(group.op, group.passes, device_tag, (str(group.dtype).replace("torch.", ""),),
                              (group.head_dim,), (group.mask,), group.dropout, ("functional",), (lo, hi),
                              (speedup, speedup), det, source))
    return rows


def tune(device: torch.device, budget: float, quick: bool = False, out: Optional[str] = None,
         log: Callable[[str], None] = print) -> Tuple[str, List[route.Row]]:
    """Measure the rows on ``device`` for at most about ``budget`` seconds, write them where the route reads them
    (or to ``out``); returns ``(path, rows)``."""
    start = time.monotonic()
    ours = ft.current(device, torch.float32)
    if ours == "reference":
        raise SystemExit(f"tune: no kernels of ours run on {device} (backend 'auto' resolves to the reference)")
    tag = route.device_tag(device)
    source = f"tune {time.strftime('%Y-%m-%d')}"
    min_time = 0.02 if quick else (0.1 if device.type == "cuda" else 0.25)
    rows: List[route.Row] = []
    for group in _groups(device, quick):
        if time.monotonic() - start > budget:
            log(f"budget of {budget:.0f} s spent: {group.op} {group.passes} and later groups left to the built-in rows")
            break
        measured = []
        for size, example in group.examples:
            speedup, det = measure(group, example, device, ours, min_time)
            measured.append((size, speedup, det))
        group_rows = rows_of(group, tag, measured, source)
        rows.extend(group_rows)
        for row in group_rows:
            log(row.line())
    path = out or route.tuned_path(device)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(f"# {route.device_key(device)}: python -m fused_transformer tune, {time.monotonic() - start:.0f} s\n")
        f.write(route.HEADER + "\n" + "\n".join(row.line() for row in rows) + "\n")
    os.replace(path + ".tmp", path)
    route.forget_tuned()
    return path, rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused_transformer tune",
                                     description="measure the route table's rows on this device and keep them in "
                                                 "the user's cache, where the route reads them first")
    add_device_option(parser, "measures")
    parser.add_argument("--budget", type=positive_seconds, default=110.0, help="seconds to spend at most (default 110)")
    parser.add_argument("--quick", action="store_true", help="one small size per op (a check that it runs)")
    parser.add_argument("--out", default=None, help="write the rows here instead of the user's cache")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(route.HEADER)
    path, rows = tune(args.device, args.budget, args.quick, args.out)
    print(f"{len(rows)} rows written to {path}")
    return 0
