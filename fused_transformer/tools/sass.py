"""What a kernel's SASS (``cuobjdump -sass``) issues: its tensor-core instructions (``HMMA`` / ``HGMMA``, shape and
count), its global-to-shared copy kind and its main loop, with the other instructions that loop issues per MMA. The
report (``fused_transformer.tools.report``) reads these figures from every config it compiles."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

WARPS_PER_WARPGROUP = 4  # an HGMMA is issued by all 4 warps of a warpgroup and computes its 64xNxK tile once
# One SASS instruction as cuobjdump prints it: "/*3e90*/  @!P5 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;".
_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@(!?U?P(?:T|\d+))\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_HMMA_SHAPE = re.compile(r"HMMA\.(16|8)(8)(16|8|4)\b")  # HMMA.16816: m16 n8 k16, per warp
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\b")  # HGMMA.64x128x16: m64 n128 k16, per warpgroup
# Global-to-shared copies, fastest kind first: TMA tensor and bulk copies (sm_90), cp.async (sm_80 and later).
ASYNC_COPY_KINDS = ("UTMALDG", "UBLKCP", "LDGSTS")


@dataclasses.dataclass(frozen=True)
class SassInstruction:
    address: int
    opcode: str  # with its modifiers: "HMMA.16816.F32.BF16"
    operands: str
    predicate: str = ""  # "P0", "!P5", ...; empty when the instruction always runs


@dataclasses.dataclass(frozen=True)
class SassFigures:
    """What ``analyse_sass`` reads from one kernel's SASS (the ``AotResult`` fields of the same names)."""

    mma_counts: Tuple[Tuple[str, int], ...]
    async_copy: str
    loop_instructions: int
    loop_mma_instructions: int
    loop_macs_per_warp: int
    serialized_mmas: int


def parse_sass(sass: str) -> List[SassInstruction]:
    """The instructions of ``cuobjdump -sass`` output, in address order."""
    return [SassInstruction(int(address, 16), opcode, operands.strip(), predicate)
            for address, predicate, opcode, operands in _SASS_INSTRUCTION.findall(sass)]


def mma_macs_per_warp(opcode: str) -> int:
    """Multiply-accumulates one warp's share of an MMA instruction computes (0: not an MMA). An HMMA is a warp's
    own m x n x k product; an HGMMA's m x n x k product is shared by the 4 warps of the warpgroup that issue it."""
    match = _HMMA_SHAPE.match(opcode)
    if match:
        m, n, k = map(int, match.groups())
        return m * n * k
    match = _HGMMA_SHAPE.match(opcode)
    if match:
        m, n, k = map(int, match.groups())
        return m * n * k // WARPS_PER_WARPGROUP
    return 0


def async_copy_kind(instructions: Sequence[SassInstruction]) -> str:
    """The global-to-shared copy kinds used ("UTMALDG", "LDGSTS", ... joined by "+"), else "LDG" when the kernel
    reads global memory with plain loads only, else "-"."""
    kinds = {i.opcode.split(".")[0] for i in instructions}
    found = [kind for kind in ASYNC_COPY_KINDS if kind in kinds]
    if found:
        return "+".join(found)
    return "LDG" if "LDG" in kinds else "-"


def loops(instructions: Sequence[SassInstruction]) -> List[Tuple[int, int]]:
    """``(first, last)`` indices (inclusive) of every loop: from the target of a backward ``BRA`` to the branch.
    Not loops: a branch to itself (the trap after ``EXIT``, a spin-wait), and the jumps back into the kernel from
    the out-of-line code ptxas places after the last unconditional ``EXIT`` (e.g. mbarrier wait retries on sm_90),
    whose span would hold the whole kernel."""
    index_at = {instruction.address: index for index, instruction in enumerate(instructions)}
    exits = [index for index, i in enumerate(instructions) if i.opcode == "EXIT" and not i.predicate]
    end = exits[-1] if exits else len(instructions)
    found = []
    for last, instruction in enumerate(instructions[:end]):
        if instruction.opcode.split(".")[0] != "BRA":
            continue
        targets = re.findall(r"0x([0-9a-f]+)", instruction.operands)
        first = index_at.get(int(targets[-1], 16)) if targets else None
        if first is not None and first < last:
            found.append((first, last))
    return found


_HGMMA_FLAGS = ("gsb0", "!UPT", "UPT")  # scoreboard and accumulate-predicate operands after an HGMMA's registers


def serialized_mmas(instructions: Sequence[SassInstruction]) -> int:
    """HGMMAs that accumulate onto the HGMMA just before them (the next K step of one product) after a
    ``WARPGROUP.DEPBAR`` wait for it. A pipelined product issues its HGMMAs back to back and waits once; ptxas
    serializes them instead when it cannot prove the accumulator registers untouched in between (its C7515 note,
    "wgmma.mma_async instructions are serialized"), and each K step then waits out the whole MMA latency."""
    serialized, waited, previous_dst = 0, False, None
    for instruction in instructions:
        if instruction.opcode.startswith("WARPGROUP.DEPBAR"):
            waited = True
        elif _HGMMA_SHAPE.match(instruction.opcode):
            # "R24, gdesc[UR8], R24, gsb0" (A and B in shared memory) or "R88, R152, gdesc[UR8].tnspB, R88"
            # (A in registers): destination first, accumulator input last, then flags.
            operands = [o.strip() for o in instruction.operands.split(",") if o.strip() not in _HGMMA_FLAGS]
            if waited and operands[0] == previous_dst and operands[-1] == operands[0]:
                serialized += 1
            waited, previous_dst = False, operands[0]
    return serialized


def main_loop(instructions: Sequence[SassInstruction]) -> Optional[Tuple[int, int]]:
    """``(first, last)`` indices (inclusive) of the main loop: of the innermost loops with MMA instructions (those
    holding no other loop with one), the one with the most, and the shortest among equals (a causal kernel's
    unmasked loop rather than its diagonal one); None when no loop has an MMA."""
    is_mma = [bool(mma_macs_per_warp(i.opcode)) for i in instructions]
    with_mma = [(first, last) for first, last in loops(instructions) if any(is_mma[first:last + 1])]
    innermost = [(first, last) for first, last in with_mma
                 if not any(first <= inner_first and inner_last <= last and (inner_first, inner_last) != (first, last)
                            for inner_first, inner_last in with_mma)]
    if not innermost:
        return None
    return max(innermost, key=lambda loop: (sum(is_mma[loop[0]:loop[1] + 1]), loop[0] - loop[1]))


def analyse_sass(sass: str) -> SassFigures:
    """MMA opcodes and counts, async-copy kind and main-loop figures of one kernel's ``cuobjdump -sass`` output."""
    instructions = parse_sass(sass)
    mma_counts: Dict[str, int] = {}
    for instruction in instructions:
        if mma_macs_per_warp(instruction.opcode):
            mma_counts[instruction.opcode] = mma_counts.get(instruction.opcode, 0) + 1
    loop = main_loop(instructions)
    body = instructions[loop[0]:loop[1] + 1] if loop else []
    macs = [mma_macs_per_warp(i.opcode) for i in body]
    return SassFigures(
        mma_counts=tuple(sorted(mma_counts.items(), key=lambda item: (-mma_macs_per_warp(item[0]), item[0]))),
        async_copy=async_copy_kind(instructions),
        loop_instructions=len(body), loop_mma_instructions=sum(map(bool, macs)), loop_macs_per_warp=sum(macs),
        serialized_mmas=serialized_mmas(instructions),
    )
