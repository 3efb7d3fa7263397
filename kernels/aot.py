"""The record a kernel module declares each config it ships with, for the ahead-of-time report
(``python -m fused_transformer report``): every kernel module exposes ``aot_configs() -> List[AotKernel]``, one
entry per kernel variant and tile config its launcher can pick on a GPU, and the report compiles each for its
targets. It lives here, below the kernels, so that the report imports the kernels and never the reverse."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Dict, Optional, Tuple

from .targets import CAPABILITIES


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """One kernel variant and config to compile.

    ``signature`` maps every runtime argument to its Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``, ...; a host-side
    TMA descriptor, as ``triton.tools.tensor_descriptor.TensorDescriptor`` passes one, is
    ``"tensordesc<bf16[1,1,64,128]>"``: element type and block shape);
    ``constexprs`` maps constexpr arguments (and runtime arguments specialised to a constant, e.g. unit
    strides) to their values; they need not appear in ``signature``. ``targets`` are the compute
    capabilities the config is shipped for (a Hopper-only tile config lists only 90).
    """

    name: str
    config: str
    fn: Any  # triton JITFunction
    signature: Dict[str, str]
    constexprs: Dict[str, Any]
    num_warps: int  # per CTA
    num_stages: int
    targets: Tuple[int, ...] = CAPABILITIES
    expect_tensor_cores: bool = False
    # SASS opcodes (prefixes: "HGMMA", "UTMALDG", "USETMAXREG") the config must issue: what its variant exists for.
    expect_instructions: Tuple[str, ...] = ()
    # Why the plan refuses this config's variant (no supported release builds it), else "": the report compiles it to
    # check that it still fails or lacks ``expect_instructions``, and fails when it builds them.
    refused: str = ""
    # Arguments compiled as multiples of 16 (None: every pointer and integer argument, as the JIT specialises
    # a launch whose sizes and strides are multiples of 16). Odd sizes compile another, unchecked variant.
    divisible_by_16: Optional[Tuple[str, ...]] = None
    num_ctas: int = 1  # CTAs per program: a thread-block cluster when > 1 (sm_90 and later)


def kernel_modules() -> Tuple[str, ...]:
    """The kernel modules of this package that declare their configs (``aot_configs``), in name order: a new kernel
    module is in the report by defining it. Imports them (they register their variants as they load). A module may
    also name the configs ``docs/report.md`` shows of it (``MARKDOWN_ROWS``, a compiled pattern of config names)."""
    package = importlib.import_module(__package__)
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "aot_configs"):
            found.append(module.__name__)
    return tuple(found)
