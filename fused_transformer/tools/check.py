"""``python -m fused_transformer check``: every op and module, on every backend usable here, against float64.

A check runs one op or module of the grid (``fused_transformer.tools.check_cases``) in one precision on one
backend, and compares each of its results (output, attention weights, every gradient) with the same computation
in float64 on the reference backend, under the project's rule (``fused_transformer.tools.numerics``: at most 2x
PyTorch's own error in that precision, plus a small floor). The float64 run starts from the very inputs,
parameters and output gradients the checked run got (rounded to its precision), so the comparison measures the
computation, not the rounding of its inputs. A check passes when every one of its results passes.

Table columns: ``max err`` and ``torch err`` are those of the check's worst result, named in the last column;
``ratio`` is ``err / (torch err + floor / 2)``, so 1.0 means "as accurate as PyTorch in this precision" (below 1:
more accurate) and a check passes exactly when its ratio is at most 2.0. The reference backend's own rows
compare PyTorch with itself (ratio below 1 by construction): they check the dispatch and the module wiring.
Interpreted Triton kernels round bfloat16 as a GPU does, and their unwritten elements read as NaN.

Test-only hook: ``CORRUPT`` (a set of ``(op, backend)``) and the environment variable
``FUSED_TRANSFORMER_CHECK_CORRUPT=op:backend[,op:backend...]`` make every check of that op on that backend add
``CORRUPT_SCALE * max|out|`` to one element of its real output before the comparison, as a broken kernel
would; the header says so. Nothing else uses them.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, TextIO, Tuple

import torch
from fused_transformer._progress import tqdm

import fused_transformer as ft
from fused_transformer import backend, ops, route
from fused_transformer.interrupts import Interrupted
from fused_transformer.tools import add_device_option
from fused_transformer.tools.check_cases import CHECKS, DTYPES, QUICK_DTYPES, Case, Results, build_cases
from fused_transformer.tools.provenance import package_version
from fused_transformer.tools.numerics import (
    ATOL_FLOOR, FACTOR, Verdict, interpreter_rounds_to_nearest, judge, unwritten_elements_are_nan,
)

BACKENDS = ("triton", "cpu", "reference")

# Test-only (see the module docstring): (op, backend) pairs whose output is perturbed before the comparison.
CORRUPT: Set[Tuple[str, str]] = set()
CORRUPT_ENV = "FUSED_TRANSFORMER_CHECK_CORRUPT"
# Large enough to break the rule in every dtype, bfloat16 modules included.
CORRUPT_SCALE = 0.5


def backend_status(device: torch.device) -> Dict[str, Optional[str]]:
    """Backend name -> None when it runs on ``device`` here, else why not."""
    status = {}
    for name in BACKENDS:
        try:
            with ft.use_backend(name):
                ft.current(device)
            status[name] = None
        except RuntimeError as exc:
            status[name] = str(exc)
    return status


def usable_backends(device: torch.device) -> List[str]:
    return [name for name, reason in backend_status(device).items() if reason is None]


def corrupted_checks() -> Set[Tuple[str, str]]:
    """Test-only: the (op, backend) pairs to perturb, from ``CORRUPT`` and ``FUSED_TRANSFORMER_CHECK_CORRUPT``."""
    pairs = set(CORRUPT)
    for item in os.environ.get(CORRUPT_ENV, "").split(","):
        if item.strip():
            op, _, name = item.strip().partition(":")
            if op not in CHECKS or name not in BACKENDS:
                raise ValueError(f"{CORRUPT_ENV}={os.environ[CORRUPT_ENV]!r}: expected op:backend[,...] with op one "
                                 f"of {', '.join(CHECKS)} and backend one of {', '.join(BACKENDS)}")
            pairs.add((op, name))
    return pairs


def _corrupt(results: Results) -> None:
    """Test-only: a wrong element in the check's own output (its first result), as a broken kernel would write."""
    out = next(iter(results.values()))
    out.view(-1)[0] += CORRUPT_SCALE * float(out.abs().max())


def _describe_backend(name: str, device: torch.device) -> str:
    if name == "triton":
        if device.type == "cpu":
            return ("triton (Triton interpreter on CPU tensors, TRITON_INTERPRET=1: slow; "
                    "bfloat16 casts round as on a GPU)")
        return f"triton (Triton kernels on {torch.cuda.get_device_name(device)})"
    if name == "cpu":
        from fused_transformer import cpu_ops

        return (f"cpu (C++ kernels of fused_transformer._C, {cpu_ops.cpu_capability()} loops; 16-bit inputs computed "
                "in float32)")
    return "reference (plain PyTorch, the baseline)"


@dataclass
class Row:
    """One check: an op or module, on one backend, in one dtype, on one case of the grid."""

    op: str
    backend: str
    dtype: str
    label: str
    worst: Verdict
    failed: List[str]
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failed


