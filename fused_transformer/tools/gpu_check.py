"""``python -m fused_transformer gpu-check``: everything only a GPU can check, in one command, with a verdict.

    python -m fused_transformer gpu-check [--out DIR] [--only PART ...] [--budget SECONDS] [--device DEVICE]
                                          [--all-tests]

Six parts (``gpu_check_parts``), each in a process of its own under a wall-clock limit, so that a CUDA fault, a
hang or a timeout in one is recorded and the others still run:

- ``variants``: ``bench --suite variants --quick``: every variant of our kernels against the vendor's, the winners
  written as the rows the plans read (``kernels/variant_rows.json``; a copy in ``DIR/variants``), first and alone;

- ``tests``: the GPU test files on the GPU itself (no Triton interpreter), judged by pytest's junit XML;
- ``check``: ``check --quick``: every op and module against float64;
- ``bench``: ``bench --quick`` on attention, every registered op, encoder_layer: our TFLOP/s and speed-up over
  SDPA's default dispatch, each SDPA backend, flash_attn and xformers when installed;
- ``graphs``: a CUDA graph of a training step against eager, backward determinism, peak memory against L
  (``gpu_check_graphs``);
- ``tune``: ``tune --out DIR/tuned_rows.txt``: the route's rows measured on this GPU, compared with the priors it ran
  under before (``priors``): ``DIR/priors.md``, and a line of counts in the summary.

The variants part runs first, alone, in its share (``variants_limit``). The parts that time nothing (``SIDE_BY_SIDE``:
tests, check, graphs) then run at the same time; bench runs after them, alone, so that nothing shares the GPU with its
timings, and tune after bench, alone for the same reason. The whole run is held to ``--budget`` (``DEFAULT_BUDGET_S``):
of what variants leaves, bench's share is ``bench_share`` and tune's ``tune_share``, and the parts side by side get the
rest (``split_budget``); bench gets whatever they leave but tune's share (``bench_limit``), tune all that is left
(``tune_limit``). By default: variants 120 s, tests/check/graphs 199.5 s, bench 157.5 s, tune 63 s. Every part runs
on one GPU, the ``--device``: its process sees only that one (``CUDA_VISIBLE_DEVICES``, ``visible_devices``).

Each part writes ``DIR/<part>.json`` (and its output to ``DIR/<part>.log``); every invocation then rebuilds
``DIR/summary.json`` and ``DIR/summary.md`` from all the part records in DIR (``gpu_check_summary``), so parts run
in separate invocations merge.

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
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from fused_transformer.interrupts import Interrupted
from fused_transformer.tools import add_device_option, make_folder, positive_seconds
from fused_transformer.tools.gpu_check_parts import (
    FAILED, NOT_RUN, PARTS, PASSED, RUNNING, TAIL_CHARS, TIMED_OUT, LimitedRun, gpu_environment, log_path,
    part_record, read_record, record_path, write_record,
)
from fused_transformer.tools.gpu_check_summary import write_summary
from fused_transformer.tools.provenance import package_version

# A GPU machine is lent for 15 minutes, its start included, and 10 minutes a command: 9 minutes leave room for both.
DEFAULT_BUDGET_S = 540.0
SIDE_BY_SIDE = ("tests", "check", "graphs")  # they time nothing, so they may share the GPU and the CPU cores
# bench's share of the budget: 3/8 of it, at most 3 minutes, which bench --quick's two lengths fit (docs/gpu-check.md);
# every second beyond that goes to the tests, the part that grows with its time.
BENCH_SHARE = 0.375
BENCH_SHARE_MAX_S = 180.0
MIN_PART_S = 60.0  # a part with less left than this is not started (and --budget is at least this)
# The variants part runs first and alone (it times the kernels' variants): a quarter of the budget, at most 2 minutes,
# which bench --suite variants --quick fits (docs/gpu-check.md); the other parts share what it leaves.
VARIANTS_SHARE = 0.25
VARIANTS_SHARE_MAX_S = 120.0
# tune runs last and alone (it times ours against torch's path): 15% of what variants leaves, at most 90 s; 63 s by
# default, which leaves its --budget 23 s after its start and the comparison (gpu_check_parts.tune_command).
TUNE_SHARE = 0.15
TUNE_SHARE_MAX_S = 90.0
ALONE_AFTER = ("bench", "tune")  # the parts that run alone after those side by side, in this order
KILL_GRACE_S = 15.0  # a part stopped at its limit gets this long to end its own commands before SIGKILL
TICK_S = 0.2  # how often the parts running are looked at
NO_CUDA_STATUS = 2

CommandFor = Callable[[str, str, float], List[str]]
Say = Callable[[str], None]


def no_cuda_reason() -> Optional[str]:
    """None when torch sees a CUDA device, else the reason in words."""
    if torch.cuda.is_available():
        return None
    return (f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
            "torch.cuda.is_available() False)")


def visible_devices(index: int, parent: Optional[str] = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a part that must see only CUDA device ``index`` of this process: that entry of
    this process's own list (``parent``, default its environment's) when it has one, else the index."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    if not parent or not parent.strip():
        return str(index)
    entries = [entry.strip() for entry in parent.split(",")]
    if index >= len(entries):
        raise ValueError(f"cuda:{index} is not in CUDA_VISIBLE_DEVICES={parent}")
    return entries[index]


def environment(device: Optional[torch.device] = None, visible: Optional[str] = None) -> dict:
    """Date, versions and the GPU the parts run on (None without one), as the summary and each record give them."""
    described = None
    if device is not None:
        props = torch.cuda.get_device_properties(device)
        described = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "sm_count": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
                     "torch_device": str(device), "cuda_visible_devices": visible}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": package_version("triton"), "fused_transformer": package_version("fused_transformer"),
        "cuda_available": torch.cuda.is_available(), "device": described,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),  # removed for the parts
    }


def part_command(part: str, out: str, limit_s: float, all_tests: bool = False) -> List[str]:
    """The command that runs one part in a process of its own."""
    command = [sys.executable, "-m", "fused_transformer.tools.gpu_check_parts", "--part", part, "--out", out,
               "--time-limit", f"{limit_s:g}"]
    return command + (["--all-tests"] if all_tests and part == "tests" else [])


# ------------------------------------------------------------------------------------------------- the budget


def bench_share(budget_s: float) -> float:
    """The seconds of ``budget_s`` kept for bench, which runs after the parts side by side."""
    return min(BENCH_SHARE_MAX_S, budget_s * BENCH_SHARE)


def variants_limit(budget_s: float, asked: Sequence[str]) -> float:
    """The seconds of ``budget_s`` the variants part runs for, first and alone: its share (``VARIANTS_SHARE``, at most
    ``VARIANTS_SHARE_MAX_S``), or the whole budget when it is the only part asked for."""
    if all(part == "variants" for part in asked):
        return budget_s
    return max(MIN_PART_S, min(VARIANTS_SHARE_MAX_S, budget_s * VARIANTS_SHARE))


def tune_share(budget_s: float) -> float:
    """The seconds of ``budget_s`` kept for tune, which runs last."""
    return min(TUNE_SHARE_MAX_S, budget_s * TUNE_SHARE)


def split_budget(budget_s: float, asked: Sequence[str]) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """(the limit of each part side by side, bench's share, tune's share) of ``budget_s`` for the parts ``asked``; None
    for a phase not asked for. The parts side by side get what the shares of bench and tune leave; bench without
    parts side by side gets what tune's share leaves; a phase alone gets the whole budget."""
    side = any(part in SIDE_BY_SIDE for part in asked)
    alone = [part for part in ALONE_AFTER if part in asked]
    if not alone:
        return (budget_s if side else None), None, None
    if not side and len(alone) == 1:
        return (None, budget_s, None) if alone == ["bench"] else (None, None, budget_s)
    tune = tune_share(budget_s) if "tune" in asked else None
    bench = bench_share(budget_s) if "bench" in asked else None
    if not side:
        return None, budget_s - tune, tune
    return budget_s - (bench or 0.0) - (tune or 0.0), bench, tune


