"""How ``python -m fused_transformer bench`` and ``pytest benchmarks/`` time a call and measure its peak memory.

Time (``time_ms``): on CUDA the median of ``triton.testing.do_bench`` (gradients reset to None outside the timed
region); on CPU ``torch.utils.benchmark.Timer`` over ``reset gradients; call``, the implementations of a case taking
turns in blocks so that a noisy machine slows them alike, and the median over the blocks.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over one call, above what was allocated before it; on CPU
torch has no allocator statistics, so it is the peak of the bytes allocated through torch's CPU allocator during one
call (on the calling thread), above the start, read from the profiler's memory events (``profile_memory=True``).
``python -m fused_transformer bench`` measures it on the first call of each implementation of a case on CPU (the
slowest calls take seconds; that call is also the warm-up), on a second call on CUDA (the first may autotune).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from typing import Callable, Dict, Iterator, Sequence

import torch
from torch import Tensor

from fused_transformer.interrupts import interrupts_held_back


def reset_grads(tensors: Sequence[Tensor]) -> None:
    for t in tensors:
        t.grad = None


def runner(fn: Callable[[], object], grads: Sequence[Tensor], device: torch.device) -> Callable[[], None]:
    """One benchmarked call as CPU timers see it: reset gradients, call, wait for the device."""
    def run() -> None:
        reset_grads(grads)
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def time_ms(fns: Dict[str, Callable[[], object]], grads: Sequence[Tensor], device: torch.device,
            min_time: float, max_rounds: int = 5) -> Dict[str, float]:
    """Median milliseconds of one call of each implementation, measured side by side.

    CUDA: ``triton.testing.do_bench`` medians, one implementation after the other. CPU: the implementations
    take turns: one call each, then up to ``max_rounds - 1`` rounds in which each runs a block of calls lasting
    about ``min_time / rounds``, so that a slow-down of a shared machine hits them all alike. The result is the
    median over the blocks of ``torch.utils.benchmark`` time per call (a single call when one takes
    ``min_time`` or more).
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return {name: float(do_bench(fn, grad_to_none=list(grads) or None, return_mode="median"))
                for name, fn in fns.items()}
    from torch.utils.benchmark import Timer

    timers = {name: Timer("run()", globals={"run": runner(fn, grads, device)}, num_threads=torch.get_num_threads())
              for name, fn in fns.items()}
    # A first block of one call each sizes the others (and counts): calls of a second or more get no more.
    blocks = {name: [timer.timeit(1).median] for name, timer in timers.items()}  # seconds per call
    rounds = min(max_rounds - 1, int(min_time / max(times[0] for times in blocks.values())))
    for _ in range(rounds):
        for name, timer in timers.items():
            blocks[name].append(timer.timeit(max(1, round(min_time / rounds / blocks[name][0]))).median)
    return {name: statistics.median(times) * 1e3 for name, times in blocks.items()}


MEMORY_MEASURES = {
    "cuda": "cuda max_memory_allocated over one call, above the start",
    "cpu": "CPU allocator bytes allocated during one call (profiler memory events), peak above the start",
}


def peak_memory_mb(fn: Callable[[], object], grads: Sequence[Tensor], device: torch.device) -> float:
    """Peak memory of one call in MiB, as ``MEMORY_MEASURES`` describes for the device type."""
    reset_grads(grads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return _cpu_allocated_peak(fn) / 2**20


def _cpu_allocated_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated through torch's CPU allocator during ``fn()`` (on this thread), above the start.

    The profiler's memory events carry the allocator's running total ("Total Allocated") after each allocation
    and free; the first event's total minus its own size is the level at the start.
    """
    from torch.profiler import ProfilerActivity, profile

    # A Ctrl-C landing while the profiler starts or stops leaves it half on, and the process then crashes at exit
    # (SIGSEGV or SIGABRT instead of the status 130 that ``python -m fused_transformer`` promises): it waits.
    with interrupts_held_back(), _quiet_stderr(), profile(activities=[ProfilerActivity.CPU],
                                                          profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        with _quiet_stderr():
            prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in memory) - start)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop log lines (written straight to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
