"""The tools behind ``python -m fused_transformer``: nothing here is needed to use the modules.

- ``check`` (with its grid ``check_cases`` and the accuracy rule ``numerics``): every op and module on every
  backend against float64.
- ``bench`` (with ``bench_cases``, ``bench_timing``, ``bench_plots``): throughput and memory against torch.
- ``report``: the ahead-of-time resource report of every shipped Triton kernel config.
"""
import argparse
import contextlib
import os
import signal
import threading
from typing import Iterator, List


class Interrupted(KeyboardInterrupt):
    """A command stopped by Ctrl-C after keeping what it had finished; ``str()`` says what was kept and where.
    ``python -m fused_transformer`` prints it on one line and exits with status 130."""


def make_folder(parser: argparse.ArgumentParser, option: str, folder: str) -> None:
    """Make ``folder`` and its missing parents for a command-line ``option`` (its name and value, as the user
    gave them), or ``parser.error`` saying why not: a regular file in the way, or a folder that cannot be made
    or written in."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f"{option}: {existing} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        parser.error(f"{option}: cannot make its folder {folder} ({exc.strerror})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{option}: cannot write in the folder {folder}")


@contextlib.contextmanager
def interrupts_held_back() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) until the block has run, then deliver it to the handler that was in place: for
    work that must not be cut in half (a training step's parameter, optimizer and step update; a checkpoint
    write, which torch.save turns into a RuntimeError when interrupted; a worker pool spawning its processes).
    Only the main thread receives signals, and a handler not installed from Python cannot be put back: both run
    the block as it is. (Blocking the signal would not do: torch's threads do not block it and take it.)"""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    received: List[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)
