"""The launch plumbing the attention kernels share: the masks and sequence bounds in kernel form (``MaskArgs``),
sizes and strides (``Layout``), grids, TMA descriptors, the input checks of the hardware path, and the output
layout. Dense outputs (o, dq, dk, dv) are [B, H, L, D] laid out as [B, L, H, D] (``empty_output``, the
packed layout with sequence b starting at row b L), so that a module merges the heads with a view. The backward
reads o in that layout and do through its own strides, in whatever layout autograd hands it, except on the rows
whose tiles spill doing so (``configs``' ``do_strides=False``): those read do in o's layout, ``output_layout``
copying a gradient that is not in it."""
import functools
from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ...contract import (
    NO_SCORE_MODS, AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Window, heads_interleaved_strides,
)
from .. import variants
from .._common import interpreting, positional_constexprs, tma_addressable, tma_descriptor
from ..targets import Target, target_of
from . import configs
from .jit import LOG2E, NO_SCORE_MOD, score_mod_args, score_mod_flags
from .lengths import padding_lengths

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# What kind of attn_mask a kernel reads (a constexpr): none, bool (True = may attend) or float (added).
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


class MaskArgs(NamedTuple):
    """Everything the kernels need to know about the masks and where each sequence lies, in kernel form."""

    mask: Optional[Tensor]  # attn_mask viewed as [B, H, Lq, Lk] with stride 0 on broadcast dims
    mask_kind: int
    padding: Optional[Tensor]  # [B, Lk] uint8
    key_lens: Optional[Tensor]  # [2, B] int32 (lengths.padding_lengths)
    query_lens: Optional[Tensor]  # [B] int32, or padding_lengths' [2, B], whose first row the kernels read
    query_padding: Optional[Tensor]  # [B, Lq] uint8
    cu_seqlens_q: Optional[Tensor]  # [B + 1] int32, packed sequences only
    cu_seqlens_k: Optional[Tensor]
    is_causal: bool
    causal_offset: int  # the alignment offset, when it is one for every sequence
    per_sequence_offset: bool  # bottom_right aligned per sequence (computed in the kernel)
    window: Optional[Tuple[int, int]]  # (left, right) as the kernels take it, see kernel_window
    # Score modifiers and sinks (the forward and backward kernels only, not the weights kernel):
    mods: ScoreMods = NO_SCORE_MODS
    sinks: Optional[Tensor] = None  # float32 [H] contiguous
    # What must run before a kernel reads these, as launch_kernel's arguments: the padding lengths' kernel
    launches: Tuple[tuple, ...] = ()

    def pointer_args(self) -> tuple:
        return (self.mask, self.padding, self.key_lens, self.query_lens, self.query_padding, self.cu_seqlens_q,
                self.cu_seqlens_k)

    def stride_args(self) -> tuple:
        mask_strides = self.mask.stride() if self.mask is not None else (0, 0, 0, 0)
        return (*mask_strides, self.padding.stride(0) if self.padding is not None else 0,
                self.query_padding.stride(0) if self.query_padding is not None else 0)

    def offset_args(self) -> tuple:
        return (self.causal_offset, *(self.window if self.window is not None else (0, 0)))

    def score_args(self) -> tuple:
        """SINKS, MODS (``jit.score_mod_args``)."""
        return self.sinks, score_mod_args(self.mods)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def modifies_scores(self) -> bool:
        """Whether a score modifier is given (``configs``' score_mods launches; sinks change no score)."""
        return self.mods is not NO_SCORE_MODS and bool(self.mods.given)

    def scores_only(self, dropout_p: float) -> bool:
        """Whether the scores read no attn_mask element, draw no dropout number and take no score modifier
        (``configs``' scores-only launches)."""
        return self.mask_kind == MASK_NONE and dropout_p == 0.0 and not self.modifies_scores

    def kind(self) -> tuple:
        """What the kernels specialise on (``KIND_CONSTEXPRS``' values, in order): launches of one kind share their
        constexprs and plan."""
        return (self.mask_kind, self.padding is not None, self.query_lens is not None, self.query_padding is not None,
                self.is_causal, self.window is not None, self.per_sequence_offset, self.cu_seqlens_q is not None,
                self.mask is not None and mask_offsets_need_int64(self.mask),
                NO_SCORE_MOD if self.mods is NO_SCORE_MODS else score_mod_flags(self.mods), self.sinks is not None)

    def constexprs(self, score_modifiers: bool = True) -> dict:
        """The kernels' constexprs of the masks and, with ``score_modifiers``, of the score modifiers (the forward
        and backward kernels take them, the weights kernel does not)."""
        names = KIND_CONSTEXPRS if score_modifiers else KIND_CONSTEXPRS[:-2]
        return dict(zip(names, self.kind()))


