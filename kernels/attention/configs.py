"""The tile plan of the attention kernels: one table of tile rows and one ``plan()`` that the launchers and the AOT
report both call, so what a GPU runs is what the report compiled.

A launch is described by its kernel (``"fwd"``, ``"bwd_dq"``, ``"bwd_dkdv"``, ``"weights"``), its precision
(``"bf16"`` for either 16-bit dtype, ``"fp32"``, ``"tf32"``: float32 with ``allow_tf32``), its head-dim bucket
(the next power of two, at least 16), its target (``kernels/targets.py``), whether it loads through TMA, whether it
is *scores-only* (its scores read no attn_mask element and draw no dropout number: the registers the every-feature
tiles keep for those buy wider tiles), whether it modifies the scores (softcap or ALiBi: never scores-only) and its
layout (dense or packed sequences). ``plan()`` returns the first row of ``TILE_ROWS`` that matches it; failing every
row in float32 with tf32 products, it looks again as exact float32. So the rows run from the most specific to the most general, and the order is the fallback order:

0. launches with softcap or ALiBi, where the tiles below spill with them;
1. tf32: sm_90's forward through TMA, then the tf32 tiles of every target (tensor-core operands hold more
   registers than the float32 tiles' CUDA-core ones);
2. sm_86 / sm_89 (99 KB of shared memory) where the general tiles do not fit there or spill;
3. sm_90 through TMA: scores-only packed launches, scores-only launches, then any launch;
4. the general tiles, for every target and load path.

Each row also says where its tiles run the two-loop path (``interior_loop``: unmasked interior tiles, for launches
with no attn_mask, query padding, window or dropout) without spilling, per layout: the report compiles both paths
and checks. A backward row says whether its pointer path reads do through do's own strides (``do_strides``): in the
float32 tiles that spill doing so (ptxas keeps 64-128 registers and stacks a value or two), it reads do in o's
layout instead, and the launcher copies a gradient that is not in it. The rows were chosen as the largest tiles that
compile without spills on their targets in every variant that picks them; ``python -m fused_transformer report``
prints what each runs (registers, HGMMA widths, instructions per kMAC) and ``docs/attention.md`` tells how they were
found.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from .. import variants
from .._common import next_power_of_2
from ..targets import LARGE_SHARED_MEMORY, TARGETS, Target
from ..toolchain import (
    BEFORE_3_9, EVERY_RELEASE, SINCE_3_7, SINCE_3_9, TRITON_3_6, TRITON_3_7, Version, VersionRange, installed,
)

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv", "weights")
PRECISIONS = ("bf16", "fp32", "tf32")
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)
# float32 stops at head_dim 128: its dq kernel spills at every tile size tried for 256.
MAX_HEAD_DIM = {"bf16": 256, "fp32": 128, "tf32": 128}


@dataclasses.dataclass(frozen=True)
class Tile:
    """What a launch's grid and compilation take: query rows and keys per program, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}_BN{self.block_n}_w{self.num_warps}_s{self.num_stages}"


# The targets a row is for (kernels/targets.py): all of them, the 99 KB parts, the TMA ones.
ALL = tuple(t.capability for t in TARGETS)
SMALL_SHARED_MEMORY = tuple(t.capability for t in TARGETS if t.shared_memory < LARGE_SHARED_MEMORY)
HOPPER = tuple(t.capability for t in TARGETS if t.tma)
BOTH = ("dense", "packed")


@dataclasses.dataclass(frozen=True)
class TileRow:
    """One row of the plan: the tile ``kernel`` runs in ``precision`` at these head-dim buckets on these targets."""

    kernel: str
    precision: str
    head_dims: Tuple[int, ...]
    tile: Tile
    targets: Tuple[int, ...] = ALL
    loads: str = "any"  # "tma": only launches that load through TMA
    scores_only: bool = False  # only scores-only launches (no attn_mask tile, no dropout)
    layouts: Tuple[str, ...] = BOTH  # the layouts the row serves
    score_mods: bool = False  # only launches with softcap or ALiBi
    interior_loop: Tuple[str, ...] = BOTH  # the layouts whose two-loop path compiles without spills
    interior_loop_tma: Optional[Tuple[str, ...]] = None  # the same through TMA, where it differs (loads="any" rows)
    tritons: VersionRange = EVERY_RELEASE  # the Triton releases the row holds for (kernels/toolchain.py)
    # The backward kernels: whether the pointer path reads do through its strides without spilling with this tile
    # (else in o's layout, where the launcher copies a gradient that is not).
    do_strides: bool = True
    provenance: str = ""  # what was measured: which larger tile spilled how much, under which Triton release / target

    def interior_loop_for(self, tma: bool, packed: bool) -> bool:
        """Whether a launch with these loads and layout may run the two-loop path with this row's tile."""
        layouts = self.interior_loop_tma if tma and self.interior_loop_tma is not None else self.interior_loop
        return ("packed" if packed else "dense") in layouts

    def serves(self, kernel: str, precision: str, head_dim: int, target: int, tma: bool, scores_only: bool,
               layout: str, triton: Version, score_mods: bool = False) -> bool:
        return (self.kernel == kernel and self.precision == precision and head_dim in self.head_dims
                and target in self.targets and self.loads in ("any", "tma" if tma else "pointer")
                and (scores_only or not self.scores_only) and layout in self.layouts and triton in self.tritons
                and (score_mods or not self.score_mods))


