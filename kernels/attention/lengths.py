"""What a padding mask tells the attention kernels, in one launch: per row b of a mask ``[B, L]`` (1 = padding)

    LENGTHS[0, b] = one past its last position that is not padding (0 for a row of padding only)
    LENGTHS[1, b] = how many positions come before its first padding position (L if none)

equal for a right-padded row. The kernels read the first row as a sequence's key (or query) length, past which
they visit no tile, and the second as the keys whose tiles need no padding mask (``jit._leading_real_keys``).
Composed of torch ops the two rows took eight launches (a negation, a cumulative product, a sum, an arange, a
where, a max, a stack and a cast): about 30 us of host time per masked call on the CPU, more on a GPU's host.
"""
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..aot import AotKernel
from ..toolchain import Version

Tensor = torch.Tensor

BLOCK = 1024  # positions a program reads at a time
NUM_WARPS = 4


@triton.jit
def _padding_lengths_kernel(
    PAD,  # [B, L] uint8 (a bool mask viewed), 1 = padding; rows stride_pb apart, positions contiguous
    LENGTHS,  # [2, B] int32, contiguous
    n_rows, length, stride_pb,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = PAD + row.to(tl.int64) * stride_pb
    last_real = tl.zeros((BLOCK,), dtype=tl.int32)  # per lane: one past the last real position it saw
    first_pad = tl.zeros((BLOCK,), dtype=tl.int32) + length  # per lane: the first padding position it saw
    for start in range(0, length, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        is_pad = tl.load(base + cols, mask=cols < length, other=1) != 0  # past the end: padding, at or past L
        last_real = tl.maximum(last_real, tl.where(is_pad, 0, cols + 1))
        first_pad = tl.minimum(first_pad, tl.where(is_pad, cols, length))
    tl.store(LENGTHS + row, tl.max(last_real, axis=0))
    tl.store(LENGTHS + n_rows + row, tl.min(first_pad, axis=0))


def padding_lengths(padding: Tensor) -> Tuple[Tensor, Tuple[tuple, ...]]:
    """``LENGTHS`` (int32 ``[2, B]``, above) of ``padding``, a ``[B, L]`` mask viewed as uint8 with its last dim
    contiguous, computed on its device (the host never waits) by the launch returned with it (``launch_kernel``'s
    arguments; none for no row: a grid of 0 programs is an error on a GPU), which the caller makes before a kernel
    reads them."""
    rows, length = padding.shape
    lengths = torch.empty((2, rows), dtype=torch.int32, device=padding.device)
    if not rows:
        return lengths, ()
    return lengths, ((_padding_lengths_kernel, (rows,), (padding, lengths, rows, length, padding.stride(0), BLOCK),
                      NUM_WARPS),)


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """The one config ``padding_lengths`` launches, on every target and Triton release."""
    return [AotKernel(
        name="attention_padding_lengths", config=f"BLOCK={BLOCK}_w{NUM_WARPS}", fn=_padding_lengths_kernel,
        signature={"PAD": "*u8", "LENGTHS": "*i32", "n_rows": "i32", "length": "i32", "stride_pb": "i32"},
        constexprs={"BLOCK": BLOCK}, num_warps=NUM_WARPS, num_stages=1,
        divisible_by_16=("PAD", "LENGTHS"),
    )]
