"""Ahead-of-time check of every shipped kernel config: compile for sm_80, sm_86, sm_89 and sm_90 without a GPU
and report registers, spills, shared memory, occupancy and tensor-core use, and what the SASS does.

Each kernel module (``KERNEL_MODULES``: those of ``fused_transformer.kernels`` that define it) exposes ``aot_configs()
-> List[AotKernel]``: one entry per kernel variant and tile config its launcher can pick on a GPU. ``compile_all``
compiles each entry for each of its targets with ``triton.compile`` (PTX and cubin come from the ptxas inside the
triton wheel), reads registers and local memory from ``cuobjdump --dump-resource-usage`` and looks for ``mma`` /
``wgmma`` in the PTX. From the SASS (``cuobjdump -sass``) it reads the tensor-core instructions (``HMMA`` / ``HGMMA``,
shape and count), the global-to-shared copy kind (``UTMALDG``: TMA, ``LDGSTS``: cp.async, or plain ``LDG``) and the
main loop (``main_loop``: the innermost loop with the most MMA instructions), to count the other instructions the loop
issues per MMA. Occupancy (blocks and warps per SM) follows from registers, shared memory and ``SM_LIMITS``. These
figures are static: what the code issues, not how long it takes. A config fails when it spills, needs more shared
memory than one block may have, or (``expect_tensor_cores``) runs its matmul on the CUDA cores.

    python -m fused_transformer report                   # table; exit status 1 if any config fails
    python -m fused_transformer report --verdicts-only   # the same verdicts without the SASS figures, sooner
    python -m fused_transformer.tools.report             # the same as the first

Compilation runs in worker processes spawned with ``TRITON_INTERPRET=0`` in their environment: under the interpreter
(as in the test process, on a machine without a GPU) ``@triton.jit`` makes interpreter functions that cannot be
compiled.
Nothing here runs on import, and nothing needs a GPU.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
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
import threading
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from fused_transformer.kernels.aot import AotKernel, kernel_modules
from fused_transformer.kernels.targets import BY_CAPABILITY, CAPABILITIES
from fused_transformer.kernels.targets import TARGETS as KNOWN_TARGETS
from fused_transformer.interrupts import Interrupted, interrupts_held_back
from fused_transformer.tools import provenance
from fused_transformer.tools.sass import analyse_sass

# Modules whose ``aot_configs()`` are compiled: every kernel module that defines it.
KERNEL_MODULES = kernel_modules()

# The targets every config is compiled for (kernels/targets.py describes them), and the limits read here.
TARGETS = CAPABILITIES
SHARED_MEMORY_LIMIT = {t.capability: t.shared_memory for t in KNOWN_TARGETS}
SM_LIMITS = BY_CAPABILITY
WARP_SIZE = 32
REGISTERS_PER_SM = 65536  # also the most one block may hold, on every target here
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp, in units of 256
SUB_PARTITIONS_PER_SM = 4  # a warp's registers come from the register file of one of the SM's 4 schedulers
SHARED_MEMORY_ALLOCATION_UNIT = 128  # bytes
SHARED_MEMORY_RESERVED_PER_BLOCK = 1024  # bytes the CUDA runtime keeps in every block (sm_80 and later)

_RESOURCE_LINE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
# mma.sync (Ampere and later) or wgmma.mma_async (Hopper): the matmul runs on tensor cores.
_TENSOR_CORE_INSTRUCTION = re.compile(r"wgmma\.mma_async|\bmma\.sync")


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
    blocks_per_sm: int = 0
    warps_per_sm: int = 0
    # (SASS opcode, count in the whole kernel), widest shape first, e.g. (("HMMA.16816.F32.BF16", 128),)
    mma_counts: Tuple[Tuple[str, int], ...] = ()
    async_copy: str = ""  # "+"-joined ASYNC_COPY_KINDS in the SASS, else "LDG" (plain loads only) or "-"
    loop_instructions: int = 0  # SASS instructions in the main loop (0: no loop with MMAs)
    loop_mma_instructions: int = 0
    loop_macs_per_warp: int = 0  # multiply-accumulates one warp's share of the loop's MMAs compute
    serialized_mmas: int = 0  # HGMMAs that wait for the one before them in their own product (``serialized_mmas``)
    # The opcodes of ``AotKernel.expect_instructions`` that its SASS for this target lacks (sm_90's claims only).
    missing_instructions: Tuple[str, ...] = ()
    refused: bool = False  # a variant the plan refuses (``AotKernel.refused``): failing to build it is its verdict

    @property
    def non_mma_per_mma(self) -> Optional[float]:
        """Main-loop instructions that are not MMAs, per MMA instruction (an HGMMA counts as one)."""
        if not self.loop_mma_instructions:
            return None
        return (self.loop_instructions - self.loop_mma_instructions) / self.loop_mma_instructions

    @property
    def non_mma_per_kmac(self) -> Optional[float]:
        """Main-loop non-MMA instructions one warp issues per 1024 multiply-accumulates of its share of the MMAs:
        comparable across HMMA and HGMMA shapes (an HMMA.16816 is 2048 MACs per warp, an HGMMA.64xNx16 is
        64*N*16 per warpgroup, so 256*N per warp)."""
        if not self.loop_macs_per_warp:
            return None
        return (self.loop_instructions - self.loop_mma_instructions) * 1024 / self.loop_macs_per_warp

    @property
    def problems(self) -> List[str]:
        if self.refused:
            if self.error is not None or self.missing_instructions:
                return []
            return ["the plan refuses this variant, but this release builds it with what it claims: update the plan"]
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
        if self.serialized_mmas:
            found.append(f"wgmma serialized ({self.serialized_mmas} HGMMA wait for the one before)")
        if self.missing_instructions:
            found.append(f"its variant's instructions missing: {', '.join(self.missing_instructions)}")
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
    strides are multiples of 16 (``kernel.divisible_by_16``, default every pointer and integer argument; a tuple
    argument named there: its pointers)."""
    names = kernel.divisible_by_16
    if names is None:
        names = [name for name, ty in kernel.signature.items()
                 if isinstance(ty, tuple) or ty.startswith("*") or ty in ("i32", "i64")]
    attrs = {}
    for name in names:
        index, ty = kernel.fn.arg_names.index(name), kernel.signature[name]
        paths = [(index, i) for i, part in enumerate(ty) if part.startswith("*")] if isinstance(ty, tuple) else [
            (index,)]
        attrs.update({path: [["tt.divisibility", 16]] for path in paths})
    return attrs


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What the triton wheel's cuobjdump prints for ``cubin`` with ``flags``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), *flags, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cuobjdump_output: str) -> Dict[str, int]:
    """Registers, stack, static shared and local bytes per thread of a one-kernel cubin, from the output of
    ``cuobjdump --dump-resource-usage``."""
    match = _RESOURCE_LINE.search(cuobjdump_output)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{cuobjdump_output}")
    registers, stack, shared, local = map(int, match.groups())
    return {"registers": registers, "stack": stack, "shared": shared, "local": local}