def limit_after(part: str, budget_s: float, spent_s: float, share_s: float,
                kept_s: float = 0.0) -> Tuple[Optional[float], Optional[str]]:
    """(``part``'s limit, a note when it is not its share) after ``spent_s`` of ``budget_s``, ``kept_s`` kept for the
    parts after it: all that is left, so more than its share when the parts before it ended early; None when less than
    ``MIN_PART_S`` is left."""
    left = budget_s - spent_s - kept_s
    if left < MIN_PART_S:
        return None, (f"only {max(left, 0):.0f} s of the {budget_s:.0f} s budget were left for it: run it alone "
                      f"(gpu-check --only {part})")
    if left >= share_s + 1:
        return left, f"its {share_s:.0f} s share of the budget and the {left - share_s:.0f} s the parts before it left"
    if left < share_s - 1:
        return left, f"cut from its {share_s:.0f} s share to the {left:.0f} s left of the {budget_s:.0f} s budget"
    return left, None


def bench_limit(budget_s: float, spent_s: float, share_s: float,
                tune_s: float = 0.0) -> Tuple[Optional[float], Optional[str]]:
    """(bench's limit, a note when it is not its share) after ``spent_s`` of ``budget_s``: all that is left but tune's
    share ``tune_s`` (``limit_after``)."""
    return limit_after("bench", budget_s, spent_s, share_s, tune_s)


