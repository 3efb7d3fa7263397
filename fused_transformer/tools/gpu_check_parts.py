"""The parts of ``python -m fused_transformer gpu-check``, each run in a process of its own by ``gpu_check``:

    python -m fused_transformer.tools.gpu_check_parts --part NAME --out DIR --time-limit SECONDS [--all-tests]

runs one part and writes its record to ``DIR/<part>.json``: ``status`` (passed / failed / timed out / not run),
``reason``, ``figures`` (what the summary shows), ``command`` and ``output_tail``. What the part runs goes to
``DIR/<part>.log``. gpu-check gives the process only the GPU it runs on (``CUDA_VISIBLE_DEVICES``): there it is
``PART_DEVICE``, ``cuda:0``.

- ``tests``: pytest on the GPU subset ``GPU_TEST_FILES`` (or the whole suite) of the source checkout beside the
  package, on the GPU itself (``TRITON_INTERPRET`` removed), over pytest-xdist's workers when it is installed
  (``xdist_workers``); its junit XML gives the counts and the failures. Then the kernels' test files again, ``--quick``,
  with ``FUSED_TRANSFORMER_DIRECT_LAUNCH=0`` (``public_launch_tests``): their counts under ``public_launch``.
- ``check``: ``python -m fused_transformer check --device cuda:0 --quick --no-progress``: its summary line and the
  rows that failed.
- ``bench``: first ``python -m fused_transformer tune --device cuda:0`` for what the limit leaves beyond one length
  of bench (``tune_seconds``, at most ``TUNE_MAX_S``): the route's rows measured on this GPU, kept in the user's
  cache, which bench's "ours" then follows; then ``python -m fused_transformer bench --device cuda:0 --quick
  --lengths ...`` on ``BENCH_SUITES`` into ``DIR/bench``, at the lengths the rest fits (``bench_lengths``): per shape
  our time and TFLOP/s (tokens/s) and our speed-up over every other implementation measured.
- ``graphs``: ``gpu_check_graphs``, in this process: CUDA-graph replay of a training step, backward determinism,
  peak memory against the sequence length.
- ``tune``: ``python -m fused_transformer tune --device cuda:0 --out DIR/tuned_rows.txt --budget ...`` (the part's
  limit less ``INNER_MARGIN_S`` and ``TUNE_START_S``): the route's rows measured on this GPU, kept in DIR (not the
  user's cache), then compared with the table the GPU ran under before, its priors (``priors``): ``DIR/priors.md``.
- ``variants``: ``python -m fused_transformer bench --device cuda:0 --suite variants --quick`` into
  ``DIR/variants``: every kernel variant against the vendor's kernel, the winners written to the package's
  ``kernels/variant_rows.json`` (the rows the plans read) and copied to ``DIR/variants/variant_rows.json``.

An inner command gets the part's limit less ``INNER_MARGIN_S``, so that a part that runs out of time still writes
what it has (pytest's junit XML of the tests it ran, the benchmark rows measured so far) as "timed out".
"""
from __future__ import annotations

import argparse
import csv
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from fused_transformer import ops
from fused_transformer.tools import bench_cases
from fused_transformer.tools.provenance import PACKAGE_ROOT

PARTS = ("variants", "tests", "check", "bench", "graphs", "tune")
PASSED, FAILED, TIMED_OUT, NOT_RUN, RUNNING = "passed", "failed", "timed out", "not run", "running"
FINAL_STATUSES = (PASSED, FAILED, TIMED_OUT, NOT_RUN)