def uses_tensor_cores(ptx: str) -> bool:
    return _TENSOR_CORE_INSTRUCTION.search(ptx) is not None


# ------------------------------------------------------------------------------------------------ occupancy


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(target: int, num_warps: int, registers: int, shared_bytes: int) -> Tuple[int, int]:
    """``(blocks, warps)`` resident per SM of sm_<target> for blocks of ``num_warps`` warps using ``registers``
    per thread and ``shared_bytes`` of shared memory, as NVIDIA's occupancy calculator counts them."""
    limits = BY_CAPABILITY[target]
    registers_per_warp = _round_up(max(registers, 1) * WARP_SIZE, REGISTER_ALLOCATION_UNIT)
    # The launch check assumes a block's warps are spread over all sub-partitions at once.
    if registers_per_warp * _round_up(num_warps, SUB_PARTITIONS_PER_SM) > REGISTERS_PER_SM:
        return 0, 0
    warps_by_registers = REGISTERS_PER_SM // SUB_PARTITIONS_PER_SM // registers_per_warp * SUB_PARTITIONS_PER_SM
    shared_per_block = _round_up(shared_bytes + SHARED_MEMORY_RESERVED_PER_BLOCK, SHARED_MEMORY_ALLOCATION_UNIT)
    blocks = min(warps_by_registers // num_warps, limits.max_warps_per_sm // num_warps, limits.max_blocks_per_sm,
                 limits.shared_memory_per_sm // shared_per_block)
    return blocks, blocks * num_warps


def needs_sass(kernel: AotKernel, target: int, figures: bool) -> bool:
    """Whether compiling ``kernel`` for ``sm_<target>`` reads its SASS: always for the figures, else only where a
    verdict needs it (``serialized_mmas``: the wgmma matmuls of sm_90). Disassembling takes about a third of the
    time of a compilation."""
    return figures or (target == 90 and (kernel.expect_tensor_cores or bool(kernel.expect_instructions)))


# Where a compilation may start from another target's: Triton lowers a kernel to the same TTGIR for sm_80, sm_86 and
# sm_89, and to the same PTX for sm_86 and sm_89, but for the target these name (``ttg.target = "cuda:86"``,
# ``.target sm_86``). So a config listed for sm_86 is compiled for it from its source, and sm_80 goes on from that
# TTGIR (LLVM IR, PTX and ptxas left: about three quarters of a compilation) and sm_89 from that PTX (ptxas only,
# about a seventh), retargeted: every figure as compiling from the source gives (tests/test_report.py compares, on
# every Triton release CI tests).
STARTS_FROM = {80: (86, "ttgir"), 89: (86, "ptx")}
_TARGETS_NAMED = {"ttgir": (r'(\bttg\.target"? = )"cuda:{}"', '"cuda:{}"'), "ptx": (r"^(\.target )sm_{}\b", "sm_{}")}


def _options(kernel: AotKernel) -> Dict[str, int]:
    return {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, "num_ctas": kernel.num_ctas}


def _compile(kernel: AotKernel, target: int, ttgir: Optional[str] = None):
    """``triton.compile`` of ``kernel`` for ``sm_<target>``, from its source or, given, from ``ttgir``."""
    import triton
    from triton.backends.compiler import GPUTarget

    gpu = GPUTarget("cuda", target, WARP_SIZE)
    if ttgir is not None:
        with tempfile.TemporaryDirectory() as folder:  # Triton reads an IR from a file named for its stage
            path = os.path.join(folder, f"{kernel.name}.ttgir")
            with open(path, "w") as f:
                f.write(ttgir)
            return triton.compile(path, target=gpu, options=_options(kernel))
    signature = dict(kernel.signature)
    for name in kernel.constexprs:
        signature.setdefault(name, "constexpr")
    source = triton.compiler.ASTSource(
        fn=kernel.fn, signature=signature, constexprs=kernel.constexprs, attrs=_divisibility_attrs(kernel)
    )
    return triton.compile(source, target=gpu, options=_options(kernel))


def retarget(ir: str, stage: str, source: int, target: int) -> str:
    """``ir``, Triton's ``stage`` ("ttgir" or "ptx") of a kernel for ``sm_<source>``, naming ``sm_<target>``."""
    pattern, name = _TARGETS_NAMED[stage]
    retargeted, count = re.subn(pattern.format(source), rf"\g<1>{name.format(target)}", ir, flags=re.MULTILINE)
    if count != 1:
        raise RuntimeError(f"expected {name.format(source)} named once in the {stage}, found {count} times")
    return retargeted


def _assemble(kernel: AotKernel, ptx: str, target: int) -> bytes:
    """ptxas on ``ptx`` for ``sm_<target>`` with the flags a compilation for that target passes (Triton's own
    ``make_cubin``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target, WARP_SIZE))
    return backend.make_cubin(ptx, {}, backend.parse_options(_options(kernel)), target)


def _identity(kernel: AotKernel, target: int, module: str) -> Dict[str, object]:
    """The ``AotResult`` fields that say which compilation it is, whatever it gave."""
    return dict(module=module, name=kernel.name, config=kernel.config, target=target, num_warps=kernel.num_warps,
                expect_tensor_cores=kernel.expect_tensor_cores, refused=bool(kernel.refused))


def _result(kernel: AotKernel, target: int, module: str, figures: bool, ptx: str, cubin: bytes,
            shared: int) -> AotResult:
    sass_flags = ("-sass",) if needs_sass(kernel, target, figures) else ()
    dump = cuobjdump(cubin, "--dump-resource-usage", *sass_flags)
    usage = resource_usage(dump)
    sass = analyse_sass(dump)
    # A variant's claims are sm_90's instructions (wgmma, TMA, setmaxnreg): the other targets run it without them.
    claimed = kernel.expect_instructions if target == 90 else ()
    missing = tuple(opcode for opcode in claimed if not re.search(rf"\b{opcode}\b", dump))
    # A block holds its static shared memory (1 KB on sm_90, none below) besides the dynamic part the launch asks for.
    blocks_per_sm, warps_per_sm = occupancy(target, kernel.num_warps, usage["registers"], shared + usage["shared"])
    return AotResult(
        **_identity(kernel, target, module), registers=usage["registers"], spill_bytes=usage["local"],
        stack_bytes=usage["stack"], shared_bytes=max(shared, usage["shared"]), tensor_cores=uses_tensor_cores(ptx),
        blocks_per_sm=blocks_per_sm, warps_per_sm=warps_per_sm, missing_instructions=missing,
        **dataclasses.asdict(sass),
    )


def _failed(kernel: AotKernel, target: int, module: str, e: Exception) -> AotResult:
    message = str(e).strip()
    return AotResult(**_identity(kernel, target, module),
                     error=f"{type(e).__name__}: {message.splitlines()[-1] if message else ''}")


def compile_kernel(kernel: AotKernel, target: int, module: str = "", figures: bool = True) -> AotResult:
    """Compile ``kernel`` for ``sm_<target>`` in this process (which must not be interpreting Triton); without
    ``figures``, only what its verdict needs (``needs_sass``): the SASS figures of the other kernels stay empty."""
    return compile_targets(kernel, (target,), module, figures, share_stages=False)[0]


def compile_targets(kernel: AotKernel, targets: Sequence[int], module: str = "", figures: bool = True,
                    share_stages: bool = True) -> List[AotResult]:
    """``compile_kernel`` for each of ``targets``; with ``share_stages``, a target that ``STARTS_FROM`` one listed
    before it goes on from that one's compilation (a failure reported per config, so one broken kernel does not
    hide the others)."""
    results: List[AotResult] = []
    compiled = {}
    for target in targets:
        try:
            source, stage = STARTS_FROM.get(target, (None, ""))
            start = share_stages and source in compiled
            if start and stage == "ptx":
                ptx = retarget(compiled[source].asm["ptx"], "ptx", source, target)
                cubin, shared = _assemble(kernel, ptx, target), int(compiled[source].metadata.shared)
            else:
                ttgir = retarget(compiled[source].asm["ttgir"], "ttgir", source, target) if start else None
                compiled[target] = _compile(kernel, target, ttgir)
                ptx, cubin = compiled[target].asm["ptx"], compiled[target].asm["cubin"]
                shared = int(compiled[target].metadata.shared)
            results.append(_result(kernel, target, module, figures, ptx, cubin, shared))
        except Exception as e:
            results.append(_failed(kernel, target, module, e))
    return results


@functools.lru_cache(maxsize=None)
def _configs(module: str) -> List[AotKernel]:
    return list(importlib.import_module(module).aot_configs())


def _compile_job(module: str, index: int, targets: Tuple[int, ...], figures: bool,
                 share_stages: bool) -> List[AotResult]:
    return compile_targets(_configs(module)[index], targets, module, figures, share_stages)


def _exit_when_orphaned(parent: int) -> None:
    """Poll (in a daemon thread) for the parent's end and exit then: a worker that was still starting when a Ctrl-C
    stopped the parent can otherwise wait forever on the parent's queues, holding its stdout and stderr open."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _init_worker() -> None:
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    # Ctrl-C on a terminal reaches the whole process group: the parent alone stops the run.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """The environment workers are spawned with. A spawned worker imports triton and this package (to unpickle its
    initializer) before any code of ours runs in it, so ``TRITON_INTERPRET=0`` has to be in the environment it
    starts with: switched off later, triton's own lazily imported modules (gluon) were already made for the
    interpreter and ``triton.compile`` fails inside them. Set in this process only while workers start."""
    # FP fusion on is Triton 3.9's default, stated so it stops warning in every worker.
    wanted = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def jobs_for(modules: Sequence[str]) -> List[Tuple[str, int, int]]:
    """``(module, config index, target)`` for every config of every module and each of its targets."""
    jobs = []
    for module in modules:
        for index, kernel in enumerate(importlib.import_module(module).aot_configs()):
            jobs.extend((module, index, target) for target in kernel.targets)
    return jobs


# The parts of a config's name that add code around the same tiles (``AotKernel.config``: "bf16/D64/BM128_BN64_w8_s2/
# varlen/scoremods/tma"), by how much code they add: the sample below keeps, per tile, the variant that adds the most.
VARIANT_PARTS = {"scoremods": 4, "varlen": 2, "causal": 1, "paged": 1}


def variant_weight(config: str) -> int:
    """How much code the variant parts of ``config`` add (``VARIANT_PARTS``)."""
    return sum(VARIANT_PARTS.get(part, 0) for part in config.split("/"))


def tile_of(config: str) -> str:
    """``config`` without its variant parts: the tile and the precision, head dim and copy kind it is compiled for."""
    return "/".join(part for part in config.split("/") if part not in VARIANT_PARTS)


def release_sample(work: Sequence[Tuple[str, int, int]]) -> List[Tuple[str, int, int]]:
    """The report's sample for the older Triton releases CI runs (``report --sample``): for every kernel, tile and
    target of ``work``, the variant that adds the most code to that tile (``variant_weight``; the first listed on a
    tie). A release's register allocation is what spills, and the variant with the most code around a tile holds the
    most registers, so the sample compiles every tile each target's plan can pick, once each."""
    chosen: Dict[Tuple[str, str, str, int], Tuple[int, Tuple[str, int, int]]] = {}
    for job in work:
        module, index, target = job
        kernel = _configs(module)[index]
        key = (module, kernel.name, tile_of(kernel.config), target)
        weight = variant_weight(kernel.config)
        if key not in chosen or weight > chosen[key][0]:
            chosen[key] = (weight, job)
    kept = {job for _, job in chosen.values()}
    return [job for job in work if job in kept]


