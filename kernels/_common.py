"""Small helpers shared by the kernel modules: Python utilities, TMA descriptors, the dropout keep-mask jit helper
and its replay, and a deterministic row reduction. What each GPU has is kernels/targets.py's."""
from __future__ import annotations

import inspect
import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._env import triton_interpreting
from ..contract import Seed, draw_dropout_seed, traced  # noqa: F401 (draw_dropout_seed re-exported for the tests)

# Whether the kernels run under the Triton interpreter: fixed when triton is imported (its knob is read then).
INTERPRETING = triton_interpreting()


def interpreting() -> bool:
    """``INTERPRETING`` (a function, so that tests can stand in a GPU's answer)."""
    return INTERPRETING


# Triton's own cdiv and next_power_of_2 are constexpr functions since 3.9, a microsecond or two a host call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# TMA's addressing rules: base and every stride but the last (which is 1) in multiples of 16 bytes.
TMA_ALIGNMENT = 16


def tma_addressable(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``x`` (non-empty, last dim contiguous, base and other strides 16-byte
    aligned). The strides of size-1 dims are never used: ``tma_descriptor`` replaces them."""
    size = x.element_size()
    return (x.numel() > 0 and x.stride(-1) == 1 and x.data_ptr() % TMA_ALIGNMENT == 0
            and all(stride * size % TMA_ALIGNMENT == 0 for n, stride in zip(x.shape[:-1], x.stride()[:-1]) if n > 1))


def tma_descriptor(x: torch.Tensor, block_shape: List[int]) -> TensorDescriptor:
    """A host-side TMA descriptor over ``x`` (``tma_addressable``) loading ``block_shape`` blocks; out-of-bounds
    elements of a block read as zeros."""
    aligned = TMA_ALIGNMENT // x.element_size()
    strides = [stride if n > 1 else aligned for n, stride in zip(x.shape[:-1], x.stride()[:-1])] + [1]
    return TensorDescriptor(x, list(x.shape), strides, list(block_shape))


# ------------------------------------------------------------------------------------------- launches
# ``JITFunction.run`` binds and specializes every argument, builds a cache key as a string and checks the kernel's
# globals at every launch: on an H200's host, half of an attention forward's host time. ``launch_kernel`` keeps the
# compiled kernel that run returned under a key of its own, and calls its launcher directly the next time.
# Its key is finer than Triton's or equal to it (``launch_key``, checked against Triton's specialization by the
# tests), so a reused kernel is one Triton would have picked. Under the interpreter every launch goes through run.
# The launcher is Triton's private API: its layout is checked at a compiled kernel's first use
# (``direct_launch_mismatch``), and a kernel whose compiled kernel does not fit launches through run for good.


def _runtime_key(arg: object) -> object:
    """What Triton specializes a non-constexpr argument on, or finer: an int on == 1, divisibility by 16 and its
    type (i32, i64, u64); a tensor on its dtype and 16-byte alignment; a descriptor on its dtype and block shape; a
    tuple on each of its elements."""
    kind = type(arg)
    if kind is int:
        return arg if arg == 1 else (arg & 15 == 0, -0x80000000 <= arg <= 0x7FFFFFFF, arg < 0x8000000000000000)
    if arg is None or kind is float or kind is bool:
        return kind
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if kind is TensorDescriptor:
        return TensorDescriptor, arg.base.dtype, tuple(arg.block_shape)
    if kind is tuple:  # Triton specializes a tuple's elements one by one
        return tuple, *map(_runtime_key, arg)
    raise TypeError(f"no launch key for a {kind.__name__}")


# Per kernel: how many leading parameters are not constexprs (None when a constexpr is followed by another kind). The
# caches here key kernels by id: hashing a JITFunction takes a lock (its cache_key), a microsecond a launch. Each
# kernel's entry here holds it, so its id is never reused while any cache keys by it.
_RUNTIME_PARAMS: Dict[int, Tuple[object, Optional[int]]] = {}
# Kernels whose compiled kernel did not fit the direct call (``direct_launch_mismatch``), by id as above: (kernel, why).
_REFUSED: Dict[int, Tuple[object, str]] = {}
# Compiled kernels by launch_key; emptied when it grows past _MAX_COMPILED (a key per shape class, not per call).
_COMPILED: Dict[tuple, object] = {}
_MAX_COMPILED = 4096
# runtime_keys' numbers: a key per class of shapes and strides a launcher keeps, never forgotten (a number must not
# stand for two keys while _COMPILED holds one of them).
_KEY_NUMBERS: Dict[tuple, int] = {}


def _runtime_params(kernel: object) -> Optional[int]:
    entry = _RUNTIME_PARAMS.get(id(kernel))
    if entry is not None and entry[0] is kernel:
        return entry[1]
    found = None  # not a JITFunction (a test's wrapper that records launches): through its run
    if hasattr(kernel, "params"):
        flags = [param.is_constexpr for param in kernel.params]
        runtime = flags.index(True) if True in flags else len(flags)
        found = runtime if all(flags[runtime:]) else None
        if getattr(kernel, "pre_run_hooks", None):  # hooks run from JITFunction.run only
            found = None
    if _REFUSED.get(id(kernel), (None,))[0] is kernel:
        found = None
    _RUNTIME_PARAMS[id(kernel)] = (kernel, found)
    return found


def runtime_keys(args: tuple) -> Optional[int]:
    """A number standing for the launch-key part of ``args``, arguments that are not constexprs (``_runtime_key`` of
    each; the same number for the same part), None where an argument has none: a launcher that passes the same
    arguments again and again keeps it, and gives it to ``launch_kernel`` in ``cached_key`` (a number, which a
    dictionary hashes at once)."""
    try:
        key = tuple(map(_runtime_key, args))
    except TypeError:
        return None
    return _KEY_NUMBERS.setdefault(key, len(_KEY_NUMBERS))


def launch_key(kernel: object, args: tuple, options: tuple,
               cached_key: Optional[Tuple[int, int, int]] = None) -> Optional[tuple]:
    """The key ``launch_kernel`` reuses a compiled kernel under, None where it cannot (the arguments are not all of the
    kernel's parameters, its constexprs are not its last, or an argument is of a kind it does not know). ``cached_key``:
    ``(start, stop, number)``, ``args[start:stop]``'s part of the key as ``runtime_keys`` numbered it for the caller,
    who made it before and kept it: those arguments are not looked at again."""
    runtime = _runtime_params(kernel)
    if runtime is None or len(args) != len(kernel.params):
        return None
    try:
        if cached_key is None:
            return (id(kernel), options, *args[runtime:], *map(_runtime_key, args[:runtime]))
        start, stop, key = cached_key
        return (id(kernel), options, *args[runtime:], *map(_runtime_key, args[:start]), (start, stop, key),
                *map(_runtime_key, args[stop:runtime]))
    except TypeError:
        return None


def current_device() -> int:
    """The device Triton launches on (JITFunction.run's)."""
    return triton.runtime.driver.active.get_current_device()


def current_stream(device: int) -> int:
    """Triton's current stream on ``device``."""
    return triton.runtime.driver.active.get_current_stream(device)


# Whether launch_kernel may call a compiled kernel's launcher directly: FUSED_TRANSFORMER_DIRECT_LAUNCH=0 sends every
# launch through Triton's public JITFunction.run (read once, here; ``set_direct_launch`` for tests).
_DIRECT_LAUNCH = os.environ.get("FUSED_TRANSFORMER_DIRECT_LAUNCH", "1") != "0"

# What the direct call reads of a compiled kernel (``launch_metadata`` only under a launch-enter hook, a profiler's).
_COMPILED_FIELDS = ("run", "function", "packed_metadata")
_HOOK_FIELDS = ("launch_enter_hook", "launch_exit_hook")  # of triton.knobs.runtime
# The direct call passes, by position, what JITFunction.run passes its compiled kernel's launcher (``compiled.run``,
# backends/nvidia/driver.py's CudaLauncher, AMD's HIPLauncher alike): the grid, the stream, the function, the packed
# metadata, the launch metadata, the two hooks, then the kernel's arguments. Per release, the launcher's parameters
# (``inspect.signature``) that this layout was checked against; up to 3.6 the launcher took the metadata and the hooks
# in its ``*args`` and its C code parsed them in the same order. A release not listed must have the newest's.
_HOOKED_LAUNCHER = ("(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook, "
                    "launch_exit_hook, *args)")
LAUNCHER_SIGNATURES: Dict[Tuple[int, int], str] = {
    (3, 6): "(gridX, gridY, gridZ, stream, function, *args)",
    (3, 7): _HOOKED_LAUNCHER,
    (3, 8): _HOOKED_LAUNCHER,
    (3, 9): _HOOKED_LAUNCHER,
}


def set_direct_launch(enabled: bool) -> bool:
    """Let ``launch_kernel`` call compiled kernels' launchers directly (the default) or send every launch through
    Triton's public ``JITFunction.run`` (as ``FUSED_TRANSFORMER_DIRECT_LAUNCH=0`` at import does); returns the
    setting it replaces."""
    global _DIRECT_LAUNCH
    previous, _DIRECT_LAUNCH = _DIRECT_LAUNCH, bool(enabled)
    return previous


def direct_launch_refusals() -> Dict[str, str]:
    """The kernels that launch through ``JITFunction.run`` for good because their compiled kernel did not fit the direct
    call (``direct_launch_mismatch``): kernel name -> why."""
    return {_kernel_name(kernel): why for kernel, why in _REFUSED.values()}


def _kernel_name(kernel: object) -> str:
    return getattr(kernel, "__name__", None) or type(kernel).__name__


def _release(version: str) -> Optional[Tuple[int, int]]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def _bare_signature(fn: object) -> str:
    """``fn``'s parameters as ``inspect.signature`` writes them, without annotations (not part of a call's layout)."""
    signature = inspect.signature(fn)
    parameters = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=signature.empty))


def direct_launch_mismatch(compiled: object, version: Optional[str] = None) -> Optional[str]:
    """Why ``launch_kernel``'s direct call would not fit ``compiled`` (a compiled kernel that ``JITFunction.run``
    returned) under Triton ``version`` (the installed one by default), None where it fits: a field it reads is
    missing, or its launcher's parameters are not ``LAUNCHER_SIGNATURES``'s for the release. A launcher that takes
    every argument through ``*args`` (a tool's wrapper, which hands them on as they come) fits too."""
    missing = [name for name in _COMPILED_FIELDS if getattr(compiled, name, None) is None]
    missing += [f"triton.knobs.runtime.{name}" for name in _HOOK_FIELDS if not hasattr(triton.knobs.runtime, name)]
    if missing:
        return f"the compiled kernel has no {', '.join(missing)}"
    try:
        found = _bare_signature(compiled.run)
    except (TypeError, ValueError) as exc:
        return f"its launcher's parameters cannot be read ({exc})"
    version = triton.__version__ if version is None else version
    release = _release(version)
    listed = release if release in LAUNCHER_SIGNATURES else max(LAUNCHER_SIGNATURES)
    expected = LAUNCHER_SIGNATURES[listed]
    variadic = re.fullmatch(r"\(\*\w+(, \*\*\w+)?\)", found) is not None
    if found != expected and not variadic:
        return (f"its launcher takes {found}, not {expected} (Triton {listed[0]}.{listed[1]}'s launcher; Triton "
                f"{version} is installed)")
    return None


def _refuse(kernel: object, why: str) -> None:
    """Send ``kernel``'s launches through ``JITFunction.run`` for good (its launch key None), and say why once."""
    _REFUSED[id(kernel)] = (kernel, why)
    _RUNTIME_PARAMS[id(kernel)] = (kernel, None)
    warnings.warn(f"fused_transformer: {_kernel_name(kernel)} launches through Triton's JITFunction.run from now on: "
                  f"{why}", RuntimeWarning, stacklevel=3)


def launch_kernel(kernel: object, grid: Tuple[int, ...], args: tuple, num_warps: int,
                  num_stages: Optional[int] = None, num_ctas: int = 1,
                  cached_key: Optional[Tuple[int, int, int]] = None, **constexprs: object) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=..., num_ctas=...)``: through
    ``JITFunction.run`` the first time a ``launch_key`` is seen, to its compiled kernel directly after that, where the
    compiled kernel fits the direct call (``direct_launch_mismatch``; else through run for good) and the direct launch
    is on (``set_direct_launch``). ``args`` are the kernel's parameters by position; the constexprs, its last
    parameters, may end them or come by name. ``cached_key``: part of the launch key, made before (``launch_key``)."""
    if interpreting() or not _DIRECT_LAUNCH:
        kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps, num_stages=num_stages, num_ctas=num_ctas,
                   **constexprs)
        return
    if constexprs:
        args = (*args, *positional_constexprs(kernel, constexprs))
    options = {"num_warps": num_warps, "num_ctas": num_ctas}
    if num_stages is not None:
        options["num_stages"] = num_stages
    device = current_device()
    key = launch_key(kernel, args, (device, num_warps, num_stages, num_ctas), cached_key)
    try:
        compiled = _COMPILED.get(key) if key is not None else None
    except TypeError:  # a constexpr value that cannot be hashed
        key = compiled = None
    if compiled is None:
        compiled = kernel.run(*args, grid=grid, warmup=False, **options)
        if hasattr(compiled, "result"):  # a compilation that was asynchronous
            compiled = compiled.result()
        if key is not None:
            mismatch = direct_launch_mismatch(compiled)
            if mismatch is not None:
                _refuse(kernel, mismatch)
                return
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.clear()
            _COMPILED[key] = compiled
        return
    stream = current_stream(device)
    hooks = triton.knobs.runtime
    enter_hook = hooks.launch_enter_hook
    # The metadata only an enter hook reads (a profiler's): None, as launch_metadata gives, where no hook is set
    # (None up to Triton 3.6, an empty HookChain since 3.7, whose launch_metadata builds it anyway).
    metadata = None
    if enter_hook is not None and bool(getattr(enter_hook, "calls", True)):
        if not callable(getattr(compiled, "launch_metadata", None)):  # read only here: checked at its first use
            _refuse(kernel, "the compiled kernel has no launch_metadata, which a launch-enter hook reads")
            kernel.run(*args, grid=grid, warmup=False, **options)
            return
        metadata = compiled.launch_metadata(grid, stream, *args)
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, metadata, enter_hook,
                 hooks.launch_exit_hook, *args)


def contiguous_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Kernels take strides; only the last dim must be contiguous (copy only when it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def contiguous_last_dims(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``contiguous_last_dim`` of each of ``tensors``, in one call where none needs a copy (the common case)."""
    for x in tensors:
        if x.stride(-1) != 1:
            return tuple(map(contiguous_last_dim, tensors))
    return tensors