KIND_CONSTEXPRS = ("MASK_KIND", "HAS_PADDING", "HAS_QUERY_LENS", "HAS_QUERY_PADDING", "IS_CAUSAL", "HAS_WINDOW",
                   "PER_SEQUENCE_OFFSET", "VARLEN", "MASK_OFFSETS_64", "SCORE_MODS", "HAS_SINKS")


def row_strides(t: Tensor) -> Tuple[int, int, int]:
    """The (batch, head, row) strides of a dense ``[B, H, L, D]`` or a packed ``[T, H, D]`` tensor, as the kernels
    take them (packed: batch stride 0)."""
    if t.dim() == 4:
        return t.stride()[:3]
    return 0, t.stride(1), t.stride(0)


class Layout(NamedTuple):
    """Sizes and (batch, head, row) strides of q, k and v as the kernels take them: dense ``[B, H, L, D]``, or
    packed ``[T, H, D]`` (batch stride 0: the kernels find each sequence's rows through cu_seqlens)."""

    batch: int
    heads: int
    kv_heads: int
    n_queries: int  # Lq; packed: max_seqlen_q
    n_keys: int  # Lk; packed: max_seqlen_k
    head_dim: int
    q_strides: Tuple[int, int, int]
    k_strides: Tuple[int, int, int]
    v_strides: Tuple[int, int, int]

    @staticmethod
    def dense(q: Tensor, k: Tensor, v: Tensor) -> "Layout":
        (batch, heads, lq, head_dim), (_, kv_heads, lk, _) = q.shape, k.shape
        if lq * heads > MAX_DENSE_OUTPUT_ROWS:
            raise ValueError(f"triton attention: q {tuple(q.shape)} has Lq x heads = {lq * heads} rows of o per "
                             f"batch element; at most {MAX_DENSE_OUTPUT_ROWS} are supported")
        return Layout(batch, heads, kv_heads, lq, lk, head_dim, *map(row_strides, (q, k, v)))

    @staticmethod
    def packed(q: Tensor, k: Tensor, v: Tensor, batch: int, max_seqlen_q: int, max_seqlen_k: int) -> "Layout":
        (_, heads, head_dim), kv_heads = q.shape, k.shape[1]
        return Layout(batch, heads, kv_heads, max_seqlen_q, max_seqlen_k, head_dim, *map(row_strides, (q, k, v)))

    @property
    def kv_group(self) -> int:
        return self.heads // self.kv_heads


# Offsets at or past this need int64 arithmetic in the kernels.
INT32_OFFSET_LIMIT = 2**31
# Lq x heads of one batch element: _row_index indexes those rows of o / do / dq in int32.
MAX_DENSE_OUTPUT_ROWS = 2**31 - 1
# CUDA's limits on grid axis 0 and on axes 1 and 2.
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535


def mask_offsets_need_int64(mask: Tensor) -> bool:
    """Whether an element of one (batch, head) slice of ``mask`` ``[B, H, Lq, Lk]`` lies 2**31 elements or more
    from the slice's first: its row and column offsets must then be computed in int64."""
    rows, cols = mask.shape[2:]
    return max(rows - 1, 0) * abs(mask.stride(2)) + max(cols - 1, 0) * abs(mask.stride(3)) >= INT32_OFFSET_LIMIT


def grid(tiles: int, batch: int, heads: int) -> Tuple[int, int, int]:
    """(tiles, heads, batch), the order ``jit._batch_head`` reads, within CUDA's limits or a clear error."""
    if tiles <= MAX_GRID_X and heads <= MAX_GRID_YZ and batch <= MAX_GRID_YZ:
        return (tiles, heads, batch)
    axes = (("tiles", tiles, MAX_GRID_X), ("heads", heads, MAX_GRID_YZ), ("batch", batch, MAX_GRID_YZ))
    for name, size, limit in axes:
        if size > limit:
            raise ValueError(f"triton attention: {name}={size} is more than a CUDA grid axis holds ({limit}); "
                             "split the batch or the sequence")
    return (tiles, heads, batch)