def _units(work: Sequence[Tuple[str, int, int]], share_stages: bool) -> List[Tuple[str, int, Tuple[int, ...]]]:
    """``work`` as worker jobs ``(module, config index, targets)``: a target alone or, with ``share_stages``, the
    targets of one config that start from another it lists (``STARTS_FROM``) after that one."""
    listed = set(work)

    def first(job: Tuple[str, int, int]) -> Tuple[str, int, int]:
        module, index, target = job
        source = (module, index, STARTS_FROM.get(target, (None,))[0])
        return source if share_stages and source in listed else job

    units: Dict[Tuple[str, int, int], List[int]] = {}
    for job in work:
        unit = units.setdefault(first(job), [])
        if first(job) != job:
            unit.append(job[2])
    return [(module, index, (target, *after)) for (module, index, target), after in units.items()]


def compile_all(jobs: int = 2, modules: Sequence[str] = KERNEL_MODULES, figures: bool = True,
                share_stages: bool = True, work: Optional[Sequence[Tuple[str, int, int]]] = None) -> List[AotResult]:
    """Compile every config of every module for each of its targets (or only the ``work`` given, ``jobs_for``'s
    entries), on ``jobs`` spawned worker processes (compilation is CPU-bound and must not run under the interpreter),
    with the SASS figures or, without ``figures``, what the verdicts need only (``compile_kernel``); ``share_stages``:
    sm_80 and sm_89 go on from sm_86's compilation (``STARTS_FROM``). Results come in the order of the work."""
    work = jobs_for(modules) if work is None else list(work)
    units = _units(work, share_stages)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=context, initializer=_init_worker
    ) as pool:
        futures: List[concurrent.futures.Future] = []
        try:
            # A Ctrl-C while a worker is being spawned would leave it dying with an EOFError traceback. Workers are
            # spawned by submit(), so all of them start inside _worker_environment.
            with interrupts_held_back(), _worker_environment():
                futures.extend(pool.submit(_compile_job, *unit, figures, share_stages) for unit in units)
            by_job = {(module, index, target): result for (module, index, targets), future in zip(units, futures)
                      for target, result in zip(targets, future.result())}
            return [by_job[job] for job in work]
        except KeyboardInterrupt:
            # Cancelled here, not by shutdown(cancel_futures=True): that leaves the cancelling to the pool's manager
            # thread, which, interrupted while its workers were still starting, went on feeding them every job
            # (Python 3.11: a Ctrl-C in the first second took 75 s and ~100 compilations to exit).
            for future in futures:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            done = sum(len(targets) for (_, _, targets), f in zip(units, futures) if f.done() and not f.cancelled())
            raise Interrupted(f"{done} of {len(work)} compilations finished; report writes nothing") from None


