"""Attention's autograd Functions, written once above the backends' raw entries (``backend.ops(name)``, the interface
in ``fused_transformer.contract``), and ``run`` / ``run_varlen``, which hand a checked call to the backend the route
chose: ``"torch"`` (SDPA, which autograd differentiates through its ops), ``"reference"`` (the composed torch ops of
``fused_transformer.reference``, the oracle these Functions are checked against) or a backend of ours.

What the Functions own, for every backend alike: the dropout seed, the float-output rule for the sinks' gradient,
what is saved for the backward, which gradients are computed, and the no-grad fast path (the backend's forward
called directly).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ... import backend
from ...autograd import backward_seed, draw_seed, saved_seed, traced_apply
from ...contract import (
    NO_SCORE_MODS, AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed, score_mods_flat,
    score_mods_of_flat,
)
from ...route import needs_grad as _needs_grad
from .torch_paths import sdpa_mask

Tensor = torch.Tensor


def sdpa(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, alibi_slopes: Optional[Tensor] = None) -> Tensor:
    """torch's path of a routed call: ``F.scaled_dot_product_attention`` without masks but ``is_causal`` (top-left, or
    ``Lq = Lk``), dropout, score modifiers or sinks but ALiBi (a float bias, ``torch_paths.sdpa_mask``), grouped-query
    heads by ``enable_gqa`` (``facts``: the calls it serves)."""
    if alibi_slopes is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=spec.is_causal, scale=spec.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    bias, _ = sdpa_mask(q, k, is_causal=spec.is_causal, causal_alignment=spec.causal_alignment,
                        alibi_slopes=alibi_slopes)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=spec.scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _float_output(ctx, q: Tensor, sinks: Optional[Tensor]) -> bool:
    """Whether the forward keeps o in float32 for the backward: for sinks that need a gradient, whose sum over every
    row (``sinks_gradient``) must not see o's rounding to 16 bits (twice PyTorch's own error). The caller
    gets o in q's dtype (through a cast only then: under torch 2.11, a compiled graph that returned
    ``o.to(o.dtype)``, an alias of a saved tensor, gave wrong gradients)."""
    return sinks is not None and bool(ctx.needs_input_grad[3]) and q.dtype in (torch.float16, torch.bfloat16)


def sinks_gradient(sinks: Tensor, lse: Tensor, do: Tensor, out: Tensor, dlse: Optional[Tensor],
                   head_dim_last: bool) -> Tensor:
    """The gradient of the attention sinks ``[H]``: each row's sink probability ``exp(sink - lse)`` times
    ``-(rowsum(do * out) - dlse)``, summed over batch and rows. ``lse`` ``[B, H, Lq]`` or packed ``[H, Tq]`` (the
    forward's, the sinks in its sums), ``do`` / ``out`` ``[B, H, Lq, D]`` or packed ``[Tq, H, D]``
    (``head_dim_last`` False: dense). Rows with no query (LSE -inf) give nothing. Pass ``out`` as the kernel
    computed it, before its rounding to a 16-bit dtype: summed over every row of the batch, that rounding alone
    reached several times PyTorch's own error in bfloat16."""
    stats = lse.dtype
    row_dot = (do.to(stats) * out.to(stats)).sum(-1)  # dense [B, H, Lq]; packed [Tq, H]
    if head_dim_last:
        row_dot = row_dot.transpose(0, 1)  # [H, Tq]
    delta = row_dot if dlse is None else row_dot - dlse.to(stats)
    head_axis = 0 if head_dim_last else 1
    shape = [1] * lse.dim()
    shape[head_axis] = -1
    p_sink = torch.exp(sinks.to(stats).view(shape) - lse)
    per_row = torch.where(lse == float("-inf"), torch.zeros_like(delta), -p_sink * delta)
    dims = [d for d in range(lse.dim()) if d != head_axis]
    return per_row.sum(dims).to(sinks.dtype)


def _saved_mods(ctx, mods: ScoreMods) -> list:
    """The tensors of ``mods`` for ``save_for_backward``; its numbers are kept on ``ctx`` (``_mods_of``)."""
    if mods is NO_SCORE_MODS:
        ctx.mod_numbers = None
        return []
    tensors, ctx.mod_numbers = score_mods_flat(mods)
    return tensors


def _mods_of(ctx, tensors: list) -> ScoreMods:
    """The ``ScoreMods`` ``_saved_mods`` saved."""
    return NO_SCORE_MODS if ctx.mod_numbers is None else score_mods_of_flat(tensors, ctx.mod_numbers)


def _forward_state(ctx, q: Tensor, sinks: Optional[Tensor], spec: AttentionSpec,
                   name: str) -> Tuple[Optional[Seed], bool, Optional[dict]]:
    """What both attention Functions' forwards hand the backend's entry beside the tensors: ``(seed, float_output,
    for_backward)``, the last the dict the entry fills for the backward of the same call (``for_backward`` in the
    interface): none in a graph torch.compile traces, whose custom ops keep nothing."""
    ctx.for_backward = None if torch.compiler.is_compiling() else {}
    ctx.spec, ctx.name, ctx.float_output = spec, name, _float_output(ctx, q, sinks)
    return draw_seed(spec.dropout_p, q.device), ctx.float_output, ctx.for_backward


def _attention_outputs(ctx, q: Tensor, o: Tensor, lse: Tensor, with_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The forward's outputs: o in q's dtype, and the LSE ``with_lse`` (differentiable where the backend takes its
    gradient)."""
    if with_lse:
        ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None (no zeros to write and read)
        if not backend.ops(ctx.name).DIFFERENTIABLE_LSE:
            ctx.mark_non_differentiable(lse)
    out = o.to(q.dtype) if ctx.float_output else o
    return (out, lse) if with_lse else out


def _sinks_gradient(ctx, do: Tensor, dlse: Optional[Tensor], o: Tensor, lse: Tensor, sinks: Optional[Tensor],
                    packed: bool) -> Optional[Tensor]:
    return sinks_gradient(sinks, lse, do, o, dlse, head_dim_last=packed) if ctx.needs_input_grad[3] else None


class AttentionFunction(torch.autograd.Function):
    """Autograd over a backend's ``attention_fwd`` / ``attention_bwd``: ``(o, lse)``, or o alone unless ``with_lse``
    (one output less for autograd to track). Differentiable: q, k, v, sinks (theirs from the saved LSE and o) and the
    LSE where the backend takes its gradient; masks and score modifiers are constants."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, attn_mask, key_padding_mask, query_padding_mask, query_lengths,
                mods: ScoreMods, spec: AttentionSpec, name: str, with_lse: bool = True):
        masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask, query_lengths)
        seed, float_output, for_backward = _forward_state(ctx, q, sinks, spec, name)
        o, lse = backend.ops(name).attention_fwd(q, k, v, masks, spec, mods, sinks, seed, float_output, for_backward)
        ctx.save_for_backward(q, k, v, o, lse, sinks, saved_seed(ctx, seed), *masks, *_saved_mods(ctx, mods))
        return _attention_outputs(ctx, q, o, lse, with_lse)

    @staticmethod
    def backward(ctx, do, dlse=None):
        q, k, v, o, lse, sinks, seed, *rest = ctx.saved_tensors
        do = torch.zeros_like(o, dtype=q.dtype) if do is None else do  # only the LSE was used
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = backend.ops(ctx.name).attention_bwd(do, dlse, q, k, v, o, lse, AttentionMasks(*rest[:4]),
                                                             ctx.spec, _mods_of(ctx, rest[4:]),
                                                             backward_seed(ctx, seed), ctx.for_backward)
        return (dq, dk, dv, _sinks_gradient(ctx, do, dlse, o, lse, sinks, False), None, None, None, None, None, None,
                None, None)