def tune_limit(budget_s: float, spent_s: float, share_s: float) -> Tuple[Optional[float], Optional[str]]:
    """(tune's limit, a note when it is not its share) after ``spent_s`` of ``budget_s``: all that is left."""
    return limit_after("tune", budget_s, spent_s, share_s)


# -------------------------------------------------------------------------------------------- running parts


@dataclass
class RunningPart:
    """A part's process, started by ``run_side_by_side``."""

    part: str
    run: LimitedRun
    started: str  # the date, for the record


def _start_part(part: str, command: Sequence[str], out: str, limit_s: float,
                env: Optional[Mapping[str, str]]) -> RunningPart:
    path = record_path(out, part)
    if os.path.exists(path):
        os.remove(path)  # a record from an earlier run must not pass for this one's
    log = log_path(out, part)
    open(log, "wb").close()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return RunningPart(part, LimitedRun(command, limit_s, log, env=env, grace_s=KILL_GRACE_S), started)


def _part_result(running: RunningPart, out: str, fields: Mapping[str, object]) -> dict:
    """The ended part's record: its own, or one that says it timed out (keeping what it had saved) or died without
    writing one; with its wall time, its limit and ``fields``."""
    finished, part, limit_s = running.run.finished, running.part, running.run.limit_s
    record = read_record(record_path(out, part))
    if finished.timed_out:
        record = record or part_record(part, TIMED_OUT)
        record.update(status=TIMED_OUT, reason=f"stopped at its {limit_s:.0f} s limit")
    elif record is None or record["status"] == RUNNING:
        record = part_record(part, FAILED, f"its process ended (exit status {finished.returncode}) before writing its "
                             f"result", (record or {}).get("figures"))
    if not record.get("output_tail"):
        record["output_tail"] = finished.output[-TAIL_CHARS:]
    record.update(fields, started=running.started, duration_s=round(finished.seconds, 1), limit_s=round(limit_s, 1))
    write_record(out, record)
    return record


def run_side_by_side(commands: Mapping[str, Sequence[str]], out: str, limit_s: float,
                     env: Optional[Mapping[str, str]] = None, say: Say = lambda line: None,
                     fields: Optional[Mapping[str, object]] = None) -> Dict[str, dict]:
    """Run each part's command at the same time, each in a process (session) of its own under ``limit_s``, and return
    their records as ``_part_result`` makes them, also written to ``DIR/<part>.json``, with ``fields`` added and
    ``phase`` (the parts beside it, unless ``fields`` says). Ctrl-C stops them all, and their records say so."""
    running = {part: _start_part(part, command, out, limit_s, env) for part, command in commands.items()}
    records: Dict[str, dict] = {}

    def fields_of(part: str) -> dict:
        others = [other for other in commands if other != part]
        return {"phase": f"side by side with {', '.join(others)}" if others else "alone", **(fields or {})}

    try:
        while len(records) < len(running):
            for part, this in running.items():
                if part not in records and this.run.poll() is not None:
                    records[part] = _part_result(this, out, fields_of(part))
                    say(_ended_line(records[part]))
            time.sleep(TICK_S)
    except KeyboardInterrupt:
        left = [this for part, this in running.items() if part not in records]
        for this in left:
            this.run.stop()
        for this in left:
            this.run.wait()  # its grace at most
            write_record(out, dict(part_record(this.part, NOT_RUN, "interrupted (Ctrl-C) while it ran"),
                                   **fields_of(this.part)))
        raise
    return records