# ---------------------------------------------------------------------------------------------- reporting


def format_mma(counts: Sequence[Tuple[str, int]]) -> str:
    """``"HGMMA.64x64x16.F32.BF16 x8"``: each MMA opcode with its count, or "none"."""
    return ", ".join(f"{opcode} x{count}" for opcode, count in counts) or "none"


def _format_ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


TABLE_HEADER = ("kernel", "config", "target", "warps", "regs", "spill B", "shared B", "blocks/SM", "warps/SM",
                "MMA (SASS, whole kernel)", "copy", "loop instr/MMA", "non-MMA/MMA", "non-MMA/kMAC", "status")


def _row(r: AotResult) -> Tuple[str, ...]:
    if r.error is not None:
        return (r.name, r.config, f"sm_{r.target}", str(r.num_warps)) + ("-",) * (len(TABLE_HEADER) - 5) + (
            "FAIL: " + "; ".join(r.problems),)
    loop = f"{r.loop_instructions}/{r.loop_mma_instructions}" if r.loop_mma_instructions else "-"
    return (
        r.name, r.config, f"sm_{r.target}", str(r.num_warps), str(r.registers), str(r.spill_bytes + r.stack_bytes),
        str(r.shared_bytes), str(r.blocks_per_sm), str(r.warps_per_sm), format_mma(r.mma_counts), r.async_copy or "-",
        loop, _format_ratio(r.non_mma_per_mma), _format_ratio(r.non_mma_per_kmac),
        "OK" if r.ok else "FAIL: " + "; ".join(r.problems),
    )


