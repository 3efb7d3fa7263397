"""The CPU backend: autograd Functions over the C++ kernels of ``csrc/`` (``torch.ops.fused_transformer_cpu``).

This is the CPU analogue of ``kernels/*.py``: each op converts its masks and arguments once, calls the C++
forward, and its ``torch.autograd.Function`` calls the C++ backward. Importing this module loads
``fused_transformer._C`` (``backend.cpu_unavailable_reason()`` says why when that fails).

Kernels compute in float32 (float64 for float64 inputs); bfloat16 / float16 inputs are converted at the op
boundary and results returned in the input dtype. Matrix products outside attention stay with ATen.

Where an ATen op is faster, it runs instead of our kernel: without dropout, a float32 ``layer_norm`` is ATen's
add + ``layer_norm`` (about 2x faster forward+backward than ours at 640x256 to 4096x512, 2 threads; not in 16
bits, where ATen's weight gradient is 4x less accurate than the rule allows, nor for a single feature, where its
backward cancels 1/sqrt(eps)-sized terms), and ``feed_forward`` ATen's ``linear`` + activation + ``linear``
(ours 0.64-0.98x there). With dropout ours win (layer_norm 1.4-4x, feed_forward with relu 1.2-1.4x, gelu at
parity), saving ATen's separate dropout passes.

Dropout: every op that drops draws one seed tensor with ``draw_dropout_seed`` from torch's generator (so
``torch.manual_seed`` reproduces it; the kernel reads it, so the draw stays inside a compiled graph), and
element ``i`` of the dropped tensor in row-major order (attention: the probabilities ``[B, H, Lq, Lk]``;
layer_norm: ``x``; feed_forward: the hidden activation ``[..., d_ff]``) is kept as
``dropout_keep_mask(seed, shape, p)`` says, for replaying the mask in the reference.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F

from . import _C  # noqa: F401  (registers torch.ops.fused_transformer_cpu)
from . import contract, reference
from .contract import (
    AttentionMasks, AttentionSpec, FeedForwardSpec, KVCache, KVCacheSpec, LayerNormSpec, Window, as_rows,
    draw_dropout_seed, empty_heads_interleaved, stats_dtype,
)

Tensor = torch.Tensor
_ops = torch.ops.fused_transformer_cpu


def dropout_keep_mask(seed: Union[int, Tensor], shape: Sequence[int], dropout_p: float) -> Tensor:
    """The bool keep-mask (True = kept) of ``shape`` that an op drew with ``seed`` (its seed tensor, or that
    tensor's value), for ``reference.*(keep_mask=)``."""
    numel = math.prod(shape)
    return _ops.dropout_keep_mask(int(seed), numel, float(dropout_p)).view(tuple(shape))


def _check_cpu(name: str, anchor: Tensor) -> None:
    """The functional ops have checked that every tensor argument is on ``anchor``'s device."""
    if anchor.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors; {name} is on {anchor.device}")


class _NoGradContext:
    """What a Function's ``forward`` gets for ``ctx`` when nothing needs a gradient: saving is a no-op."""

    def save_for_backward(self, *tensors: Optional[Tensor]) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        pass


def _apply(function: Type[torch.autograd.Function], *args: object) -> object:
    """``function.apply(*args)``; when no tensor argument needs a gradient, its ``forward`` alone, without
    autograd's per-call Python cost (about 20 us, as much as the kernel of a one-token decoding step)."""
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(_NoGradContext(), *args)


# ------------------------------------------------------------------------------------------- attention


def _attention_bias(attn_mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The contract's ``attn_mask`` as the kernel takes it: a bool one as it is (True = may attend), a float
    one as an additive bias in ``dtype``. The key padding mask goes to the kernel as it is."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.to(dtype)


def _window_bounds(window: Window) -> Tuple[int, int]:
    """``(left, right)`` as the C++ kernels take them: -1 for no limit."""
    left, right = window if window is not None else (None, None)
    return (-1 if left is None else left, -1 if right is None else right)


def _float32_out_for_sinks(ctx, q: Tensor, sinks: Optional[Tensor], sinks_index: int) -> bool:
    """Whether a Function keeps its output in float32 for the backward: when the sinks need a gradient and q is 16-bit.
    That gradient sums ``exp(sink - lse) * rowsum(dO * out)`` over every row, and a 16-bit ``out`` would round each
    term (twice PyTorch's own error at 16 bits); the q, k, v gradients then use the float32 ``out`` as well."""
    needs = getattr(ctx, "needs_input_grad", None)  # _NoGradContext has none: nothing needs a gradient
    return sinks is not None and bool(needs and needs[sinks_index]) and q.dtype in (torch.float16, torch.bfloat16)


class AttentionFunction(torch.autograd.Function):
    """Autograd over ``attention_fwd`` / ``attention_bwd``; ``attn_mask`` already converted by ``_attention_bias``.
    ``options``: is_causal, bottom_right, window_left, window_right, scale, dropout_p. ``alibi_slopes`` are
    constants; ``sinks`` get their gradient from ``contract.sinks_gradient`` (the kernels' backward needs no sinks:
    the LSE holds them)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, key_padding, query_padding, options, seed, softcap=None, alibi_slopes=None,
                sinks=None):
        exact = _float32_out_for_sinks(ctx, q, sinks, 10)  # the kernel converts to float32 anyway: no extra work
        out, lse = _ops.attention_fwd(*((q.float(), k.float(), v.float()) if exact else (q, k, v)), bias, key_padding,
                                      query_padding, *options, seed, softcap, alibi_slopes, sinks)
        ctx.save_for_backward(q, k, v, out, lse, bias, key_padding, query_padding, seed, alibi_slopes, sinks)
        ctx.options, ctx.softcap = options, softcap
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype) if exact else out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, bias, key_padding, query_padding, seed, alibi_slopes, sinks = ctx.saved_tensors
        dq = dk = dv = dsinks = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _ops.attention_bwd(dout, q, k, v, out, lse, bias, key_padding, query_padding, *ctx.options,
                                            seed, ctx.softcap, alibi_slopes)
        if sinks is not None and ctx.needs_input_grad[10]:
            dsinks = contract.sinks_gradient(sinks, lse, dout, out, None, head_dim_last=False)
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks


def run_attention(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                  alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``functional.attention`` on the C++ flash-attention kernel: ``(out, lse)``, the LSE ``[B, H, Lq]`` in float32
    (float64 for float64), the sinks in it. A float ``attn_mask`` is not differentiated."""
    _check_cpu("q", q)
    attn_mask = masks.attn_mask
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("the cpu backend does not compute gradients for attn_mask; use backend 'reference'")
    bias = _attention_bias(attn_mask, stats_dtype(q.dtype))
    options = (spec.is_causal, spec.bottom_right, *_window_bounds(spec.window), spec.scale, spec.dropout_p)
    seed = draw_dropout_seed(q.device) if spec.dropout_p > 0.0 else None
    return _apply(AttentionFunction, q, k, v, bias, masks.key_padding_mask, masks.query_padding_mask, options, seed,
                  spec.softcap, alibi_slopes, sinks)


def run_attention_with_kvcache(q: Tensor, cache: KVCache, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                               spec: KVCacheSpec, k_new: Optional[Tensor] = None,
                               v_new: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``functional.attention_with_kvcache`` on the C++ KV-cache kernel, which reads the cache in place (paged or not,
    through its strides) with each sequence's length, the GQA heads of a KV head together. With ``k_new`` / ``v_new``
    (see ``appends_new_keys`` below) the kernel first writes them into the cache, ``cache.lengths`` counting the keys
    before them; without, the new keys are in the cache already."""
    _check_cpu("q", q)
    return _ops.attention_with_kvcache_fwd(q, cache.k, cache.v, cache.lengths, cache.block_table, k_new, v_new,
                                           spec.is_causal, *_window_bounds(spec.window), spec.scale, spec.softcap,
                                           alibi_slopes, sinks)


# functional.attention_with_kvcache hands this backend the new keys and values instead of appending them itself: the
# kernel's one pass replaces two slice copies (or index_put_ calls) and the lengths' update, a sixth of a one-token
# decoding step at batch 1.
run_attention_with_kvcache.appends_new_keys = True


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd over ``attention_varlen_fwd`` / ``attention_varlen_bwd``. ``options``: max_seqlen_q, max_seqlen_k,
    is_causal, bottom_right, window_left, window_right, scale, dropout_p; softcap, ALiBi and sinks as in
    ``AttentionFunction``."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, options, seed, softcap=None, alibi_slopes=None, sinks=None):
        exact = _float32_out_for_sinks(ctx, q, sinks, 9)
        out, lse = _ops.attention_varlen_fwd(*((q.float(), k.float(), v.float()) if exact else (q, k, v)), cu_seqlens_q,
                                             cu_seqlens_k, *options, seed, softcap, alibi_slopes, sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks)
        ctx.options, ctx.softcap = options, softcap
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype) if exact else out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks = ctx.saved_tensors
        dq = dk = dv = dsinks = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _ops.attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options,
                                                   seed, ctx.softcap, alibi_slopes)
        if sinks is not None and ctx.needs_input_grad[9]:
            dsinks = contract.sinks_gradient(sinks, lse, dout, out, None, head_dim_last=True)
        return dq, dk, dv, None, None, None, None, None, None, dsinks


def run_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, spec: AttentionSpec, alibi_slopes: Optional[Tensor] = None,
                         sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``functional.attention_varlen`` on the C++ kernels: ``(out [Tq, H, D], lse [H, Tq])``, the sinks in the LSE."""
    _check_cpu("q", q)
    options = (int(max_seqlen_q), int(max_seqlen_k), spec.is_causal, spec.bottom_right, *_window_bounds(spec.window),
               spec.scale, spec.dropout_p)
    seed = draw_dropout_seed(q.device) if spec.dropout_p > 0.0 else None
    return _apply(AttentionVarlenFunction, q, k, v, cu_seqlens_q, cu_seqlens_k, options, seed, spec.softcap,
                  alibi_slopes, sinks)


def run_attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    """``functional.attention_weights``: the result is the full ``[B, H, Lq, Lk]`` matrix, so there is nothing to fuse
    and the reference computes it."""
    _check_cpu("q", q)
    return reference.run_attention_weights(q, k, lse, masks, spec)


# ------------------------------------------------------------------------------------------ layer_norm


class LayerNormFunction(torch.autograd.Function):
    """Autograd over ``layer_norm_fwd`` / ``layer_norm_bwd``; x and residual already flattened to ``[rows, N]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, dropout_p, seed, prenorm):
        store_z = prenorm or residual is not None or dropout_p > 0.0
        y, z, mean, rstd = _ops.layer_norm_fwd(x, weight, bias, residual, eps, dropout_p, seed, store_z)
        ctx.save_for_backward(z if store_z else x, weight, bias, mean, rstd, seed)
        ctx.dropout_p, ctx.has_residual = dropout_p, residual is not None
        return (y, z) if prenorm else y

    @staticmethod
    def backward(ctx, dy, dz=None):
        z, weight, bias, mean, rstd, seed = ctx.saved_tensors
        dx, dresidual, dweight, dbias = _ops.layer_norm_bwd(
            dy, dz, z, weight, bias, mean, rstd, ctx.dropout_p, seed, ctx.has_residual
        )
        return (
            dx,
            dweight if weight is not None else None,
            dbias if bias is not None else None,
            dresidual if ctx.has_residual else None,
            None, None, None, None,
        )


def run_layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   spec: LayerNormSpec) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``functional.layer_norm`` on the C++ kernel: ``y = LayerNorm(dropout(x) + residual)`` over the last dim, and
    ``z = dropout(x) + residual`` with ``prenorm``; statistics in float32."""
    eps, dropout_p, prenorm = spec
    _check_cpu("x", x)
    if (dropout_p == 0.0 and x.dtype == torch.float32 and x.shape[-1] > 1
            and (weight is None or weight.dtype == x.dtype) and (bias is None or bias.dtype == x.dtype)):
        # ATen's is faster here (see the module docstring)
        z = x if residual is None else x + residual
        y = F.layer_norm(z, (x.shape[-1],), weight, bias, eps)
        return (y, z) if prenorm else y
    shape = x.shape
    rows = as_rows(x)
    residual_rows = as_rows(residual) if residual is not None else None
    seed = draw_dropout_seed(x.device) if dropout_p > 0.0 else None
    out = _apply(
        LayerNormFunction, rows, weight, bias, residual_rows, float(eps), float(dropout_p), seed, bool(prenorm)
    )
    if prenorm:
        y, z = out
        return y.view(shape), z.view(shape)
    return out.view(shape)


# ---------------------------------------------------------------------------------------- feed_forward


class BiasActivationFunction(torch.autograd.Function):
    """``dropout(act(h + bias))`` over ``h [..., F]``; keeps only ``h`` for the backward."""

    @staticmethod
    def forward(ctx, h, bias, activation, dropout_p, seed):
        rows = as_rows(h)
        out = _ops.bias_activation_fwd(rows, bias, activation, dropout_p, seed)
        ctx.save_for_backward(rows, bias, seed)
        ctx.activation, ctx.dropout_p = activation, dropout_p
        return out.view(h.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, bias, seed = ctx.saved_tensors
        grad_pre = _ops.bias_activation_bwd(grad.reshape(rows.shape), rows, bias, ctx.activation, ctx.dropout_p, seed)
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            grad_bias = grad_pre.sum(dim=0, dtype=stats_dtype(grad_pre.dtype)).to(bias.dtype)
        return grad_pre.view(grad.shape), grad_bias, None, None, None


def run_feed_forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                     spec: FeedForwardSpec) -> Tensor:
    """``functional.feed_forward``: ``linear(dropout(act(linear(x, w1, b1))), w2, b2)`` with the matmuls on ATen and
    the bias, activation and dropout in one C++ pass in between (and one in backward)."""
    activation, dropout_p = spec
    _check_cpu("x", x)
    if dropout_p == 0.0:  # ATen's, as the reference composes it, is at least as fast here (module docstring)
        return reference.feed_forward(x, w1, b1, w2, b2, activation=activation)
    seed = draw_dropout_seed(x.device)
    if x.dtype in (torch.float16, torch.bfloat16):
        # The bias must be added before the pre-activation is rounded to 16 bits, as ATen's addmm does: rounding
        # first moves values near 0 across ReLU's kink, whose gradient then flips between 0 and 1.
        hidden = _apply(BiasActivationFunction, F.linear(x, w1, b1), None, activation, float(dropout_p), seed)
    else:
        hidden = _apply(BiasActivationFunction, F.linear(x, w1), b1, activation, float(dropout_p), seed)
    return F.linear(hidden, w2, b2)


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
