"""``python -m fused_transformer bench --suite overhead``: the host time of one call of every public op and module on a
tiny input, that is, the Python and dispatch overhead we add to each call.

Cases (``cases``):

- ops: every registered op (``fused_transformer.ops``) on the tiny calls of its ``Op.overhead`` (batch 2, L 8, 2
  heads of 16, d_model 32, d_ff 64 as the op takes them; a mask, packed sequences or a decoding step are calls of
  their own), the first case named as the op and the others ``op (label)``, in the modes of its
  ``Op.overhead_target``: forward (under ``no_grad``) and, where listed, forward+backward. An op with dropout runs it
  here (without, ATen runs the norms and the feed-forward).
- modules: ``ft.LayerNorm``, ``ft.MultiheadAttention`` (``need_weights=False``), ``ft.TransformerEncoderLayer`` and
  ``ft.TransformerDecoderLayer`` on batch 2, L 8, d_model 32, 2 heads, d_ff 64 (dropout 0.1, batch_first), an eval
  call under ``no_grad`` and a training step.

Each op is measured three ways in the same run: ``torch``, torch's own equivalent: the op's baseline as its rivals
prepare it where they do (``Op.rivals``, ``Op.baseline``: SDPA with its masks made before the timed calls, a
block-diagonal one for packed sequences, on the cache after the same write for a decoding step), else
``Op.torch_path``; ``thin``, ``ThinFunction``, an autograd Function over the tensors the op differentiates
(``Op.differentiated``) that only allocates its output and, in backward, the gradients: the least a fused op can cost
on the host (an op whose launches include torch's own gives a thin of its own, ``Op.overhead_thin``, which makes
those too: the feed-forward's products); and ``ours``, the op's function. Modules are measured against the
``torch.nn`` module holding the same weights. The figures that matter are ours / thin (``TARGETS``: each op's
``Op.overhead_target`` for its first call) and ours / torch; forward+backward and training steps take the gradients
with ``torch.autograd.grad``, so that no ``.grad`` has to be reset between calls.

Launches (``launch_count``, ``tools/launches.py``): the device launches of one call of each implementation (Triton
kernels, C++ kernels, ATen ops that compute), counted apart from the timing; the CSV's ``launches`` column.

Time (``host_ms``): blocks of N back-to-back calls, synchronised before and after each block but never inside it
(on a GPU, kernels this small keep up with the host, so the time is the host's), divided by N; the
implementations of a case take turns block by block, and the result is the median over the blocks. On CPU, "ours"
runs on the Triton backend under the Triton interpreter with every kernel launch skipped (``launches_skipped``), on
one torch thread, dropout seeds drawn on the host as from a CUDA generator (``launches.cpu_draws_as_on_a_gpu``): only
our Python path and the allocations it makes are timed, which is what a GPU's host would run.
"""
from __future__ import annotations

import contextlib
import cProfile
import functools
import gc
import os
import pstats
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import fused_transformer as ft
from fused_transformer import ops
from fused_transformer.tools.bench_cases import Built, Case, Setup, module_calls, module_twins, random_like
from fused_transformer.tools.launches import cpu_draws_as_on_a_gpu

SUITE = "overhead"
BATCH, HEADS, SEQ_LEN, HEAD_DIM, D_MODEL, D_FF = 2, 2, 8, 16, 32, 64  # the modules' (the ops' are their examples')


def _op_cases() -> Dict[str, Tuple[ops.Op, ops.Example]]:
    """Case name -> (op, example) for every registered op's ``Op.overhead``: the first named as the op, the others
    ``op (label)``."""
    return {op.name if i == 0 else f"{op.name} ({example.label})": (op, example)
            for op in ops.registered() for i, example in enumerate(op.overhead)}


