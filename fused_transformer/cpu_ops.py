"""The CPU backend: the C++ kernels of ``csrc/`` (``torch.ops.fused_transformer_cpu``) under the interface of
``fused_transformer.contract`` (raw forward and backward functions; ``fused_transformer.ops.attention.function`` holds the
Functions above them).

This is the CPU analogue of ``fused_transformer.kernels.backend``: each function converts its masks and arguments
and calls the C++ op. Importing this module loads ``fused_transformer._C`` (``backend.cpu_unavailable_reason()``
says why when that fails).

Kernels compute in float32 (float64 for float64 inputs); bfloat16 / float16 inputs are converted at the op
boundary and results returned in the input dtype. Matrix products outside attention stay with ATen.

Where an ATen op is faster, ``fused_transformer.route`` runs it instead of our kernel. The ops with modules of their
own (``fused_transformer.ops``) call their C++ kernels from there.

Dropout: every op that drops draws one seed tensor with ``draw_dropout_seed`` from torch's CPU generator (so
``torch.manual_seed`` reproduces it; the kernel reads it, so the draw stays inside a compiled graph), and
element ``i`` of the dropped tensor in row-major order (attention: the probabilities ``[B, H, Lq, Lk]``; the norms:
``x``; the feed-forward: the hidden activation ``[..., d_ff]``) is kept as
``dropout_keep_mask(seed, shape, p)`` says, for replaying the mask in the reference.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C  # noqa: F401  (registers torch.ops.fused_transformer_cpu)
from . import reference
from .contract import (
    AttentionMasks, AttentionSpec, KVCache, KVCacheSpec, PackedSequences, ScoreMods, Seed, empty_heads_interleaved,
    seed_tensor, stats_dtype, window_bounds,
)

Tensor = torch.Tensor
_ops = torch.ops.fused_transformer_cpu


def dropout_keep_mask(seed: Union[int, Tensor], shape: Sequence[int], dropout_p: float) -> Tensor:
    """The bool keep-mask (True = kept) of ``shape`` that an op drew with ``seed`` (its seed tensor, or that
    tensor's value), for ``reference.*(keep_mask=)``."""
    numel = math.prod(shape)
    return _ops.dropout_keep_mask(int(seed), numel, float(dropout_p)).view(tuple(shape))


_CPU = torch.device("cpu")


def _seed(seed: Optional[Seed]) -> Optional[Tensor]:
    """The kernels take the seed as a tensor; a host draw (``launches.cpu_draws_as_on_a_gpu``) becomes one."""
    return seed_tensor(seed, _CPU)


def cpu_capability() -> str:
    """The instruction set the C++ kernels' float loops run on: ``"AVX512"``, ``"AVX2"`` or ``"baseline"``, the one
    ATen runs its own CPU kernels at (``ATEN_CPU_CAPABILITY=avx2`` switches both)."""
    return _ops.cpu_capability()


def _check_cpu(name: str, anchor: Tensor) -> None:
    """The functional ops have checked that every tensor argument is on ``anchor``'s device."""
    if not anchor.is_cpu:  # not anchor.device.type: that builds a device and its name, 0.4 us of a 20 us call
        raise ValueError(f"the cpu backend runs on CPU tensors; {name} is on {anchor.device}")


# The LSE the C++ kernels return takes no gradient (their backward has no term for it).
DIFFERENTIABLE_LSE = False


# ------------------------------------------------------------------------------------------- attention


def _attention_bias(attn_mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The contract's ``attn_mask`` as the kernel takes it: a bool one as it is (True = may attend), a float
    one as an additive bias in ``dtype``. The key padding mask goes to the kernel as it is."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.to(dtype)


def _dense_args(q: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> tuple:
    """The C++ attention ops' masks and options: bias, key padding, query padding, is_causal, bottom_right,
    window_left, window_right, scale, dropout_p."""
    if masks.query_lengths is not None:
        raise ValueError("query_lengths is an option of the Triton kernels' entry; pass a query_padding_mask")
    return (_attention_bias(masks.attn_mask, stats_dtype(q.dtype)), masks.key_padding_mask,
            masks.query_padding_mask, *_options(spec))


def _options(spec: AttentionSpec) -> tuple:
    return (spec.is_causal, spec.bottom_right, *window_bounds(spec.window), spec.scale, spec.dropout_p)


def _exact(float_output: bool, *tensors: Tensor) -> Tuple[Tensor, ...]:
    """The inputs in float32 when the output is kept in float32 (the kernels compute in float32 anyway)."""
    return tuple(t.float() for t in tensors) if float_output else tensors




def attention_fwd(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                  mods: ScoreMods, sinks: Optional[Tensor], seed: Optional[Seed],
                  float_output: bool, for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The C++ flash-attention forward: ``(o, lse)``, the LSE ``[B, H, Lq]`` in float32 (float64 for float64). The
    masks in the kernels' form go into ``for_backward`` for the backward, unless that would keep a converted copy of
    attn_mask alive in between."""
    _check_cpu("q", q)
    mask_args = _dense_args(q, masks, spec)
    if for_backward is not None and mask_args[0] is masks.attn_mask:
        for_backward["mask_args"] = mask_args
    return _ops.attention_fwd(*_exact(float_output, q, k, v), *mask_args, _seed(seed), mods.softcap, mods.alibi_slopes,
                              sinks)


def attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  seed: Optional[Seed], for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The C++ backward; ``o`` in q's dtype or float32; ``dlse`` is None (``DIFFERENTIABLE_LSE``)."""
    mask_args = for_backward.get("mask_args") if for_backward is not None else None
    if mask_args is None:
        mask_args = _dense_args(q, masks, spec)
    return _ops.attention_bwd(do, q, k, v, o, lse, *mask_args, _seed(seed), mods.softcap, mods.alibi_slopes)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSequences, spec: AttentionSpec,
                         mods: ScoreMods, sinks: Optional[Tensor], seed: Optional[Seed],
                         float_output: bool, for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The C++ forward on packed sequences: ``(o [Tq, H, D], lse [H, Tq])``, the sinks in the LSE."""
    _check_cpu("q", q)
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = seqs
    return _ops.attention_varlen_fwd(*_exact(float_output, q, k, v), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                     int(max_seqlen_k), *_options(spec), _seed(seed), mods.softcap, mods.alibi_slopes,
                                     sinks)


def attention_varlen_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         lse: Tensor, seqs: PackedSequences, spec: AttentionSpec, mods: ScoreMods,
                         seed: Optional[Seed], for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The C++ backward on packed sequences."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = seqs
    return _ops.attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                     int(max_seqlen_k), *_options(spec), _seed(seed), mods.softcap, mods.alibi_slopes)


def attention_with_kvcache(q: Tensor, cache: KVCache, mods: ScoreMods, sinks: Optional[Tensor],
                           spec: KVCacheSpec, k_new: Optional[Tensor] = None,
                           v_new: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The C++ KV-cache kernel, which reads the cache in place (paged or not, through its strides) with each
    sequence's length, the GQA heads of a KV head together. With ``k_new`` / ``v_new`` (see ``appends_new_keys``
    below) the kernel first writes them into the cache, ``cache.lengths`` counting the keys before them; without,
    the new keys are in the cache already."""
    _check_cpu("q", q)
    return _ops.attention_with_kvcache_fwd(q, cache.k, cache.v, cache.lengths, cache.block_table, k_new, v_new,
                                           spec.is_causal, *window_bounds(spec.window), spec.scale, mods.softcap,
                                           mods.alibi_slopes, sinks)


# functional.attention_with_kvcache hands this backend the new keys and values instead of appending them itself: the
# kernel's one pass replaces two slice copies (or index_put_ calls) and the lengths' update, a sixth of a one-token
# decoding step at batch 1.
attention_with_kvcache.appends_new_keys = True


def attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    """The result is the full ``[B, H, Lq, Lk]`` matrix, so there is nothing to fuse and the reference computes it."""
    _check_cpu("q", q)
    return reference.run_attention_weights(q, k, lse, masks, spec)


# ----------------------------------------------------------------------- shapes for torch.compile tracing


def _register_fakes() -> None:
    def stats(t: Tensor, shape: Sequence[int]) -> Tensor:
        return t.new_empty(shape, dtype=stats_dtype(t.dtype))

    @torch.library.register_fake("fused_transformer_cpu::attention_fwd")
    def _(q, k, v, bias, key_padding, query_padding, *options_and_seed):
        return empty_heads_interleaved(q), stats(q, q.shape[:3])

    @torch.library.register_fake("fused_transformer_cpu::attention_bwd")
    def _(dout, q, k, v, out, lse, bias, key_padding, query_padding, *options_and_seed):
        return tuple(map(empty_heads_interleaved, (q, k, v)))

    @torch.library.register_fake("fused_transformer_cpu::attention_with_kvcache_fwd")
    def _(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, *options):
        batch, q_len, heads = q.shape[:3]
        return torch.empty_like(q, memory_format=torch.contiguous_format), stats(q, (batch, heads, q_len))

    @torch.library.register_fake("fused_transformer_cpu::attention_varlen_fwd")
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options_and_seed):
        return torch.empty_like(q, memory_format=torch.contiguous_format), stats(q, (q.shape[1], q.shape[0]))

    @torch.library.register_fake("fused_transformer_cpu::attention_varlen_bwd")
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *options_and_seed):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    @torch.library.register_fake("fused_transformer_cpu::bias_activation_fwd")
    def _(h, bias, activation, dropout_p, seed):
        return torch.empty_like(h, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fused_transformer_cpu::bias_activation_bwd")
    def _(grad, h, bias, activation, dropout_p, seed):
        return torch.empty_like(h, memory_format=torch.contiguous_format)


_register_fakes()