def _error_row(case: Case, name: str, dtype_name: str, error: str) -> Row:
    return Row(case.op, name, dtype_name, case.label, Verdict("-", math.nan, math.nan, math.inf, False), [], error)


def _check_one(case: Case, name: str, dtype_name: str, oracle: Results, baseline: Results, corrupt: bool) -> Row:
    """Run ``case`` on backend ``name`` and judge every result; an exception becomes a row with ``error``."""
    try:
        with ft.use_backend(name), unwritten_elements_are_nan():
            results = case.run(DTYPES[dtype_name], False)
        if corrupt:
            _corrupt(results)
    except Exception as exc:  # noqa: BLE001 (reported as a failed check, never swallowed)
        return _error_row(case, name, dtype_name, f"{type(exc).__name__}: {exc}")
    verdicts = [judge(n, results.get(n), ref, baseline.get(n)) for n, ref in oracle.items()]
    verdicts += [Verdict(n, math.nan, math.nan, math.inf, False, "unexpected") for n in results if n not in oracle]
    worst = max(verdicts, key=lambda v: (not v.ok, math.inf if math.isnan(v.ratio) else v.ratio))
    failed = [v.name + (f" ({v.note})" if v.note else "") for v in verdicts if not v.ok]
    return Row(case.op, name, dtype_name, case.label, worst, failed)