def kernel_window(window: Window, is_causal: bool, unlimited: int) -> Optional[Tuple[int, int]]:
    """``window`` (``contract.Window``) as the kernels take it, None without one. A side that is None, or wider than
    ``unlimited`` (Lq + Lk, beyond which no alignment offset reaches a key), becomes ``unlimited``, so the kernels'
    int32 sums stay in range; causal caps right at 0 (key j <= i + o)."""
    if window is None:
        return None
    left = unlimited if window[0] is None else min(int(window[0]), unlimited)
    right = unlimited if window[1] is None else min(int(window[1]), unlimited)
    return (left, min(right, 0) if is_causal else right)


def mask_args(q: Tensor, k: Tensor, masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods = NO_SCORE_MODS,
              sinks: Optional[Tensor] = None) -> MaskArgs:
    """The masks of a dense launch (q ``[B, H, Lq, D]``, k ``[B, Hkv, Lk, D]``) in kernel form; the launches that
    compute their padding lengths in ``MaskArgs.launches``, for the caller to make first."""
    (batch, heads, lq, _), lk = q.shape, k.shape[2]
    attn_mask, key_padding_mask, query_padding_mask, query_lengths = masks
    mask, mask_kind = None, MASK_NONE
    if attn_mask is not None:
        mask = attn_mask.expand(batch, heads, lq, lk)
        if attn_mask.dtype == torch.bool:
            mask, mask_kind = mask.view(torch.uint8), MASK_BOOL
        else:
            mask_kind = MASK_FLOAT
    padding = key_lens = None
    launches: Tuple[tuple, ...] = ()
    if key_padding_mask is not None:
        padding = key_padding_mask.contiguous().view(torch.uint8)
        key_lens, launches = padding_lengths(padding)
    query_lens = query_padding = None
    if query_lengths is not None:
        query_lens = query_lengths.to(device=q.device, dtype=torch.int32).clamp(0, lq).contiguous()
    if query_padding_mask is not None:
        if query_lens is not None:  # one query mask: rows past query_lengths are padding too
            query_padding_mask = query_padding_mask | (
                torch.arange(lq, device=q.device, dtype=torch.int32)[None, :] >= query_lens[:, None])
        query_padding = query_padding_mask.contiguous().view(torch.uint8)
        query_lens, query_launches = padding_lengths(query_padding)  # the kernels read its first row
        launches += query_launches
    window = kernel_window(spec.window, spec.is_causal, lq + lk)
    aligned = spec.bottom_right and (spec.is_causal or window is not None or mods is not NO_SCORE_MODS)
    return MaskArgs(mask, mask_kind, padding, key_lens, query_lens, query_padding, None, None, spec.is_causal,
                    lk - lq if aligned else 0, aligned and query_padding is not None, window, mods,
                    None if sinks is None else sinks.contiguous(), launches)