OP_CASES = _op_cases()
OPS = {case: tuple(op.overhead_target) for case, (op, _) in OP_CASES.items()}  # case -> its modes
MODULES = ("LayerNorm", "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer")
# The targets for ours / thin (CPU, launches skipped), of each op's first call: (op, mode) -> the largest ratio allowed.
TARGETS = {(op.name, mode): target for op in ops.registered() if op.overhead
           for mode, target in op.overhead_target.items() if target is not None}
WARMUP_CALLS = 3
MIN_CALLS = 5  # per block
BLOCKS = 5


# ------------------------------------------------------------------------------------------- conditions


def setup_for(setup: Setup) -> Setup:
    """The setup the suite runs on: ``auto`` on CPU becomes ``triton`` (under the interpreter, launches skipped);
    any other choice, and CUDA, are kept."""
    if setup.device.type == "cpu" and setup.backend == "auto":
        return Setup(setup.device, setup.dtype, "triton")
    return setup


def unusable_reason(setup: Setup) -> Optional[str]:
    """None when ours can run on ``setup_for(setup)``, else why not (on CPU: the Triton interpreter is off)."""
    backend = setup_for(setup).backend
    with ft.use_backend(backend):
        try:
            ft.current(setup.device, setup.dtype)
        except RuntimeError as exc:
            return (f"the overhead suite runs ours on backend {backend!r}, which cannot run here: {exc} "
                    "(python -m fused_transformer sets it when torch sees no GPU)")
    return None


_skipped = {"active": False, "launches": 0}  # what launches_skipped is doing, for host_ms's check


