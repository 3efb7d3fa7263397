"""The tools behind ``python -m fused_transformer``: nothing here is needed to use the modules.

- ``check`` (with its grid ``check_cases`` and the accuracy rule ``numerics``): every op and module on every
  backend against float64.
- ``bench`` (with ``bench_cases``, ``bench_timing``, ``bench_plots``): throughput and memory against torch.
- ``report``: the ahead-of-time resource report of every shipped Triton kernel config.
- ``demo``: trains the study notes' Seq2Seq model (``fused_transformer.models``), fused against torch.nn.
- ``gpu_check`` (with ``gpu_check_parts``, ``gpu_check_graphs``, ``gpu_check_summary``): on a CUDA machine, the
  GPU tests, ``check``, ``bench``, CUDA graphs, backward determinism and peak memory, each part in a process of
  its own under a time limit, merged into one verdict.
"""
import argparse
import math
import os


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


def positive_seconds(text: str) -> float:
    """An argparse ``type`` for a number of seconds: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value
