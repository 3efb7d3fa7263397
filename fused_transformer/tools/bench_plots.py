"""The figures ``python -m fused_transformer bench`` writes: throughput and peak memory against the sequence
length, one panel per case and mode (and head dim, where the suite's rows have several), one line per
implementation; for a suite measured at one length (as ``module_call``, which times calls of small modules), bars per
case instead, one panel per mode."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from fused_transformer.tools.bench_cases import OP_SUITES, Setup
from fused_transformer.tools.bench_work import finite

Row = Dict[str, object]

THROUGHPUT = {  # suite -> (CSV column, axis label); an op's is its ``Op.throughput``
    **{suite: op.throughput for suite, op in OP_SUITES.items()},
    "encoder_layer": ("tokens_per_s", "tokens/s"),
    "decoder_layer": ("tokens_per_s", "tokens/s"),
    "llama": ("tokens_per_s", "tokens/s"),
    "decode_step": ("tokens_per_s", "tokens/s"),
    "module_call": ("tokens_per_s", "tokens/s"),
}
MEMORY_AXIS = {
    "cuda": "peak MiB allocated over one call\n(cuda max_memory_allocated)",
    "cpu": "peak MiB allocated during one call\n(CPU allocator, profiler memory events)",
}


def plot_suite(rows: Sequence[Row], suite: str, setup: Setup, out_dir: str) -> List[str]:
    """Write the throughput and memory figures of one suite; return their paths."""
    paths = []
    for kind, fig in suite_figures(rows, suite, setup):
        path = os.path.join(out_dir, f"{suite}_{setup.device.type}_{kind}.png")
        _save_png(fig, path)
        paths.append(path)
    return paths


def suite_figures(rows: Sequence[Row], suite: str, setup: Setup) -> List[Tuple[str, object]]:
    """``(kind, matplotlib Figure)`` for the throughput and memory figures of one suite."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = [r for r in rows if r["suite"] == suite and r["ms"] is not None]
    if not rows:
        return []
    lengths = sorted({r["seq_len"] for r in rows})
    if len(lengths) == 1:
        return _bar_figures(rows, suite, setup)
    by_head_dim = len({r["head_dim"] for r in rows if r["head_dim"]}) > 1  # a row of panels per mode and head dim
    row_keys = list(dict.fromkeys(_panel_row(r, by_head_dim) for r in rows))
    col_keys = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: "black" if impl == "ours" else f"C{i}" for i, impl in enumerate(impls)}
    device, dtype = setup.device.type, str(setup.dtype)[6:]
    figures = []
    for kind, (column, label) in (("throughput", THROUGHPUT[suite]), ("memory", ("peak_mem_mb", MEMORY_AXIS[device]))):
        fig = Figure(figsize=(3.6 * len(col_keys) + 0.4, 2.7 * len(row_keys) + 0.8), dpi=100)
        axes = fig.subplots(len(row_keys), len(col_keys), squeeze=False, sharex=True)
        for i, row_key in enumerate(row_keys):
            for j, col_key in enumerate(col_keys):
                ax = axes[i][j]
                panel = [r for r in rows if r["case"] == col_key and _panel_row(r, by_head_dim) == row_key]
                for impl in impls:
                    points = sorted((r["seq_len"], r[column]) for r in panel if r["impl"] == impl
                                    and finite(r[column]) and (kind == "throughput" or r[column] > 0))
                    if points:
                        ax.plot(*zip(*points), marker="o", markersize=3, color=colors[impl], label=impl,
                                linewidth=2.4 if impl == "ours" else 1.2, linestyle="-" if impl == "ours" else "--")
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [str(n) for n in lengths])
                ax.xaxis.set_minor_formatter(NullFormatter())
                if kind == "memory":  # linear and quadratic growth both read as straight lines
                    ax.set_yscale("log")
                    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
                    ax.yaxis.set_minor_formatter(NullFormatter())
                ax.tick_params(axis="both", which="both", labelsize=7)
                ax.set_title(f"{col_key}, {row_key}", fontsize=9)
                ax.grid(True, alpha=0.3)
                if i == len(row_keys) - 1:
                    ax.set_xlabel("sequence length", fontsize=8)
                if j == 0:
                    ax.set_ylabel(label, fontsize=8)
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes.flat:  # a panel may lack an implementation: collect every label once
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        better = "higher" if kind == "throughput" else "lower"
        fig.suptitle(f"{suite} on {device}, {dtype}: {kind} ({better} is better)", fontsize=10)
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.06 if len(row_keys) > 1 else 0.1, 1, 0.96))
        figures.append((kind, fig))
    return figures


def _bar_figures(rows: Sequence[Row], suite: str, setup: Setup) -> List[Tuple[str, object]]:
    """One length only: per mode a panel of grouped bars, a group per case and a bar per implementation."""
    from matplotlib.figure import Figure

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: "black" if impl == "ours" else f"C{i}" for i, impl in enumerate(impls)}
    width = 0.8 / len(impls)
    figures = []
    for kind, (column, label) in (("throughput", THROUGHPUT[suite]),
                                  ("memory", ("peak_mem_mb", MEMORY_AXIS[setup.device.type]))):
        fig = Figure(figsize=(1.2 * len(cases) * len(modes) + 1.5, 3.4), dpi=100)
        axes = fig.subplots(1, len(modes), squeeze=False)[0]
        for ax, mode in zip(axes, modes):
            for i, impl in enumerate(impls):
                values = [next((float(r[column]) for r in rows if r["mode"] == mode and r["case"] == case
                                and r["impl"] == impl and finite(r[column])), 0.0) for case in cases]
                ax.bar([c + (i - (len(impls) - 1) / 2) * width for c in range(len(cases))], values, width,
                       color=colors[impl], label=impl)
            ax.set_xticks(range(len(cases)), cases, fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(f"{mode}, L={rows[0]['seq_len']}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].set_ylabel(label, fontsize=8)
        better = "higher" if kind == "throughput" else "lower"
        fig.suptitle(f"{suite} on {setup.device.type}, {str(setup.dtype)[6:]}: {kind} ({better} is better)",
                     fontsize=10)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(impls), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 0.94))
        figures.append((kind, fig))
    return figures


def _save_png(fig: object, path: str) -> None:
    """A 64-colour palette PNG: line plots need no more, and the file is a third of the size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # matplotlib's own dependency

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    image.convert("RGB").quantize(colors=64).save(path, optimize=True)


def _panel_row(row: Row, by_head_dim: bool) -> str:
    return f"{row['mode']} D{row['head_dim']}" if by_head_dim else str(row["mode"])