# ------------------------------------------------------------------------------------- dropout keep-mask
# Convention: element (row, col) of a [rows, cols] tensor is kept when tl.rand(seed, row * cols + col) >= p.
# Kernels regenerate the mask from the seed in backward instead of storing it. The seed (contract.draw_dropout_seed)
# is *SEED + host_seed (seed_args): an eager call on a GPU draws it on the host and passes it by value (no launch),
# a traced call or a CUDA graph's capture draws a one-element int64 tensor the kernels read themselves, so a replay
# or a compiled graph draws a new one each time and the host never syncs on it (SEED is None without dropout).


# A fixed Philox key: the seed goes into a counter word instead. With a run-time key (the seed loaded from
# memory), the key schedule of every round took registers, and tight configs spilled.
PHILOX_KEY = tl.constexpr(0x2545F4914F6CDD1D)
# Seven rounds of Philox4x32, not Triton's default ten: the fewest that passed TestU01's BigCrush in the Random123
# paper (Salmon et al., SC 2011, which keeps three more as a safety margin), and the rounds FlashAttention's dropout
# runs (torch's flash SDPA backend). A draw is integer work per element: in the attention forward's main loop
# (bfloat16, head dim 64, sm_90) ten rounds took 2050 of its 2367 SASS instructions, seven take 1458 of 1775.
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def dropout_seed(SEED, host_seed):
    """The op's seed (below 2**31) as a uint32: ``*SEED + host_seed`` (``seed_args``), one int64 drawn on the device
    or one drawn on the host and passed by value, the other 0. A kernel reads it once, where it starts."""
    return tl.load(SEED).to(tl.uint32) + host_seed.to(tl.uint32)


