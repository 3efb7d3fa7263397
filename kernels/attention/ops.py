"""The attention ops as torch sees them: custom ops (with fake kernels, so ``torch.compile`` and ``torch.export``
trace them) around the launchers, the autograd Functions over them, and the Triton backend's entries
(``run_attention``, ...) that ``fused_transformer.backend`` dispatches to after functional's checks."""
from typing import Optional, Tuple

import torch

from ...contract import AttentionMasks, AttentionSpec, Window, sinks_gradient
from .._common import contiguous_last_dim, draw_dropout_seed, dropout_keep_mask
from .bwd import launch_bwd
from .fwd import launch_fwd
from .launch import Layout, check_inputs, empty_output, mask_args, varlen_mask_args
from .weights import launch_weights

Tensor = torch.Tensor


@torch.library.custom_op("fused_transformer::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], dropout_p: float, seed: Optional[Tensor],
    scale: float, allow_tf32: bool, softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, float_output: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Launch the forward; q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` with contiguous last dims; softcap, ALiBi
    slopes (float32 ``[H]`` or ``[B, H]``) and sinks (float32 ``[H]``) as in ``functional.attention``.

    Returns ``o [B, H, Lq, D]`` (q's dtype, float32 with ``float_output``; laid out as ``[B, Lq, H, D]``) and
    ``lse [B, H, Lq]`` (float32).
    """
    check_inputs(q, k, v)
    batch, heads, lq, _ = q.shape
    o = empty_output(q, torch.float32 if float_output else None)
    lse = torch.empty((batch, heads, lq), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:  # no query row: a grid of 0 programs is an error on a GPU
        return o, lse
    masks = mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                      query_padding_mask, window_left, window_right, softcap, alibi_slopes, sinks)
    launch_fwd(q, k, v, o, lse, Layout.dense(q, k, v), masks, dropout_p, seed, scale, allow_tf32)
    return o, lse


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, dropout_p, seed, scale, allow_tf32, softcap=None, alibi_slopes=None, sinks=None,
      float_output=False):
    return empty_output(q, torch.float32 if float_output else None), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fused_transformer::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], query_lengths: Optional[Tensor],
    query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, seed: Optional[Tensor], scale: float, allow_tf32: bool,
    softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Launch the backward (dq kernel, then dk/dv kernel); returns ``dq, dk, dv`` in the inputs' shapes, laid out
    as o. Sinks need no argument here: they are in the forward's LSE."""
    dq, dk, dv = map(empty_output, (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    masks = mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                      query_padding_mask, window_left, window_right, softcap, alibi_slopes)
    launch_bwd(do, dlse, q, k, v, o, lse, dq, dk, dv, Layout.dense(q, k, v), masks, dropout_p, seed, scale,
               allow_tf32)
    return dq, dk, dv


@attention_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal,
      causal_alignment, window_left, window_right, dropout_p, seed, scale, allow_tf32, softcap=None, alibi_slopes=None):
    return tuple(map(empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, seed: Optional[Tensor], scale: float, allow_tf32: bool,
    softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
    float_output: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Launch the forward on packed sequences; q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]`` with contiguous last dims.

    Returns ``o [Tq, H, D]`` (q's dtype, float32 with ``float_output``) and ``lse [H, Tq]`` (float32).
    """
    check_inputs(q, k, v)
    total_q, heads, _ = q.shape
    o = empty_output(q, torch.float32 if float_output else None)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return o, lse
    layout = Layout.packed(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
    masks = varlen_mask_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                             window_left, window_right, heads, softcap, alibi_slopes, sinks)
    launch_fwd(q, k, v, o, lse, layout, masks, dropout_p, seed, scale, allow_tf32)
    return o, lse


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment, window_left,
      window_right, dropout_p, seed, scale, allow_tf32, softcap=None, alibi_slopes=None, sinks=None,
      float_output=False):
    return (empty_output(q, torch.float32 if float_output else None),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("fused_transformer::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
    causal_alignment: str, window_left: Optional[int], window_right: Optional[int], dropout_p: float,
    seed: Optional[Tensor], scale: float, allow_tf32: bool, softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Launch the backward on packed sequences; returns ``dq [Tq, H, D], dk, dv [Tk, Hkv, D]``."""
    dq, dk, dv = map(empty_output, (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    layout = Layout.packed(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
    masks = varlen_mask_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                             window_left, window_right, q.shape[1], softcap, alibi_slopes)
    launch_bwd(do, dlse, q, k, v, o, lse, dq, dk, dv, layout, masks, dropout_p, seed, scale, allow_tf32)
    return dq, dk, dv


@attention_varlen_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
      causal_alignment, window_left, window_right, dropout_p, seed, scale, allow_tf32, softcap=None,
      alibi_slopes=None):
    return tuple(map(empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_weights", mutates_args=())
def attention_weights_fwd(
    q: Tensor, k: Tensor, lse: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], scale: float,
) -> Tensor:
    """Launch the probabilities kernel: ``[B, H, Lq, Lk]`` in q's dtype, zeros where masked."""
    check_inputs(q, k, k)
    layout = Layout.dense(q, k, k)
    weights = torch.empty((*q.shape[:3], layout.n_keys), dtype=q.dtype, device=q.device)
    if weights.numel() == 0:
        return weights
    masks = mask_args(q, k, attn_mask, key_padding_mask, query_lengths, is_causal, causal_alignment,
                      query_padding_mask, window_left, window_right)
    launch_weights(q, k, lse.contiguous(), weights, layout, masks, scale)
    return weights


@attention_weights_fwd.register_fake
def _(q, k, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, scale):
    return q.new_empty((*q.shape[:3], k.shape[2]))


# -------------------------------------------------------------------------------------------- autograd


class AttentionFunction(torch.autograd.Function):
    """Autograd over ``attention_fwd`` / ``attention_bwd``. Masks and ALiBi slopes are constants (no gradient); the
    LSE is differentiable (its gradient folds into the backward's row term); the sinks get theirs from the saved LSE
    and o (``contract.sinks_gradient``)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal,
                causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32, softcap=None,
                alibi_slopes=None, sinks=None):
        seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
        float_output = _float_output(ctx, q, sinks)
        o, lse = torch.ops.fused_transformer.attention_fwd(
            q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
            window_left, window_right, dropout_p, seed, scale, allow_tf32, softcap, alibi_slopes, sinks, float_output,
        )
        ctx.save_for_backward(q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, seed,
                              alibi_slopes, sinks)
        ctx.options = (is_causal, causal_alignment, window_left, window_right, dropout_p)
        ctx.scale, ctx.allow_tf32, ctx.softcap, ctx.float_output = scale, allow_tf32, softcap, float_output
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None (no zeros to write and read)
        return (o.to(q.dtype) if float_output else o), lse

    @staticmethod
    def backward(ctx, do, dlse):
        (q, k, v, saved_o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, seed, alibi_slopes,
         sinks) = ctx.saved_tensors
        o = saved_o.to(q.dtype) if ctx.float_output else saved_o
        do = torch.zeros_like(o) if do is None else do  # only the LSE was used
        dq, dk, dv = torch.ops.fused_transformer.attention_bwd(
            do, dlse, q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask,
            *ctx.options, seed, ctx.scale, ctx.allow_tf32, ctx.softcap, alibi_slopes,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[16]:
            dsinks = sinks_gradient(sinks, lse, do, saved_o, dlse, head_dim_last=False)
        return dq, dk, dv, *(None,) * 13, dsinks


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd over ``attention_varlen_fwd`` / ``attention_varlen_bwd`` (packed sequences), as
    ``AttentionFunction``."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
                window_left, window_right, dropout_p, scale, allow_tf32, softcap=None, alibi_slopes=None, sinks=None):
        seed = draw_dropout_seed(q.device) if dropout_p > 0.0 else None
        float_output = _float_output(ctx, q, sinks)
        o, lse = torch.ops.fused_transformer.attention_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment,
            window_left, window_right, dropout_p, seed, scale, allow_tf32, softcap, alibi_slopes, sinks, float_output,
        )
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks)
        ctx.options = (max_seqlen_q, max_seqlen_k, is_causal, causal_alignment, window_left, window_right, dropout_p)
        ctx.scale, ctx.allow_tf32, ctx.softcap, ctx.float_output = scale, allow_tf32, softcap, float_output
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None (no zeros to write and read)
        return (o.to(q.dtype) if float_output else o), lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, saved_o, lse, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks = ctx.saved_tensors
        o = saved_o.to(q.dtype) if ctx.float_output else saved_o
        do = torch.zeros_like(o) if do is None else do  # only the LSE was used
        dq, dk, dv = torch.ops.fused_transformer.attention_varlen_bwd(
            do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, seed, ctx.scale, ctx.allow_tf32,
            ctx.softcap, alibi_slopes,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[16]:
            dsinks = sinks_gradient(sinks, lse, do, saved_o, dlse, head_dim_last=True)
        return dq, dk, dv, *(None,) * 13, dsinks


def _float_output(ctx, q: Tensor, sinks: Optional[Tensor]) -> bool:
    """Whether the forward keeps o in float32 for the backward: for sinks that need a gradient, whose sum over every
    row (``contract.sinks_gradient``) must not see o's rounding to 16 bits. The caller gets o in q's dtype (through a
    cast only then: under torch 2.11, a compiled graph that returned ``o.to(o.dtype)``, an alias of a saved tensor,
    gave wrong gradients)."""
    return sinks is not None and bool(ctx.needs_input_grad[16]) and q.dtype != torch.float32


def _window_sides(window: Window) -> Tuple[Optional[int], Optional[int]]:
    return (None, None) if window is None else (window[0], window[1])


def run_attention(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                  alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                  query_lengths: Optional[Tensor] = None, allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
    """The Triton backend's entry for ``functional.attention`` (arguments checked there): ``(out, lse)``, out laid out
    as ``[B, Lq, H, D]``, the LSE float32 ``[B, H, Lq]``; ``query_lengths`` and ``allow_tf32`` as in ``attention``."""
    q, k, v = (contiguous_last_dim(t) for t in (q, k, v))
    attn_mask = masks.attn_mask
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("triton attention: attn_mask requires grad, but masks are constants here (no gradient); "
                         "pass attn_mask.detach(), or use the reference backend to differentiate the mask")
    return AttentionFunction.apply(
        q, k, v, attn_mask, masks.key_padding_mask, query_lengths, masks.query_padding_mask, spec.is_causal,
        spec.causal_alignment, *_window_sides(spec.window), spec.dropout_p, spec.scale, bool(allow_tf32), spec.softcap,
        alibi_slopes, sinks,
    )


def run_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, spec: AttentionSpec, alibi_slopes: Optional[Tensor] = None,
                         sinks: Optional[Tensor] = None, allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
    """The Triton backend's entry for ``functional.attention_varlen`` (arguments checked there): ``(out, lse)``."""
    q, k, v = (contiguous_last_dim(t) for t in (q, k, v))
    return AttentionVarlenFunction.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), spec.is_causal,
        spec.causal_alignment, *_window_sides(spec.window), spec.dropout_p, spec.scale, bool(allow_tf32), spec.softcap,
        alibi_slopes, sinks,
    )


def run_attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec,
                          query_lengths: Optional[Tensor] = None) -> Tensor:
    """The Triton backend's entry for ``functional.attention_weights``: the probabilities ``[B, H, Lq, Lk]`` (q's
    dtype, before dropout), recomputed from the LSE by a separate kernel; only modules asked for ``need_weights``
    run it. Not differentiable (``torch.nn`` returns these weights for inspection)."""
    q, k = contiguous_last_dim(q), contiguous_last_dim(k)
    return torch.ops.fused_transformer.attention_weights(
        q, k, lse.float(), masks.attn_mask, masks.key_padding_mask, query_lengths, masks.query_padding_mask,
        spec.is_causal, spec.causal_alignment, *_window_sides(spec.window), spec.scale,
    )


def attention_keep_mask(seed: Tensor, batch: int, heads: int, n_queries: int, n_keys: int, dropout_p: float,
                        device: torch.device) -> Tensor:
    """The bool ``[B, H, Lq, Lk]`` dropout keep-mask the kernels drew with the seed tensor ``seed`` (for the
    reference); for packed sequences ``[B, H, max_seqlen_q, max_seqlen_k]``, sequence b using its top-left
    ``[H, len_q, len_k]`` corner."""
    return dropout_keep_mask(seed, batch * heads * n_queries, n_keys, dropout_p, device).view(
        batch, heads, n_queries, n_keys)
