"""``python -m fused_transformer gpu-check``: everything only a GPU can check, in one command, with a verdict.

    python -m fused_transformer gpu-check [--out DIR] [--only PART ...] [--time-limit SECONDS] [--all-tests]

Four parts (``gpu_check_parts``), each in a process of its own under a wall-clock limit, so that a CUDA fault, a
hang or a timeout in one is recorded and the others still run:

- ``tests``: the GPU test files on the GPU itself (no Triton interpreter), judged by pytest's junit XML;
- ``check``: ``check --device cuda --quick``: every op and module against float64;
- ``bench``: ``bench --device cuda --quick`` on attention, layer_norm, feed_forward, encoder_layer: our TFLOP/s and
  speed-up over SDPA's default dispatch, each SDPA backend, flash_attn and xformers when installed;
- ``graphs``: a CUDA graph of a training step against eager, backward determinism, peak memory against L
  (``gpu_check_graphs``).

Each part writes ``DIR/<part>.json`` (and its output to ``DIR/<part>.log``); every invocation then rebuilds
``DIR/summary.json`` and ``DIR/summary.md`` from all the part records in DIR (``gpu_check_summary``), so parts run
in separate invocations merge. Limits: ``TIME_LIMITS_S`` per part, the whole run held to ``TOTAL_LIMIT_S`` (a
part that would start with less than ``MIN_PART_S`` left is not run, and says so).

Exit status: 0 every part asked for passed; 1 one failed, timed out or could not run; 2 no CUDA device here (the
summary says so; nothing ran).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from fused_transformer.interrupts import Interrupted
from fused_transformer.tools import make_folder, positive_seconds
from fused_transformer.tools.gpu_check_parts import (
    FAILED, NOT_RUN, PARTS, PASSED, RUNNING, TAIL_CHARS, TIMED_OUT, gpu_environment, log_path, part_record, read_record,
    record_path, run_with_limit, write_record,
)
from fused_transformer.tools.gpu_check_summary import write_summary
from fused_transformer.tools.provenance import package_version

TIME_LIMITS_S = {"tests": 540.0, "check": 300.0, "bench": 540.0, "graphs": 300.0}
TOTAL_LIMIT_S = 1200.0
MIN_PART_S = 60.0
# Quickest verdicts first; bench last, as its rows are kept when the whole run's time runs out under it.
RUN_ORDER = ("check", "graphs", "tests", "bench")
KILL_GRACE_S = 15.0  # a part stopped at its limit gets this long to end its own commands before SIGKILL
NO_CUDA_STATUS = 2

CommandFor = Callable[[str, str, float], List[str]]


def no_cuda_reason() -> Optional[str]:
    """None when torch sees a CUDA device, else the reason in words."""
    if torch.cuda.is_available():
        return None
    return (f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
            "torch.cuda.is_available() False)")


def environment() -> dict:
    """Date, versions and the GPU (None without one), as the summary and each part record give them."""
    device = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                  "sm_count": props.multi_processor_count, "memory_gib": props.total_memory / 2**30}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": package_version("triton"), "fused_transformer": package_version("fused_transformer"),
        "cuda_available": device is not None, "device": device,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),  # removed for the parts
    }


def part_command(part: str, out: str, limit_s: float, all_tests: bool = False) -> List[str]:
    """The command that runs one part in a process of its own."""
    command = [sys.executable, "-m", "fused_transformer.tools.gpu_check_parts", "--part", part, "--out", out,
               "--time-limit", f"{limit_s:g}"]
    return command + (["--all-tests"] if all_tests and part == "tests" else [])


def limit_for(part: str, limits: Mapping[str, float], total_s: Optional[float],
              spent_s: float) -> Tuple[Optional[float], Optional[str]]:
    """(the part's limit, a note when the whole run's limit cut it); the limit is None when too little is left."""
    limit = limits[part]
    if total_s is None:
        return limit, None
    left = total_s - spent_s
    if left < MIN_PART_S:
        return None, (f"the whole run's {total_s:.0f} s were spent before it could start: run it alone "
                      f"(gpu-check --only {part})")
    if left < limit:
        return left, f"cut from {limit:.0f} s to {left:.0f} s, the rest of the whole run's {total_s:.0f} s"
    return limit, None


def run_part(part: str, command: Sequence[str], out: str, limit_s: float) -> dict:
    """Run one part's process under ``limit_s`` and return its record, also written to ``DIR/<part>.json``: the
    part's own, or one that says it timed out (keeping what it had saved) or died without writing one."""
    path = record_path(out, part)
    if os.path.exists(path):
        os.remove(path)  # a record from an earlier run must not pass for this one's
    log = log_path(out, part)
    open(log, "wb").close()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        finished = run_with_limit(command, limit_s, log, env=gpu_environment(), grace_s=KILL_GRACE_S)
    except KeyboardInterrupt:  # run_with_limit has ended the part's processes
        write_record(out, part_record(part, NOT_RUN, "interrupted (Ctrl-C) while it ran"))
        raise
    record = read_record(path)
    if finished.timed_out:
        record = record or part_record(part, TIMED_OUT)
        record.update(status=TIMED_OUT, reason=f"stopped at its {limit_s:.0f} s limit")
    elif record is None or record["status"] == RUNNING:
        record = part_record(part, FAILED, f"its process ended (exit status {finished.returncode}) before writing its "
                             f"result", (record or {}).get("figures"))
    if not record.get("output_tail"):
        record["output_tail"] = finished.output[-TAIL_CHARS:]
    record.update(started=started, duration_s=round(finished.seconds, 1), limit_s=limit_s)
    write_record(out, record)
    return record


