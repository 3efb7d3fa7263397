"""``python -m fused_transformer bench``: throughput of the fused ops and layers against their torch equivalents.

    python -m fused_transformer bench [--quick] [--device DEV] [--suite NAME ...] [--lengths 128,256]
                                      [--dtype float32|float16|bfloat16] [--out DIR] [--min-time S]
                                      [--threads N] [--backend NAME] [--no-plots] [--no-progress]

Runs the suites of ``fused_transformer.tools.bench_cases`` (every registered op with a bench, encoder_layer,
decoder_layer, llama, decode_step, module_call; all by default; llama, ``bench_llama``, is skipped with a line saying
so where transformers is not installed) and, only when named, ``overhead``
(``fused_transformer.tools.bench_overhead``: the host time of one call of each op and module on a tiny input) and
``variants`` (``fused_transformer.tools.bench_variants``: every variant of our kernels against the vendor's, the
winners written to ``--variant-rows``, the rows the plans read), prints
one table row per measurement as it goes, and writes to ``--out`` (default ``bench-results/``):

- ``bench_<device>.csv``, one row per (case, implementation), columns ``COLUMNS``:
  ``suite, case, mode, impl`` (what was measured: ``case`` is the mask or shape, ``mode`` fwd / fwd+bwd for the
  ops, train / eval for the layers, ``impl`` ours / sdpa / sdpa:<backend> / flash_attn / xformers / torch /
  torch.nn); ``device, dtype, batch, heads, seq_len, head_dim, d_model, d_ff, causal, padding`` (the shape;
  ``padding`` is the fraction of keys that are padding); ``ms`` (median time of one call);
  ``tflops`` (counted work / time, attention and feed-forward), ``tokens_per_s`` (batch * seq_len / time),
  ``gb_per_s`` and ``bw_of_peak`` (ops that count bytes: counted bytes / time, and that as a fraction of the GPU's peak
  DRAM bandwidth when known); ``peak_mem_mb`` and ``mem_measure`` (peak memory of one call in MiB, and how it
  was measured: ``cuda_max_allocated`` or ``cpu_profiler_alloc``); ``baseline`` (the implementation the
  speed-up is against: sdpa's default dispatch, torch, torch.nn) and ``speedup`` (baseline ms / this ms: > 1 means
  faster than the baseline, 1.0 for the baseline itself); ``note`` (the backend ours ran on, the backend SDPA's
  default dispatch picked; for the overhead suite, the host microseconds per call and ours' ratios to thin and to
  torch).
- ``<suite>_<device>_throughput.png``: TFLOP/s (attention, ops that count FLOPs) or tokens/s (the others, layers)
  against
  the sequence length, one line per implementation, one panel per case and mode;
- ``<suite>_<device>_memory.png``: peak memory against the sequence length, same panels (a suite measured at one
  length only, as ``module_call``, gets bars per case instead); no plots for the overhead suite, whose table (in
  ``bench_<device>.md``) is its figure;
- ``bench_<device>.md``: each case of ours against its baseline as markdown tables, headed by the command, date,
  machine, versions and the commit measured (``bench_summary``, ``provenance``).

Work counted, timing and memory measurement are described in ``fused_transformer.tools.bench_cases``. Exit code 0,
or 1 if one of our implementations or a baseline failed on a case (the other cases are still measured).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional

import torch
from fused_transformer._progress import tqdm

import fused_transformer as ft
from fused_transformer import route
from fused_transformer.kernels import variants
from fused_transformer.interrupts import Interrupted
from fused_transformer.tools import (
    add_device_option, bench_overhead, bench_summary, bench_variants, bench_work, make_folder, positive_seconds,
)
from fused_transformer.tools import bench_cases as suites
from fused_transformer.tools.bench_cases import Case, Setup
from fused_transformer.tools.bench_plots import plot_suite
from fused_transformer.tools.bench_timing import MEMORY_MEASURES, peak_memory_mb, reset_grads, time_ms

COLUMNS = (
    "suite", "case", "mode", "impl", "device", "dtype", "batch", "heads", "seq_len", "head_dim", "d_model",
    "d_ff", "causal", "padding", "ms", "tflops", "tokens_per_s", "gb_per_s", "bw_of_peak", "peak_mem_mb",
    "mem_measure", "baseline", "speedup", "launches", "note",
)
# The overhead and variants suites run only when named.
SUITE_CHOICES = (*suites.SUITES, bench_overhead.SUITE, bench_variants.SUITE)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # as check spells them
Row = Dict[str, object]


# -------------------------------------------------------------------------------------------- measuring


def measure(case: Case, setup: Setup, min_time: float, failures: List[str],
            profile_path: Optional[str] = None) -> Iterator[Row]:
    """Time every implementation of ``case`` side by side (``bench_timing.time_ms``) and yield its CSV rows,
    the baseline first, then ours. An implementation that refuses the case yields a row with ``ms`` None and
    the reason in ``note``. ``profile_path``: an overhead case's profiles are appended there after its timing
    (``bench_overhead.profile``)."""
    try:
        built = case.build()
    except (RuntimeError, ValueError) as exc:  # e.g. out of memory while allocating the inputs
        failures.append(f"{case.id}: {_first_line(exc)}")
        yield _row(case, setup, case.baseline, None, None, f"FAILED to build the case: {_first_line(exc)}")
        return
    overhead = case.suite == bench_overhead.SUITE
    accepted, memory, routes = {}, {}, {}
    for impl in case.impls:
        fn = built.fns[impl]
        try:
            with _quiet(impl in built.quiet or suites.is_competitor(impl)):
                # The first call warms up and tells whether this implementation takes the case at all. On CPU it
                # is also the memory measurement (the slowest calls take seconds); on CUDA the first call of a
                # new shape may autotune, so memory is measured on a second one.
                with route.explain() as decided:
                    if setup.device.type == "cuda":
                        reset_grads(built.grads)
                        fn()
                    memory[impl] = peak_memory_mb(fn, built.grads, setup.device)
                routes[impl] = route.describe(decided)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            _free_device_memory(setup.device)
            if suites.is_competitor(impl):
                yield _row(case, setup, impl, None, None, f"refused, left out: {_first_line(exc)}")
                continue
            failures.append(f"{case.id} {impl}: {_first_line(exc)}")
            yield _row(case, setup, impl, None, None, f"FAILED: {_first_line(exc)}")
            if impl == case.baseline:
                return  # no speed-up to report against
            continue
        accepted[impl] = fn
    notes = built.notes
    counted = {impl: bench_overhead.launch_count(fn, setup.device) for impl, fn in accepted.items()} if overhead else {}
    try:
        with _quiet(bool(built.quiet)):
            times = (bench_overhead.host_ms if overhead else time_ms)(accepted, built.grads, setup.device, min_time)
        if overhead and profile_path is not None:
            bench_overhead.profile(case, accepted, setup.device, profile_path)
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # out of memory, say
        failures.append(f"{case.id}: {_first_line(exc)}")
        yield _row(case, setup, case.baseline, None, None, f"FAILED while timing: {_first_line(exc)}")
        return
    finally:
        del built, accepted  # the inputs, before the next case allocates its own
        _free_device_memory(setup.device)
    for impl, ms in times.items():
        note = _note(notes, setup, impl, routes.get(impl, ""))
        if overhead:
            note = "; ".join(filter(None, [note, bench_overhead.ratio_note(case, times, impl)]))
        yield _row(case, setup, impl, ms, memory[impl], note, times.get(case.baseline), counted.get(impl))


def _row(case: Case, setup: Setup, impl: str, ms: Optional[float], mem: Optional[float], note: str,
         baseline_ms: Optional[float] = None, launches: Optional[int] = None) -> Row:
    measured = ms is not None
    bandwidth = bench_work.gbps_of(case, ms) if measured else None
    peak = bench_work.peak_bandwidth_gbps(setup.device)
    return {
        "suite": case.suite, "case": case.case, "mode": case.mode, "impl": impl, "device": setup.device.type,
        "dtype": str(setup.dtype).replace("torch.", ""), "batch": case.batch, "heads": case.heads,
        "seq_len": case.seq_len, "head_dim": case.head_dim, "d_model": case.d_model, "d_ff": case.d_ff,
        "causal": case.causal, "padding": round(case.padding, 4), "ms": ms,
        "tflops": bench_work.tflops_of(case, ms) if measured else None,
        "tokens_per_s": bench_work.tokens_per_s(case, ms) if measured else None,
        "gb_per_s": bandwidth, "bw_of_peak": bandwidth / peak if bandwidth is not None and peak else None,
        "peak_mem_mb": mem, "mem_measure": _mem_measure(setup.device) if measured else None,
        "baseline": case.baseline,
        "speedup": baseline_ms / ms if measured and baseline_ms is not None else None,
        "launches": launches, "note": note,
    }


def _mem_measure(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "cpu_profiler_alloc"


def _note(notes: Dict[str, str], setup: Setup, impl: str, routed: str = "") -> str:
    """The CSV's note: for ours the backend and the route's decisions (``route.describe``) of its calls."""
    if impl == "ours":
        with ft.use_backend(setup.backend):
            backend = ft.current(setup.device, setup.dtype)
        note = f"backend {backend}" + (" (interpreter, launches skipped)" if bench_overhead.skips_launches(setup)
                                       else "")
        return note + (f"; route: {routed}" if routed else "")
    return notes.get(impl, "")


@contextlib.contextmanager
def _quiet(active: bool) -> Iterator[None]:
    """SDPA warns about each backend that refuses a case: the table already says so (``Built.quiet``)."""
    with warnings.catch_warnings():
        if active:
            warnings.simplefilter("ignore", UserWarning)
        yield


def _free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


# ---------------------------------------------------------------------------------------------- output


def _rate(row: Row) -> str:
    if row["tflops"] is not None:
        return f"{row['tflops']:.3g} TFLOP/s"
    text = f"{row['tokens_per_s'] / 1e3:.4g}k tok/s"
    if row["gb_per_s"] is not None:
        text += f", {row['gb_per_s']:.3g} GB/s"
        if row["bw_of_peak"] is not None:
            text += f" ({row['bw_of_peak']:.0%} of peak)"
    return text


TABLE = "{case:<13} {mode:<8} {seq_len:>5}  {impl:<22}{ms:>10}  {rate:<34}{mem:>10}{speedup:>10}"


def say(text: str = "") -> None:
    """A line on stdout; a progress bar on the same terminal is cleared first and redrawn after."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def print_header(suite: str, setup: Setup, baseline: str) -> None:
    describe = (bench_overhead.describe(setup) if suite == bench_overhead.SUITE else bench_variants.describe(setup)
                if suite == bench_variants.SUITE else suites.describe(suite, setup))
    say(f"\n== {suite}: {describe}; {setup.device.type} {str(setup.dtype)[6:]}; "
        f"speed-up = {baseline} ms / ms (> 1: faster than {baseline})")
    say(TABLE.format(case="case", mode="mode", seq_len="L", impl="impl", ms="ms", rate="throughput",
                     mem="peak MB", speedup="speed-up"))


