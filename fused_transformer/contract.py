"""What every op's contract shares, and attention's backend interface: the types every attention backend takes
(``AttentionMasks``, ``AttentionSpec``, ``ScoreMods``, ``PackedSequences``, ``KVCache``), the dtypes, seeds, autocast
rules and the checks every op's own contract is written with (``check_tensor``, ``check_same``, ``describe``). Each
op's own checks live in its module (``fused_transformer.ops``: attention's in ``ops.attention.contract``). Nothing here
imports another module of the package.

The backend interface, below autograd. The Triton backend (``fused_transformer.kernels.backend``) and the C++ one
(``fused_transformer.cpu_ops``) export these raw functions: no autograd, outputs allocated by the callee, every
argument checked before; ``fused_transformer.ops.attention.function`` writes each Function once above them::

    attention_fwd(q, k, v, masks, spec, mods, sinks, seed, float_output, for_backward=None) -> (o, lse)
    attention_bwd(do, dlse, q, k, v, o, lse, masks, spec, mods, seed, for_backward=None) -> (dq, dk, dv)
    attention_varlen_fwd(q, k, v, seqs, spec, mods, sinks, seed, float_output, for_backward=None) -> (o, lse)
    attention_varlen_bwd(do, dlse, q, k, v, o, lse, seqs, spec, mods, seed, for_backward=None) -> (dq, dk, dv)
    attention_weights(q, k, lse, masks, spec) -> weights [B, H, Lq, Lk]
    attention_with_kvcache(q, cache, mods, sinks, spec, k_new, v_new) -> (out [B, Lq, H, D], lse)

Shapes: attention q ``[B, H, Lq, D]``, k / v ``[B, Hkv, Lk, D]``, o ``[B, H, Lq, D]`` (laid out as the backend writes
it), lse ``[B, H, Lq]``; packed q ``[Tq, H, D]``, lse ``[H, Tq]``, ``seqs`` a ``PackedSequences``; lse in
``stats_dtype``, the sinks in it, so the backward needs no sinks; ``dlse`` None when the LSE was not used; o in
float32 with ``float_output`` (16-bit inputs whose sinks need a gradient, ``ops.attention.function.sinks_gradient``); ``mods`` a
``ScoreMods`` (``NO_SCORE_MODS`` for none), the sinks apart (they change no score); ``seed`` from
``draw_dropout_seed`` or None without dropout; ``for_backward`` a dict the forward may fill with what it derived from
its arguments (the masks and strides in the kernels' form), handed unchanged to the backward of the same call, which
then need not derive it again (None: nothing kept). The other ops write down their launchers' interface in their own
modules (``fused_transformer.ops``). What a backend computes (score modifiers, sinks) is data in
``fused_transformer.route.SUPPORTS``, which sends a call it lacks to the reference, and a call torch's own ops run
faster to them (``route``). ``attention_with_kvcache`` is forward only: with ``k_new`` / ``v_new`` (only for a backend
whose function has ``appends_new_keys``) it writes them into the cache itself, else they are in the cache already. The
reference backend (``fused_transformer.reference``) takes the same calls composed of torch ops and differentiated by
autograd: the oracle does not go through the Functions it checks.
"""
from __future__ import annotations

import math
import os
import numbers
from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")

# ``(left, right)``: query i sees keys i + o - left .. i + o + right, a side that is None is unlimited; None: no window.
# The kernels take the two sides as ints, -1 for no limit (``window_bounds``, FlashAttention's convention).
Window = Optional[Tuple[Optional[int], Optional[int]]]
NO_LIMIT = -1


def window_bounds(window: Window) -> Tuple[int, int]:
    """``window`` (checked) as the kernels take it: ``(left, right)`` ints, ``NO_LIMIT`` for an unlimited side."""
    if window is None:
        return (NO_LIMIT, NO_LIMIT)
    left, right = window
    return (NO_LIMIT if left is None else left, NO_LIMIT if right is None else right)


def window_of_bounds(left: Optional[int], right: Optional[int]) -> Window:
    """The ``Window`` of kernel-style sides (None or negative: no limit), normalised as ``check_window`` does."""
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    return None if left is None and right is None else (left, right)