def _skipped_launch(self: object, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
    """``InterpretedFunction.run`` that runs nothing."""
    _skipped["launches"] += 1


@contextlib.contextmanager
def launches_skipped() -> Iterator[None]:
    """Every Triton kernel launch under the interpreter (``kernel[grid](...)``, which ends in
    ``InterpretedFunction.run``) returns at once without running the kernel; restored on exit."""
    from triton.runtime.interpreter import InterpretedFunction

    run, active = InterpretedFunction.run, _skipped["active"]
    InterpretedFunction.run = _skipped_launch
    _skipped["active"] = True
    try:
        yield
    finally:
        InterpretedFunction.run, _skipped["active"] = run, active


def skips_launches(setup: Setup) -> bool:
    """Whether the suite skips ours' kernel launches on ``setup`` (a ``setup_for`` one): the Triton backend on CPU."""
    return setup.device.type == "cpu" and setup.backend == "triton"


@contextlib.contextmanager
def conditions(setup: Setup) -> Iterator[None]:
    """What the suite runs under: the backend chosen once (no call pays a ``use_backend`` of its own), and on CPU one
    torch thread and, on the Triton backend, every launch skipped."""
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        stack.enter_context(ft.use_backend(setup.backend))
        if setup.device.type == "cpu":
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        if skips_launches(setup):
            stack.enter_context(launches_skipped())
            stack.enter_context(cpu_draws_as_on_a_gpu())
        yield


def describe(setup: Setup) -> str:
    """The suite's shapes and conditions in words (the table's header)."""
    where = ("ours on the Triton backend under the interpreter, every kernel launch skipped, dropout seeds drawn on the "
             "host as from a CUDA generator" if skips_launches(setup)
             else f"ours on backend {setup.backend}") + (", 1 torch thread" if setup.device.type == "cpu" else "")
    return (f"batch {BATCH}, {HEADS} heads, L {SEQ_LEN}, head dim {HEAD_DIM}, d_model {D_MODEL}, d_ff {D_FF}: host "
            f"time of one call, N back-to-back calls between two synchronisations, median of {BLOCKS} blocks; {where}")


# ------------------------------------------------------------------------------------------------ timing


def host_ms(fns: Dict[str, Callable[[], object]], grads: Sequence[Tensor], device: torch.device,
            min_time: float) -> Dict[str, float]:
    """Median milliseconds per call of each implementation over ``BLOCKS`` blocks of back-to-back calls lasting about
    ``min_time / BLOCKS`` each, the implementations taking turns; ``grads`` are not touched (the cases take their
    gradients with ``torch.autograd.grad``). The signature of ``bench_timing.time_ms``."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def block(fn: Callable[[], object], calls: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls

    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection inside a block would land on whichever call triggered it
    try:
        calls = {}
        for name, fn in fns.items():
            launches = _skipped["launches"]
            block(fn, WARMUP_CALLS)
            if name == "ours" and "thin" in fns and _skipped["active"] and _skipped["launches"] == launches:
                # Then the op ran another path than the Triton kernels' (or launched them some other way than
                # InterpretedFunction.run, which would then run them): its time would not be what this suite says.
                # A module may run ATen alone (on a GPU ft.LayerNorm without dropout, as torch.nn does).
                raise RuntimeError("ours launched no Triton kernel while launches were skipped")
            calls[name] = max(MIN_CALLS, round(min_time / BLOCKS / block(fn, MIN_CALLS)))
        times: Dict[str, List[float]] = {name: [] for name in fns}
        for _ in range(BLOCKS):
            for name, fn in fns.items():
                times[name].append(block(fn, calls[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}


def launch_count(fn: Callable[[], object], device: torch.device) -> int:
    """The device launches of one call of ``fn`` (``tools.launches``)."""
    from fused_transformer.tools.launches import launches

    return sum(launches(fn, device).values())


def ratio_note(case: Case, times: Dict[str, float], impl: str) -> str:
    """The CSV note of one row: its host microseconds, and for ours its ratios to thin and to the baseline."""
    note = f"host {times[impl] * 1e3:.1f} us/call"
    if impl != "ours":
        return note
    if "thin" in times:
        target = TARGETS.get((case.case, case.mode))
        note += f"; ours/thin {times['ours'] / times['thin']:.2f}x" + (f" (target <= {target:g}x)" if target else "")
    return note + f"; ours/{case.baseline} {times['ours'] / times[case.baseline]:.2f}x"


# ------------------------------------------------------------------------------------------------- cases


class ThinFunction(torch.autograd.Function):
    """The least an op over these tensors can cost on the host: autograd's bookkeeping, an output allocated like the
    first input, and in backward a gradient allocated for each input that needs one. No arithmetic."""

    @staticmethod
    def forward(ctx: object, x: Tensor, *others: Tensor) -> Tensor:
        ctx.save_for_backward(x, *others)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return tuple(torch.empty_like(t) if needed else None
                     for t, needed in zip(ctx.saved_tensors, ctx.needs_input_grad))


def _forward(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()
    return run


def _forward_backward(fn: Callable[[], Tensor], inputs: Sequence[Tensor], grad: Tensor) -> Callable[[], object]:
    wanted = [t for t in inputs if t.requires_grad]

    def run() -> object:
        return torch.autograd.grad(fn(), wanted, grad)
    return run


def _randn(setup: Setup, *shape: int, grad: bool = False) -> Tensor:
    return torch.randn(*shape, device=setup.device, dtype=setup.dtype).requires_grad_(grad)


def _op_calls(op: ops.Op, example: ops.Example, setup: Setup,
              backward: bool) -> Tuple[List[Tensor], Dict[str, Callable[[], Tensor]]]:
    """The tensors ``example`` differentiates (``Op.differentiated``: requiring a gradient for the backward) and the
    calls on them: ``torch``, the op's baseline as its rivals prepare it (a mask it takes in another form made here,
    outside the timed call), else ``Op.torch_path``; ``ours``, the op's function; ``thin`` where the op has its own
    (``Op.overhead_thin``)."""
    tensors = example.draw(lambda *shape, scale=1.0: _randn(setup, *shape) * scale)
    tensors = {name: t.float() if name in op.float32 and t is not None and t.is_floating_point() else t
               for name, t in tensors.items()}
    inputs = [t.requires_grad_(backward) for t in op.differentiated(tensors)]
    baseline_call = op.rivals.calls(example, tensors, (), backward).calls.get(op.baseline)
    calls = {"torch": baseline_call or (lambda: op.torch_path(**tensors, **example.options)),
             "ours": lambda: op.function(**tensors, **example.options)}
    if op.overhead_thin is not None:
        calls["thin"] = lambda: op.overhead_thin(**tensors)
    return inputs, calls


def _build_op(setup: Setup, case: str, backward: bool) -> Built:
    """torch, thin and ours on the same inputs; thin's output is shaped as its first input, ours as torch's."""
    torch.manual_seed(0)
    op, example = OP_CASES[case]
    inputs, calls = _op_calls(op, example, setup, backward)
    thin = calls.get("thin", lambda: ThinFunction.apply(*inputs))
    calls = {"torch": calls["torch"], "thin": thin, "ours": calls["ours"]}
    if not backward:
        return Built({name: _forward(fn) for name, fn in calls.items()})
    grad = random_like(calls["torch"]())
    return Built({name: _forward_backward(fn, inputs, grad) for name, fn in calls.items()})


def _build_module(setup: Setup, name: str, train: bool) -> Built:
    theirs, ours = module_twins(setup, name, D_MODEL, HEADS, D_FF)
    x, grad = _randn(setup, BATCH, SEQ_LEN, D_MODEL, grad=train), _randn(setup, BATCH, SEQ_LEN, D_MODEL)
    parameters = {"torch.nn": list(theirs.parameters()), "ours": list(ours.parameters())}
    return Built({impl: _forward_backward(fn, [x, *parameters[impl]], grad) if train else _forward(fn)
                  for impl, fn in module_calls(theirs, ours, name, x, train).items()})


def cases(setup: Setup) -> List[Case]:
    """Every case of the suite: the ops (torch, thin, ours), then the modules (torch.nn, ours)."""
    found = []
    for case, (op, example) in OP_CASES.items():
        shape = example.shape
        for mode in op.overhead_target:
            found.append(Case(
                SUITE, case, mode, shape["seq_len"], shape["batch"], ("torch", "thin", "ours"),
                heads=shape.get("heads"), head_dim=shape.get("head_dim"), d_model=shape.get("d_model"),
                d_ff=shape.get("d_ff"), new_tokens=shape.get("tokens"),
                build=functools.partial(_build_op, setup, case, mode == "fwd+bwd")))
    for name in MODULES:
        for mode in ("eval", "train"):
            found.append(Case(
                SUITE, name, mode, SEQ_LEN, BATCH, ("torch.nn", "ours"),
                heads=None if name == "LayerNorm" else HEADS,
                head_dim=None if name == "LayerNorm" else D_MODEL // HEADS, d_model=D_MODEL,
                d_ff=D_FF if name.endswith("Layer") else None,
                build=functools.partial(_build_module, setup, name, mode == "train")))
    return found


# --------------------------------------------------------------------------------------------- profiles
# ``bench --suite overhead --profile``: where the host time of a call goes, for whoever must cut it (on a GPU, where
# Triton's launch and the device's allocator add to what the CPU run shows).
PROFILE_CALLS = 30  # few enough to keep gpu-check's bench part within its share (each case is profiled twice)
PROFILE_WARMUP_CALLS = 3
PROFILE_ROWS = 25


def profile_path(out: str, device: torch.device) -> str:
    return os.path.join(out, f"overhead_profile_{device.type}.txt")


def start_profiles(path: str, setup: Setup) -> None:
    """Begin ``path``'s file (replacing an earlier run's) with the conditions of the profiles that follow."""
    with open(path, "w") as f:
        f.write(f"bench --suite overhead --profile: {describe(setup)}; torch {torch.__version__}.\n"
                f"Per case, ours and thin (whose time is torch's own: autograd's bookkeeping), {PROFILE_CALLS} calls "
                "each, microseconds per call: cProfile's functions by own time (the profiler's own cost inflates "
                "every Python call alike), then the torch profiler's operators (on CUDA with the runtime's calls: "
                "launches, copies, synchronisations) by self CPU time, its totals over the calls.\n")


def _function_rows(profiler: cProfile.Profile) -> List[str]:
    """cProfile's ``PROFILE_ROWS`` functions with the most own time, in microseconds per profiled call."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, ...)
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:PROFILE_ROWS]
    lines = [f"{'own us':>8} {'cum us':>8} {'calls':>6}  function"]
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        shown = os.path.relpath(file) if file.startswith(os.getcwd()) else file
        where = name if file == "~" else f"{name} ({shown}:{line})"
        lines.append(f"{own / PROFILE_CALLS * 1e6:8.2f} {cumulative / PROFILE_CALLS * 1e6:8.2f} "
                     f"{calls / PROFILE_CALLS:6.2f}  {where}")
    return lines