def _routes(device: torch.device) -> str:
    """Who runs a few typical calls on ``device`` under ``"auto"`` (``route.decide``), with why."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with ft.use_backend("auto"):
        ours = backend.current(device, dtype)
    calls = {f"{op.name} {example.label}".strip(): op.route_call(example, device, dtype)
             for op in ops.registered() for example in op.route_examples}
    return "; ".join(f"{name} -> {route.decide_for(call, device, 'auto', ours).backend} "
                     f"({route.decide_for(call, device, 'auto', ours).reason})" for name, call in calls.items())


def _header(device: torch.device, quick: bool, status: Dict[str, Optional[str]], requested: Sequence[str],
            corrupt: Set[Tuple[str, str]]) -> List[str]:
    threads = f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""
    lines = [
        f"fused_transformer {ft.__version__} check ({'quick' if quick else 'full'} grid): torch {torch.__version__}, "
        f"triton {package_version('triton')}, python {platform.python_version()}, device {device}{threads}",
        "backends: " + "; ".join(_describe_backend(n, device) for n in requested if status[n] is None),
    ]
    for name in BACKENDS:
        if status[name] is not None:
            lines.append(f"not usable here{' (requested)' if name in requested else ''}: {status[name]}")
    with ft.use_backend("auto"):
        auto = ", ".join(f"{n} -> {backend.current(device, DTYPES[n])}" for n in DTYPES)
    lines.append(f"auto picks: {auto}; every backend takes all three dtypes (none is skipped)")
    lines.append("route on auto (training, 1024 keys or rows; checks below name their backend): " + _routes(device))
    floors = ", ".join(f"{n} {ATOL_FLOOR[DTYPES[n]]:.1e}" for n in DTYPES)
    lines.append(f"rule: pass iff err <= {FACTOR:g} x torch err + floor ({floors}) for the output and every gradient; "
                 f"ratio = err / (torch err + floor/{FACTOR:g}), pass iff <= {FACTOR:g}")
    if corrupt:
        pairs = ", ".join(f"{op} on {name}" for op, name in sorted(corrupt))
        lines.append(f"TEST HOOK: outputs perturbed before comparison for {pairs}")
    return lines


def _summary(rows: List[Row], failures: int, dtype_names: Sequence[str], unchecked: Sequence[str],
             seconds: float) -> str:
    worst = []
    for dtype_name in dtype_names:
        mine = [row for row in rows if row.dtype == dtype_name]
        if mine:
            top = max(mine, key=lambda r: math.inf if math.isnan(r.worst.ratio) else r.worst.ratio)
            worst.append(f"{dtype_name} {top.worst.ratio:.2f} ({top.op} on {top.backend}, {top.worst.name})")
    missing = f" (requested backend {', '.join(unchecked)} not usable here)" if unchecked else ""
    return (f"summary: {len(rows)} checks, {failures} failed{missing}; worst ratio {'; '.join(worst) or '-'} "
            f"(limit {FACTOR:g}); {seconds:.1f} s")


def check(
    device: torch.device, quick: bool = False, *, ops: Sequence[str] = CHECKS, backends: Optional[Sequence[str]] = None,
    dtypes: Optional[Sequence[str]] = None, progress: bool = True, out: Optional[TextIO] = None,
    recap: Optional[List[str]] = None,
) -> int:
    """Print the header, the table and the summary to ``out`` (stdout), and append the summary to ``recap``; return
    the number of failed checks. ``backends`` None: every backend usable here; a named one that is not usable
    counts as a failure."""
    out = out or sys.stdout
    started = time.perf_counter()
    status = backend_status(device)
    corrupt = corrupted_checks()
    requested = list(backends) if backends else [name for name in BACKENDS if status[name] is None]
    names = [name for name in requested if status[name] is None]
    unchecked = [name for name in requested if status[name] is not None]
    dtype_names = list(dtypes) if dtypes else list(QUICK_DTYPES if quick else DTYPES)
    cases = build_cases(device, ops, quick)

    def say(line: str = "") -> None:  # through tqdm, so that a bar on the same terminal is cleared first
        tqdm.write(line, file=out)
        out.flush()

    for line in _header(device, quick, status, requested, corrupt):
        say(line)
    op_w = max([len("op")] + [len(c.op) for c in cases]) + 2
    label_w = max([len("case")] + [len(c.label) for c in cases]) + 2
    header = (f"{'op':<{op_w}}{'backend':<11}{'dtype':<10}{'case':<{label_w}}{'max err':>10}{'torch err':>11}"
              f"{'ratio':>8}  result  worst")
    say()
    say(header)
    say("-" * len(header))

    rows: List[Row] = []
    notes: List[str] = []
    bar = tqdm(total=len(cases) * len(dtype_names) * len(names), unit="check", file=sys.stderr, leave=False,
               dynamic_ncols=True, disable=None if progress else True)
    try:
        with interpreter_rounds_to_nearest():
            for case in cases:
                for dtype_name in dtype_names:
                    bar.set_description(f"{case.op} {dtype_name}: float64 and torch")
                    try:
                        with ft.use_backend("reference"):
                            oracle = case.run(DTYPES[dtype_name], True)
                            baseline = case.run(DTYPES[dtype_name], False)
                        reference_error = None
                    except Exception as exc:  # noqa: BLE001 (every row of this case and dtype reports it)
                        oracle, baseline, reference_error = {}, {}, f"reference: {type(exc).__name__}: {exc}"
                    for name in names:
                        bar.set_description(f"{case.op} {name} {dtype_name}")
                        hooked = (case.op, name) in corrupt
                        if reference_error is None:
                            row = _check_one(case, name, dtype_name, oracle, baseline, hooked)
                        else:
                            row = _error_row(case, name, dtype_name, reference_error)
                        rows.append(row)
                        if row.error:
                            notes.append(f"[{len(notes) + 1}] {case.op} {name} {dtype_name} {case.label}: {row.error}")
                            detail = f"see [{len(notes)}]"
                        elif row.failed:
                            more = len(row.failed) - 3
                            detail = ", ".join(row.failed[:3]) + (f" and {more} more" if more > 0 else "")
                        else:
                            detail = row.worst.name
                        result = "pass" if row.ok else ("ERROR" if row.error else "FAIL")
                        bar.update()
                        w = row.worst
                        say(f"{row.op:<{op_w}}{row.backend:<11}{row.dtype:<10}{row.label:<{label_w}}{w.err:>10.2e}"
                            f"{w.baseline_err:>11.2e}{w.ratio:>8.2f}  {result:<6}  {detail}" + " (test hook)" * hooked)
    except KeyboardInterrupt:
        bar.close()
        say()
        say(_summary(rows, sum(not row.ok for row in rows), dtype_names, (), time.perf_counter() - started)
            + " (interrupted)")
        raise Interrupted(f"{len(rows)} of {bar.total} checks done: their rows and summary are above") from None
    bar.close()

    failures = sum(not row.ok for row in rows) + len(unchecked)
    say()
    for note in notes:
        say(note)
    summary = _summary(rows, failures, dtype_names, unchecked, time.perf_counter() - started)
    say(summary)
    if recap is not None:
        recap.append("check " + summary.removeprefix("summary: "))
    return failures


def main(argv: Optional[List[str]] = None, recap: Optional[List[str]] = None) -> int:
    """The command; with ``recap`` (``python -m fused_transformer``), its summary line is appended to it."""
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer check", description=__doc__.splitlines()[0],
        epilog="Exit code 1 when any check fails. See fused_transformer.tools.numerics for the rule.",
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller grid: small shapes, fewer masks, {' and '.join(QUICK_DTYPES)} only")
    add_device_option(parser, "checks on")
    parser.add_argument("--backend", action="append", choices=BACKENDS, metavar="NAME",
                        help=f"check only this backend (repeatable; {', '.join(BACKENDS)}); default: all usable here")
    parser.add_argument("--op", action="append", choices=CHECKS, metavar="NAME",
                        help=f"check only this op or module (repeatable; one of {', '.join(CHECKS)}); default: all")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), metavar="NAME",
                        help=f"check only this dtype (repeatable; one of {', '.join(DTYPES)})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    try:
        corrupted_checks()
    except ValueError as exc:
        parser.error(str(exc))
    dedup = lambda names: list(dict.fromkeys(names)) if names else None  # noqa: E731
    failures = check(args.device, args.quick, ops=dedup(args.op) or CHECKS, backends=dedup(args.backend),
                     dtypes=dedup(args.dtype), progress=not args.no_progress, recap=recap)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
