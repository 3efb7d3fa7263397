"""Ahead-of-time check of every shipped kernel config: compile for sm_80, sm_86, sm_89 and sm_90 without a GPU
and report registers, spills, shared memory and tensor-core use.

Each kernel module listed in ``KERNEL_MODULES`` exposes ``aot_configs() -> List[AotKernel]``: one entry per
kernel variant and tile config its launcher can pick on a GPU. ``compile_all`` compiles each entry for each of
its targets with ``triton.compile`` (PTX and cubin come from the ptxas inside the triton wheel), reads
registers and local memory from ``cuobjdump --dump-resource-usage`` and looks for ``mma`` / ``wgmma`` in the
PTX. A config fails when it spills, needs more shared memory than one block may have, or (``expect_tensor_cores``)
runs its matmul on the CUDA cores.

    python -m fused_transformer report         # table; exit status 1 if any config fails
    python -m fused_transformer.tools.report   # the same

Compilation runs in spawned worker processes with ``TRITON_INTERPRET=0``: under the interpreter (as in the test
process, on a machine without a GPU) ``@triton.jit`` makes interpreter functions that cannot be compiled.
Nothing here runs on import, and nothing needs a GPU.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fused_transformer.tools import Interrupted, interrupts_held_back

# Modules whose ``aot_configs()`` are compiled; a new kernel module adds its name here.
KERNEL_MODULES = (
    "fused_transformer.kernels.attention",
    "fused_transformer.kernels.layer_norm",
    "fused_transformer.kernels.feed_forward",
)

# Largest dynamic shared memory one block may use, in bytes, per compute capability: A100 (sm_80); the A10, A40
# and RTX 30 (sm_86) and L4, L40S and RTX 40 (sm_89) have 99 KB; H100 / H200 (sm_90).
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
TARGETS = (80, 86, 89, 90)
WARP_SIZE = 32

_RESOURCE_LINE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
# mma.sync (Ampere and later) or wgmma.mma_async (Hopper): the matmul runs on tensor cores.
_TENSOR_CORE_INSTRUCTION = re.compile(r"wgmma\.mma_async|\bmma\.sync")


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """One kernel variant and config to compile.

    ``signature`` maps every runtime argument to its Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``, ...);
    ``constexprs`` maps constexpr arguments (and runtime arguments specialised to a constant, e.g. unit
    strides) to their values; they need not appear in ``signature``. ``targets`` are the compute
    capabilities the config is shipped for (a Hopper-only tile config lists only 90).
    """

    name: str
    config: str
    fn: Any  # triton JITFunction
    signature: Dict[str, str]
    constexprs: Dict[str, Any]
    num_warps: int
    num_stages: int
    targets: Tuple[int, ...] = TARGETS
    expect_tensor_cores: bool = False
    # Arguments compiled as multiples of 16 (None: every pointer and integer argument, as the JIT specialises
    # a launch whose sizes and strides are multiples of 16). Odd sizes compile another, unchecked variant.
    divisible_by_16: Optional[Tuple[str, ...]] = None


@dataclasses.dataclass(frozen=True)
class AotResult:
    """What compiling one ``AotKernel`` for one target gave (``error`` set when it did not compile)."""

    module: str
    name: str
    config: str
    target: int
    num_warps: int
    registers: int = 0
    spill_bytes: int = 0  # local memory per thread: Triton kernels have no local arrays, so this is spills
    stack_bytes: int = 0
    shared_bytes: int = 0  # dynamic shared memory the launch requests (metadata.shared)
    tensor_cores: bool = False
    expect_tensor_cores: bool = False
    error: Optional[str] = None

    @property
    def problems(self) -> List[str]:
        if self.error is not None:
            return [f"compile error: {self.error}"]
        found = []
        if self.spill_bytes or self.stack_bytes:
            found.append(f"spills ({self.spill_bytes} B local, {self.stack_bytes} B stack)")
        limit = SHARED_MEMORY_LIMIT[self.target]
        if self.shared_bytes > limit:
            found.append(f"shared {self.shared_bytes} B > {limit} B")
        if self.expect_tensor_cores and not self.tensor_cores:
            found.append("no mma/wgmma")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems


# ------------------------------------------------------------------------------------------------ compiling


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found at {path} (it ships inside the triton wheel)")
    return path


def _divisibility_attrs(kernel: AotKernel) -> Dict[Tuple[int, ...], list]:
    """The JIT's specialisation for a typical launch: pointers from torch are 16-byte aligned and sizes and
    strides are multiples of 16 (``kernel.divisible_by_16``, default every pointer and integer argument)."""
    names = kernel.divisible_by_16
    if names is None:
        names = [name for name, ty in kernel.signature.items() if ty.startswith("*") or ty in ("i32", "i64")]
    return {(kernel.fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """Registers, stack, static shared and local bytes per thread of a one-kernel cubin, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = _RESOURCE_LINE.search(out)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{out}")
    registers, stack, shared, local = map(int, match.groups())
    return {"registers": registers, "stack": stack, "shared": shared, "local": local}