class AttentionMasks(NamedTuple):
    """The masks of an ``attention`` call, as the functional op takes them (checked)."""

    attn_mask: Optional[Tensor] = None  # bool True = may attend, or float added; broadcastable to [B, H, Lq, Lk]
    key_padding_mask: Optional[Tensor] = None  # [B, Lk] bool, True = padding
    query_padding_mask: Optional[Tensor] = None  # [B, Lq] bool, True = padding
    query_lengths: Optional[Tensor] = None  # [B] integers, rows past them are padding (the Triton entry's option)

    @property
    def unmasked(self) -> bool:
        """Whether no mask is given, by identity (``count(None)`` would take ``Tensor.__eq__``, 12 us a mask)."""
        return (self.attn_mask is None and self.key_padding_mask is None and self.query_padding_mask is None
                and self.query_lengths is None)


class AttentionSpec(NamedTuple):
    """Everything about an attention call that is not a tensor, checked and resolved: what a backend computes."""

    is_causal: bool
    causal_alignment: str  # one of CAUSAL_ALIGNMENTS
    window: Window  # normalised by check_window: None when neither side limits anything
    dropout_p: float  # in [0, 1)
    scale: float  # the factor the scores are multiplied by (softmax_scale resolved)
    allow_tf32: bool = False  # float32 products in TF32 on tensor cores (the Triton entry's option)

    @property
    def bottom_right(self) -> bool:
        return self.causal_alignment == "bottom_right"


class ScoreMods(NamedTuple):
    """What modifies the scaled scores of an attention call, checked (``score_mods``) and applied in this order,
    before the masks; None where absent. Constants: no gradient flows to them. A modifier is a field here (its check
    in ``score_mods``), its math in ``reference.modify_scores`` and in the Triton kernels' ``jit.py`` (host and
    device sides); ``route.SUPPORTS`` names those each backend computes, the others sending its calls to the
    reference."""

    softcap: Optional[float] = None  # scores become softcap * tanh(scores / softcap) (Gemma 2, Grok)
    alibi_slopes: Optional[Tensor] = None  # float32 [H] or [B, H]: scores less slope * |i + o - j| (o: the alignment)

    @property
    def given(self) -> Tuple[str, ...]:
        """The names of the modifiers present."""
        return tuple(name for name, value in zip(self._fields, self) if value is not None)


NO_SCORE_MODS = ScoreMods()
SCORE_MOD_TENSORS = ("alibi_slopes",)  # the tensors of ScoreMods, the others being numbers (``score_mods_flat``)


def score_mods_flat(mods: ScoreMods) -> Tuple[list, list]:
    """``mods`` as the custom ops take them: the tensors (None where absent), then the numbers (NaN where absent: a
    given one is finite)."""
    tensors = [getattr(mods, name) for name in SCORE_MOD_TENSORS]
    numbers = [math.nan if value is None else value for name, value in zip(mods._fields, mods)
               if name not in SCORE_MOD_TENSORS]
    return tensors, numbers


def score_mods_of_flat(tensors: Sequence[Optional[Tensor]], numbers: Sequence[float]) -> ScoreMods:
    """The ``ScoreMods`` of ``score_mods_flat``'s lists (``NO_SCORE_MODS`` for none)."""
    tensors, numbers = iter(tensors), iter(numbers)
    values = [next(tensors) if name in SCORE_MOD_TENSORS else next(numbers) for name in ScoreMods._fields]
    mods = ScoreMods(*(None if isinstance(v, float) and math.isnan(v) else v for v in values))
    return mods if mods.given else NO_SCORE_MODS


class PackedSequences(NamedTuple):
    """Where the sequences of an ``attention_varlen`` call lie (checked)."""

    cu_seqlens_q: Tensor  # int32 [B + 1]
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def options_of(op: str, given: Dict[str, object], defaults: Dict[str, object]) -> Dict[str, object]:
    """``defaults`` updated with ``given``, the keyword arguments a kernel-level entry of ``op`` got beside its own;
    a name ``op`` does not take is a TypeError, as Python raises it for an unexpected keyword argument."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword arguments {unknown}; it takes {sorted(defaults)}")
    return {**defaults, **given}


# --------------------------------------------------------------------------------------------- numerics


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics (softmax, LSE, mean/variance) are kept in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_scale(head_dim: int, scale: Optional[float] = None) -> float:
    """The factor attention scores are multiplied by: ``scale``, by default ``1 / sqrt(head_dim)``; 1 for
    ``head_dim = 0``, whose scores are all 0 (any finite factor keeps them 0, ``1 / sqrt(0)`` makes them NaN)."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


