"""The CPU backend: the C++ kernels of ``csrc/`` (``torch.ops.fused_transformer_cpu``) under the interface of
``fused_transformer.contract`` (raw forward and backward functions; ``fused_transformer.autograd`` holds the
Functions above them).

This is the CPU analogue of ``fused_transformer.kernels.backend``: each function converts its masks and arguments
and calls the C++ op. Importing this module loads ``fused_transformer._C`` (``backend.cpu_unavailable_reason()``
says why when that fails).

Kernels compute in float32 (float64 for float64 inputs); bfloat16 / float16 inputs are converted at the op
boundary and results returned in the input dtype. Matrix products outside attention stay with ATen.

Where an ATen op is faster, ``fused_transformer.route`` runs it instead of our kernel: without dropout, a float32 ``layer_norm`` is ATen's
add + ``layer_norm`` (about 2x faster forward+backward than ours at 640x256 to 4096x512, 2 threads; not in 16
bits, where ATen's weight gradient is 4x less accurate than the rule allows, nor for a single feature, where its
backward cancels 1/sqrt(eps)-sized terms), and ``feed_forward`` ATen's ``linear`` + activation + ``linear``
(ours 0.64-0.98x there). With dropout ours win (layer_norm 1.4-4x, feed_forward with relu 1.2-1.4x, gelu at
parity), saving ATen's separate dropout passes.

Dropout: every op that drops draws one seed tensor with ``draw_dropout_seed`` from torch's CPU generator (so
``torch.manual_seed`` reproduces it; the kernel reads it, so the draw stays inside a compiled graph), and
element ``i`` of the dropped tensor in row-major order (attention: the probabilities ``[B, H, Lq, Lk]``;
layer_norm: ``x``; feed_forward: the hidden activation ``[..., d_ff]``) is kept as
``dropout_keep_mask(seed, shape, p)`` says, for replaying the mask in the reference.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import _C  # noqa: F401  (registers torch.ops.fused_transformer_cpu)
from . import reference
from .contract import (
    AttentionMasks, AttentionSpec, FeedForwardSpec, KVCache, KVCacheSpec, LayerNormSpec, PackedSequences, ScoreMods,
    Seed, empty_heads_interleaved, seed_tensor, stats_dtype, window_bounds,
)

Tensor = torch.Tensor
_ops = torch.ops.fused_transformer_cpu


def dropout_keep_mask(seed: Union[int, Tensor], shape: Sequence[int], dropout_p: float) -> Tensor:
    """The bool keep-mask (True = kept) of ``shape`` that an op drew with ``seed`` (its seed tensor, or that
    tensor's value), for ``reference.*(keep_mask=)``."""
    numel = math.prod(shape)
    return _ops.dropout_keep_mask(int(seed), numel, float(dropout_p)).view(tuple(shape))


def _seed(seed: Optional[Seed]) -> Optional[Tensor]:
    """The kernels take the seed as a tensor; a host draw (``launches.cpu_draws_as_on_a_gpu``) becomes one."""
    return seed_tensor(seed, torch.device("cpu"))


def cpu_capability() -> str:
    """The instruction set the C++ kernels' float loops run on: ``"AVX512"``, ``"AVX2"`` or ``"baseline"``, the one
    ATen runs its own CPU kernels at (``ATEN_CPU_CAPABILITY=avx2`` switches both)."""
    return _ops.cpu_capability()


def _check_cpu(name: str, anchor: Tensor) -> None:
    """The functional ops have checked that every tensor argument is on ``anchor``'s device."""
    if anchor.device.type != "cpu":
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
                  float_output: bool, prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The C++ flash-attention forward: ``(o, lse)``, the LSE ``[B, H, Lq]`` in float32 (float64 for float64). The
    masks in the kernels' form go into ``prepared`` for the backward, unless that would keep a converted copy of
    attn_mask alive in between."""
    _check_cpu("q", q)
    mask_args = _dense_args(q, masks, spec)
    if prepared is not None and mask_args[0] is masks.attn_mask:
        prepared["mask_args"] = mask_args
    return _ops.attention_fwd(*_exact(float_output, q, k, v), *mask_args, _seed(seed), mods.softcap, mods.alibi_slopes,
                              sinks)


def attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  seed: Optional[Seed], prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The C++ backward; ``o`` in q's dtype or float32; ``dlse`` is None (``DIFFERENTIABLE_LSE``)."""
    mask_args = prepared.get("mask_args") if prepared is not None else None
    if mask_args is None:
        mask_args = _dense_args(q, masks, spec)
    return _ops.attention_bwd(do, q, k, v, o, lse, *mask_args, _seed(seed), mods.softcap, mods.alibi_slopes)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSequences, spec: AttentionSpec,
                         mods: ScoreMods, sinks: Optional[Tensor], seed: Optional[Seed],
                         float_output: bool, prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The C++ forward on packed sequences: ``(o [Tq, H, D], lse [H, Tq])``, the sinks in the LSE."""
    _check_cpu("q", q)
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = seqs
    return _ops.attention_varlen_fwd(*_exact(float_output, q, k, v), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                     int(max_seqlen_k), *_options(spec), _seed(seed), mods.softcap, mods.alibi_slopes,
                                     sinks)


def attention_varlen_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         lse: Tensor, seqs: PackedSequences, spec: AttentionSpec, mods: ScoreMods,
                         seed: Optional[Seed], prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
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


# ------------------------------------------------------------------------------------------ layer_norm


def layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   spec: LayerNormSpec, seed: Optional[Seed], store_z: bool) -> Tuple[Tensor, ...]:
    """``y, z, mean, rstd`` of rows ``[rows, N]`` from the C++ kernel."""
    _check_cpu("x", x)
    return _ops.layer_norm_fwd(x, weight, bias, residual, spec.eps, spec.dropout_p, _seed(seed), store_z)


def layer_norm_bwd(dy: Tensor, dz: Optional[Tensor], z: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   mean: Tensor, rstd: Tensor, spec: LayerNormSpec, seed: Optional[Seed],
                   has_residual: bool) -> Tuple[Tensor, ...]:
    """``dx, dresidual, dweight, dbias`` from the C++ kernel."""
    return _ops.layer_norm_bwd(dy, dz, z, weight, bias, mean, rstd, spec.dropout_p, _seed(seed), has_residual)


# ---------------------------------------------------------------------------------------- feed_forward
# Without dropout ATen runs it all (``linear`` + activation + ``linear``: route.py); with dropout the
# bias, activation and dropout of the hidden layer are one C++ pass (``bias_activation``) between ATen's products,
# one in backward.


def _bias_in_kernel(x: Tensor, spec: FeedForwardSpec) -> bool:
    """Whether the C++ pass adds b1 (float32 with dropout). In 16 bits the bias must be added before the
    pre-activation is rounded, as ATen's addmm does: rounding first moves values near 0 across ReLU's kink, whose
    gradient then flips between 0 and 1."""
    return spec.dropout_p > 0.0 and x.dtype not in (torch.float16, torch.bfloat16)


def _hidden(pre: Tensor, b1: Optional[Tensor], x: Tensor, spec: FeedForwardSpec, seed: Optional[Seed]) -> Tensor:
    if spec.dropout_p == 0.0:
        return reference.ACTIVATIONS[spec.activation](pre)
    bias = b1 if _bias_in_kernel(x, spec) else None
    return _ops.bias_activation_fwd(pre, bias, spec.activation, spec.dropout_p, _seed(seed))


def feed_forward_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                     spec: FeedForwardSpec, seed: Optional[Seed], keep: bool) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """``y`` of rows ``x [M, d_model]`` and, with ``keep``, ``(pre, hidden)`` for the backward: the pre-activation
    (without b1 where the C++ pass adds it) and the activation after dropout."""
    _check_cpu("x", x)
    pre = F.linear(x, w1, None if _bias_in_kernel(x, spec) else b1)
    hidden = _hidden(pre, b1, x, spec, seed)
    return F.linear(hidden, w2, b2), ((pre, hidden) if keep else ())


def feed_forward_bwd(dy: Tensor, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, saved: Tuple[Tensor, ...],
                     has_b2: bool, spec: FeedForwardSpec, seed: Optional[Seed]) -> Tuple[Tensor, ...]:
    """``dx, dw1, db1, dw2, db2``; without ``saved``, the pre-activation and the hidden activation are recomputed (the
    same dropout mask: the same seed)."""
    bias_in_kernel = _bias_in_kernel(x, spec)
    if saved:
        pre, hidden = saved
    else:
        pre = F.linear(x, w1, None if bias_in_kernel else b1)
        hidden = _hidden(pre, b1, x, spec, seed)
    dhidden = dy.mm(w2)
    dw2 = dy.t().mm(hidden)
    if spec.dropout_p > 0.0:
        dpre = _ops.bias_activation_bwd(dhidden, pre, b1 if bias_in_kernel else None, spec.activation,
                                        spec.dropout_p, _seed(seed))
    elif spec.activation == "relu":
        dpre = torch.ops.aten.threshold_backward(dhidden, pre, 0)
    else:
        dpre = torch.ops.aten.gelu_backward(dhidden, pre, approximate="tanh" if spec.activation == "gelu_tanh"
                                            else "none")
    empty = x.new_empty((0,))
    db1 = dpre.sum(dim=0, dtype=stats_dtype(dpre.dtype)).to(b1.dtype) if b1 is not None else empty
    db2 = dy.sum(dim=0, dtype=stats_dtype(dy.dtype)).to(dy.dtype) if has_b2 else empty
    return dpre.mm(w1), dpre.t().mm(x), db1, dw2, db2


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

    @torch.library.register_fake("fused_transformer_cpu::layer_norm_fwd")
    def _(x, weight, bias, residual, eps, dropout_p, seed, store_z):
        z = torch.empty_like(x) if store_z else x.new_empty((0,))
        return torch.empty_like(x), z, stats(x, x.shape[:1]), stats(x, x.shape[:1])

    @torch.library.register_fake("fused_transformer_cpu::layer_norm_bwd")
    def _(dy, dz, z, weight, bias, mean, rstd, dropout_p, seed, has_residual):
        empty = z.new_empty((0,))
        return (torch.empty_like(z), torch.empty_like(z) if has_residual else empty,
                torch.empty_like(weight) if weight is not None else empty,
                torch.empty_like(bias) if bias is not None else empty)

    @torch.library.register_fake("fused_transformer_cpu::bias_activation_fwd")
    def _(h, bias, activation, dropout_p, seed):
        return torch.empty_like(h, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fused_transformer_cpu::bias_activation_bwd")
    def _(grad, h, bias, activation, dropout_p, seed):
        return torch.empty_like(h, memory_format=torch.contiguous_format)


_register_fakes()
