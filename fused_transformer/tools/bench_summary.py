"""What ``python -m fused_transformer bench`` says of a run beyond its CSV: the speed-ups of ours per suite (the
recap of ``python -m fused_transformer``), and ``bench_<device>.md``, the run's figures as markdown tables headed by
where they come from (docs/bench/bench_cpu.md is written so)."""
from __future__ import annotations

import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from fused_transformer.tools import bench_overhead, provenance
from fused_transformer.tools.bench_cases import Setup, describe
from fused_transformer.tools.bench_work import finite

Row = Dict[str, object]


def _ours(rows: Sequence[Row], suite: str) -> List[Row]:
    return [r for r in rows if r["suite"] == suite and r["impl"] == "ours" and finite(r["speedup"])]


def recap(rows: Sequence[Row]) -> List[str]:
    """One line per suite: the median (and range) of ours' speed-up over its baseline across the suite's cases."""
    lines = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        ours = _ours(rows, suite)
        if ours:
            speedups = [float(r["speedup"]) for r in ours]
            baseline = ours[0]["baseline"]
            lines.append(f"{suite}: ours / {baseline} {statistics.median(speedups):.2f}x median "
                         f"({min(speedups):.2f}x - {max(speedups):.2f}x) over {len(ours)} case{'s' if len(ours) > 1 else ''}")
    return lines


def _key(row: Row) -> Tuple[object, ...]:
    return tuple(row[c] for c in ("suite", "case", "mode", "seq_len", "batch", "head_dim"))


def _ms(value: object) -> str:
    return f"{float(value):.3f}" if finite(value) else "-"


def markdown(rows: Sequence[Row], setup: Setup, command: Sequence[str], plots: Sequence[str] = ()) -> str:
    """The run's figures: per suite, each case of ours against its baseline (ms of one call, and the speed-up:
    baseline ms / ours ms, measured in the same run taking turns), and the plots written beside."""
    device = setup.device
    lines = provenance.header(f"Benchmark on {device.type}, {str(setup.dtype)[6:]}", command, device)
    by_key = {(_key(r), r["impl"]): r for r in rows}
    for suite in dict.fromkeys(r["suite"] for r in rows):
        ours = [r for r in rows if r["suite"] == suite and r["impl"] == "ours"]
        if not ours:
            continue
        if suite == bench_overhead.SUITE:  # host microseconds and ratios to thin, not milliseconds
            lines += [f"## {suite}", "", bench_overhead.describe(bench_overhead.setup_for(setup)) + ".", "",
                      *bench_overhead.table(rows), ""]
            continue
        baseline = ours[0]["baseline"]
        lines += [f"## {suite}", "", describe(suite, setup) + ".", "",
                  f"| case | mode | L | ours ms | {baseline} ms | speed-up |", "| --- | --- | --- | --- | --- | --- |"]
        for row in ours:
            other: Optional[Row] = by_key.get((_key(row), baseline))
            speedup = f"{float(row['speedup']):.2f}x" if finite(row["speedup"]) else "-"
            lines.append(f"| {row['case']} | {row['mode']} | {row['seq_len']} | {_ms(row['ms'])} | "
                         f"{_ms(other['ms']) if other else '-'} | {speedup} |")
        lines.append("")
        for path in plots:
            name = os.path.basename(path)
            if name.startswith(f"{suite}_"):
                lines += [f"![{name}]({name})", ""]
    return "\n".join(lines)