def format_table(results: Sequence[AotResult]) -> str:
    """One row per kernel x config x target. The loop columns describe the main loop (``main_loop``): its SASS
    instructions / MMA instructions, non-MMA instructions per MMA instruction, and non-MMA instructions per 1024
    multiply-accumulates of a warp's share of the MMAs (``AotResult.non_mma_per_kmac``)."""
    rows = [TABLE_HEADER] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_rows() -> Dict[str, "re.Pattern[str]"]:
    """The rows docs/report.md shows of each module (the full table is the command's output): the configs its
    ``MARKDOWN_ROWS`` pattern names (every config of a module without one)."""
    return {name: getattr(importlib.import_module(name), "MARKDOWN_ROWS", re.compile("")) for name in KERNEL_MODULES}


def format_markdown(results: Sequence[AotResult], command: Sequence[str]) -> str:
    """docs/report.md: where the figures come from, the count of compilations and failures per module, the
    ``MARKDOWN_ROWS`` of each module as markdown tables, the decode launches' occupancy and the attention tile plan
    with each row's provenance."""
    lines = provenance.header("AOT resource report", command)
    lines += ["| module | compilations | failed |", "| --- | --- | --- |"]
    for module in dict.fromkeys(r.module for r in results):
        mine = [r for r in results if r.module == module]
        lines.append(f"| {module} | {len(mine)} | {sum(not r.ok for r in mine)} |")
    lines += ["", f"{len(results)} compilations, {sum(not r.ok for r in results)} failed. The columns are explained in "
              "[report-guide.md](report-guide.md); `python -m fused_transformer report` prints every row.", ""]
    for module, pattern in markdown_rows().items():
        rows = [_row(r) for r in results if r.module == module and pattern.search(r.config)]
        if rows:
            lines += [f"## {module.rsplit('.', 1)[-1]}", "", "| " + " | ".join(TABLE_HEADER) + " |",
                      "|" + " --- |" * len(TABLE_HEADER)]
            lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
            lines.append("")
    lines += ["## decode launches", "", "Programs per SM of a one-token decoding step: the general forward's grid (a "
              "program per query head) -> the split-KV decode kernel's (a program per KV head and key split).", "",
              *decode_occupancy_lines(), ""]
    lines += ["## The attention tile plan", "", "`TILE_ROWS` of kernels/attention/configs.py in order (a launch takes "
              "the first row that serves it), each with what was measured about it.", "", *tile_plan_markdown(), ""]
    lines += ["## Kernel variants", "", "Each op's variants (configs named `...+<variant>` above), the refused ones "
              "with why, and which GPUs' measured rows (`bench --suite variants`) pick among them:", "",
              *(f"- {line.strip()}" for line in variant_status_lines()), ""]
    return "\n".join(lines)