def varlen_mask_args(seqs: PackedSequences, spec: AttentionSpec, mods: ScoreMods = NO_SCORE_MODS,
                     sinks: Optional[Tensor] = None) -> MaskArgs:
    """The sequence bounds of a packed launch in kernel form."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = seqs
    window = kernel_window(spec.window, spec.is_causal, max_seqlen_q + max_seqlen_k)
    aligned = spec.bottom_right and (spec.is_causal or window is not None or mods is not NO_SCORE_MODS)
    return MaskArgs(
        None, MASK_NONE, None, None, None, None, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), spec.is_causal,
        0, aligned, window, mods, None if sinks is None else sinks.contiguous(),
    )


def tiles_of(x: Tensor, rows: int, block_d: int, use_tma: bool) -> Union[Tensor, TensorDescriptor]:
    """What a kernel takes for an input it loads in [rows, block_d] tiles: ``x`` itself, or with ``use_tma`` a
    descriptor over ``x`` seen as [B, H, L, D] (packed [T, H, D] as [1, H, T, D]), as ``_tma_tile`` reads it."""
    if not use_tma:
        return x
    if x.dim() == 3:
        x = x.transpose(0, 1).unsqueeze(0)
    return tma_descriptor(x, [1, 1, rows, block_d])


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if not (q.dtype in SUPPORTED_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"triton attention: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    head_dim = q.shape[-1]
    if not 0 <= head_dim <= configs.MAX_HEAD_DIM["bf16"]:
        raise ValueError(f"triton attention: head_dim={head_dim} is not supported (0..{configs.MAX_HEAD_DIM['bf16']})")
    if q.dtype == torch.float32 and head_dim > configs.MAX_HEAD_DIM["fp32"]:
        raise ValueError(
            f"triton attention: float32 supports head_dim up to {configs.MAX_HEAD_DIM['fp32']}, got {head_dim}; "
            "use float16/bfloat16 inputs (any head_dim up to 256) or the reference backend"
        )


def empty_output(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """An empty output shaped as ``like`` in the layout the kernels write: dense ``[B, H, L, D]`` laid out as
    ``[B, L, H, D]`` (``contract.heads_interleaved_strides``), packed ``[T, H, D]`` contiguous; in ``dtype`` (default:
    like's)."""
    if like.dim() == 4:
        return like.new_empty_strided(like.shape, heads_interleaved_strides(like.shape), dtype=dtype)
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def empty_lse(q: Tensor, packed: bool = False) -> Tensor:
    """The forward's float32 LSE of ``q``'s rows, contiguous: ``[B, H, Lq]``, packed ``[H, Tq]`` (allocated with its
    strides: ``new_empty`` takes about twice as long on the host)."""
    if packed:
        tokens, heads = q.shape[:2]
        return q.new_empty_strided((heads, tokens), (tokens, 1), dtype=torch.float32)
    batch, heads, rows = q.shape[:3]
    return q.new_empty_strided((batch, heads, rows), (heads * rows, rows, 1), dtype=torch.float32)


def output_layout(t: Tensor) -> Tensor:
    """``t`` in the kernels' output layout, which the backward reads o in: copied unless it already is (as the
    forward's o is)."""
    if t.dim() != 4:
        return t.contiguous()
    strides, wanted = t.stride(), heads_interleaved_strides(t.shape)
    if strides == wanted or all(size <= 1 or stride == want for size, stride, want in zip(t.shape, strides, wanted)):
        return t
    return t.new_empty_strided(t.shape, wanted).copy_(t)


def launch_target(device: torch.device) -> Optional[Target]:
    """The target a launch on ``device`` plans for: None under the interpreter."""
    return None if interpreting() else target_of(device)


def tma_can_load(inputs: Tuple[Tensor, ...], layout: Layout) -> bool:
    """Whether the launch on ``layout`` loads (and stores) ``inputs`` through TMA: the target has it (under the
    interpreter, when ``configs.TMA_UNDER_INTERPRETER``), the launch has ``configs.TMA_MIN_SCORES`` scores to compute
    at least, and TMA can address each input (``_common.tma_addressable``)."""
    if interpreting():
        has_tma = configs.TMA_UNDER_INTERPRETER
    else:
        has_tma = (layout.batch * layout.heads * layout.n_queries * layout.n_keys >= configs.TMA_MIN_SCORES
                   and target_of(inputs[0].device).tma)
    return has_tma and all(map(tma_addressable, inputs))


def shared_args(layout: Layout, masks: MaskArgs, scale: float, dropout_p: float,
                seed: Tuple[Optional[Tensor], int]) -> tuple:
    """The arguments the forward kernel and both backward kernels take, in this order, after their own tensors;
    ``seed`` as ``_common.seed_args`` gives it."""
    return (*masks.pointer_args(), *layout.q_strides, *layout.k_strides, *layout.v_strides, *masks.stride_args(),
            layout.heads, layout.kv_group, layout.n_queries, layout.n_keys, *masks.offset_args(), scale * LOG2E,
            dropout_p, *seed, *masks.score_args())


class LaunchArgs(NamedTuple):
    """What the forward and backward launches of a call share: its layout, its masks in kernel form, the
    ``shared_args`` and, where it was made once for many calls, the launch key of the first ``keyed_args`` of them
    (those before the seed; ``_common.runtime_keys``' number, else None)."""

    layout: Layout
    masks: MaskArgs
    args: tuple
    args_key: Optional[int] = None
    keyed_args: int = 0


def cached_key_of(start: int, launch_args: LaunchArgs) -> Optional[Tuple[int, int, int]]:
    """``_common.launch_kernel``'s ``cached_key`` for a kernel whose ``launch_args.args`` start at parameter ``start``."""
    return None if launch_args.args_key is None else (start, start + launch_args.keyed_args, launch_args.args_key)


class Launch(NamedTuple):
    """What a kind of launch shares (``launch_options``): its plan, the values of the kernel's constexpr parameters
    (``_common.positional_constexprs``), its warps and stages."""

    plan: configs.Plan
    constexprs: tuple
    num_warps: int
    num_stages: int


# The launches so far, by what decides them (``launch_options``). A replaced ``configs.plan`` (a test that records or
# changes the plans) is asked at every launch instead.
_LAUNCHES: Dict[tuple, Launch] = {}
_PLANNER = configs.plan


def chosen_variant(op: str, q: Tensor, layout: Layout, masks: MaskArgs, dropout_p: float) -> str:
    """The variant of ``op`` ("attention.fwd", "attention.bwd") a launch on ``layout`` runs: the one the variant rows
    name for this GPU and shape class, forced or measured (``kernels/variants.py``), else the default."""
    return variants.chosen(op, q.device, lambda: configs.shape_class(
        q.dtype, layout.head_dim, layout.n_keys, masks.is_causal, masks.scores_only(dropout_p)))


# Persistent programs under the interpreter: few, so that the tests' short sequences give each several tiles.
INTERPRETER_PERSISTENT_PROGRAMS = 3
# The SM count the launcher plans for where there is no CUDA device to ask (the interpreter): an H100's.
DEFAULT_SM_COUNT = 132


def sm_count_of(device: torch.device) -> int:
    """The SMs of ``device`` (CUDA), else ``DEFAULT_SM_COUNT``."""
    if device.type == "cuda" and not interpreting():
        return _cuda_sm_count(device)
    return DEFAULT_SM_COUNT


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(device: torch.device, tile: configs.Tile, tiles: int) -> int:
    """The grid of a persistent launch of ``tiles`` tiles: as many programs as the SMs hold at once (two of four
    warps, one of eight or more, as the sm_90 tiles' shared memory allows), at most one per tile."""
    if interpreting():
        return max(1, min(tiles, INTERPRETER_PERSISTENT_PROGRAMS))
    return max(1, min(tiles, sm_count_of(device) * max(1, 8 // tile.num_warps)))


def launch_options(kernel: str, jit_kernel: object, q: Tensor, head_dim: int, masks: MaskArgs, dropout_p: float,
                   allow_tf32: bool, tma_loadable: bool, has_dlse: bool = False,
                   variant: str = configs.DEFAULT_VARIANT) -> Launch:
    """The ``Launch`` of ``jit_kernel`` (``configs.plan``'s ``kernel``) on ``q``'s dtype and device with these masks
    and dropout, on inputs TMA can load or not (``tma_can_load``), reading the LSE's gradient or not (the dq
    kernel), in ``variant`` (``chosen_variant``): made once per kind of launch."""
    key = (kernel, q.dtype, q.device, head_dim, allow_tf32, tma_loadable, dropout_p > 0.0, has_dlse, masks.kind(),
           configs.TMA_UNDER_INTERPRETER, variant)
    found = _LAUNCHES.get(key)
    if found is None or configs.plan is not _PLANNER:
        plan = configs.plan(kernel, q.dtype, head_dim, launch_target(q.device), allow_tf32=allow_tf32,
                            tma_addressable=tma_loadable, scores_only=masks.scores_only(dropout_p), packed=masks.packed,
                            score_mods=masks.modifies_scores, variant=variant)
        values = dict(BLOCK_D=configs.head_dim_bucket(head_dim), HEAD_DIM=head_dim,
                      **masks.constexprs(score_modifiers=kernel != "weights"), **plan.constexprs())
        if kernel != "weights":
            values["HAS_DROPOUT"] = dropout_p > 0.0
        if kernel == "bwd_dq":
            values["HAS_DLSE"] = has_dlse
        found = Launch(plan, positional_constexprs(jit_kernel, values), plan.tile.num_warps, plan.tile.num_stages)
        if configs.plan is _PLANNER:
            _LAUNCHES[key] = found
    return found
