"""Ctrl-C that keeps finished work: what the long-running parts of the package (training loops, checkpoint writes,
the CLI commands) share, below both ``models`` and ``tools``."""
import contextlib
import signal
import threading
from typing import Iterator, List


class Interrupted(KeyboardInterrupt):
    """A command stopped by Ctrl-C after keeping what it had finished; ``str()`` says what was kept and where.
    ``python -m fused_transformer`` prints it on one line and exits with status 130."""


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
