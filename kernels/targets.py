"""Which GPU is this: the one description of the CUDA targets the kernels are tuned and checked for.

A ``Target`` holds what the launchers, the tile plans and the AOT report need to know of a GPU generation:
compute capability, the shared memory one block may use, TMA and thread-block clusters, and the per-SM limits
that bound occupancy. ``TARGETS`` are the ones the report compiles every shipped config for; ``target_of`` maps
a device to the closest of them (a newer GPU than we know gets the newest target it has the resources of, so
sm_100 runs sm_90's plans and a 99 KB sm_120 part sm_89's). Nothing here touches a GPU at import.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """One CUDA target generation. Per-SM limits from the CUDA C++ Programming Guide's "Technical Specifications
    per Compute Capability" table."""

    capability: int  # 80 for sm_80
    shared_memory: int  # bytes of dynamic shared memory one block may use (the opt-in maximum)
    tma: bool  # the Tensor Memory Accelerator (sm_90 and later)
    clusters: bool  # thread-block clusters (sm_90 and later)
    max_warps_per_sm: int
    max_blocks_per_sm: int
    shared_memory_per_sm: int  # bytes, with the largest shared-memory carveout
    examples: str = ""  # parts of this generation, for the reader

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


# A100 class: 163 KB per block; the sm_86 / sm_89 parts 99 KB; H100 / H200 227 KB.
LARGE_SHARED_MEMORY = 166912
SMALL_SHARED_MEMORY = 101376
HOPPER_SHARED_MEMORY = 232448

TARGETS: Tuple[Target, ...] = (
    Target(80, LARGE_SHARED_MEMORY, tma=False, clusters=False, max_warps_per_sm=64, max_blocks_per_sm=32,
           shared_memory_per_sm=164 * 1024, examples="A100, A30"),
    Target(86, SMALL_SHARED_MEMORY, tma=False, clusters=False, max_warps_per_sm=48, max_blocks_per_sm=16,
           shared_memory_per_sm=100 * 1024, examples="A10, A40, RTX 30"),
    Target(89, SMALL_SHARED_MEMORY, tma=False, clusters=False, max_warps_per_sm=48, max_blocks_per_sm=24,
           shared_memory_per_sm=100 * 1024, examples="L4, L40S, RTX 40"),
    Target(90, HOPPER_SHARED_MEMORY, tma=True, clusters=True, max_warps_per_sm=64, max_blocks_per_sm=32,
           shared_memory_per_sm=228 * 1024, examples="H100, H200"),
)
BY_CAPABILITY: Dict[int, Target] = {t.capability: t for t in TARGETS}
CAPABILITIES: Tuple[int, ...] = tuple(BY_CAPABILITY)


def closest_target(capability: int, shared_memory: int) -> Target:
    """The known target a GPU of ``capability`` (major * 10 + minor) with ``shared_memory`` bytes per block runs the
    plans of: itself when known, else the newest known target no newer than it whose shared memory it has (the
    oldest target for a GPU older than every known one)."""
    if capability in BY_CAPABILITY:
        return BY_CAPABILITY[capability]
    fitting = [t for t in TARGETS if t.capability <= capability and t.shared_memory <= shared_memory]
    return max(fitting, key=lambda t: t.capability) if fitting else TARGETS[0]


@functools.lru_cache(maxsize=None)
def target_of(device: torch.device) -> Target:
    """The target CUDA ``device`` runs the plans of (its properties queried once per device)."""
    props = torch.cuda.get_device_properties(device)
    shared_memory = int(getattr(props, "shared_memory_per_block_optin", 0) or SMALL_SHARED_MEMORY)
    return closest_target(props.major * 10 + props.minor, shared_memory)
