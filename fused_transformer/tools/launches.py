"""How many device launches a call makes: the kernels it queues on the GPU, counted on any machine.

A launch is one Triton kernel launch (counted by Triton's launch hook on a GPU, at ``InterpretedFunction.run`` under
the interpreter), one call of a C++ kernel of ours (``torch.ops.fused_transformer_cpu``), or one ATen op that computes
(an elementwise op, a product, a reduction, a copy, a random draw: on a GPU a kernel, or for a few of them a
library's handful); views, allocations and metadata queries are none. ATen ops are counted with a dispatch mode
marked ``eager_inside``, under which our ops keep their eager path (``contract.traced``).

A CPU run stands for a GPU's host path with ``cpu_draws_as_on_a_gpu``: a CUDA generator's dropout seed is drawn on the
host (``contract.host_seed``), the CPU's by a ``torch.randint``, which would count as a launch a GPU does not make.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fused_transformer import contract

aten = torch.ops.aten
# ATen ops that queue no kernel: views and aliases, allocations, metadata.
NO_LAUNCH = {
    aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute, aten.expand, aten.as_strided,
    aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach, aten.unbind, aten.split,
    aten.split_with_sizes, aten.narrow, aten.unfold, aten.view_as_real, aten.view_as_complex, aten.lift_fresh,
    aten.empty, aten.empty_like, aten.empty_strided, aten.empty_permuted, aten.new_empty, aten.new_empty_strided,
    aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size, aten._reshape_alias,
}


class _ATenLaunches(TorchDispatchMode):
    eager_inside = True  # our ops keep their eager launch path under this mode (contract.traced)

    def __init__(self, counts: Dict[str, int]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace == "fused_transformer_cpu" or (namespace == "aten" and func.overloadpacket not in NO_LAUNCH):
            name = str(func.overloadpacket).replace("aten.", "")
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_launches(counts: Dict[str, int]) -> Iterator[None]:
    """Each Triton launch counted as ``"triton"``: at ``InterpretedFunction.run`` under the interpreter (run or skipped
    as it was), through ``triton.knobs.runtime.launch_enter_hook`` on a GPU."""
    def count() -> None:
        counts["triton"] = counts.get("triton", 0) + 1
    try:
        import triton
    except ImportError:
        yield
        return
    from fused_transformer.kernels._common import interpreting

    if interpreting():
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(self, *args, **kwargs):
            count()
            with _disable_current_modes():  # the interpreter's own tensor copies are not the kernel's launches
                return run(self, *args, **kwargs)
        InterpretedFunction.run = counted
        try:
            yield
        finally:
            InterpretedFunction.run = run
        return
    hooks = triton.knobs.runtime
    hook = hooks.launch_enter_hook
    if hasattr(hook, "add"):  # Triton 3.7: a HookChain
        def on_launch(metadata: object) -> None:
            count()
        hook.add(on_launch)
        try:
            yield
        finally:
            hook.remove(on_launch)
        return

    def chained(metadata: object) -> None:
        count()
        if hook is not None:
            hook(metadata)
    hooks.launch_enter_hook = chained
    try:
        yield
    finally:
        hooks.launch_enter_hook = hook


@contextlib.contextmanager
def counting() -> Iterator[Dict[str, int]]:
    """The launches of the calls made inside the block, by kind (``"triton"``, an ATen op's name, a C++ op's)."""
    counts: Dict[str, int] = {}
    with _triton_launches(counts), _ATenLaunches(counts):
        yield counts


def launches(fn: Callable[[], object], device: torch.device) -> Dict[str, int]:
    """The launches of one call of ``fn`` (after the device finished what was queued before)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with counting() as counts:
        fn()
    return counts


class PhiloxState:
    """What ``contract.host_seed`` reads of a CUDA generator, its seed and Philox offset, kept for a CPU device."""

    def __init__(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


@contextlib.contextmanager
def cpu_draws_as_on_a_gpu(seed: Optional[int] = None) -> Iterator[PhiloxState]:
    """Inside the block, an eager op on a CPU tensor draws its dropout seed as on a CUDA device: on the host, from the
    ``PhiloxState`` yielded (seeded with ``seed``, default torch's initial seed), with no ``torch.randint``."""
    state = PhiloxState(torch.initial_seed() if seed is None else seed)
    found = contract.philox_generator

    def generator(device: torch.device) -> Optional[object]:
        return state if device.type == "cpu" else found(device)
    contract.philox_generator = generator
    try:
        yield state
    finally:
        contract.philox_generator = found