class AttentionVarlenFunction(torch.autograd.Function):
    """Autograd over a backend's ``attention_varlen_fwd`` / ``attention_varlen_bwd``, as ``AttentionFunction``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, mods: ScoreMods, max_seqlen_q: int,
                max_seqlen_k: int, spec: AttentionSpec, name: str, with_lse: bool = True):
        seqs = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        seed, float_output, for_backward = _forward_state(ctx, q, sinks, spec, name)
        o, lse = backend.ops(name).attention_varlen_fwd(q, k, v, seqs, spec, mods, sinks, seed, float_output,
                                                        for_backward)
        ctx.save_for_backward(q, k, v, o, lse, sinks, saved_seed(ctx, seed), cu_seqlens_q, cu_seqlens_k,
                              *_saved_mods(ctx, mods))
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        return _attention_outputs(ctx, q, o, lse, with_lse)

    @staticmethod
    def backward(ctx, do, dlse=None):
        q, k, v, o, lse, sinks, seed, cu_seqlens_q, cu_seqlens_k, *mod_tensors = ctx.saved_tensors
        do = torch.zeros_like(o, dtype=q.dtype) if do is None else do  # only the LSE was used
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            seqs = PackedSequences(cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens)
            dq, dk, dv = backend.ops(ctx.name).attention_varlen_bwd(do, dlse, q, k, v, o, lse, seqs, ctx.spec,
                                                                    _mods_of(ctx, mod_tensors),
                                                                    backward_seed(ctx, seed), ctx.for_backward)
        return (dq, dk, dv, _sinks_gradient(ctx, do, dlse, o, lse, sinks, True), None, None, None, None, None, None,
                None, None)


_attention_apply = super(torch.autograd.Function, AttentionFunction).apply  # autograd's own (C++) apply: no frame
_attention_varlen_apply = super(torch.autograd.Function, AttentionVarlenFunction).apply


def _check_constant_mask(attn_mask: Tensor, name: str) -> None:
    # The route sends such calls to the reference ("attn_mask gradients"); the Triton kernel-level entries, which
    # name their backend without asking it, still reach here.
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"attn_mask requires grad, but backend {name!r} treats masks as constants (no gradient); "
                         "pass attn_mask.detach(), or use the reference backend to differentiate the mask")


def _tracked_lse(return_lse: bool) -> bool:
    """Whether an attention Function returns the LSE: when the caller asked for it, and always in a graph
    torch.compile traces (one form of the Function there, whatever the caller asks; the saving is eager's)."""
    return return_lse or torch.compiler.is_compiling()


def run(name: str, q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec,
              mods: ScoreMods, sinks: Optional[Tensor], return_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out, lse)`` of checked arguments on backend ``name`` (``"torch"``: SDPA); lse may be None unless
    ``return_lse``."""
    if name == "torch":
        return sdpa(q, k, v, spec, mods.alibi_slopes), None
    ops = backend.ops(name)
    if name == "reference":
        return ops.attention(q, k, v, masks, spec, mods, sinks)
    if masks.attn_mask is not None:
        _check_constant_mask(masks.attn_mask, name)
    if _needs_grad(q, k, v, sinks):
        with_lse = _tracked_lse(return_lse)
        apply = AttentionFunction.apply if traced_apply() else _attention_apply
        out = apply(q, k, v, sinks, *masks, mods, spec, name, with_lse)
        return out if with_lse else (out, None)
    return ops.attention_fwd(q, k, v, masks, spec, mods, sinks, draw_seed(spec.dropout_p, q.device), False)


def run_varlen(name: str, q: Tensor, k: Tensor, v: Tensor, seqs: PackedSequences, spec: AttentionSpec,
                     mods: ScoreMods, sinks: Optional[Tensor],
                     return_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out, lse)`` of checked arguments on packed sequences, on backend ``name``; lse may be None unless
    ``return_lse``."""
    ops = backend.ops(name)
    if name == "reference":
        return ops.attention_varlen(q, k, v, *seqs, spec, mods, sinks)
    if _needs_grad(q, k, v, sinks):
        with_lse = _tracked_lse(return_lse)
        apply = AttentionVarlenFunction.apply if traced_apply() else _attention_varlen_apply
        out = apply(q, k, v, sinks, seqs.cu_seqlens_q, seqs.cu_seqlens_k, mods, int(seqs.max_seqlen_q),
                    int(seqs.max_seqlen_k), spec, name, with_lse)
        return out if with_lse else (out, None)
    return ops.attention_varlen_fwd(q, k, v, seqs, spec, mods, sinks, draw_seed(spec.dropout_p, q.device), False)