def _ended_line(record: Mapping[str, object]) -> str:
    return (f"{record['part']}: {record['status']} in {record['duration_s']:.0f} s (limit {record['limit_s']:.0f} s)"
            + (f": {record['reason']}" if record.get("reason") else ""))


def run_parts(asked: Sequence[str], out: str, budget_s: float, command_for: CommandFor, stamp: Optional[dict] = None,
              env: Optional[Mapping[str, str]] = None, say: Say = print,
              started: Optional[float] = None) -> Tuple[Dict[str, dict], dict]:
    """The parts ``asked``: variants alone, those of ``SIDE_BY_SIDE`` at the same time, then bench alone, then tune
    alone, within ``budget_s`` counted
    from ``started`` (``time.monotonic()``; default now). Returns their records (``stamp``, the environment, in each)
    and what the summary says of the run: its budget, its split and its wall time."""
    started = time.monotonic() if started is None else started
    side = [part for part in PARTS if part in SIDE_BY_SIDE and part in asked]
    clock = lambda: time.monotonic() - started  # noqa: E731
    stamped = lambda line: say(f"[{clock():4.0f} s] {line}")  # noqa: E731
    fields = dict({"environment": stamp} if stamp is not None else {}, budget_s=budget_s)
    records: Dict[str, dict] = {}
    variants_s = None
    if "variants" in asked:
        variants_s = variants_limit(budget_s, asked)
        stamped(f"variants: first, alone on the GPU, at most {variants_s:.0f} s; output in "
                f"{log_path(out, 'variants')}")
        records["variants"] = run_side_by_side({"variants": command_for("variants", out, variants_s)}, out,
                                               variants_s, env, stamped, fields)["variants"]
    side_limit, share, tune_s = split_budget(budget_s - (variants_s or 0.0), asked)
    if side:
        kept = " and ".join(f"{part}'s {s:.0f} s" for part, s in (("bench", share), ("tune", tune_s)) if s)
        stamped(f"{', '.join(side)}: {'side by side, each' if len(side) > 1 else 'running,'} at most "
                f"{side_limit:.0f} s" + (f" (the budget less {kept} share{'s' if share and tune_s else ''})"
                                         if kept else "") + f"; output in {log_path(out, '<part>')}")
        records.update(run_side_by_side({part: command_for(part, out, side_limit) for part in side}, out, side_limit,
                                        env, stamped, fields))
    for part in ALONE_AFTER:
        if part not in asked:
            continue
        if part == "bench":
            limit, note = bench_limit(budget_s, clock(), share, tune_s or 0.0)
        else:
            limit, note = tune_limit(budget_s, clock(), tune_s)
        if limit is None:
            records[part] = dict(part_record(part, NOT_RUN, note), **fields)
            write_record(out, records[part])
            stamped(f"{part}: not run: {note}")
            continue
        stamped(f"{part}: alone on the GPU, at most {limit:.0f} s" + (f" ({note})" if note else "")
                + f"; output in {log_path(out, part)}")
        before = side or [other for other in ALONE_AFTER[:ALONE_AFTER.index(part)] if other in asked]
        part_fields = dict(fields, **({"phase": "alone, after the others"} if before else {}),
                           **({"limit_note": note} if note else {}))
        records[part] = run_side_by_side({part: command_for(part, out, limit)}, out, limit, env, stamped,
                                         part_fields)[part]
    run = {"budget_s": budget_s, "wall_s": round(clock(), 1), "side_by_side": side,
           "side_by_side_limit_s": side_limit, "alone": [part for part in PARTS if part in asked and part not in
                                                         SIDE_BY_SIDE],
           "bench_share_s": share, "tune_share_s": tune_s, "variants_limit_s": variants_s}
    stamped(f"the whole run: {run['wall_s']:.0f} s of its {budget_s:.0f} s budget")
    return records, run