@triton.jit
def dropout_keep(seed, offsets, dropout_p):
    """True where the element at ``offsets`` (int64 block) survives dropout of probability ``dropout_p``.

    Philox is a bijection of its 128-bit counter (offset low, offset high, ``seed``, 0) under the fixed key, so every
    (seed, offset) pair draws its own number.
    """
    offset_lo = offsets.to(tl.uint32)
    zero = offset_lo * 0
    bits, _, _, _ = tl.philox(PHILOX_KEY, offset_lo, (offsets >> 32).to(tl.uint32), zero + seed, zero,
                               PHILOX_ROUNDS)
    return tl.uint_to_uniform_float(bits) >= dropout_p


# The feed-forward's activation kernel, memory-bound, uses all four numbers of a Philox call: element
# (row, col) of a [rows, N] view takes lane col % 4 of the call whose counter is (group, seed, 1) with group
# row * cdiv(N, 4) + col // 4 (the last word keeps this stream apart from dropout_keep's). A ten-round call per
# element capped those kernels near 1.4 TB/s on an H200 (one call per element of bfloat16 rows that
# move 8 bytes each); a call per four elements puts the cap above the memory's rate. LayerNorm and attention keep
# dropout_keep, a call per element: under Triton 3.7.1 the LayerNorm backward of 512 columns (sm_80) put 8 B on the
# stack with four numbers a call (spread with join + reshape, spread with tl.where, or picked per element alike), and
# in attention's tiles the four either moved between register layouts (36 configs spilled 8-128 B or serialized
# sm_90's wgmma) or stayed live to be picked per score (13 configs spilled 8-24 B).
@triton.jit
def _philox_quads(seed, groups):
    group_lo = groups.to(tl.uint32)
    zero = group_lo * 0
    return tl.philox(PHILOX_KEY, group_lo, (groups >> 32).to(tl.uint32), zero + seed, zero + 1, PHILOX_ROUNDS)