REPO_ROOT = os.path.dirname(PACKAGE_ROOT)
# The test files that run our kernels and modules on CUDA tensors when there is a GPU (tests/numerics.py's DEVICE,
# test_edges' device_for, the CUDA-graph test of test_drop_in, the CUDA generator's seed draws of test_dropout_seed;
# check, the demo and its checkpoints on the default device), plus the two that ask the GPU which target it is: every
# kernel's own file (``tests/test_*_triton.py``) and every registered op's (``tests/test_<op>.py``), then these.
GPU_TEST_FILES = (
    *sorted(os.path.relpath(path, REPO_ROOT)
            for path in glob.glob(os.path.join(REPO_ROOT, "tests", "test_*_triton.py"))),
    *(f"tests/test_{name}.py" for name in ops.names()
      if os.path.isfile(os.path.join(REPO_ROOT, f"tests/test_{name}.py"))),
    "tests/test_attention_score_mods.py", "tests/test_attention_kvcache.py", "tests/test_ops_registry.py",
    "tests/test_drop_in.py", "tests/test_modules.py", "tests/test_edges.py", "tests/test_integration_sdpa.py",
    "tests/test_check.py", "tests/test_seq2seq.py", "tests/test_checkpoints.py", "tests/test_backend.py",
    "tests/test_targets.py", "tests/test_thin_path.py", "tests/test_dropout_seed.py",
)
# The kernels' own test files run once more, --quick, with every launch through Triton's public JITFunction.run
# (FUSED_TRANSFORMER_DIRECT_LAUNCH=0): the path launch_kernel falls back to where a launcher does not fit its call.
PUBLIC_LAUNCH_TEST_FILES = tuple(f for f in GPU_TEST_FILES if f.endswith("_triton.py"))
PUBLIC_LAUNCH_MIN_S = 60.0  # less left of the part's limit: that run is left out, and the record says so
# overhead first: its fixed tiny shapes take seconds, and a part stopped by its limit keeps the rows it measured. Then
# the ops timed with their backward (bench_cases.TRAINED: those timed in inference only are left to bench) and the
# encoder layer.
BENCH_SUITES = ("overhead", *bench_cases.TRAINED, "encoder_layer")
BENCH_LENGTHS = (1024, 4096)  # bench --quick's on CUDA; with less time, the longest are kept
# Estimates for an H100 / H200 (docs/gpu-check.md: to be confirmed by a GPU run): the start (imports, CUDA, compiling
# the kernels that the parts before left out of Triton's cache), then per length 184 timed implementations
# (attention: 24 shapes x 6, the others 40) at about 0.25 s each under triton.testing.do_bench.
BENCH_START_S = 60.0
BENCH_LENGTH_S = 45.0
# tune's seconds in the bench part: what the part's limit leaves beyond one length of bench, at most this.
TUNE_MAX_S = 60.0
TUNE_MIN_S = 30.0  # less than this left: no tune (its start takes about 15 s)
TUNE_START_S = 20.0  # of tune's seconds, those its --budget leaves for its start and its last group
# A part's process sees one GPU (CUDA_VISIBLE_DEVICES): this one, named with its index, as torch.cuda.set_device needs.
PART_DEVICE = "cuda:0"
COMPETITORS = ("flash_attn", "xformers")
INNER_MARGIN_S = 20.0
INNER_GRACE_S = 10.0  # an inner command stopped at its limit gets this long to end (pytest: to write its junit XML)
MAX_XDIST_WORKERS = 8  # as on the H200 run, where 8 workers ran the GPU test files in about 3 minutes
CORES_LEFT = 4  # for check, graphs and their Triton compiles, which run beside the tests
TAIL_CHARS = 4000


# ------------------------------------------------------------------------------------------ records, processes


def record_path(out: str, part: str) -> str:
    return os.path.join(out, f"{part}.json")


def log_path(out: str, part: str) -> str:
    return os.path.join(out, f"{part}.log")


def part_record(part: str, status: str, reason: Optional[str] = None, figures: Optional[dict] = None,
                command: Optional[Sequence[str]] = None, output: str = "") -> dict:
    """What a part leaves in ``DIR/<part>.json``; ``gpu_check`` adds its duration, limit and environment."""
    return {"part": part, "status": status, "reason": reason, "figures": figures or {},
            "command": " ".join(command) if command else None, "output_tail": output[-TAIL_CHARS:]}


def write_record(out: str, record: dict) -> None:
    """Write ``record`` to ``DIR/<part>.json`` whole or not at all (a part killed mid-write leaves the old one)."""
    path = record_path(out, record["part"])
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def read_record(path: str) -> Optional[dict]:
    """The record at ``path``, or None when there is none or it is not a record."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "status" in record else None


def gpu_environment(visible_devices: Optional[str] = None) -> Dict[str, str]:
    """The environment the parts run in: the Triton kernels compiled for the GPU, never interpreted; with
    ``visible_devices``, ``CUDA_VISIBLE_DEVICES`` set to it, so that a part sees only the GPU gpu-check runs on."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"  # the log shows progress as it happens
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    return env


@dataclass
class Finished:
    """How a command ended: its exit status (None when stopped at its limit), and what it wrote."""

    returncode: Optional[int]
    timed_out: bool
    seconds: float
    output: str


def _default_disposition(signum: int):
    """A ``preexec_fn`` that puts ``signum`` back to its default action in the child."""
    def reset() -> None:
        signal.signal(signum, signal.SIG_DFL)
    return reset


