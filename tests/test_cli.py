"""``python -m fused_transformer``: argparse help, one spelling per option, unknown commands, and Ctrl-C in every long
command: one line on stderr saying what was kept, no traceback, exit status 130, and nothing finished is lost."""
import argparse
import csv
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from fused_transformer import __main__ as cli
from fused_transformer import tools
from fused_transformer import backend as ft_backend
from tests.signals import sigint_as_in_a_terminal

INTERRUPTED = 130


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fused_transformer")
    for command in ("all", "check", "bench", "report", "demo", "gpu-check"):
        assert re.search(rf"^    {command}\s", out, re.M), command  # a long name gets its help on the next line


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["chek"])
    assert exc.value.code == 2
    assert "unknown command 'chek': choose from all, check, bench, report, demo, gpu-check" in capsys.readouterr().err


def _parsers(monkeypatch):
    """The argument parser of every command, as each builds it (parse_args stopped before it parses)."""
    parsers = {}

    def capture(self, args=None, namespace=None):
        parsers[self.prog] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit):
            cli.main([command])
    return parsers


def test_every_option_has_help_and_one_spelling_across_commands(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert len(parsers) == len(cli.COMMANDS)
    spellings = {}
    for prog, parser in parsers.items():
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert action.help, f"{prog} {option} has no help text"
                    spellings.setdefault(option, set()).add(tuple(action.choices) if action.choices else None)
    assert "--quiet" not in spellings  # --no-progress, as check and bench spell it
    assert len(spellings["--dtype"]) == 1, spellings["--dtype"]  # float32 / float16 / bfloat16 everywhere
    # check --backend names the backends it compares, bench --backend also takes "auto" (its default): the same names
    assert all(len(choices) == 1 for option, choices in spellings.items() if option != "--backend"), spellings


# ------------------------------------------------------------------------------------------------- --device


@pytest.fixture
def two_gpus_current_1(monkeypatch):
    """torch as it is on a machine with two CUDA devices whose current one is cuda:1 (the resolution is checked,
    not the GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_every_command_with_a_device_resolves_it_in_the_one_place(monkeypatch, two_gpus_current_1):
    """Each command's --device is tools.device_argument with the default "auto": "cuda" and no --device become the
    current device with its index (torch.cuda.set_device refuses "cuda" without one), "cuda:N" must exist."""
    parsers = _parsers(monkeypatch)
    with_device = {prog: next(a for a in parser._actions if "--device" in a.option_strings)
                   for prog, parser in parsers.items() if "--device" in parser._option_string_actions}
    assert {prog.split()[-1] for prog in with_device} == {"[all]", "check", "bench", "demo", "gpu-check", "tune"}
    for prog, action in with_device.items():
        assert action.type is tools.device_argument and action.default == tools.AUTO_DEVICE, prog
    assert tools.device_argument("auto") == tools.device_argument("cuda") == torch.device("cuda", 1)
    assert tools.device_argument("cuda:0") == torch.device("cuda", 0)
    assert tools.device_argument("cpu") == torch.device("cpu")
    with pytest.raises(argparse.ArgumentTypeError, match=r"device 'cuda:2': there are 2 CUDA devices here"):
        tools.device_argument("cuda:2")


@pytest.mark.parametrize("name, message", [
    ("cuda", "device 'cuda': no CUDA device is available here"),
    ("cuda:0", "device 'cuda:0': no CUDA device is available here"),
    ("mps", "device 'mps': device type 'mps' is not supported"),
    ("gpu", "device 'gpu' is not a torch device"),
])
def test_devices_that_are_not_here_are_refused_by_name(monkeypatch, name, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tools.resolve_device() == torch.device("cpu")
    with pytest.raises(ValueError, match=re.escape(message)):
        tools.resolve_device(name)


def test_a_device_that_is_not_here_is_an_argparse_error_in_every_command():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for command in ("check", "bench", "demo"):
        proc = subprocess.run([sys.executable, "-m", "fused_transformer", command, "--device", "cuda"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert "argument --device: device 'cuda': no CUDA device is available here" in proc.stderr, proc.stderr


def interrupt(args, ready, timeout=240):
    """Start ``python -m fused_transformer *args``, send SIGINT once ``ready(pid)`` is true (polled), and return
    (exit status, stdout, stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fused_transformer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_in_a_terminal)
    deadline = time.monotonic() + timeout
    try:
        while not ready(proc.pid):
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"finished (status {proc.returncode}) before it could be interrupted:\n{out}\n{err}")
            if time.monotonic() > deadline:
                pytest.fail("never became ready to interrupt")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)  # a child left holding its pipes fails the test rather than hanging it
    return proc.returncode, out, err