def uses_tensor_cores(ptx: str) -> bool:
    return _TENSOR_CORE_INSTRUCTION.search(ptx) is not None


def compile_kernel(kernel: AotKernel, target: int, module: str = "") -> AotResult:
    """Compile ``kernel`` for ``sm_<target>`` in this process (which must not be interpreting Triton)."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = dict(kernel.signature)
    for name in kernel.constexprs:
        signature.setdefault(name, "constexpr")
    base = dict(module=module, name=kernel.name, config=kernel.config, target=target, num_warps=kernel.num_warps,
                expect_tensor_cores=kernel.expect_tensor_cores)
    try:
        source = triton.compiler.ASTSource(
            fn=kernel.fn, signature=signature, constexprs=kernel.constexprs, attrs=_divisibility_attrs(kernel)
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", target, WARP_SIZE),
            options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages},
        )
        usage = resource_usage(compiled.asm["cubin"])
    except Exception as e:  # reported per config, so one broken kernel does not hide the others
        return AotResult(**base, error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
    return AotResult(
        **base, registers=usage["registers"], spill_bytes=usage["local"], stack_bytes=usage["stack"],
        shared_bytes=max(int(compiled.metadata.shared), usage["shared"]),
        tensor_cores=uses_tensor_cores(compiled.asm["ptx"]),
    )


@functools.lru_cache(maxsize=None)
def _configs(module: str) -> List[AotKernel]:
    return list(importlib.import_module(module).aot_configs())


def _compile_job(module: str, index: int, target: int) -> AotResult:
    return compile_kernel(_configs(module)[index], target, module)


def _init_worker() -> None:
    # Ctrl-C on a terminal reaches the whole process group: the parent alone stops the run.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before any kernel module is imported in this worker, so @triton.jit makes compilable functions.
    os.environ["TRITON_INTERPRET"] = "0"
    # Triton 3.9's default (FP fusion on), stated so it stops warning in every worker.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def jobs_for(modules: Sequence[str]) -> List[Tuple[str, int, int]]:
    """``(module, config index, target)`` for every config of every module and each of its targets."""
    jobs = []
    for module in modules:
        for index, kernel in enumerate(importlib.import_module(module).aot_configs()):
            jobs.extend((module, index, target) for target in kernel.targets)
    return jobs


def compile_all(jobs: int = 2, modules: Sequence[str] = KERNEL_MODULES) -> List[AotResult]:
    """Compile every config of every module for each of its targets, on ``jobs`` spawned worker processes
    (compilation is CPU-bound and must not run under the interpreter). Results come in job order."""
    work = jobs_for(modules)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=context, initializer=_init_worker
    ) as pool:
        futures: List[concurrent.futures.Future] = []
        try:
            # A Ctrl-C while a worker is being spawned would leave it dying with an EOFError traceback.
            with interrupts_held_back():
                futures.extend(pool.submit(_compile_job, *job) for job in work)
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            done = sum(f.done() and not f.cancelled() for f in futures)
            raise Interrupted(f"{done} of {len(work)} compilations finished; report writes nothing") from None


# ---------------------------------------------------------------------------------------------- reporting


def format_table(results: Sequence[AotResult]) -> str:
    """One row per kernel x config x target."""
    header = ("kernel", "config", "target", "warps", "regs", "spill B", "shared B", "tensor cores", "status")
    rows = [header]
    for r in results:
        if r.error is not None:
            rows.append((r.name, r.config, f"sm_{r.target}", str(r.num_warps), "-", "-", "-", "-",
                         "FAIL: " + "; ".join(r.problems)))
            continue
        tensor_cores = ("yes" if r.tensor_cores else "no") + (" (expected)" if r.expect_tensor_cores else "")
        rows.append((
            r.name, r.config, f"sm_{r.target}", str(r.num_warps), str(r.registers), str(r.spill_bytes + r.stack_bytes),
            str(r.shared_bytes), tensor_cores, "OK" if r.ok else "FAIL: " + "; ".join(r.problems),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer report",
        description="Compile every shipped kernel config for sm_80 / sm_86 / sm_89 / sm_90 (no GPU needed) and "
                    "check spills, shared memory and tensor-core use.",
    )
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    parser.add_argument("--module", action="append", choices=KERNEL_MODULES,
                        help="only this kernel module (repeatable; default all)")
    args = parser.parse_args(argv)
    results = compile_all(jobs=args.jobs, modules=tuple(args.module or KERNEL_MODULES))
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results)} compilations, {len(failed)} failed "
          f"(limits: no spills; shared memory per target: "
          f"{', '.join(f'{limit} B on sm_{target}' for target, limit in SHARED_MEMORY_LIMIT.items())}; "
          f"mma/wgmma where expected)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