# ---------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer gpu-check", description=__doc__.splitlines()[0],
        epilog="Exit status: 0 every part asked for passed; 1 a part failed, timed out or could not run; 2 no CUDA "
               "device here. See docs/gpu-check.md.")
    parser.add_argument("--out", default="gpu-check-results", metavar="DIR",
                        help="folder for the part records, their logs, the benchmark and the summary (default: "
                             "%(default)s); parts run in separate invocations into one folder merge there")
    parser.add_argument("--only", action="append", choices=PARTS, metavar="PART",
                        help=f"run only this part (repeatable; one of {', '.join(PARTS)}); default: all six")
    parser.add_argument("--budget", type=positive_seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help="wall-clock seconds for the whole run, compiling included (default: %(default)g): "
                             f"variants first, alone, in its share (1/4, at most {VARIANTS_SHARE_MAX_S:.0f} s), then "
                             f"{', '.join(SIDE_BY_SIDE)} side by side, then bench alone in its share (3/8 of what is "
                             f"left, at most {BENCH_SHARE_MAX_S:.0f} s) and what they left, then tune alone in its "
                             f"share (15%% of what variants left, at most {TUNE_SHARE_MAX_S:.0f} s)")
    add_device_option(parser, "runs every part on (a CUDA device; without one, the summary says so)")
    parser.add_argument("--all-tests", action="store_true",
                        help="tests: the whole test suite instead of the GPU test files (longer: give --budget)")
    args = parser.parse_args(argv)
    if args.device.type != "cuda" and torch.cuda.is_available():
        parser.error(f"--device {args.device}: gpu-check runs on a CUDA device (cuda or cuda:N)")
    if args.budget < MIN_PART_S:
        parser.error(f"--budget {args.budget:g}: at least {MIN_PART_S:.0f} seconds")
    make_folder(parser, f"--out {args.out!r}", args.out)
    args.out = os.path.abspath(args.out)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """The command: run the parts asked for, rebuild the summary, print the verdict."""
    started = time.monotonic()
    args = parse_args(argv)
    asked = [part for part in PARTS if part in (args.only or PARTS)]
    reason = no_cuda_reason()
    if reason is not None:
        write_summary(args.out, environment(), lambda part: reason)
        print(f"gpu-check: {reason}: nothing ran; {os.path.join(args.out, 'summary.md')} says so", file=sys.stderr)
        return NO_CUDA_STATUS
    device = args.device
    visible = visible_devices(device.index)
    stamp = environment(device, visible)
    if stamp["triton_interpret"]:
        print(f"gpu-check: TRITON_INTERPRET={stamp['triton_interpret']} is set here: removed for the parts, "
              "which run the compiled kernels")
    print(f"gpu-check on {stamp['device']['name']} ({device}, CUDA_VISIBLE_DEVICES={visible} for the parts): "
          f"{', '.join(asked)} within {args.budget:.0f} s; writing to {args.out}", flush=True)

    def command_for(part: str, out: str, limit_s: float) -> List[str]:
        return part_command(part, out, limit_s, args.all_tests)

    not_asked = lambda part: f"not asked for yet (gpu-check --only {part})"  # noqa: E731
    try:
        records, run = run_parts(asked, args.out, args.budget, command_for, stamp, gpu_environment(visible),
                                 say=lambda line: print(line, flush=True), started=started)
    except KeyboardInterrupt:
        write_summary(args.out, stamp, not_asked)
        raise Interrupted(f"the parts running were stopped; the summary of the others is in "
                          f"{os.path.join(args.out, 'summary.md')}") from None
    summary = write_summary(args.out, stamp, not_asked, run)
    print(f"\n{summary['verdict']}\nsummary: {os.path.join(args.out, 'summary.md')}")
    return 0 if all(record["status"] == PASSED for record in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