def print_row(row: Row) -> None:
    if row["ms"] is None:
        say(TABLE.format(case=row["case"], mode=row["mode"], seq_len=row["seq_len"], impl=row["impl"], ms="-",
                         rate=row["note"], mem="", speedup=""))
        return
    speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-"
    note = f"  {row['note']}" if row["note"] and row["impl"] != "ours" else ""  # ours' backend is in the header
    say(TABLE.format(case=row["case"], mode=row["mode"], seq_len=row["seq_len"], impl=row["impl"],
                     ms=f"{row['ms']:.3f}", rate=_rate(row), mem=f"{row['peak_mem_mb']:.1f}", speedup=speedup)
        + note)


def _csv_value(value: object) -> object:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value



# ------------------------------------------------------------------------------------------------- CLI


def _lengths(text: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: the lengths must be positive integers")
    return values


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fused_transformer bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sequence lengths and shorter timings (about 1-2 minutes on a 2-core CPU)")
    add_device_option(parser, "measures on")
    parser.add_argument("--suite", action="append", metavar="NAME", choices=SUITE_CHOICES,
                        help=f"a suite to run, one of {', '.join(SUITE_CHOICES)}; repeat for several (default: all "
                        f"but {bench_overhead.SUITE}, which runs only when named)")
    parser.add_argument("--lengths", type=_lengths, metavar="L,L,...",
                        help="sequence lengths, e.g. 128,256 (default: per suite and device)")
    parser.add_argument("--dtype", choices=DTYPES, help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--out", default="bench-results", metavar="DIR",
                        help="folder for the CSV and the plots (default: %(default)s)")
    parser.add_argument("--min-time", type=positive_seconds, metavar="SECONDS",
                        help="CPU: seconds each implementation of a case is timed for, at least (default 0.5, 0.2 "
                        "with --quick)")
    parser.add_argument("--backend", default="auto", choices=ft.backend.BACKENDS,
                        help="the fused_transformer backend 'ours' runs on (default: %(default)s)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help=f"CPU threads for torch and our kernels (default {torch.get_num_threads()}, torch's)")
    parser.add_argument("--profile", action="store_true",
                        help=f"with --suite {bench_overhead.SUITE}: also write where each case's host time goes "
                        "(cProfile and the torch profiler) to DIR/overhead_profile_<device>.txt")
    parser.add_argument("--variant-rows", metavar="PATH",
                        help=f"with --suite {bench_variants.SUITE}: where the winners go (default: the package's "
                        "kernels/variant_rows.json on CUDA, which the plans read; DIR/variant_rows_cpu.json on the "
                        "CPU)")
    parser.add_argument("--no-plots", action="store_true", help="write the CSV only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    if args.min_time is None:
        args.min_time = 0.2 if args.quick else 0.5
    with ft.use_backend(args.backend):
        try:
            ft.current(args.device, args.dtype)
        except RuntimeError as exc:
            parser.error(f"--backend {args.backend}: {exc}")
    if args.profile and bench_overhead.SUITE not in (args.suite or ()):
        parser.error(f"--profile profiles the {bench_overhead.SUITE} suite: add --suite {bench_overhead.SUITE}")
    for named in (bench_overhead, bench_variants):
        if named.SUITE in (args.suite or ()):
            reason = named.unusable_reason(Setup(args.device, args.dtype, args.backend))
            if reason:
                parser.error(f"--suite {named.SUITE}: {reason}")
    if args.variant_rows is not None and bench_variants.SUITE not in (args.suite or ()):
        parser.error(f"--variant-rows holds the winners of the {bench_variants.SUITE} suite: add --suite "
                     f"{bench_variants.SUITE}")
    make_folder(parser, f"--out {args.out!r}", args.out)
    return args


def main(argv: Optional[List[str]] = None, recap: Optional[List[str]] = None) -> int:
    """The command; with ``recap`` (``python -m fused_transformer``), the files written are not listed one by one,
    and a few lines summing the run up are appended to it instead."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        return run(args, ["bench", *(argv if argv is not None else sys.argv[1:])], recap)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, command: Optional[List[str]] = None, recap: Optional[List[str]] = None) -> int:
    setup = Setup(args.device, args.dtype, args.backend)
    names = list(dict.fromkeys(args.suite or suites.SUITES))
    unavailable = {name: reason for name in names if name in suites.SUITES
                   for reason in [suites.unavailable_reason(name)] if reason}
    names = [name for name in names if name not in unavailable]
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)  # do_bench and the memory statistics use the current device
    device_name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU"
    with ft.use_backend(setup.backend):
        ours = ft.current(setup.device, setup.dtype)
    print(f"fused_transformer bench: torch {torch.__version__}, {device_name}, {torch.get_num_threads()} threads, "
          f"{str(setup.dtype)[6:]}; ours = backend {setup.backend!r} -> {ours}")
    for name, reason in unavailable.items():
        print(f"SKIPPED suite {name}: {reason}")
    if setup.backend == "auto" and setup.device.type == "cpu" and ours != "cpu":
        print(f"WARNING: the C++ cpu backend is unavailable ({ft.backend.cpu_unavailable_reason()}); "
              "'ours' is the pure-PyTorch reference here")
    for note in suites.competitor_notes(setup.device, names):
        print(f"  {note}")
    timing = ("triton.testing.do_bench median" if setup.device.type == "cuda" else
              f"torch.utils.benchmark, the implementations of a case taking turns (at least {args.min_time:g} s "
              "each), median")
    print(f"  time: {timing}\n  peak memory: {MEMORY_MEASURES[setup.device.type]}")
    csv_path = os.path.join(args.out, f"bench_{setup.device.type}.csv")
    rows: List[Row] = []
    failures: List[str] = []
    started = time.perf_counter()
    suite_setups = {name: bench_overhead.setup_for(setup) if name == bench_overhead.SUITE else setup for name in names}
    suite_cases = {name: bench_overhead.cases(suite_setups[name]) if name == bench_overhead.SUITE
                   else bench_variants.cases(setup, args.quick) if name == bench_variants.SUITE
                   else suites.cases(name, setup, args.lengths, args.quick) for name in names}
    # Rows go to a new file as they are measured; the previous CSV is replaced only by a complete run.
    partial_path = csv_path + ".partial"
    bar = tqdm(total=sum(map(len, suite_cases.values())), unit="case", file=sys.stderr, dynamic_ncols=True,
               disable=True if args.no_progress else None, leave=False)
    try:
        with open(partial_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for name, cases in suite_cases.items():
                suite_started, suite_setup = time.perf_counter(), suite_setups[name]
                print_header(name, suite_setup, cases[0].baseline)
                overhead = name == bench_overhead.SUITE
                profiles = bench_overhead.profile_path(args.out, setup.device) if overhead and args.profile else None
                if profiles is not None:
                    bench_overhead.start_profiles(profiles, suite_setup)
                with bench_overhead.conditions(suite_setup) if overhead else contextlib.nullcontext():
                    for case in cases:
                        bar.set_description(f"{name} {case.case} {case.mode} L{case.seq_len}")
                        for row in measure(case, suite_setup, args.min_time, failures, profiles):
                            print_row(row)
                            rows.append(row)
                            writer.writerow({key: _csv_value(value) for key, value in row.items()})
                            f.flush()
                        bar.update()
                if overhead:
                    say("\n".join(["", *bench_overhead.table(rows)]))
                if name == bench_variants.SUITE:
                    verdicts = bench_variants.verdicts(rows, setup)
                    say("\n".join(["", *bench_variants.table(verdicts)]))
                say(f"({name}: {len(cases)} cases in {time.perf_counter() - suite_started:.0f} s)")
            os.fsync(f.fileno())
    except KeyboardInterrupt:
        bar.close()
        kept = f"{csv_path} untouched" if os.path.exists(csv_path) else f"no {csv_path} written"
        raise Interrupted(f"{len(rows)} rows measured are in {partial_path}; {kept}") from None
    bar.close()
    os.replace(partial_path, csv_path)
    written = [csv_path]
    if bench_variants.SUITE in names:
        rows_path = args.variant_rows or (variants.MEASURED_FILE if setup.device.type == "cuda"
                                          else os.path.join(args.out, f"variant_rows_{setup.device.type}.json"))
        variants.write_rows(verdicts, rows_path)
        written.append(rows_path)
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is NOT INSTALLED: no plots written (pip install matplotlib, or the [bench] extra)")
        else:
            written += [path for name in names if name not in (bench_overhead.SUITE, bench_variants.SUITE)
                        for path in plot_suite(rows, name, setup, args.out)]
    summary_path = os.path.join(args.out, f"bench_{setup.device.type}.md")
    with open(summary_path, "w") as f:
        f.write(bench_summary.markdown(rows, setup, command or ["bench"], written[1:]))
    written.append(summary_path)
    if args.profile:
        written.append(bench_overhead.profile_path(args.out, setup.device))
    seconds = time.perf_counter() - started
    if recap is None:
        print(f"\n{len(rows)} rows in {seconds:.0f} s; wrote " + ", ".join(written))
    else:
        recap += [f"bench: {len(rows)} rows in {seconds:.0f} s, written to {args.out}"] + [
            "  " + line for line in bench_summary.recap(rows)]
    if failures:
        print(f"\n{len(failures)} failure(s):\n  " + "\n  ".join(failures))
        if recap is not None:
            recap.append(f"  {len(failures)} failure(s), listed above")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