def run_parts(parts: Sequence[str], out: str, limits: Mapping[str, float], command_for: CommandFor,
              total_s: Optional[float] = TOTAL_LIMIT_S, stamp: Optional[dict] = None,
              say: Callable[[str], None] = print) -> Dict[str, dict]:
    """Run ``parts`` one after another, each with ``run_part``; ``stamp`` (the environment) goes into each record."""
    records = {}
    started = time.monotonic()
    for number, part in enumerate(parts, 1):
        limit, note = limit_for(part, limits, total_s, time.monotonic() - started)
        if limit is None:
            record = part_record(part, NOT_RUN, note)
        else:
            say(f"[{number}/{len(parts)}] {part}: running, at most {limit:.0f} s"
                + (f" ({note})" if note else "") + f"; output in {log_path(out, part)}")
            record = run_part(part, command_for(part, out, limit), out, limit)
            if note:
                record["limit_note"] = note
        if stamp is not None:
            record["environment"] = stamp
        write_record(out, record)
        records[part] = record
        duration = f" in {record['duration_s']:.0f} s" if record.get("duration_s") is not None else ""
        say(f"[{number}/{len(parts)}] {part}: {record['status']}{duration}"
            + (f": {record['reason']}" if record.get("reason") else ""))
    return records


# ---------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    limits = ", ".join(f"{part} {TIME_LIMITS_S[part]:.0f}" for part in PARTS)
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer gpu-check", description=__doc__.splitlines()[0],
        epilog="Exit status: 0 every part asked for passed; 1 a part failed, timed out or could not run; 2 no CUDA "
               "device here. See docs/gpu-check.md.")
    parser.add_argument("--out", default="gpu-check-results", metavar="DIR",
                        help="folder for the part records, their logs, the benchmark and the summary (default: "
                             "%(default)s); parts run in separate invocations into one folder merge there")
    parser.add_argument("--only", action="append", choices=PARTS, metavar="PART",
                        help=f"run only this part (repeatable; one of {', '.join(PARTS)}); default: all four")
    parser.add_argument("--time-limit", type=positive_seconds, metavar="SECONDS",
                        help=f"every part's wall-clock limit, with no limit on the whole run (default: {limits} "
                             f"seconds, the whole run held to {TOTAL_LIMIT_S:.0f})")
    parser.add_argument("--all-tests", action="store_true",
                        help="tests: the whole test suite instead of the GPU test files (longer: give --time-limit)")
    args = parser.parse_args(argv)
    make_folder(parser, f"--out {args.out!r}", args.out)
    args.out = os.path.abspath(args.out)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """The command: run the parts asked for, rebuild the summary, print the verdict."""
    args = parse_args(argv)
    asked = [part for part in RUN_ORDER if part in (args.only or PARTS)]
    reason = no_cuda_reason()
    if reason is not None:
        write_summary(args.out, environment(), lambda part: reason)
        print(f"gpu-check: {reason}: nothing ran; {os.path.join(args.out, 'summary.md')} says so", file=sys.stderr)
        return NO_CUDA_STATUS
    stamp = environment()
    if stamp["triton_interpret"]:
        print(f"gpu-check: TRITON_INTERPRET={stamp['triton_interpret']} is set here: removed for the parts, "
              "which run the compiled kernels")
    print(f"gpu-check on {stamp['device']['name']}: {', '.join(asked)}; writing to {args.out}", flush=True)
    limits = {part: args.time_limit for part in PARTS} if args.time_limit else TIME_LIMITS_S

    def command_for(part: str, out: str, limit_s: float) -> List[str]:
        return part_command(part, out, limit_s, args.all_tests)

    not_asked = lambda part: f"not asked for yet (gpu-check --only {part})"  # noqa: E731
    try:
        records = run_parts(asked, args.out, limits, command_for, None if args.time_limit else TOTAL_LIMIT_S, stamp,
                            say=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        write_summary(args.out, stamp, not_asked)
        raise Interrupted(f"the part running was stopped; the summary of the others is in "
                          f"{os.path.join(args.out, 'summary.md')}") from None
    summary = write_summary(args.out, stamp, not_asked)
    print(f"\n{summary['verdict']}\nsummary: {os.path.join(args.out, 'summary.md')}")
    return 0 if all(record["status"] == PASSED for record in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