def profile(case: Case, fns: Dict[str, Callable[[], object]], device: torch.device, path: str) -> None:
    """Append to ``path`` where the host time of ``ours`` and ``thin`` (where the case has it) goes over
    ``PROFILE_CALLS`` calls of each, with the garbage collector off as in the timing: cProfile's ``PROFILE_ROWS``
    functions with the most own time, and the torch profiler's operators by self CPU time. A profile that fails is
    said so in the file: it is a diagnosis, and the case's timing stands."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with open(path, "a") as f:
            for impl in ("ours", "thin"):
                fn = fns.get(impl)
                if fn is None:
                    continue
                f.write(f"\n=== {case.case} {case.mode}: {impl}\n")
                try:
                    f.write("\n".join(_profiled(fn, device, activities)) + "\n")
                except Exception as exc:  # noqa: BLE001 (whatever the profilers raise, the timing stands)
                    f.write(f"profile failed: {type(exc).__name__}: {exc}\n")
    finally:
        if gc_was_enabled:
            gc.enable()


def _profiled(fn: Callable[[], object], device: torch.device, activities: list) -> List[str]:
    for _ in range(PROFILE_WARMUP_CALLS):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILE_CALLS):
        fn()
    profiler.disable()
    with torch.profiler.profile(activities=activities) as torch_profile:
        for _ in range(PROFILE_CALLS):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    operators = torch_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    return [*_function_rows(profiler), "", operators]


# ------------------------------------------------------------------------------------------------ tables


def table(rows: Sequence[Dict[str, object]]) -> List[str]:
    """The suite's figures as a markdown table: host microseconds of ours, thin and the baseline, and the ratios."""
    lines = ["| op / module | mode | ours us | thin us | torch us | ours/thin | target | ours/torch | "
             "launches ours / torch |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    measured: Dict[Tuple[object, object], Dict[str, float]] = {}
    launched: Dict[Tuple[object, object], Dict[str, object]] = {}
    for row in rows:
        if row["suite"] == SUITE and row["ms"] is not None:
            measured.setdefault((row["case"], row["mode"]), {})[str(row["impl"])] = float(row["ms"]) * 1e3
            launched.setdefault((row["case"], row["mode"]), {})[str(row["impl"])] = row.get("launches")
    for (case, mode), us in measured.items():
        baseline = us.get("torch", us.get("torch.nn"))
        target = TARGETS.get((case, mode))
        counts = launched[(case, mode)]

        def cell(value: Optional[float], unit: str = "", digits: int = 1) -> str:
            return f"{value:.{digits}f}{unit}" if value is not None else "-"

        lines.append(" | ".join([
            f"| {case}", str(mode), cell(us.get("ours")), cell(us.get("thin")), cell(baseline),
            cell(us["ours"] / us["thin"] if "ours" in us and "thin" in us else None, "x", 2),
            f"<= {target:g}x" if target else "-",
            cell(us["ours"] / baseline if "ours" in us and baseline else None, "x", 2),
            f"{counts.get('ours', '-')} / {counts.get('torch', counts.get('torch.nn', '-'))}"]) + " |")
    return lines