def assert_one_line(err):
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("interrupted"), err
    return lines[-1]


def test_ctrl_c_in_bench_keeps_the_previous_csv_and_the_rows_measured(tmp_path):
    previous = tmp_path / "bench_cpu.csv"
    previous.write_text("a complete earlier run\n")
    partial = tmp_path / "bench_cpu.csv.partial"

    def some_rows_written(pid):
        return partial.exists() and partial.read_text().count("\n") >= 3

    status, _, err = interrupt(["bench", "--device", "cpu", "--suite", "attention", "--lengths", "64,128,256",
                                "--min-time", "0.5", "--threads", "1", "--out", str(tmp_path)], some_rows_written)
    assert status == INTERRUPTED, err
    line = assert_one_line(err)
    assert str(partial) in line and "untouched" in line
    assert previous.read_text() == "a complete earlier run\n"
    with open(partial, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 2 and all(row["suite"] == "attention" for row in rows)


@pytest.mark.skipif(ft_backend.triton_unavailable_reason() is not None, reason="triton is not installed")
def test_ctrl_c_in_check_prints_the_summary_of_the_rows_done(tmp_path):
    log = tmp_path / "out.txt"  # stdout goes to a file, read while the check runs
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            # The interpreted Triton kernels take tens of seconds after the first row: the Ctrl-C lands mid-check
            # (the reference backend's whole check takes about a second, and a Ctrl-C could land after it).
            [sys.executable, "-m", "fused_transformer", "check", "--quick", "--backend", "triton"],
            stdout=out, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_in_a_terminal)
        deadline = time.monotonic() + 240
        # a row's result column: the header's "rule: pass iff ..." comes before the rows' try block
        while "  pass  " not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "check finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == INTERRUPTED, err
    assert "checks done: their rows and summary are above" in assert_one_line(err)
    text = log.read_text()
    assert "  pass  " in text and text.splitlines()[-1].endswith("(interrupted)")


def children(pid):
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):  # the process ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the compiler workers through /proc")
def test_ctrl_c_in_report_stops_the_compiler_workers():
    """Interrupted as its workers start, the report exits within seconds: the jobs not yet running are cancelled
    (left to the pool, the workers went on compiling for over a minute)."""
    ctrl_c_at = []

    def workers_started(pid):
        if len(children(pid)) < 2:
            return False
        ctrl_c_at.append(time.monotonic())  # interrupt() sends the Ctrl-C as this returns
        return True

    status, out, err = interrupt(["report", "--jobs", "2"], ready=workers_started)
    assert status == INTERRUPTED, out + err
    assert "compilations finished; report writes nothing" in assert_one_line(err)
    # Counted from the Ctrl-C, not from the start (imports, listing the jobs). What remains is the workers' start and
    # the jobs already handed to them: seconds, a few times more on a busy machine; left to the pool, the rest of the
    # jobs took over a minute even on an idle one.
    assert time.monotonic() - ctrl_c_at[0] < 60


def test_a_compiler_worker_exits_when_its_parent_is_gone(monkeypatch):
    """A worker still starting when a Ctrl-C ended the report would wait forever on queues whose write ends the
    workers themselves hold; its watchdog exits once the parent is gone (the worker is re-parented)."""
    from fused_transformer.tools import report

    parents = iter([100, 100, 1])
    monkeypatch.setattr(report.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(report.time, "sleep", lambda seconds: None)

    def exit_(status):
        raise SystemExit(status)

    monkeypatch.setattr(report.os, "_exit", exit_)
    with pytest.raises(SystemExit) as exited:
        report._exit_when_orphaned(100)
    assert exited.value.code == 1 and next(parents, None) is None


def test_ctrl_c_in_the_demo_keeps_a_checkpoint_and_exits_130(tmp_path):
    from fused_transformer.models import read_checkpoint

    path = str(tmp_path / "ckpt.pt")
    status, _, err = interrupt(["demo", "--quick", "--steps", "100000", "--batch-size", "8", "--checkpoint", path,
                                "--save-every", "5"], ready=lambda pid: os.path.exists(path), timeout=120)
    assert status == INTERRUPTED, err
    step = read_checkpoint(path)["step"]
    assert assert_one_line(err) == (f"interrupted: step {step} of 100000 is saved in the checkpoint {path}; "
                                    "the same command with --resume continues it")
