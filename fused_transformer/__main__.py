"""The main job: ``python -m fused_transformer [COMMAND] [options]``; ``--help`` lists the commands and
``python -m fused_transformer COMMAND --help`` the options of each.

Without a GPU the Triton kernels are checked on CPU tensors under the Triton interpreter, which has to be
switched on before triton is imported: that is why this module sets ``TRITON_INTERPRET`` before anything else.

Ctrl-C (SIGINT) anywhere stops the command with one line on stderr saying what was kept (the rows already
printed, a partial benchmark CSV, the last training checkpoint) and exit status 130, the shell's convention.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Dict, List, Optional

from fused_transformer.interrupts import Interrupted

COMMANDS: Dict[str, str] = {
    "all": "check, then bench (the default command)",
    "check": "every op and module on every usable backend against float64",
    "bench": "throughput and memory against torch: a table, a CSV, plots",
    "report": "compile every shipped Triton kernel config without a GPU: registers, spills, shared memory",
    "demo": "train the study notes' Seq2Seq model, fused against torch.nn",
    "gpu-check": "on a CUDA machine: GPU tests, check, bench, CUDA graphs, determinism, memory; a verdict in --out",
    "tune": "measure ours against torch's path on this device: the route's rows, kept in the user's cache",
}
# The module whose main(argv) runs each command but "all".
COMMAND_MODULES = {
    "check": "fused_transformer.tools.check", "bench": "fused_transformer.tools.bench",
    "report": "fused_transformer.tools.report", "demo": "fused_transformer.tools.demo",
    "gpu-check": "fused_transformer.tools.gpu_check", "tune": "fused_transformer.tools.tune",
}
INTERRUPTED_STATUS = 130  # 128 + SIGINT


def _interpret_triton_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _check_then_bench(argv: List[str]) -> int:
    """``all``: the self-check, then the benchmark (also when a check failed: its figures still say something),
    with the options the two share, and a recap of both at the end; exit status 1 if either failed."""
    from fused_transformer.tools import add_device_option, bench, check

    parser = argparse.ArgumentParser(prog="python -m fused_transformer [all]",
                                     description="check, then bench; see the commands for more options")
    parser.add_argument("--quick", action="store_true", help="the quick check and the quick benchmark")
    add_device_option(parser, "checks and measures on")
    parser.add_argument("--out", default=None, help="where the benchmark writes its CSV, plots and summary")
    args = parser.parse_args(argv)
    shared = ["--device", str(args.device)] + (["--quick"] if args.quick else [])
    recap: List[str] = []
    check_status = check.main(shared, recap=recap)
    bench_status = bench.main(shared + (["--out", args.out] if args.out else []), recap=recap)
    print("\nrecap:\n" + "\n".join("  " + line for line in recap))
    return check_status or bench_status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="fused_transformer's main job: self-check, benchmark, resource report, Seq2Seq demo, GPU check.",
        epilog="With no command, 'all' runs with the options given (e.g. python -m fused_transformer --quick).\n"
               "Ctrl-C stops any command with one line and exit status 130, keeping what had finished.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        commands.add_parser(name, help=help_line, add_help=False)
    return parser


def _command_main(command: str) -> Callable[[List[str]], int]:
    if command == "all":
        return _check_then_bench
    return importlib.import_module(COMMAND_MODULES[command]).main


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if argv[:1] in (["-h"], ["--help"]):
        parser.print_help()
        return 0
    if argv and argv[0] in COMMANDS:
        command = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        parser.error(f"unknown command {argv[0]!r}: choose from {', '.join(COMMANDS)}")
    else:
        command = "all"
    if command in ("all", "check", "bench"):  # bench: its overhead suite runs the Triton backend on CPU tensors
        _interpret_triton_without_gpu()
    try:
        return _command_main(command)(argv)
    except KeyboardInterrupt as exc:
        kept = f": {exc}" if isinstance(exc, Interrupted) and str(exc) else ""
        print(f"\ninterrupted{kept}", file=sys.stderr, flush=True)
        return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