# --------------------------------------------------------------------------------------------- autocast

_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(anchor: object, matmul: bool) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` runs an op in on ``anchor``'s device, None when autocast is off there: the
    autocast dtype for matrix products, float32 for normalisation (autocast's own policy for what the op replaces)."""
    if not torch.compiler.is_compiling() and not torch._C._is_any_autocast_enabled():
        return None  # an eager call with autocast off everywhere: one question instead of a device's
    if not isinstance(anchor, Tensor) or not torch.is_autocast_enabled(anchor.device.type):
        return None
    return torch.get_autocast_dtype(anchor.device.type) if matmul else torch.float32


def autocast_all(dtype: Optional[torch.dtype], *args: object) -> Tuple[object, ...]:
    """``args`` with their float16 / bfloat16 / float32 tensors cast to ``dtype`` (None: autocast is off)."""
    if dtype is None:
        return args
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.dtype in _AUTOCAST_ELIGIBLE else t for t in args)


# ----------------------------------------------------------------------------------------------- layouts


def as_rows(x: Tensor) -> Tensor:
    """``x [..., N]`` as ``[rows, N]`` for the row-wise kernels (a view when the strides allow); unlike
    ``reshape(-1, N)``, also when N = 0."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def heads_interleaved_strides(shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """The strides of a ``[B, H, L, D]`` tensor whose memory is ``[B, L, H, D]``: what the attention kernels write,
    so that merging the heads (``out.transpose(1, 2).flatten(2)``) is a view, not a copy."""
    _, heads, length, head_dim = shape
    return (length * heads * head_dim, head_dim, heads * head_dim, 1)


def empty_heads_interleaved(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """An empty tensor shaped as ``like`` ``[B, H, L, D]`` with ``heads_interleaved_strides``, in ``dtype`` (default:
    like's)."""
    return like.new_empty_strided(like.shape, heads_interleaved_strides(like.shape), dtype=dtype)


# A dropout seed: a one-element int64 tensor drawn on the op's device, or an int drawn on the host. The kernels take
# both (the Triton ones as ``*SEED + host_seed``); the Functions save a tensor for the backward and keep an int on ctx.
Seed = Union[Tensor, int]


def traced() -> bool:
    """Whether this call is being traced (``torch.compile``, ``torch.export``, a FakeTensor or proxy trace), where
    the backends run through their custom ops, rather than run eagerly, where they launch directly. A dispatch
    mode that only watches eager calls (``eager_inside = True``: a launch or host-read counter) is not a trace."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return not all(getattr(mode, "eager_inside", False) for mode in _get_current_dispatch_mode_stack())


def philox_generator(device: torch.device) -> Optional[torch.Generator]:
    """The generator whose Philox seed and offset an eager call on ``device`` draws its seed from on the host (a
    CUDA device's default generator); None where the draw is a tensor op (a function, so a test can stand a CPU
    tensor for a device one)."""
    if device.type != "cuda":
        return None
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def _mix64(value: int) -> int:
    """SplitMix64's finalizer: a generator seed's bits spread over all 64."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


def host_seed(generator: torch.Generator) -> int:
    """A seed below 2**31 taken from ``generator``'s Philox state on the host, no launch: its seed mixed, plus its
    offset in steps of 4, the offset then advanced by 4 as torch's own random ops advance it. Successive draws differ
    (until 2**31 of them); ``torch.manual_seed`` and a restored RNG state (activation checkpointing's recompute) draw
    the same seeds again."""
    offset = generator.get_offset()
    generator.set_offset(offset + 4)
    return (_mix64(generator.initial_seed()) + (offset >> 2)) & 0x7FFFFFFF


def draw_dropout_seed(device: Union[torch.device, str]) -> Seed:
    """A dropout (Philox) seed for an op on ``device``, from torch's generator for that device, so
    ``torch.manual_seed`` reproduces dropout on every backend.

    An eager call on a CUDA device draws it on the host (``host_seed``), with no kernel launch. A traced call, one
    inside a CUDA graph's capture or a functorch transform, and a CPU call (its generator keeps no offset) draw a
    one-element int64 tensor with ``torch.randint``, as torch's own fused dropout does: the draw stays inside a
    ``torch.compile`` graph (no host value to specialise on, so no recompile per step) and inside a CUDA graph,
    whose every replay draws a new seed. The kernels read it themselves."""
    device = torch.device(device)
    generator = philox_generator(device)
    if (generator is None or traced() or torch._C._are_functorch_transforms_active()
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    return host_seed(generator)


def seed_tensor(seed: Optional[Seed], device: torch.device) -> Optional[Tensor]:
    """``seed`` as a custom op's schema takes it, a tensor: a host draw becomes one on ``device`` (where the backward
    of an eager forward is traced, by compiled autograd)."""
    return torch.tensor([seed], dtype=torch.int64, device=device) if isinstance(seed, int) else seed



# ------------------------------------------------------------------------------------------------ checks


def describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def check_tensor(name: str, t: object, rank: Optional[int] = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {describe(t)}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got {describe(t)}")
    return t


def check_same(name: str, t: Tensor, ref_name: str, ref: Tensor, dtype: bool = True) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; expected one device")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; expected one dtype")


def check_dropout(p: object) -> float:
    if type(p) is float and 0.0 <= p < 1.0:
        return p
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_p={p!r} must be a number in [0, 1)")
    return float(p)


# Whether the ops read a device tensor's values to check them (``set_device_value_checks``).
_device_value_checks = os.environ.get("FUSED_TRANSFORMER_CHECK_VALUES", "0") == "1"


def set_device_value_checks(enabled: bool) -> None:
    """Whether the ops check the values of index tensors kept on a GPU (``cu_seqlens``, ``cache_seqlens``, a block
    table): each check is a device-to-host read that waits for the work queued before it, so by default (and with
    ``FUSED_TRANSFORMER_CHECK_VALUES`` unset or 0) they are not read there, and the kernels, which read and write
    nothing outside their tensors whatever the values, compute with what they get. Values kept on the host are
    always checked (for free). ``FUSED_TRANSFORMER_CHECK_VALUES=1`` or ``set_device_value_checks(True)`` checks
    them everywhere, as while debugging."""
    global _device_value_checks
    _device_value_checks = bool(enabled)


def _on_host(t: Tensor) -> bool:
    return t.device.type == "cpu"


def reads_values(*tensors: Optional[Tensor]) -> bool:
    """Whether a check may read the values of ``tensors``: never in a traced graph (they are data there) or during
    CUDA graph capture; always on the host; on a device only when asked (``set_device_value_checks``)."""
    if torch.compiler.is_compiling():
        return False
    given = [t for t in tensors if t is not None]
    if all(_on_host(t) for t in given):
        return True
    return _device_value_checks and not (any(t.is_cuda for t in given) and torch.cuda.is_current_stream_capturing())


# ------------------------------------------------------------------------------------------ KV cache attention


class KVCacheSpec(NamedTuple):
    """An ``attention_with_kvcache`` call's options, checked: causal is always aligned bottom-right per sequence."""

    is_causal: bool
    window: Window
    scale: float
    num_splits: Optional[int]  # key splits of the GPU decode kernel; None: chosen from the SM count


class KVCache(NamedTuple):
    """The cache of an ``attention_with_kvcache`` call as the backends take it: after the append, or before it for a
    backend that appends the new keys itself (``appends_new_keys``)."""

    k: Tensor  # [B, Lmax, Hkv, D], or paged [num_blocks, block_size, Hkv, D]
    v: Tensor
    lengths: Tensor  # int32 [B]: keys per sequence (the appended ones included, unless the backend appends them)
    block_table: Optional[Tensor]  # int32 [B, max_blocks] for a paged cache, else None
    uniform_length: Optional[int] = None  # every sequence's length when the host knows it (an int cache_seqlens)

    @property
    def capacity(self) -> int:
        """Keys a sequence can hold."""
        if self.block_table is None:
            return self.k.shape[1]
        return self.block_table.shape[1] * self.k.shape[1]
