"""The main job: ``python -m fused_transformer [all | check | bench | report | demo] [options]``.

- ``check``: every op and module on every backend usable here against the float64 reference; exit 1 on a failure.
- ``bench``: throughput against the torch equivalents; a table, a CSV and plots.
- ``report``: the AOT resource table of every shipped Triton kernel config for sm_80 and sm_90 (no GPU needed).
- ``demo``: train the Seq2Seq model of the study notes on a synthetic task, fused against torch.nn.
- ``all`` (the default): ``check`` then ``bench``, passing the options on (``--quick`` for a short run).

Without a GPU the Triton kernels are checked on CPU tensors under the Triton interpreter, which has to be
switched on before triton is imported: that is why this module sets ``TRITON_INTERPRET`` before anything else.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

COMMANDS = ("all", "check", "bench", "report", "demo")


def _interpret_triton_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _check_then_bench(argv: List[str]) -> int:
    """``all``: the self-check, then the benchmark (also when a check failed: its figures still say something),
    with the options the two share; exit status 1 if either failed."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m fused_transformer [all]",
                                     description="check, then bench; see the commands for more options")
    parser.add_argument("--quick", action="store_true", help="the quick check and the quick benchmark")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="where the benchmark writes its CSV and plots")
    args = parser.parse_args(argv)
    shared = ["--device", args.device] + (["--quick"] if args.quick else [])

    from fused_transformer.tools.bench import main as bench_main
    from fused_transformer.tools.check import main as check_main

    check_status = check_main(shared)
    bench_status = bench_main(shared + (["--out", args.out] if args.out else []))
    return check_status or bench_status


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "all"
    if command in ("all", "check"):
        _interpret_triton_without_gpu()
    if command == "check":
        from fused_transformer.tools.check import main as run
    elif command == "bench":
        from fused_transformer.tools.bench import main as run
    elif command == "report":
        from fused_transformer.tools.report import main as run
    elif command == "demo":
        from fused_transformer.models.demo import main as run
    else:
        return _check_then_bench(argv)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