def _rows(kernel: str, precision: str, tiles: dict, **options) -> Tuple[TileRow, ...]:
    """Rows of one kernel and precision: ``tiles`` maps head dims to ``(block_m, block_n, warps, stages)``."""
    return tuple(TileRow(kernel, precision, (head_dim,), Tile(*tile), **options) for head_dim, tile in tiles.items())


def _older(kernel: str, precision: str, head_dim: int, tile: Tuple[int, int, int, int], **options) -> TileRow:
    """A row for Triton 3.6-3.8 only, standing before the row tuned under 3.9 that spills there (its ``provenance``
    says what spilled): the first row that matches is the plan, so older releases take this one and 3.9 the next."""
    return TileRow(kernel, precision, (head_dim,), Tile(*tile), tritons=BEFORE_3_9, **options)


# What was measured about several rows at once (``TileRow.provenance``).
_SCORE_MODS_SPILL = "with softcap or ALiBi, the tiles of the later rows spill 8-80 B"
_SMALL_FP32_DKDV_SPILL = ("BM32_BN32_w8_s2 spills 8 B under 3.6 (32 B under 3.7, packed and causal); BM32_BN64_w8_s1 "
                          "40 B under 3.7 (since the dropout seed may come by value)")
_PACKED_FP32_DKDV_SPILL = "BM32_BN64_w8_s2 spills 16 B here (from 3.7 on sm_86 / sm_89, from 3.9 on sm_80)"

