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

import torch

# --device's default: the current CUDA device when torch sees one, else the CPU (``resolve_device``).
AUTO_DEVICE = "auto"


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


def resolve_device(name: str = AUTO_DEVICE) -> torch.device:
    """The device a command runs on, from its ``--device`` value: ``"auto"`` is the current CUDA device when torch
    sees one, else the CPU; ``"cuda"`` is the current CUDA device, with its index (``torch.cuda.set_device`` and the
    memory statistics refuse a CUDA device without one); ``"cuda:N"`` must exist here. Raises ``ValueError`` naming
    ``name`` and what was wrong with it."""
    if name == AUTO_DEVICE:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a torch device (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device {name!r}: device type {device.type!r} is not supported (cpu, cuda, cuda:N or auto)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here (torch {torch.__version__}, "
                         f"torch.version.cuda={torch.version.cuda})")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"device {name!r}: there {'is' if count == 1 else 'are'} {count} CUDA device"
                         f"{'' if count == 1 else 's'} here (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def device_argument(text: str) -> torch.device:
    """An argparse ``type`` for ``--device``: ``resolve_device``, its errors as argparse's."""
    try:
        return resolve_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_option(parser: argparse.ArgumentParser, what: str = "runs on") -> None:
    """The ``--device`` option every command shares; ``args.device`` is a resolved ``torch.device``."""
    parser.add_argument("--device", type=device_argument, default=AUTO_DEVICE, metavar="DEVICE",
                        help=f"the device it {what}: cpu, cuda (the current CUDA device), cuda:N, or auto (the "
                             "default: the current CUDA device when there is one, else cpu)")