def variant_status_lines() -> List[str]:
    """``kernels.variants.status()`` with every op's plan imported (each registers its variants)."""
    import fused_transformer.kernels.attention.decode  # noqa: F401
    from fused_transformer.kernels import variants

    kernel_modules()

    return variants.status()


TILE_PLAN_HEADER = ("kernel", "precision", "head dims", "tile", "targets", "loads", "scores only", "layouts",
                    "score_mods", "tritons", "provenance")


def tile_plan_markdown() -> List[str]:
    """A markdown table of the attention plan's rows (``configs.TILE_ROWS``), provenance included."""
    from fused_transformer.kernels.attention import configs

    def listed(values) -> str:
        return ", ".join(str(value) for value in values) or "-"

    lines = ["| " + " | ".join(TILE_PLAN_HEADER) + " |", "|" + " --- |" * len(TILE_PLAN_HEADER)]
    for row in configs.TILE_ROWS:
        cells = (row.kernel, row.precision, listed(row.head_dims), str(row.tile),
                 listed(f"sm_{target}" for target in row.targets), row.loads, "yes" if row.scores_only else "no",
                 listed(row.layouts), "yes" if row.score_mods else "no", str(row.tritons), row.provenance or "-")
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return lines


# The decode launches whose programs per SM the report shows: (batch, kv heads, keys), each with 8 and 32 query heads.
DECODE_LAUNCHES = ((1, 8, 8192), (32, 8, 2048))