TILE_ROWS: Tuple[TileRow, ...] = (
    # 0. softcap or ALiBi (the scoremods variants of the report), where the tiles below spill (the cap's tanh and its
    # derivative per score, the ALiBi distance), mostly in the backward.
    TileRow("bwd_dq", "bf16", (64,), Tile(128, 32, 8, 2), targets=HOPPER, loads="tma", layouts=("packed",),
            score_mods=True, provenance=_SCORE_MODS_SPILL),
    TileRow("bwd_dq", "bf16", (128,), Tile(128, 32, 8, 3), targets=HOPPER, loads="tma", layouts=("packed",),
            score_mods=True, provenance=_SCORE_MODS_SPILL),
    TileRow("bwd_dq", "tf32", (32,), Tile(32, 16, 8, 2), targets=(86, 89), layouts=("packed",), score_mods=True,
            provenance=_SCORE_MODS_SPILL),
    TileRow("fwd", "bf16", (32,), Tile(128, 32, 8, 1), targets=(80, 90), loads="pointer", layouts=("packed",),
            score_mods=True, tritons=VersionRange((3, 8)), provenance="BM128_BN32_w8_s2 spills 8 B on sm_80"),
    TileRow("bwd_dq", "fp32", (64,), Tile(64, 16, 8, 1), score_mods=True, provenance=_SCORE_MODS_SPILL),
    TileRow("bwd_dq", "bf16", (128,), Tile(64, 32, 8, 1), targets=SMALL_SHARED_MEMORY, score_mods=True,
            tritons=VersionRange((3, 8), (3, 8)),
            provenance="BM64_BN32_w8_s2 spills 32 B under 3.8 on the 99 KB parts (since the dropout seed may come by "
                       "value)"),
    TileRow("fwd", "bf16", (256,), Tile(32, 16, 8, 1), targets=SMALL_SHARED_MEMORY, score_mods=True,
            tritons=TRITON_3_7,
            provenance="BM32_BN32_w8_s1 spills 8 B under 3.7 on the 99 KB parts (o in float32; since the dropout seed "
                       "may come by value)"),
    TileRow("fwd", "fp32", (16,), Tile(64, 32, 8, 1), targets=HOPPER, layouts=("dense",), score_mods=True,
            tritons=TRITON_3_6, provenance="BM64_BN32_w8_s2 spills 8 B under 3.6"),
    TileRow("bwd_dkdv", "fp32", (64,), Tile(16, 16, 8, 1), targets=(80, 90), score_mods=True, tritons=SINCE_3_9,
            provenance="BM16_BN32_w8_s1 spills 8 B under 3.9 on sm_80 (since the dropout seed may come by value)"),
    TileRow("bwd_dkdv", "fp32", (16,), Tile(32, 32, 8, 1), score_mods=True, do_strides=False,
            provenance=_SCORE_MODS_SPILL),
    TileRow("bwd_dkdv", "fp32", (32,), Tile(32, 64, 8, 1), score_mods=True, provenance=_SCORE_MODS_SPILL),
    _older("fwd", "tf32", 64, (32, 16, 8, 1), targets=(80, 86, 89), layouts=("dense",), score_mods=True,
           provenance="BM32_BN32_w8_s1 spills 8 B under 3.7"),
    _older("fwd", "fp32", 32, (64, 32, 8, 1), targets=SMALL_SHARED_MEMORY, score_mods=True,
           provenance="BM64_BN32_w8_s2 spills 8 B under 3.6"),
    _older("bwd_dq", "tf32", 16, (16, 32, 8, 1), targets=(80,), layouts=("packed",), score_mods=True,
           provenance="BM16_BN32_w4_s1 spills 8 B under 3.6, 3.7"),
    _older("bwd_dq", "tf32", 32, (32, 16, 8, 1), targets=HOPPER, layouts=("packed",), score_mods=True,
           provenance="BM32_BN16_w8_s2 spills 8 B under 3.6, 3.7"),
    TileRow("bwd_dq", "tf32", (32,), Tile(32, 16, 8, 2), targets=(80, 90), layouts=("packed",), score_mods=True,
            tritons=SINCE_3_9, provenance="BM32_BN32_w8_s2 spills 8 B on sm_80"),
    # 1. float32 with tf32 products. sm_90's forward through TMA runs 128 query rows as wgmma (HGMMA...TF32).
    _older("fwd", "tf32", 64, (128, 64, 8, 1), targets=HOPPER, loads="tma",
           provenance="BM128_BN64_w8_s2 spills 16 B under 3.7"),
    *_rows("fwd", "tf32", {64: (128, 64, 8, 2), 128: (128, 32, 8, 2)}, targets=HOPPER, loads="tma"),
    *_rows("fwd", "tf32", {16: (16, 32, 4, 1), 32: (32, 32, 4, 1)}),
    _older("bwd_dq", "tf32", 16, (16, 16, 4, 1), targets=SMALL_SHARED_MEMORY, layouts=("packed",), interior_loop=(),
           provenance="BM16_BN32_w4_s1 spills 8 B under 3.6, 3.7 (packed)"),
    _older("bwd_dq", "tf32", 16, (16, 32, 4, 1), targets=(86, 89, 90), interior_loop=(),
           provenance="BM16_BN32_w4_s1 spills 8-16 B under 3.6, 3.7, 3.8"),
    TileRow("bwd_dq", "tf32", (16,), Tile(16, 32, 4, 1)),
    TileRow("bwd_dq", "tf32", (64,), Tile(16, 32, 8, 1), do_strides=False),
    TileRow("bwd_dq", "tf32", (128,), Tile(16, 16, 8, 1), interior_loop=("dense",),
            provenance="the packed two-loop path spills 8 B"),
    _older("bwd_dkdv", "tf32", 16, (16, 32, 8, 1), targets=(86, 89, 90), interior_loop=("packed",), do_strides=False,
           provenance="BM16_BN32_w4_s1 spills 8-16 B under 3.6, 3.7, 3.8"),
    TileRow("bwd_dkdv", "tf32", (16,), Tile(16, 32, 4, 1), interior_loop=("packed",),
            provenance="the dense two-loop path spills 8-16 B"),
    TileRow("bwd_dkdv", "tf32", (32,), Tile(16, 32, 8, 1)),
    _older("bwd_dkdv", "tf32", 64, (16, 16, 4, 1), targets=SMALL_SHARED_MEMORY, interior_loop=("packed",),
           do_strides=False, provenance="BM16_BN16_w8_s1 spills 8 B under 3.6, 3.7, 3.8"),
    TileRow("bwd_dkdv", "tf32", (64,), Tile(16, 16, 8, 1), interior_loop=("packed",), do_strides=False,
            provenance="the dense two-loop path spills 8-16 B"),
    _older("bwd_dkdv", "tf32", 128, (32, 32, 8, 2), interior_loop=(),
           provenance="BM16_BN16_w8_s1 spills 8-16 B under 3.6, 3.7"),
    TileRow("bwd_dkdv", "tf32", (128,), Tile(16, 16, 8, 1), interior_loop=(), do_strides=False,
            provenance="the two-loop path spills 8-16 B"),
    # 2. 99 KB parts.
    *_rows("fwd", "bf16", {32: (128, 64, 8, 2), 64: (128, 32, 8, 2)}, targets=SMALL_SHARED_MEMORY,
           provenance="BM128_BN64_w8_s2 at D64 spills 208 B under 3.6, 128 B under 3.9 (with every feature)"),
    TileRow("bwd_dkdv", "fp32", (16,), Tile(32, 64, 8, 1), targets=SMALL_SHARED_MEMORY, interior_loop=(),
            tritons=TRITON_3_6, provenance=_SMALL_FP32_DKDV_SPILL),
    TileRow("bwd_dkdv", "fp32", (16,), Tile(16, 32, 4, 1), targets=SMALL_SHARED_MEMORY, tritons=TRITON_3_7,
            provenance=_SMALL_FP32_DKDV_SPILL),
    # Under 3.8 these parts take the older releases' BM32_BN16_w8_s2 below (since the dropout seed may come by value).
    TileRow("bwd_dkdv", "fp32", (16,), Tile(32, 32, 8, 2), targets=SMALL_SHARED_MEMORY, interior_loop=(),
            tritons=SINCE_3_9, provenance="the two-loop path spills 32-48 B"),
    # 3. sm_90 through TMA. Scores-only packed launches, where the scores-only tiles below spill for packed sequences
    # (which zero a q / do tile's rows past their sequence in registers).
    TileRow("fwd", "bf16", (128,), Tile(128, 64, 8, 3), targets=HOPPER, loads="tma", scores_only=True,
            layouts=("packed",)),
    TileRow("bwd_dkdv", "bf16", (64,), Tile(32, 128, 8, 2), targets=HOPPER, loads="tma", scores_only=True,
            layouts=("packed",)),
    _older("bwd_dkdv", "bf16", 128, (32, 128, 8, 1), targets=HOPPER, loads="tma", scores_only=True, layouts=("packed",),
           interior_loop=(), provenance="BM32_BN128_w8_s2 spills 8 B under 3.6"),
    TileRow("bwd_dkdv", "bf16", (128,), Tile(32, 128, 8, 2), targets=HOPPER, loads="tma", scores_only=True,
            layouts=("packed",), interior_loop=(), provenance="the two-loop path spills 328 B"),
    # Scores-only launches: every HGMMA N >= 64 or the head dim.
    _older("fwd", "bf16", 128, (128, 64, 8, 3), targets=HOPPER, loads="tma", scores_only=True,
           provenance="BM128_BN128_w8_s3 spills 16-24 B under 3.6, 3.7"),
    *_rows("fwd", "bf16", {16: (128, 128, 8, 3), 32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 128, 8, 3)},
           targets=HOPPER, loads="tma", scores_only=True),
    _older("fwd", "bf16", 256, (128, 32, 8, 1), targets=HOPPER, loads="tma", scores_only=True, interior_loop=("dense",),
           provenance="BM128_BN64_w8_s2 spills 24-120 B under 3.6, 3.7, 3.8"),
    TileRow("fwd", "bf16", (256,), Tile(128, 64, 8, 2), targets=HOPPER, loads="tma", scores_only=True,
            interior_loop=("dense",), provenance="the packed two-loop path spills 24-120 B"),
    *_rows("bwd_dq", "bf16", {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 3)},
           targets=HOPPER, loads="tma", scores_only=True),
    TileRow("bwd_dq", "bf16", (256,), Tile(64, 64, 4, 2), targets=HOPPER, loads="tma", scores_only=True,
            layouts=("dense",), interior_loop=(),
            provenance="the two-loop path spills 8 B; packed, these tiles spill 256 B"),
    _older("bwd_dkdv", "bf16", 32, (64, 128, 8, 2), targets=HOPPER, loads="tma", scores_only=True, interior_loop=(),
           provenance="BM64_BN128_w8_s2 spills 8 B under 3.7"),
    *_rows("bwd_dkdv", "bf16", {16: (64, 128, 8, 2), 32: (64, 128, 8, 2), 64: (64, 128, 8, 2)}, targets=HOPPER,
           loads="tma", scores_only=True),
    TileRow("bwd_dkdv", "bf16", (128,), Tile(64, 64, 4, 1), targets=HOPPER, loads="tma", scores_only=True,
            interior_loop=(), provenance="the two-loop path spills 448 B"),
    # Any launch: pipelined, with every HGMMA as wide as an attn_mask tile and dropout leave registers for.
    _older("fwd", "bf16", 128, (128, 32, 8, 2), targets=HOPPER, loads="tma",
           provenance="BM128_BN64_w8_s2 spills 8-160 B under 3.6, 3.7, 3.8"),
    *_rows("fwd", "bf16", {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 128: (128, 64, 8, 2)}, targets=HOPPER,
           loads="tma"),
    _older("bwd_dq", "bf16", 16, (128, 32, 4, 1), targets=HOPPER, loads="tma",
           provenance="BM128_BN32_w4_s2 spills 8 B under 3.7"),
    _older("bwd_dq", "bf16", 128, (128, 32, 8, 3), targets=HOPPER, loads="tma",
           provenance="BM128_BN64_w8_s3 spills 8-112 B under 3.6, 3.7, 3.8"),
    TileRow("bwd_dq", "bf16", (128,), Tile(128, 32, 8, 3), targets=HOPPER, loads="tma", layouts=("packed",),
            provenance="BM128_BN64_w8_s3 spills 8 B packed, with dropout"),
    *_rows("bwd_dq", "bf16", {16: (128, 32, 4, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 3)}, targets=HOPPER,
           loads="tma"),
    _older("bwd_dkdv", "bf16", 64, (32, 128, 8, 1), targets=HOPPER, loads="tma",
           provenance="BM32_BN128_w8_s2 spills 8-80 B under 3.6, 3.8"),
    TileRow("bwd_dkdv", "bf16", (64,), Tile(32, 128, 8, 2), targets=HOPPER, loads="tma"),
    # 4. Every target: the largest tiles that compile without spills with every feature on (float mask, key and
    # query padding, causal, window, dropout) and for packed sequences.
    _older("fwd", "bf16", 128, (128, 16, 8, 2), targets=SMALL_SHARED_MEMORY,
           provenance="BM128_BN32_w8_s2 spills 16 B under 3.6"),
    *_rows("fwd", "bf16", {16: (128, 32, 8, 2), 32: (128, 32, 8, 2), 64: (128, 64, 8, 3), 128: (128, 32, 8, 2)}),
    _older("fwd", "bf16", 256, (32, 16, 8, 1), targets=HOPPER, loads="tma", interior_loop_tma=BOTH,
           provenance="BM32_BN32_w8_s1 spills 16 B under 3.7"),
    TileRow("fwd", "bf16", (256,), Tile(32, 16, 8, 1), targets=SMALL_SHARED_MEMORY, layouts=("packed",),
            interior_loop=(), tritons=TRITON_3_6, provenance="BM32_BN32_w8_s1 spills 8 B under 3.6"),
    TileRow("fwd", "bf16", (256,), Tile(32, 32, 8, 1), interior_loop=("dense",), interior_loop_tma=BOTH,
            provenance="the packed two-loop path spills 24-120 B"),
    _older("fwd", "fp32", 64, (32, 16, 8, 1), targets=(80, 90),
           provenance="BM32_BN32_w8_s1 spills 8-16 B under 3.6, 3.8 on sm_90, 8 B under 3.6, 3.7 on sm_80 (since the "
                      "dropout seed may come by value)"),
    TileRow("fwd", "fp32", (16,), Tile(64, 32, 8, 1), targets=HOPPER, tritons=TRITON_3_6,
            provenance="BM64_BN32_w8_s2 spills 8 B under 3.6 on sm_90 (since the dropout seed may come by value)"),
    TileRow("fwd", "fp32", (32,), Tile(32, 32, 8, 2), targets=HOPPER, score_mods=True, tritons=TRITON_3_6,
            provenance="BM64_BN32_w8_s2 spills 8 B under 3.6 at D32 with score modifiers (since the dropout seed may "
                       "come by value)"),
    _older("fwd", "fp32", 128, (16, 64, 8, 2), provenance="BM32_BN16_w8_s1 spills 8 B under 3.6, 3.8"),
    *_rows("fwd", "fp32", {16: (64, 32, 8, 2), 32: (64, 32, 8, 2), 64: (32, 32, 8, 1), 128: (32, 16, 8, 1)}),
    _older("bwd_dq", "bf16", 32, (128, 16, 8, 1), targets=(80, 86, 89), do_strides=False,
           provenance="BM128_BN32_w8_s2 spills 8 B under 3.6, 3.7"),
    _older("bwd_dq", "bf16", 64, (64, 32, 8, 1), targets=(80,), layouts=("packed",),
           provenance="BM128_BN32_w8_s1 spills 8 B under 3.6, 3.7"),
    *_rows("bwd_dq", "bf16", {16: (128, 32, 8, 2), 32: (128, 32, 8, 2), 64: (128, 32, 8, 1), 128: (64, 32, 8, 2)}),
    TileRow("bwd_dq", "bf16", (256,), Tile(32, 32, 8, 1), interior_loop_tma=("dense",),
            provenance="the packed two-loop path through TMA spills 680 B"),
    _older("bwd_dq", "fp32", 32, (32, 16, 8, 2), provenance="BM32_BN32_w8_s2 spills 16 B under 3.6, 3.7, 3.8"),
    TileRow("bwd_dq", "fp32", (16,), Tile(32, 32, 4, 1)),
    TileRow("bwd_dq", "fp32", (32,), Tile(32, 32, 8, 2), do_strides=False),
    _older("bwd_dq", "fp32", 64, (64, 16, 8, 1), targets=(80, 90), interior_loop=(),
           provenance="BM64_BN32_w8_s2 spills 16-40 B under 3.6"),
    TileRow("bwd_dq", "fp32", (64,), Tile(64, 32, 8, 2), interior_loop=(),
            provenance="the two-loop path spills 296-336 B"),
    TileRow("bwd_dq", "fp32", (128,), Tile(16, 16, 8, 1)),
    _older("bwd_dkdv", "bf16", 16, (32, 64, 8, 1), targets=(80, 86, 89),
           provenance="BM32_BN128_w8_s1 spills 8 B under 3.6, 3.7"),
    _older("bwd_dkdv", "bf16", 128, (16, 64, 4, 1), targets=HOPPER, loads="tma",
           provenance="BM16_BN64_w8_s1 spills 16-32 B under 3.6, 3.7, 3.8"),
    *_rows("bwd_dkdv", "bf16", {16: (32, 128, 8, 1), 32: (32, 128, 8, 1), 64: (16, 64, 4, 1), 128: (16, 64, 8, 1)}),
    TileRow("bwd_dkdv", "bf16", (256,), Tile(16, 32, 8, 1), interior_loop_tma=(),
            provenance="the two-loop path through TMA spills 704-752 B"),
    _older("bwd_dkdv", "fp32", 16, (32, 16, 8, 2), interior_loop=(), do_strides=False,
           provenance="BM32_BN64_w8_s1 spills 8-48 B under 3.6-3.8"),
    TileRow("bwd_dkdv", "fp32", (16,), Tile(16, 32, 4, 1),
            provenance="BM32_BN64_w8_s1 spills 32 B under 3.9 on sm_80 (since the dropout seed may come by value)"),
    TileRow("bwd_dkdv", "fp32", (32,), Tile(32, 64, 8, 1), targets=(80,), interior_loop=(), tritons=TRITON_3_6,
            provenance="BM32_BN64_w8_s2 spills 8-40 B under 3.6 (only) on sm_80"),
    TileRow("bwd_dkdv", "fp32", (32,), Tile(32, 32, 8, 1), targets=SMALL_SHARED_MEMORY, layouts=("packed",),
            tritons=SINCE_3_7, provenance=_PACKED_FP32_DKDV_SPILL),
    TileRow("bwd_dkdv", "fp32", (32,), Tile(32, 32, 8, 1), targets=(80, 90), layouts=("packed",), tritons=SINCE_3_9,
            provenance=_PACKED_FP32_DKDV_SPILL),
    TileRow("bwd_dkdv", "fp32", (32,), Tile(32, 64, 8, 2), interior_loop=(), do_strides=False,
            provenance="the two-loop path spills 8-48 B"),
    _older("bwd_dkdv", "fp32", 64, (16, 16, 8, 1), targets=(80, 90),
           provenance="BM16_BN32_w8_s1 spills 8-16 B under 3.6, 3.7"),
    _older("bwd_dkdv", "fp32", 128, (16, 64, 16, 1), interior_loop=(), do_strides=False,
           provenance="BM16_BN64_w8_s1 spills 8-24 B under 3.8"),
    TileRow("bwd_dkdv", "fp32", (64,), Tile(16, 32, 8, 1), do_strides=False),
    TileRow("bwd_dkdv", "fp32", (128,), Tile(16, 64, 8, 1)),
    _older("weights", "bf16", 256, (32, 16, 4, 1), targets=SMALL_SHARED_MEMORY,
           provenance="BM32_BN32_w4_s1 spills 8 B under 3.6"),
    *_rows("weights", "bf16", {16: (64, 64, 4, 1), 32: (64, 64, 4, 1), 64: (64, 64, 4, 1), 128: (64, 64, 4, 1),
                               256: (32, 32, 4, 1)}),
    *_rows("weights", "fp32", {16: (64, 64, 4, 1), 32: (64, 64, 4, 1), 64: (64, 64, 8, 1), 128: (32, 32, 8, 1)}),
)
# Small tiles under the interpreter, so short test sequences still cross several tiles.
INTERPRETER_TILE = Tile(32, 32, 1, 1)
# Whether the interpreter takes the TMA path (tests switch it on to check it against the pointer path; the
# interpreter reads descriptors as a GPU does, out-of-bounds blocks zero-filled).
TMA_UNDER_INTERPRETER = False
# A launch computing fewer scores (batch x heads x Lq x Lk) reads through pointers: each host TMA descriptor costs a
# launch about 5 us on an H200's host (3 in the forward, up to 11 in the backward), more than the few-microsecond
# kernel below this size gains from TMA. 2**24 scores are about 15 us of forward at head dim 64.
TMA_MIN_SCORES = 1 << 24
# float32 loads through TMA only in the tf32 forwards that have rows for it: exact float32 products run on the CUDA
# cores from registers, where staging the tiles in shared memory gains nothing (13 of those configs spilled with TMA
# on sm_90), and the tf32 backward's 64-row tiles spill.
TF32_TMA_HEAD_DIMS = tuple(sorted({d for row in TILE_ROWS if row.precision == "tf32" and row.loads == "tma"
                                   for d in row.head_dims}))