class LimitedRun:
    """``command`` running in a session of its own, its stdout and stderr appended to the file ``log``. Past
    ``limit_s`` seconds, or on ``stop()``, the whole session, children included, gets ``stop_signal``, then SIGKILL
    ``grace_s`` later. ``poll()`` never blocks, so that one loop can watch several runs side by side.

    The command starts with ``stop_signal`` at its default disposition: a shell without job control starts ``cmd &``
    with SIGINT ignored, and every process below it would inherit that and sit out the stop until the SIGKILL."""

    def __init__(self, command: Sequence[str], limit_s: float, log: str, *, cwd: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None, grace_s: float = 5.0,
                 stop_signal: int = signal.SIGTERM) -> None:
        self.limit_s, self.grace_s, self.stop_signal, self.log = limit_s, grace_s, stop_signal, log
        self.timed_out = False
        self.finished: Optional[Finished] = None
        self._kill_at: Optional[float] = None
        with open(log, "ab") as sink:
            self._log_start = os.fstat(sink.fileno()).st_size
            self.started = time.monotonic()
            self.proc = subprocess.Popen(list(command), stdout=sink, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=cwd, env=None if env is None else dict(env),
                                         start_new_session=True, preexec_fn=_default_disposition(stop_signal))

    def poll(self) -> Optional[Finished]:
        """How the command ended, once it has (and its session with it); None while it runs. Stops it when it is
        past its limit, and kills what is left of its session when it is past its grace."""
        if self.finished is not None:
            return self.finished
        now = time.monotonic()
        if self.proc.poll() is None:
            if self._kill_at is None and now - self.started >= self.limit_s:
                self.timed_out = True
                self.stop()
                return None
            if self._kill_at is None or now < self._kill_at:
                return None
            _signal_session(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._kill_at is not None:  # children that outlived or ignored the stop signal
            _signal_session(self.proc.pid, signal.SIGKILL)
        with open(self.log, "rb") as f:
            f.seek(self._log_start)
            output = f.read().decode(errors="replace")
        self.finished = Finished(None if self.timed_out else self.proc.returncode, self.timed_out,
                                 time.monotonic() - self.started, output)
        return self.finished

    def stop(self) -> None:
        """Send the stop signal to the whole session now (once); ``poll`` or ``wait`` then see it end."""
        if self._kill_at is None and self.proc.poll() is None:
            self._kill_at = time.monotonic() + self.grace_s
            _signal_session(self.proc.pid, self.stop_signal)

    def wait(self, tick_s: float = 0.1) -> Finished:
        """Block until the command has ended; an exception meanwhile (Ctrl-C, SIGTERM) stops it first."""
        try:
            while self.poll() is None:
                time.sleep(tick_s)
        finally:
            if self.finished is None:
                self.stop()
                while self.poll() is None:
                    time.sleep(tick_s)
        return self.finished


def _signal_session(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def run_with_limit(command: Sequence[str], limit_s: float, log: str, *, cwd: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None, grace_s: float = 5.0,
                   stop_signal: int = signal.SIGTERM) -> Finished:
    """Run ``command`` as a ``LimitedRun`` and wait for it to end (or to be stopped at ``limit_s``)."""
    return LimitedRun(command, limit_s, log, cwd=cwd, env=env, grace_s=grace_s, stop_signal=stop_signal).wait()


# ------------------------------------------------------------------------------------------------------ tests


def parse_junit(path: str, root: Optional[str] = None) -> dict:
    """Counts (tests, passed, failed, errors, skipped), the failures and errors ({name, kind, message}) and the
    commonest skip reasons of a pytest junit XML file, serial or from pytest-xdist (whose entries come in the order
    the workers finished them, a crashed worker's test as an error); names read as pytest's node ids when ``root``
    holds them. A test counts once: pytest writes a second entry for a test that failed and then errored in its
    teardown (both are listed, the test counts as failed). A run stopped by SIGINT leaves an empty entry for the
    test it stopped, not counted."""
    outcome: Dict[str, str] = {}  # node id -> its worst outcome
    failures: List[dict] = []
    skips: Counter = Counter()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # the test that SIGINT stopped: pytest leaves an empty entry for it
        name = _node_id(case.get("classname", ""), case.get("name", ""), root)
        found = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
        kind = next((kind for tag, kind in JUNIT_OUTCOMES if tag in found), "passed")
        if kind in ("failed", "errors"):
            tag = "failure" if kind == "failed" else "error"
            message = (found[tag].get("message") or found[tag].text or "").strip().splitlines()
            failures.append({"name": name, "kind": "error" if tag == "error" else "failed",
                             "message": (message[0] if message else "")[:300]})
        elif kind == "skipped":
            skips[(found["skipped"].get("message") or "").strip()[:200]] += 1
        if name not in outcome or OUTCOME_RANK[kind] < OUTCOME_RANK[outcome[name]]:
            outcome[name] = kind
    counts = Counter(outcome.values())
    figures = {"tests": len(outcome), **{key: counts[key] for key in ("passed", "failed", "errors", "skipped")}}
    figures["failures"] = failures
    figures["skip_reasons"] = [{"reason": reason, "count": n} for reason, n in skips.most_common(10)]
    return figures


JUNIT_OUTCOMES = (("failure", "failed"), ("error", "errors"), ("skipped", "skipped"))
OUTCOME_RANK = {"failed": 0, "errors": 1, "skipped": 2, "passed": 3}


def _node_id(classname: str, name: str, root: Optional[str]) -> str:
    """``tests.test_edges.TestX`` + ``test_y[a]`` -> ``tests/test_edges.py::TestX::test_y[a]``, when that file is
    in ``root``; else ``classname::name``."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if root is not None and os.path.isfile(os.path.join(root, path)):
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}" if classname else name


# pytest -q's progress: marks, then the percentage; pytest-xdist may end a line with a worker's crash notice.
PROGRESS_LINE = re.compile(r"^(?P<marks>[.FEsxX]+)\s*(\[gw\d+\] node down:.*)?(\[\s*\d+%\])?\s*$")


def pytest_progress(output: str) -> dict:
    """Counts from ``pytest -q``'s progress lines (one mark per test: . passed, F failed, E error, s skipped,
    x xfailed, X xpassed): what a run killed before its junit XML still tells."""
    marks = "".join(match["marks"] for line in output.splitlines() for match in [PROGRESS_LINE.match(line)] if match)
    counts = Counter(marks)
    return {"tests": len(marks), "passed": counts["."] + counts["X"], "failed": counts["F"], "errors": counts["E"],
            "skipped": counts["s"] + counts["x"], "failures": [], "skip_reasons": []}


def xdist_workers(cpus: Optional[int] = None, installed: Optional[bool] = None) -> Optional[int]:
    """How many pytest-xdist workers the tests part runs (``-n``): None (serially) without pytest-xdist or with
    fewer than two to give; else up to ``MAX_XDIST_WORKERS``, leaving ``CORES_LEFT`` cores to check and graphs,
    which run at the same time (and to Triton's compiler processes)."""
    installed = importlib.util.find_spec("xdist") is not None if installed is None else installed
    workers = min(MAX_XDIST_WORKERS, ((os.cpu_count() or 1) if cpus is None else cpus) - CORES_LEFT)
    return workers if installed and workers >= 2 else None


def tests_command(files: Sequence[str], junit: str, workers: Optional[int]) -> List[str]:
    """pytest on ``files``, its verdict in the junit XML file ``junit``; with ``workers``, over that many
    pytest-xdist workers."""
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--junitxml", junit]
    return command + (["-n", str(workers)] if workers else [])


def tests_part(out: str, limit_s: float, whole_suite: bool = False, root: str = REPO_ROOT,
               workers: Optional[int] = None) -> dict:
    """Run the GPU test files (or the whole suite) from ``root`` and judge them by their junit XML; ``workers``
    (pytest-xdist's ``-n``; 0: serially) defaults to ``xdist_workers()``."""
    tests_dir = os.path.join(root, "tests")
    if not os.path.isfile(os.path.join(tests_dir, "conftest.py")):
        return part_record("tests", NOT_RUN, f"no tests folder beside the package ({tests_dir}): an installed wheel "
                           "carries no tests; run gpu-check from a source checkout installed with pip install -e .")
    if importlib.util.find_spec("pytest") is None:
        return part_record("tests", NOT_RUN, "pytest is not installed here (gpu-check installs nothing)")
    files = ["tests"] if whole_suite else [f for f in GPU_TEST_FILES if os.path.isfile(os.path.join(root, f))]
    missing = [] if whole_suite else [f for f in GPU_TEST_FILES if f not in files]
    if not files:
        return part_record("tests", NOT_RUN, f"none of the GPU test files is in {tests_dir}")
    junit = os.path.join(out, "tests.xml")
    if os.path.exists(junit):
        os.remove(junit)
    workers = xdist_workers() if workers is None else workers
    command = tests_command(files, junit, workers)
    # Stopped with SIGINT, pytest (and xdist's controller) ends as on Ctrl-C: the junit XML of the tests it ran.
    finished = run_with_limit(command, max(limit_s - INNER_MARGIN_S, 1.0), log_path(out, "tests"), cwd=root,
                              env=gpu_environment(), stop_signal=signal.SIGINT, grace_s=INNER_GRACE_S)
    figures: dict = {"files": files, "missing_files": missing, "exit_status": finished.returncode,
                     "xdist_workers": workers or None}
    public = ({"not_run": "the run before was stopped at its limit"} if finished.timed_out
              else public_launch_tests(out, root, workers, limit_s - finished.seconds))
    figures["public_launch"] = public
    if os.path.exists(junit):
        figures.update(parse_junit(junit, root), stopped=finished.timed_out)
    elif finished.timed_out:  # killed before its junit XML: count its progress lines instead
        figures.update(pytest_progress(finished.output), partial=True)
    if finished.timed_out:
        status, reason = TIMED_OUT, f"pytest ran past {finished.seconds:.0f} s and was stopped"
    elif "tests" not in figures:
        status, reason = FAILED, f"pytest wrote no junit XML (exit status {finished.returncode})"
    elif figures["failed"] or figures["errors"]:
        status, reason = FAILED, f"{figures['failed']} failed, {figures['errors']} errors"
    elif finished.returncode != 0 or not figures["tests"]:
        status, reason = FAILED, f"pytest exit status {finished.returncode} with {figures['tests']} tests"
    elif public.get("exit_status", 0) != 0:
        status, reason = (TIMED_OUT if public["timed_out"] else FAILED), (
            f"with FUSED_TRANSFORMER_DIRECT_LAUNCH=0: {public['failed']} failed, {public['errors']} errors"
            + (", stopped at its limit" if public["timed_out"] else f", exit status {public['exit_status']}"))
    else:
        status, reason = PASSED, None
    return part_record("tests", status, reason, figures, command, finished.output)


def public_launch_tests(out: str, root: str, workers: Optional[int], limit_s: float) -> dict:
    """``PUBLIC_LAUNCH_TEST_FILES``, ``--quick``, with ``FUSED_TRANSFORMER_DIRECT_LAUNCH=0`` within ``limit_s``: the
    counts of their junit XML (``DIR/tests_public_launch.xml``), exit status and files; ``not_run`` says why it did
    not run."""
    files = [f for f in PUBLIC_LAUNCH_TEST_FILES if os.path.isfile(os.path.join(root, f))]
    if not files or limit_s < PUBLIC_LAUNCH_MIN_S:
        return {"not_run": f"{limit_s:.0f} s left" if files else "no kernel test files", "files": files}
    junit = os.path.join(out, "tests_public_launch.xml")
    if os.path.exists(junit):
        os.remove(junit)
    finished = run_with_limit(tests_command([*files, "--quick"], junit, workers), max(limit_s - INNER_MARGIN_S, 1.0),
                              log_path(out, "tests_public_launch"), cwd=root, stop_signal=signal.SIGINT,
                              env={**gpu_environment(), "FUSED_TRANSFORMER_DIRECT_LAUNCH": "0"}, grace_s=INNER_GRACE_S)
    counts = parse_junit(junit, root) if os.path.exists(junit) else pytest_progress(finished.output)
    return {**counts, "files": files, "exit_status": finished.returncode, "timed_out": finished.timed_out}


# ------------------------------------------------------------------------------------------------------ check


CHECK_SUMMARY = re.compile(r"^summary: (?P<checks>\d+) checks, (?P<failed>\d+) failed.*$", re.M)
CHECK_ROW = re.compile(r"^\w+\s+(triton|cpu|reference)\s+(float32|float16|bfloat16)\s+.*?\s(?P<result>pass|FAIL|ERROR)"
                       r"(\s|$)")


def parse_check_output(text: str) -> dict:
    """The counts of a ``check`` run's output, its failing rows and notes; counted from the rows when the summary
    line is missing (a run stopped midway)."""
    rows = [(match["result"], line) for line in text.splitlines() for match in [CHECK_ROW.match(line)] if match]
    failing = [line.rstrip() for result, line in rows if result != "pass"]
    summary = CHECK_SUMMARY.search(text)
    checks = int(summary["checks"]) if summary else len(rows)
    failed = int(summary["failed"]) if summary else len(failing)
    return {"checks": checks, "passed": checks - failed, "failed": failed, "summary": summary[0] if summary else None,
            "failing": failing[:50], "notes": [line for line in text.splitlines() if re.match(r"^\[\d+\] ", line)][:20],
            "backends": next((line for line in text.splitlines() if line.startswith("backends: ")), None)}


def check_part(out: str, limit_s: float) -> dict:
    command = [sys.executable, "-m", "fused_transformer", "check", "--device", PART_DEVICE, "--quick", "--no-progress"]
    finished = run_with_limit(command, max(limit_s - INNER_MARGIN_S, 1.0), log_path(out, "check"),
                              env=gpu_environment())
    figures = parse_check_output(finished.output)
    figures["exit_status"] = finished.returncode
    if finished.timed_out:
        status, reason = TIMED_OUT, f"check ran past {finished.seconds:.0f} s and was stopped"
    elif finished.returncode == 0 and figures["summary"]:
        status, reason = PASSED, None
    elif figures["summary"]:
        status, reason = FAILED, f"{figures['failed']} of {figures['checks']} checks failed"
    else:
        status, reason = FAILED, f"check exited with status {finished.returncode} before its summary"
    return part_record("check", status, reason, figures, command, finished.output)


# ------------------------------------------------------------------------------------------------------ bench


SHAPE_KEYS = ("suite", "case", "mode", "dtype", "batch", "heads", "seq_len", "head_dim", "d_model", "d_ff")


def read_bench_csv(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def bench_shapes(rows: Sequence[Mapping[str, str]]) -> List[dict]:
    """One entry per measured shape (suite, case, mode, dtype and sizes) of ``bench``'s CSV rows: our ms, TFLOP/s and
    tokens/s, ``impls`` (the others, in the CSV's order), ``ratios`` {impl: its ms / our ms} (> 1: ours is faster)
    for every other implementation timed, and ``left_out`` {impl: why} for those that refused or failed the shape."""
    groups: Dict[tuple, List[Mapping[str, str]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(key, "") for key in SHAPE_KEYS), []).append(row)
    shapes = []
    for key, members in groups.items():
        shape: dict = {k: (int(v) if k in ("batch", "heads", "seq_len", "head_dim", "d_model", "d_ff") and v else v)
                       for k, v in zip(SHAPE_KEYS, key)}
        ours = next((row for row in members if row["impl"] == "ours"), None)
        ours_ms = _number(ours["ms"]) if ours else None
        shape.update(baseline=members[0].get("baseline", ""), ours_ms=ours_ms, ratios={}, left_out={},
                     impls=[row["impl"] for row in members if row["impl"] != "ours"],
                     tflops=_number(ours["tflops"]) if ours else None,
                     tokens_per_s=_number(ours["tokens_per_s"]) if ours else None)
        if ours_ms is None:
            shape["ours_note"] = ours["note"] if ours else "no row for ours"
        for row in members:
            ms = _number(row["ms"])
            if row["impl"] == "ours":
                continue
            if ms is None:
                shape["left_out"][row["impl"]] = row.get("note", "")
            elif ours_ms:
                shape["ratios"][row["impl"]] = ms / ours_ms
        shapes.append(shape)
    return shapes


def ratio_medians(shapes: Sequence[dict]) -> List[dict]:
    """Per suite and implementation: the median, lowest and highest of our speed-up over it, and over how many
    shapes."""
    by_pair: Dict[tuple, List[float]] = {}
    for shape in shapes:
        for impl, ratio in shape["ratios"].items():
            by_pair.setdefault((shape["suite"], impl), []).append(ratio)
    return [{"suite": suite, "impl": impl, "median": statistics.median(values), "low": min(values),
             "high": max(values), "shapes": len(values)} for (suite, impl), values in by_pair.items()]


def competitor_status(rows: Sequence[Mapping[str, str]], installed: Mapping[str, bool]) -> Dict[str, str]:
    """flash_attn / xformers, where a suite measured is an op's they may rival (``bench_cases.is_competitor``):
    measured, refused, or why there are no rows (said, not silently left out)."""
    suites = {row["suite"] for row in rows}
    status = {}
    for name in COMPETITORS:
        if not any(bench_cases.is_competitor(name, suite) for suite in suites):
            continue
        mine = [row for row in rows if row["impl"] == name]
        if any(_number(row["ms"]) is not None for row in mine):
            status[name] = f"measured on {sum(_number(row['ms']) is not None for row in mine)} shapes"
        elif mine:
            status[name] = f"refused every shape it was offered ({mine[0].get('note', '')})"
        elif not installed.get(name, False):
            status[name] = "not installed here, not measured (gpu-check installs nothing)"
        else:
            status[name] = "installed, but bench measured no shape with it"
    return status


def bench_figures(rows: Sequence[Mapping[str, str]], installed: Mapping[str, bool]) -> dict:
    shapes = bench_shapes(rows)
    return {"shapes": shapes, "medians": ratio_medians(shapes), "competitors": competitor_status(rows, installed)}


def _bench_failures(output: str) -> List[str]:
    """The lines under bench's closing "N failure(s):"."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\d+ failure\(s\):$", line):
            return [item.strip() for item in lines[i + 1:] if item.startswith("  ")][:30]
    return []


def bench_lengths(limit_s: float) -> Tuple[int, ...]:
    """The sequence lengths the bench part measures within ``limit_s``: as many of ``BENCH_LENGTHS`` as
    ``BENCH_START_S`` + ``BENCH_LENGTH_S`` per length fit in what the inner command gets, the longest first, at
    least one."""
    fit = int((limit_s - INNER_MARGIN_S - BENCH_START_S) // BENCH_LENGTH_S)
    return BENCH_LENGTHS[len(BENCH_LENGTHS) - max(1, min(fit, len(BENCH_LENGTHS))):]


def tune_seconds(limit_s: float) -> float:
    """The seconds of the bench part's ``limit_s`` that ``tune`` runs for: what one length of bench leaves, at most
    ``TUNE_MAX_S``; 0 where that is under ``TUNE_MIN_S``."""
    spare = min(TUNE_MAX_S, limit_s - (INNER_MARGIN_S + BENCH_START_S + BENCH_LENGTH_S))
    return spare if spare >= TUNE_MIN_S else 0.0


def _tune(out: str, seconds: float) -> dict:
    """Run ``tune`` on the part's GPU for ``seconds``; its figures: rows written, where, exit status, seconds."""
    command = [sys.executable, "-m", "fused_transformer", "tune", "--device", PART_DEVICE,
               "--budget", f"{max(seconds - TUNE_START_S, 1.0):.0f}"]
    finished = run_with_limit(command, seconds, log_path(out, "bench_tune"), env=gpu_environment())
    written = re.search(r"^(\d+) rows written to (.+)$", finished.output, re.M)
    return {"command": " ".join(command[1:]), "exit_status": finished.returncode, "seconds": round(finished.seconds, 1),
            "timed_out": finished.timed_out, "rows": int(written[1]) if written else 0,
            "path": written[2] if written else None}


def bench_part(out: str, limit_s: float) -> dict:
    folder = os.path.join(out, "bench")
    tune_s, tuned = tune_seconds(limit_s), None
    if tune_s:
        begun = time.monotonic()
        tuned = _tune(out, tune_s)
        limit_s -= max(time.monotonic() - begun, tuned["seconds"])
    lengths = bench_lengths(limit_s)
    command = [sys.executable, "-m", "fused_transformer", "bench", "--device", PART_DEVICE, "--quick",
               *[arg for suite in BENCH_SUITES for arg in ("--suite", suite)],
               "--lengths", ",".join(map(str, lengths)), "--out", folder, "--no-progress", "--profile"]
    csv_path = os.path.join(folder, "bench_cuda.csv")
    for stale in (csv_path, csv_path + ".partial"):  # an earlier run's rows must not pass for this one's
        if os.path.exists(stale):
            os.remove(stale)
    finished = run_with_limit(command, max(limit_s - INNER_MARGIN_S, 1.0), log_path(out, "bench"),
                              env=gpu_environment())
    installed = {name: importlib.util.find_spec(name) is not None for name in COMPETITORS}
    figures: dict = {"exit_status": finished.returncode, "failures": _bench_failures(finished.output),
                     "lengths": list(lengths), "lengths_left_out": [n for n in BENCH_LENGTHS if n not in lengths],
                     "tune": tuned}
    if os.path.exists(csv_path):
        figures.update(bench_figures(read_bench_csv(csv_path), installed), csv=csv_path)
    elif os.path.exists(csv_path + ".partial"):
        partial = csv_path + ".partial"
        figures.update(bench_figures(read_bench_csv(partial), installed), csv=partial, partial=True)
    if finished.timed_out:
        status, reason = TIMED_OUT, f"bench ran past {finished.seconds:.0f} s and was stopped (rows so far kept)"
    elif "shapes" not in figures:
        status, reason = FAILED, f"bench wrote no CSV (exit status {finished.returncode})"
    elif finished.returncode != 0:
        failed = len(figures["failures"])
        status, reason = FAILED, (f"{failed} implementation(s) failed on a case" if failed
                                  else f"bench exit status {finished.returncode}")
    else:
        status, reason = PASSED, None
    return part_record("bench", status, reason, figures, command, finished.output)


# ------------------------------------------------------------------------------------------------------- tune


TUNED_ROWS = "tuned_rows.txt"
PRIORS_MD = "priors.md"


def tune_command(out: str, limit_s: float) -> List[str]:
    """The tune part's inner command: ``tune`` on the part's GPU into ``DIR/tuned_rows.txt``, its ``--budget`` what
    ``limit_s`` leaves beyond ``INNER_MARGIN_S`` (the comparison and the record) and ``TUNE_START_S`` (its start and
    its last group)."""
    return [sys.executable, "-m", "fused_transformer", "tune", "--device", PART_DEVICE, "--out",
            os.path.join(out, TUNED_ROWS),
            "--budget", f"{max(limit_s - INNER_MARGIN_S - TUNE_START_S, 1.0):.0f}"]


def tune_part(out: str, limit_s: float, device: Optional[str] = None) -> dict:
    """``tune`` alone on the GPU into ``DIR/tuned_rows.txt``, then its rows against the priors the GPU ran under
    before (``priors.write_report``): ``DIR/priors.md``, and the counts in the figures. ``device``: where the
    comparison reads the device's facts and kernels (default: the part's GPU)."""
    import torch

    from fused_transformer import route
    from fused_transformer.tools import priors

    rows_path = os.path.join(out, TUNED_ROWS)
    if os.path.exists(rows_path):
        os.remove(rows_path)  # an earlier run's rows must not pass for this one's
    command = tune_command(out, limit_s)
    finished = run_with_limit(command, max(limit_s - INNER_MARGIN_S, 1.0), log_path(out, "tune"),
                              env=gpu_environment())
    written = re.search(r"^(\d+) rows written to (.+)$", finished.output, re.M)
    figures: dict = {"exit_status": finished.returncode, "rows_file": rows_path if os.path.exists(rows_path) else None,
                     "rows": int(written[1]) if written else 0}
    if figures["rows_file"]:
        target = torch.device(device or PART_DEVICE)
        ours = "triton" if target.type == "cuda" else "cpu"
        figures["priors"] = priors.write_report(rows_path, route.device_facts(target), ours,
                                                os.path.join(out, PRIORS_MD), target.type)
    if finished.timed_out:
        status, reason = TIMED_OUT, f"tune ran past {finished.seconds:.0f} s and was stopped before writing its rows"
    elif finished.returncode != 0 or not figures["rows_file"]:
        status, reason = FAILED, f"tune wrote no rows (exit status {finished.returncode})"
    else:
        status, reason = PASSED, None
    return part_record("tune", status, reason, figures, command, finished.output)


# --------------------------------------------------------------------------------------------------- variants


def variants_part(out: str, limit_s: float) -> dict:
    """``bench --suite variants --quick`` alone on the GPU: every kernel variant timed against the vendor's, the
    winners written to the package's ``kernels/variant_rows.json`` (which the plans read) and copied to
    ``DIR/variants/variant_rows.json`` (what comes back from a lent machine, to commit)."""
    from fused_transformer.kernels import variants

    folder = os.path.join(out, "variants")
    os.makedirs(folder, exist_ok=True)
    command = [sys.executable, "-m", "fused_transformer", "bench", "--device", PART_DEVICE, "--suite", "variants",
               "--quick", "--out", folder, "--no-progress", "--no-plots"]
    before = os.path.getmtime(variants.MEASURED_FILE) if os.path.exists(variants.MEASURED_FILE) else None
    finished = run_with_limit(command, max(limit_s - INNER_MARGIN_S, 1.0), log_path(out, "variants"),
                              env=gpu_environment())
    written = os.path.exists(variants.MEASURED_FILE) and os.path.getmtime(variants.MEASURED_FILE) != before
    figures: dict = {"exit_status": finished.returncode, "failures": _bench_failures(finished.output),
                     "rows_file": variants.MEASURED_FILE if written else None}
    if written:
        copy = shutil.copyfile(variants.MEASURED_FILE, os.path.join(folder, "variant_rows.json"))
        figures["rows"] = [asdict(row) for row in variants.read_rows(copy)]
        figures["rows_copy"] = copy
    if finished.timed_out:
        status, reason = TIMED_OUT, f"the variants suite ran past {finished.seconds:.0f} s and was stopped"
    elif not written:
        status, reason = FAILED, f"the variants suite wrote no rows (exit status {finished.returncode})"
    elif finished.returncode != 0:
        status, reason = FAILED, f"{len(figures['failures'])} variant(s) failed on a case"
    else:
        status, reason = PASSED, None
    return part_record("variants", status, reason, figures, command, finished.output)


# ----------------------------------------------------------------------------------------------------- graphs


def graphs_part(out: str, limit_s: float) -> dict:
    """The three GPU checks of ``gpu_check_graphs``, in this process; the record is rewritten (status "running")
    after each, so that a part stopped at its limit keeps the checks it finished."""
    from fused_transformer.tools import gpu_check_graphs

    def save(figures: dict) -> None:
        write_record(out, part_record("graphs", RUNNING, "stopped before its checks finished", figures))

    figures, problems = gpu_check_graphs.run_all(save)
    return part_record("graphs", FAILED if problems else PASSED, "; ".join(problems) or None, figures)


# ---------------------------------------------------------------------------------------------------- the part


RUNNERS: Dict[str, Callable[..., dict]] = {"variants": variants_part, "tests": tests_part, "check": check_part,
                                           "bench": bench_part, "graphs": graphs_part, "tune": tune_part}


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_with_limit, which ends the inner command's session


def main(argv: Optional[List[str]] = None) -> int:
    """Run one part and write its record; exit status 0 once written (the record holds the verdict)."""
    parser = argparse.ArgumentParser(prog="python -m fused_transformer.tools.gpu_check_parts",
                                     description="one part of gpu-check (which runs this), its record to DIR/PART.json")
    parser.add_argument("--part", required=True, choices=PARTS, help="the part to run")
    parser.add_argument("--out", required=True, metavar="DIR", help="the gpu-check folder")
    parser.add_argument("--time-limit", type=float, default=600.0, metavar="SECONDS",
                        help="the part's wall-clock limit (default: %(default)s)")
    parser.add_argument("--all-tests", action="store_true", help="tests: the whole suite, not the GPU subset")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    try:
        if args.part == "tests":
            record = tests_part(out, args.time_limit, args.all_tests)
        else:
            record = RUNNERS[args.part](out, args.time_limit)
    except Exception as exc:  # noqa: BLE001 (the record says what broke; the other parts still run)
        record = part_record(args.part, FAILED, f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                             output=traceback.format_exc())
    write_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