def decode_occupancy_lines() -> List[str]:
    """A markdown table: for each ``DECODE_LAUNCHES`` step (one query per sequence) and target, the programs per SM
    of the general forward's grid (one program per query head: ``B * H``) and of the split-KV decode launch."""
    from fused_transformer.kernels.attention import decode

    header = ["launch", "H"] + [f"sm_{t} ({decode.TYPICAL_SM_COUNT[t]} SMs)" for t in CAPABILITIES]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for batch, kv_heads, keys in DECODE_LAUNCHES:
        for heads in (8, 32):
            cells = []
            for target in CAPABILITIES:
                before = batch * heads / decode.TYPICAL_SM_COUNT[target]
                after = decode.programs_per_sm(batch, kv_heads, keys, 1, heads, target)
                cells.append(f"{before:.2f} -> {after:.2f}")
            lines.append(f"| B{batch} Hkv{kv_heads} Lk {keys} | {heads} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fused_transformer report",
        description="Compile every shipped kernel config for sm_80 / sm_86 / sm_89 / sm_90 (no GPU needed), check "
                    "spills, shared memory and tensor-core use, and print occupancy and SASS figures (MMA shapes, "
                    "copy kind, main-loop instructions per MMA).",
    )
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default %(default)s)")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the summary and a selection of rows as markdown, with where they come from "
                             "(docs/report.md is written so)")
    parser.add_argument("--module", action="append", choices=KERNEL_MODULES,
                        help="only this kernel module (repeatable; default all)")
    parser.add_argument("--verdicts-only", action="store_true",
                        help="the same verdicts, about a quarter sooner: no SASS figures (MMA, copy, loop columns), "
                             "the SASS read only where a verdict needs it (sm_90's wgmma); what CI's older Triton "
                             "releases run")
    parser.add_argument("--sample", action="store_true",
                        help="every tile each target's plan can pick, once: per kernel, tile and target, only the "
                             "variant (causal, varlen, paged, scoremods) that adds the most code; what CI's older "
                             "Triton releases run")
    args = parser.parse_args(argv)
    if args.markdown is not None and (args.module or args.verdicts_only or args.sample):
        parser.error("--markdown writes the report of every module, every config with its figures: leave "
                     "--module, --verdicts-only and --sample out")
    modules = tuple(args.module or KERNEL_MODULES)
    every = jobs_for(modules)
    work = release_sample(every) if args.sample else every
    results = compile_all(jobs=args.jobs, modules=modules, figures=not args.verdicts_only, work=work)
    print(format_table(results))
    print("\nDecode launches, programs per SM (general forward -> split-KV decode):")
    print("\n".join(decode_occupancy_lines()))
    print("\nKernel variants (bench --suite variants measures them on a GPU):")
    print("\n".join(variant_status_lines()))
    if args.markdown is not None:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(results, ["report", *(argv if argv is not None else sys.argv[1:])]))
    failed = [r for r in results if not r.ok]
    sampled = f" (the release sample of {len(every)})" if args.sample else ""
    print(f"\n{len(results)} compilations{sampled}, {len(failed)} failed "
          f"(limits: no spills; shared memory per target: "
          f"{', '.join(f'{limit} B on sm_{target}' for target, limit in SHARED_MEMORY_LIMIT.items())}; "
          f"mma/wgmma where expected; no serialized wgmma)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