# The forward's tile orders (its TILE_ORDER constexpr): programs in grid order; the grid's query tiles reversed; a
# persistent grid whose programs walk the tiles, the heaviest first.
GRID_ORDER, HEAVIEST_FIRST, PERSISTENT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named way of running the attention kernels, beside the default one (``DEFAULT_VARIANT``): tile rows of its
    own tried before ``TILE_ROWS``, a tile order, or both. The bench's variants suite times each on the GPU it runs
    on and writes which one wins where (``kernels/variants.py``); the launchers run that one."""

    name: str
    kernels: Tuple[str, ...]  # the kernels it changes; the others run the default
    about: str
    rows: Tuple[TileRow, ...] = ()  # its own tiles, where they differ from TILE_ROWS' (the first match wins)
    tile_order: int = GRID_ORDER
    warp_specialize: bool = False
    # The launches it serves (the others run the default): precisions, head-dim buckets, scores-only ones only or not,
    # layouts.
    precisions: Tuple[str, ...] = PRECISIONS
    head_dims: Tuple[int, ...] = HEAD_DIM_BUCKETS
    scores_only: bool = False
    layouts: Tuple[str, ...] = BOTH
    targets: Tuple[int, ...] = ALL
    claims: Tuple[str, ...] = ()  # the SASS instructions it exists for, which the AOT report checks it issues
    refused: str = ""  # why the plan refuses it: no supported Triton release builds it
    builds_on: str = ""  # the refused variant whose code it would run (the report compiles that one only)


DEFAULT_VARIANT = "tiles"
# The launches the other variants serve: the bench's, where the GPU targets are (16-bit, head dims 64 and 128,
# scores-only and dense: no attn_mask, dropout or score modifier; key padding and causal masks).
MEASURED_LAUNCHES = dict(precisions=("bf16",), head_dims=(64, 128), scores_only=True, layouts=("dense",))
WARP_SPECIALIZE_REFUSED = (
    "no supported Triton (3.6-3.9) warp-specializes this kernel's key loop: with 8 warps their Hopper pass "
    "(tl.range(..., warp_specialize=True)) leaves the loop as it was (no setmaxnreg, which the AOT report checks), "
    "with 4 warps it fails (NVGPUWarpSpecialization); a bare FlashAttention loop of 64-row tiles and 4 warps builds "
    "under all four (setmaxnreg x8), so what stops it is this loop: masks, two loops, per-sequence descriptors")
VARIANTS: Tuple[Variant, ...] = (
    Variant(DEFAULT_VARIANT, KERNELS, "TILE_ROWS' tiles, programs in grid order"),
    Variant("heaviest_first", ("fwd", "bwd_dq"), "the grid's query tiles in reverse order (the forward, dq): the GPU "
            "starts programs in grid order, so under a causal mask the ones with the most keys start first",
            tile_order=HEAVIEST_FIRST,
            rows=(TileRow("fwd", "bf16", (128,), Tile(64, 32, 8, 2), targets=SMALL_SHARED_MEMORY, scores_only=True,
                          provenance="BM128_BN32_w8_s2 spills 8 B causal under 3.9"),),
            **MEASURED_LAUNCHES),
    Variant("persistent", ("fwd",), "as many programs as the SMs hold, each walking the tiles a grid's width apart, "
            "the last query tiles (the heaviest under a causal mask) first", tile_order=PERSISTENT,
            rows=(TileRow("fwd", "bf16", (128,), Tile(128, 64, 8, 3), targets=HOPPER, loads="tma", scores_only=True,
                          provenance="BM128_BN128_w8_s3 spills 104 B causal under 3.9"),
                  TileRow("fwd", "bf16", (128,), Tile(64, 32, 8, 2), targets=(80,), scores_only=True,
                          provenance="BM128_BN32_w8_s2 spills 8 B causal under 3.9")),
            **MEASURED_LAUNCHES),
    Variant("deep_pipeline", ("fwd", "bwd_dq", "bwd_dkdv"), "sm_90 through TMA: one more tile in flight than the "
            "default's rows (dk/dv at head dim 128 keeps the default's: BM64_BN64_w4_s2 spills 520 B under 3.9)",
            rows=(*_rows("fwd", "bf16", {64: (128, 128, 8, 4), 128: (128, 64, 8, 4)}, targets=HOPPER, loads="tma",
                         scores_only=True),
                  *_rows("bwd_dq", "bf16", {64: (128, 64, 8, 3), 128: (128, 64, 8, 4)}, targets=HOPPER, loads="tma",
                         scores_only=True),
                  TileRow("bwd_dkdv", "bf16", (64,), Tile(64, 128, 8, 3), targets=HOPPER, loads="tma", scores_only=True,
                          tritons=SINCE_3_7, provenance="spills 120 B under 3.6, which keeps the default's tiles")),
            claims=("HGMMA", "UTMALDG"), **MEASURED_LAUNCHES),
    Variant("warp_specialized", ("fwd",), "a producer warp loading K and V through TMA for consumer warpgroups "
            "(FlashAttention-3's split)", warp_specialize=True, claims=("USETMAXREG",), refused=WARP_SPECIALIZE_REFUSED,
            targets=HOPPER, **MEASURED_LAUNCHES),
    Variant("pingpong", ("fwd",), "two consumer warpgroups on 128 x 128 tiles taking turns at softmax and the "
            "GEMMs", warp_specialize=True, claims=("USETMAXREG",), builds_on="warp_specialized",
            refused="needs the warp-specialized loop: " + WARP_SPECIALIZE_REFUSED, targets=HOPPER, **MEASURED_LAUNCHES),
)
VARIANTS_BY_NAME = {variant.name: variant for variant in VARIANTS}
variants.register("attention.fwd", DEFAULT_VARIANT, {v.name: v.refused for v in VARIANTS if "fwd" in v.kernels})
variants.register("attention.bwd", DEFAULT_VARIANT,
                  {v.name: v.refused for v in VARIANTS if {"bwd_dq", "bwd_dkdv"} & set(v.kernels)})


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a launch needs beyond its arguments."""

    kernel: str
    tile: Tile
    use_tma: bool  # q/k/v/o/do (and dense dk/dv) through host-side TMA descriptors
    interior_loop: bool  # the kernel may run its unmasked interior tiles in a loop of their own
    dot_precision: str  # tl.dot's input_precision: "ieee" or "tf32"
    upcast: bool  # bfloat16 dots in float32 (the interpreter computes bfloat16 dots wrongly)
    do_strides: bool = True  # the backward reads do through its strides (``TileRow.do_strides``)
    variant: str = DEFAULT_VARIANT  # the variant this launch runs (``VARIANTS``; the default where the asked one
    # changes nothing for it)
    tile_order: int = GRID_ORDER  # the forward's and dq's TILE_ORDER
    warp_specialize: bool = False  # the forward's WARP_SPECIALIZE: its interior key loop warp-specialized

    def constexprs(self) -> dict:
        """The launch's tile constexprs."""
        constexprs = dict(BLOCK_M=self.tile.block_m, BLOCK_N=self.tile.block_n, USE_TMA=self.use_tma,
                          DOT_PRECISION=self.dot_precision, UPCAST=self.upcast)
        if self.kernel == "fwd":
            constexprs.update(TILE_ORDER=self.tile_order, WARP_SPECIALIZE=self.warp_specialize)
        if self.kernel == "bwd_dq":
            constexprs["TILE_ORDER"] = self.tile_order
        if self.kernel != "weights":
            constexprs["INTERIOR_LOOP"] = self.interior_loop
        if self.kernel in ("bwd_dq", "bwd_dkdv"):
            constexprs["DO_STRIDES"] = self.do_strides
        return constexprs