@triton.jit
def dropout_keep_quads(seed, first_group, dropout_p, BLOCK: tl.constexpr):
    """Keep flags of ``BLOCK`` consecutive columns of a row that start a group (a column that is a multiple of 4,
    whose group is ``first_group``): a Philox call per four columns."""
    a, b, c, d = _philox_quads(seed, first_group + tl.arange(0, BLOCK // 4))
    bits = tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [BLOCK])  # a0 b0 c0 d0 a1 ...
    return tl.uint_to_uniform_float(bits) >= dropout_p


@triton.jit
def dropout_keep_quad_lanes(seed, groups, lanes, dropout_p):
    """Keep flags of elements of any layout, each given by its group and lane: a Philox call per element."""
    a, b, c, d = _philox_quads(seed, groups)
    bits = tl.where(lanes == 0, a, tl.where(lanes == 1, b, tl.where(lanes == 2, c, d)))
    return tl.uint_to_uniform_float(bits) >= dropout_p


@triton.jit(do_not_specialize=["host_seed"])
def _dropout_keep_mask_kernel(
    KEEP,  # [rows, cols] bool, contiguous
    SEED,  # [1] int64
    host_seed,
    n_elements, n_cols, dropout_p,
    BLOCK: tl.constexpr, QUADS: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    seed = dropout_seed(SEED, host_seed)
    if QUADS:
        rows = offsets // n_cols
        cols = offsets - rows * n_cols
        keep = dropout_keep_quad_lanes(seed, rows * ((n_cols + 3) // 4) + cols // 4, cols % 4, dropout_p)
    else:
        keep = dropout_keep(seed, offsets, dropout_p)
    tl.store(KEEP + offsets, keep, mask=offsets < n_elements)


# Per device, the zero SEED points at when the seed is a host draw: made by the first such call, which waits for it
# once (a kernel on another stream may be the next to read it).
_ZERO_SEEDS: Dict[torch.device, torch.Tensor] = {}


def seed_args(seed: Optional[Seed], device: torch.device) -> Tuple[Optional[torch.Tensor], int]:
    """The kernels' ``(SEED, host_seed)`` for an op's seed (``contract.Seed``): a tensor drawn on the device is read
    there, host_seed 0; a host draw goes by value, SEED at a zero on the device. One compiled kernel serves both
    (``host_seed`` is never specialised: ``do_not_specialize``); None without dropout."""
    if seed is None:
        return None, 0
    if isinstance(seed, int):
        zero = _ZERO_SEEDS.get(device)
        if zero is None:
            zero = torch.zeros(1, dtype=torch.int64, device=device)
            if zero.is_cuda:
                torch.cuda.current_stream(zero.device).synchronize()
            _ZERO_SEEDS[device] = zero
        return zero, seed
    return seed, 0


def dropout_keep_mask(seed: Seed, n_rows: int, n_cols: int, dropout_p: float, device: torch.device,
                      quads: bool = False) -> torch.Tensor:
    """The bool ``[n_rows, n_cols]`` keep-mask (True = kept) that a kernel drew with the seed ``seed``
    (``quads``: four lanes a Philox call, the feed-forward's stream; else ``dropout_keep``'s), for
    replaying its dropout in ``fused_transformer.reference`` (``keep_mask=``)."""
    keep = torch.empty((n_rows, n_cols), dtype=torch.bool, device=device)
    if keep.numel() == 0:
        return keep
    block = 1024
    seed_pointer, seed_value = seed_args(seed if isinstance(seed, int) else seed.to(device), device)
    launch_kernel(_dropout_keep_mask_kernel, (cdiv(keep.numel(), block),), (keep, seed_pointer, seed_value,
                  keep.numel(), n_cols, dropout_p), 4, BLOCK=block, QUADS=quads)
    return keep


# ------------------------------------------------------------------------------- deterministic row sum


@triton.jit
def _sum_rows_kernel(
    X,  # [n_rows, n_cols], last dim contiguous
    OUT,  # [cdiv(n_rows, rows_per_program), n_cols]: one partial sum per row chunk
    n_rows, n_cols, stride_x_row, stride_out_row, rows_per_program,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    chunk = tl.program_id(1).to(tl.int64)
    row_start = chunk * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for first_row in range(row_start, row_end, BLOCK_ROWS):
        rows = first_row + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < row_end) & (cols[None, :] < n_cols)
        acc += tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(OUT + chunk * stride_out_row + cols, total.to(OUT.dtype.element_ty), mask=cols < n_cols)


SUM_ROWS_BLOCK_ROWS = 32
SUM_ROWS_BLOCK_COLS = 64
# Rows one program sums in the first pass; the partial sums are then summed by a second pass.
_SUM_ROWS_CHUNK = 1024


def sum_rows(x: torch.Tensor, out_dtype: torch.dtype, parts: int = 1) -> torch.Tensor:
    """``x.sum(0)`` for a 2-D ``x`` (last dim contiguous), accumulated in float32 in a fixed order (no atomics),
    returned in ``out_dtype``; with ``parts`` > 1 shaped ``[parts, n_cols // parts]`` (the sums of side-by-side
    blocks of columns, one row each: ``unbind`` gives them as views, without a view op per block)."""
    n_rows, n_cols = x.shape
    # Sizes as ints, not a tuple, which new_empty parses more slowly.
    out = x.new_empty(n_cols, dtype=out_dtype) if parts == 1 else x.new_empty(parts, n_cols // parts, dtype=out_dtype)
    if n_cols == 0:  # no column block to launch (a grid of 0 programs is an error on a GPU)
        return out
    if n_rows > _SUM_ROWS_CHUNK:
        chunks = cdiv(n_rows, _SUM_ROWS_CHUNK)
        partial = x.new_empty(chunks, n_cols, dtype=torch.float32)
        _launch_sum_rows(x, partial, chunks, _SUM_ROWS_CHUNK)
        x, n_rows = partial, chunks
    _launch_sum_rows(x, out, 1, max(n_rows, 1))
    return out


def _launch_sum_rows(x: torch.Tensor, out: torch.Tensor, chunks: int, rows_per_program: int) -> None:
    """Rows ``[c * rows_per_program, ...)`` of ``x`` summed into row ``c`` of the contiguous ``out`` (``chunks`` rows,
    or one, of any shape holding ``x``'s columns)."""
    n_rows, n_cols = x.shape
    launch_kernel(_sum_rows_kernel, (cdiv(n_cols, SUM_ROWS_BLOCK_COLS), chunks),
                  (x, out, n_rows, n_cols, x.stride(0), n_cols, rows_per_program, SUM_ROWS_BLOCK_ROWS,
                   SUM_ROWS_BLOCK_COLS), 4)


_CONSTEXPR_ORDER: Dict[tuple, Tuple[object, Tuple[str, ...]]] = {}  # by id(kernel), as _RUNTIME_PARAMS


def positional_constexprs(jit_kernel: object, values: Dict[str, object]) -> tuple:
    """``values``, the constexprs of a launch of ``jit_kernel``, in the order of its signature, whose last parameters
    they must be: passed by position, they cost a launch a quarter of what keywords do."""
    key = (id(jit_kernel), *values)
    kernel, names = _CONSTEXPR_ORDER.get(key, (None, None))
    if kernel is not jit_kernel:
        names = tuple(jit_kernel.arg_names[len(jit_kernel.arg_names) - len(values):])
        if sorted(names) != sorted(values):
            raise AssertionError(f"{getattr(jit_kernel, '__name__', jit_kernel)}'s last parameters {list(names)} are "
                                 f"not the constexprs {sorted(values)}")
        _CONSTEXPR_ORDER[key] = (jit_kernel, names)
    return tuple(values[name] for name in names)
