"""A Llama training step's memory and speed on the CPU: transformers' model against ``ft.fuse`` of it.

    python benchmarks/llama_memory.py [--tokens 1024] [--speed] [--speed-tokens 512] [--steps 5] [--threads N]

The model is the ``llama`` bench suite's (``fused_transformer.tools.bench_llama.MODELS["cpu"]``: hidden 512, MLP
1408, 4 layers, 8 heads, 2 key-value heads, vocab 32000, untied, float32), batch 2. A step is forward on random
token ids, the loss against labels, backward (no optimizer).

- memory: each variant (``hf``: transformers with ``attn_implementation="sdpa"``; ``fused``: ``ft.fuse`` of it) in
  a fresh Python process, which builds the model and the inputs, reads its peak resident memory
  (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), runs one step at batch 2 x ``--tokens``, and reads it again: the
  growth is what the step needed beyond what the process had already held. The ratio is fused / hf.
- ``--speed``: both variants in one fresh process, a warm-up step each, then ``--steps`` (at least 5) steps each at
  batch 2 x ``--speed-tokens``, taking turns; the median step time of each and the ratio hf / fused (> 1: fused
  faster).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List

BATCH = 2
VARIANTS = ("hf", "fused")


def _build(variant: str):
    import torch

    import fused_transformer as ft
    from fused_transformer.tools import bench_llama
    from fused_transformer.tools.bench_cases import Setup

    model = bench_llama.llama_model(Setup(torch.device("cpu"), torch.float32))
    return ft.fuse(model) if variant == "fused" else model


def _inputs(model, tokens: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    return (torch.randint(vocab, (BATCH, tokens), generator=generator),
            torch.randint(vocab, (BATCH, tokens), generator=generator))


def _step(model, ids, labels) -> None:
    model(input_ids=ids, labels=labels).loss.backward()


def child_memory(variant: str, tokens: int) -> Dict[str, float]:
    """In this (fresh) process: the peak resident memory's growth over one step of ``variant``, in MiB."""
    model = _build(variant)
    ids, labels = _inputs(model, tokens)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    _step(model, ids, labels)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "before_mib": before / 1024, "after_mib": after / 1024,
            "growth_mib": (after - before) / 1024}


def child_speed(tokens: int, steps: int) -> Dict[str, List[float]]:
    """In this (fresh) process: ``steps`` step times (ms) of each variant, taking turns, after a warm-up step each."""
    hf = _build("hf")
    import fused_transformer as ft

    models = {"hf": hf, "fused": ft.fuse(copy.deepcopy(hf))}
    ids, labels = _inputs(hf, tokens)
    times: Dict[str, List[float]] = {name: [] for name in models}
    for round_ in range(steps + 1):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _step(model, ids, labels)
            if round_:  # the first round warms up
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _run_child(args: List[str]) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the child process {args} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the platform's word for it: ratios differ by CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return (names[0] if names else platform.processor() or platform.machine()) + \
        f", torch CPU capability {_cpu_capability()}"


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="sequence length of the memory step (default 1024)")
    parser.add_argument("--speed", action="store_true", help="also time interleaved steps")
    parser.add_argument("--speed-tokens", type=int, default=512, help="sequence length of the timed steps")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant, at least 5 (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the children (default torch's)")
    parser.add_argument("--child", choices=(*VARIANTS, "speed"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.speed_tokens < 2:
        parser.error(f"--tokens {args.tokens} / --speed-tokens {args.speed_tokens}: at least 2 (a loss needs a next "
                     "token)")
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: at least 5")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.child == "speed":
        print(json.dumps(child_speed(args.speed_tokens, args.steps)))
        return 0
    if args.child is not None:
        print(json.dumps(child_memory(args.child, args.tokens)))
        return 0

    import torch

    threads = ["--threads", str(args.threads)] if args.threads is not None else []
    print(f"llama_memory: torch {torch.__version__}, {_cpu_name()}, "
          f"threads {args.threads or torch.get_num_threads()}, batch {BATCH}")
    print(f"peak RSS growth over one training step at {BATCH} x {args.tokens} (a fresh process each):")
    grown = {}
    for variant in VARIANTS:
        measured = _run_child(["--child", variant, "--tokens", str(args.tokens), *threads])
        grown[variant] = measured["growth_mib"]
        print(f"  {variant:5s} {measured['growth_mib']:9.1f} MiB   (before {measured['before_mib']:.1f}, "
              f"after {measured['after_mib']:.1f})")
    print(f"  fused / hf: {grown['fused'] / grown['hf']:.3f}")
    if args.speed:
        times = _run_child(["--child", "speed", "--speed-tokens", str(args.speed_tokens), "--steps",
                            str(args.steps), *threads])
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"step time at {BATCH} x {args.speed_tokens}, median of {args.steps} interleaved steps (one process):")
        for name, values in times.items():
            print(f"  {name:5s} {medians[name]:9.1f} ms   ({', '.join(f'{v:.0f}' for v in values)})")
        print(f"  hf / fused: {medians['hf'] / medians['fused']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