def head_dim_bucket(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


@functools.lru_cache(maxsize=4096)  # asked per launch once measured rows exist: a dict lookup, not a format
def shape_class(dtype: torch.dtype, head_dim: int, n_keys: int, causal: bool, scores_only: bool) -> str:
    """The class of shapes a measured variant row holds for (``kernels/variants.py``): 16-bit or float32, the head-dim
    bucket, causal or not, scores-only or not, the keys' power of two within 1024..16384: ``bf16/D128/causal/L4096``."""
    keys = min(max(next_power_of_2(max(n_keys, 1)), 1024), 16384)
    return (f"{'fp32' if dtype == torch.float32 else 'bf16'}/D{head_dim_bucket(head_dim)}/"
            f"{'causal' if causal else 'none'}{'' if scores_only else '/masked'}/L{keys}")


def precision_of(dtype: torch.dtype, allow_tf32: bool = False) -> str:
    """The plan's name for a launch's precision: "bf16" for 16-bit inputs, else "tf32" or "fp32"."""
    return "bf16" if dtype != torch.float32 else "tf32" if allow_tf32 else "fp32"


def takes_tma(kernel: str, precision: str, head_dim: int) -> bool:
    """Whether ``kernel`` in ``precision`` at ``head_dim`` loads through TMA where the target has it and TMA can
    address every input (the backward's two kernels load alike)."""
    if precision == "bf16":
        return True
    return precision == "tf32" and kernel == "fwd" and head_dim_bucket(head_dim) in TF32_TMA_HEAD_DIMS


@functools.lru_cache(maxsize=None)  # launches ask again and again; TILE_ROWS is fixed
def find_row(kernel: str, precision: str, head_dim: int, target: int, tma: bool, scores_only: bool, packed: bool,
             triton: Version, score_mods: bool = False, variant: str = DEFAULT_VARIANT) -> TileRow:
    """The first row of ``variant``'s own rows, then of ``TILE_ROWS``, that serves this launch under Triton release
    ``triton`` (tf32 falls back to exact float32's rows)."""
    bucket, layout = head_dim_bucket(head_dim), "packed" if packed else "dense"
    own = VARIANTS_BY_NAME[variant].rows
    for table in (own, TILE_ROWS) if own else (TILE_ROWS,):
        for asked in (precision, "fp32") if precision == "tf32" else (precision,):
            for row in table:
                if row.serves(kernel, asked, bucket, target, tma, scores_only, layout, triton, score_mods):
                    return row
    raise ValueError(f"attention: no tile for {kernel} in {precision} at head_dim={head_dim} on sm_{target}")


def plan(kernel: str, dtype: torch.dtype, head_dim: int, target: Optional[Target], *, allow_tf32: bool = False,
         tma_addressable: bool = True, scores_only: bool = False, packed: bool = False,
         triton: Optional[Version] = None, score_mods: bool = False, variant: str = DEFAULT_VARIANT,
         refused_too: bool = False) -> Plan:
    """The plan of a ``kernel`` launch on ``dtype`` inputs of ``head_dim`` on ``target`` (None: the interpreter),
    with products in tf32 or not, inputs that TMA can address or not (``_common.tma_addressable``), scores-only or not
    (no attn_mask tile, no dropout), on packed sequences or not, compiled by Triton release ``triton`` (default:
    the installed one), with softcap or ALiBi or not, in ``variant`` (``VARIANTS``; the plan says the default where
    the variant changes nothing for this kernel or launch). A refused variant raises, unless ``refused_too`` (the AOT
    report, which compiles it to check that it still does not build)."""
    chosen = VARIANTS_BY_NAME.get(variant)
    if chosen is None or (chosen.refused and not refused_too):
        raise ValueError(f"attention: variant {variant!r} " + (f"is refused: {chosen.refused}" if chosen else
                         f"is not one of {', '.join(VARIANTS_BY_NAME)}"))
    precision = precision_of(dtype, allow_tf32)
    serves = (kernel in chosen.kernels and precision in chosen.precisions and (scores_only or not chosen.scores_only)
              and head_dim_bucket(head_dim) in chosen.head_dims and ("packed" if packed else "dense") in chosen.layouts)
    if not serves:
        chosen = VARIANTS_BY_NAME[DEFAULT_VARIANT]
    tma = takes_tma(kernel, precision, head_dim) and tma_addressable
    if target is None:  # the interpreter: every tile order, on its small tiles
        variant = chosen.name if chosen.tile_order != GRID_ORDER else DEFAULT_VARIANT
        return Plan(kernel, INTERPRETER_TILE, tma and TMA_UNDER_INTERPRETER, True, "ieee", dtype == torch.bfloat16,
                    variant=variant, tile_order=chosen.tile_order)  # the interpreter has no warp specialization
    if target.capability not in chosen.targets:
        chosen = VARIANTS_BY_NAME[DEFAULT_VARIANT]
    tma = tma and target.tma
    row = find_row(kernel, precision, head_dim, target.capability, tma, scores_only, packed,
                   installed() if triton is None else triton, score_mods, chosen.name)
    changes = any(row is own for own in chosen.rows) or chosen.tile_order != GRID_ORDER or chosen.warp_specialize
    return Plan(kernel, row.tile, tma, row.interior_loop_for(tma, packed), "tf32" if allow_tf32 else "ieee", False,
                row.do_strides, chosen.name if changes else DEFAULT_VARIANT, chosen.tile_order, chosen.warp_specialize)
