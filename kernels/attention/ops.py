"""The Triton backend's attention entries (the interface of ``fused_transformer.contract``): an eager call goes
straight to its launcher; under ``torch.compile``, ``torch.export`` or a FakeTensor trace (``traced``) it goes
through a custom op, whose fake kernel gives the traced graph its shapes. The custom ops take the call's options
flat (their schema), and build the same masks and spec the eager path has."""
from typing import Dict, List, Optional, Tuple

import torch

from ...contract import (
    NO_SCORE_MODS, SCORE_MOD_TENSORS, AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed,
    score_mods_flat, score_mods_of_flat, seed_tensor, window_bounds, window_of_bounds,
)
from .._common import contiguous_last_dims, dropout_keep_mask, runtime_keys, seed_args, traced
from .bwd import launch_bwd
from .fwd import launch_fwd
from .launch import (
    LaunchForm, Layout, check_inputs, empty_lse, empty_output, mask_args, shared_args, varlen_mask_args,
)
from .weights import launch_weights

Tensor = torch.Tensor

# ------------------------------------------------------------------------------------------------ eager


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods,
         sinks: Optional[Tensor], seed: Optional[Seed], float_output: bool, masks: Optional[AttentionMasks] = None,
         seqs: Optional[PackedSequences] = None, prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The forward launch: dense with ``masks``, packed with ``seqs``; its layout, masks and arguments in kernel form
    go into ``prepared`` for the backward."""
    check_inputs(q, k, v)
    o = empty_output(q, torch.float32 if float_output else None)
    lse = empty_lse(q, packed=seqs is not None)
    if lse.numel() == 0:  # no query row: a grid of 0 programs is an error on a GPU
        return o, lse
    form = _launch_form(q, k, v, spec, mods, sinks, masks, seqs, seed)
    if prepared is not None:
        prepared["launch"] = form
    launch_fwd(q, k, v, o, lse, form, spec)
    return o, lse


def _bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
         spec: AttentionSpec, mods: ScoreMods, seed: Optional[Seed],
         masks: Optional[AttentionMasks] = None, seqs: Optional[PackedSequences] = None,
         prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward launches (the dq kernel, then the dk/dv kernel): dense with ``masks``, packed with ``seqs``, the
    forward's layout, masks and arguments in kernel form taken from ``prepared`` where it left them."""
    dq, dk = empty_output(q), empty_output(k)
    dv = dk.new_empty_strided(dk.shape, dk.stride())  # v has k's shape
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    form = prepared.get("launch") if prepared is not None else None
    if form is None:
        form = _launch_form(q, k, v, spec, mods, None, masks, seqs, seed)
    elif form.masks.sinks is not None:  # in the LSE: the backward kernels take none
        kernel_masks = form.masks._replace(sinks=None)
        seed_pair = seed_args(seed, q.device)
        form = LaunchForm(form.layout, kernel_masks,
                          shared_args(form.layout, kernel_masks, spec.scale, spec.dropout_p, seed_pair))
    launch_bwd(do, dlse, q, k, v, o, lse, dq, dk, dv, form, spec)
    return dq, dk, dv


# The launch forms of dense calls without masks, sinks or score modifiers that are tensors (nothing but shapes,
# strides, the spec and the modifiers' numbers decides them), by what decides them: (the form, the shared arguments
# before the seed, after it). The form is the call's own where it has no seed (no dropout); with one, its args are
# empty and each call's are made with its seed.
_PLAIN_FORMS: Dict[tuple, Tuple[LaunchForm, tuple, tuple]] = {}
_MAX_PLAIN_FORMS = 256


def _launch_form(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods,
                 sinks: Optional[Tensor], masks: Optional[AttentionMasks], seqs: Optional[PackedSequences],
                 seed: Optional[Seed]) -> LaunchForm:
    """The ``LaunchForm`` of a launch: dense with ``masks``, packed with ``seqs``; made once per shape, strides and
    spec for a plain dense call."""
    seed_pair = seed_args(seed, q.device)
    if seqs is not None:
        layout = Layout.packed(q, k, v, seqs.cu_seqlens_q.shape[0] - 1, seqs.max_seqlen_q, seqs.max_seqlen_k)
        kernel_masks = varlen_mask_args(seqs, spec, mods, sinks)
        return LaunchForm(layout, kernel_masks, shared_args(layout, kernel_masks, spec.scale, spec.dropout_p,
                                                            seed_pair))
    plain = sinks is None and masks.unmasked and (  # no tensor but q, k, v
        mods is NO_SCORE_MODS or all(getattr(mods, name) is None for name in SCORE_MOD_TENSORS))
    if plain:
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), spec, mods)
        found = _PLAIN_FORMS.get(key)
        if found is not None:
            form, before_seed, after_seed = found
            if seed is None and form.args:
                return form
            return LaunchForm(form.layout, form.masks, (*before_seed, *seed_pair, *after_seed), form.args_key,
                              form.keyed_args)
    layout, kernel_masks = Layout.dense(q, k, v), mask_args(q, k, masks, spec, mods, sinks)
    args = shared_args(layout, kernel_masks, spec.scale, spec.dropout_p, seed_pair)
    if not plain:
        return LaunchForm(layout, kernel_masks, args)
    if len(_PLAIN_FORMS) >= _MAX_PLAIN_FORMS:
        _PLAIN_FORMS.clear()
    at = len(args) - len(kernel_masks.score_args()) - len(seed_pair)  # the seed's place
    assert args[at:at + len(seed_pair)] == seed_pair
    form = LaunchForm(layout, kernel_masks, args, runtime_keys(args[:at]), at)
    _PLAIN_FORMS[key] = (form if seed is None else form._replace(args=()), args[:at], args[at + len(seed_pair):])
    return form


def _weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    check_inputs(q, k, k)
    layout = Layout.dense(q, k, k)
    weights = torch.empty((*q.shape[:3], layout.n_keys), dtype=q.dtype, device=q.device)
    if weights.numel() == 0:
        return weights
    launch_weights(q, k, lse.contiguous(), weights, layout, mask_args(q, k, masks, spec), spec.scale)
    return weights


# ----------------------------------------------------------------------------- the backend's entries


def _flat_masks(masks: AttentionMasks) -> tuple:
    """The masks in the custom ops' order."""
    return masks.attn_mask, masks.key_padding_mask, masks.query_lengths, masks.query_padding_mask


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  sinks: Optional[Tensor], seed: Optional[Seed], float_output: bool,
                  prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """``o [B, H, Lq, D]`` laid out as ``[B, Lq, H, D]`` (float32 with ``float_output``) and the float32 LSE."""
    q, k, v = contiguous_last_dims(q, k, v)
    if traced():
        return torch.ops.fused_transformer.attention_fwd(
            q, k, v, *_flat_masks(masks), *_flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods),
            sinks, float_output)
    return _fwd(q, k, v, spec, mods, sinks, seed, float_output, masks=masks, prepared=prepared)


def attention_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
                  seed: Optional[Seed], prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` laid out as o; o in q's dtype or float32 (``float_output``)."""
    q, k, v = contiguous_last_dims(q, k, v)
    o, lse = (o if o.dtype == q.dtype else o.to(q.dtype)), lse.contiguous()
    if traced():
        return torch.ops.fused_transformer.attention_bwd(
            do, dlse, q, k, v, o, lse, *_flat_masks(masks), *_flat_spec(spec), seed_tensor(seed, q.device),
            *score_mods_flat(mods))
    return _bwd(do, dlse, q, k, v, o, lse, spec, mods, seed, masks=masks, prepared=prepared)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seqs: PackedSequences, spec: AttentionSpec,
                         mods: ScoreMods, sinks: Optional[Tensor], seed: Optional[Seed],
                         float_output: bool, prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """``o [Tq, H, D]`` (float32 with ``float_output``) and the float32 LSE ``[H, Tq]``."""
    q, k, v = contiguous_last_dims(q, k, v)
    if traced():
        return torch.ops.fused_transformer.attention_varlen_fwd(
            q, k, v, *seqs, *_flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods), sinks, float_output)
    return _fwd(q, k, v, spec, mods, sinks, seed, float_output, seqs=seqs, prepared=prepared)


def attention_varlen_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                         lse: Tensor, seqs: PackedSequences, spec: AttentionSpec, mods: ScoreMods,
                         seed: Optional[Seed], prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq [Tq, H, D], dk, dv [Tk, Hkv, D]``."""
    q, k, v = contiguous_last_dims(q, k, v)
    o, lse = (o if o.dtype == q.dtype else o.to(q.dtype)), lse.contiguous()
    if traced():
        return torch.ops.fused_transformer.attention_varlen_bwd(
            do, dlse, q, k, v, o, lse, *seqs, *_flat_spec(spec), seed_tensor(seed, q.device), *score_mods_flat(mods))
    return _bwd(do, dlse, q, k, v, o, lse, spec, mods, seed, seqs=seqs, prepared=prepared)


def attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    """The probabilities ``[B, H, Lq, Lk]`` (q's dtype, before dropout) that a forward with this LSE used, recomputed
    by a separate kernel; only modules asked for ``need_weights`` run it. Not differentiable (``torch.nn`` returns
    these weights for inspection)."""
    (q, k), lse = contiguous_last_dims(q, k), lse.float()
    if traced():
        return torch.ops.fused_transformer.attention_weights(q, k, lse, *_flat_masks(masks), *_flat_spec(spec)[:4],
                                                             spec.scale)
    return _weights(q, k, lse, masks, spec)


# -------------------------------------------------------------------------- custom ops, for tracing


def _flat_spec(spec: AttentionSpec) -> tuple:
    """The spec in the custom ops' order (``_spec``'s arguments); the seed follows it."""
    return (spec.is_causal, spec.causal_alignment, *window_bounds(spec.window), spec.dropout_p, spec.scale,
            spec.allow_tf32)


def _spec(is_causal: bool, causal_alignment: str, window_left: Optional[int], window_right: Optional[int],
          dropout_p: float, scale: float, allow_tf32: bool) -> AttentionSpec:
    return AttentionSpec(is_causal, causal_alignment, window_of_bounds(window_left, window_right), dropout_p, scale,
                         allow_tf32)


# The custom ops take the spec flat (``_flat_spec``), then the seed, then the score modifiers as
# ``contract.score_mods_flat`` gives them: their tensors, then their numbers (NaN where absent).


@torch.library.custom_op("fused_transformer::attention_fwd", mutates_args=())
def _attention_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], dropout_p: float, scale: float, allow_tf32: bool,
    seed: Optional[Tensor], mod_tensors: List[Optional[Tensor]], mod_numbers: List[float], sinks: Optional[Tensor],
    float_output: bool,
) -> Tuple[Tensor, Tensor]:
    """``attention_fwd`` with its options flat: q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, contiguous last dims."""
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask, query_lengths)
    spec = _spec(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return _fwd(q, k, v, spec, score_mods_of_flat(mod_tensors, mod_numbers), sinks, seed, float_output, masks=masks)


@_attention_fwd_op.register_fake
def _(q, k, v, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, dropout_p, scale, allow_tf32, seed, mod_tensors, mod_numbers, sinks, float_output):
    return empty_output(q, torch.float32 if float_output else None), empty_lse(q)


@torch.library.custom_op("fused_transformer::attention_bwd", mutates_args=())
def _attention_bwd_op(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], query_lengths: Optional[Tensor],
    query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, scale: float, allow_tf32: bool, seed: Optional[Tensor],
    mod_tensors: List[Optional[Tensor]], mod_numbers: List[float],
) -> Tuple[Tensor, Tensor, Tensor]:
    """``attention_bwd`` with its options flat (the dq kernel, then the dk/dv kernel). Sinks need no argument here:
    they are in the forward's LSE."""
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask, query_lengths)
    spec = _spec(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return _bwd(do, dlse, q, k, v, o, lse, spec, score_mods_of_flat(mod_tensors, mod_numbers), seed, masks=masks)


@_attention_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal,
      causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32, seed, mod_tensors, mod_numbers):
    return tuple(map(empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_varlen_fwd", mutates_args=())
def _attention_varlen_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool, causal_alignment: str, window_left: Optional[int],
    window_right: Optional[int], dropout_p: float, scale: float, allow_tf32: bool, seed: Optional[Tensor],
    mod_tensors: List[Optional[Tensor]], mod_numbers: List[float], sinks: Optional[Tensor], float_output: bool,
) -> Tuple[Tensor, Tensor]:
    """``attention_varlen_fwd`` with its options flat: q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``."""
    seqs = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    spec = _spec(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return _fwd(q, k, v, spec, score_mods_of_flat(mod_tensors, mod_numbers), sinks, seed, float_output, seqs=seqs)


@_attention_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, causal_alignment, window_left,
      window_right, dropout_p, scale, allow_tf32, seed, mod_tensors, mod_numbers, sinks, float_output):
    return empty_output(q, torch.float32 if float_output else None), empty_lse(q, packed=True)


@torch.library.custom_op("fused_transformer::attention_varlen_bwd", mutates_args=())
def _attention_varlen_bwd_op(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
    causal_alignment: str, window_left: Optional[int], window_right: Optional[int], dropout_p: float, scale: float,
    allow_tf32: bool, seed: Optional[Tensor], mod_tensors: List[Optional[Tensor]], mod_numbers: List[float],
) -> Tuple[Tensor, Tensor, Tensor]:
    """``attention_varlen_bwd`` with its options flat."""
    seqs = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    spec = _spec(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return _bwd(do, dlse, q, k, v, o, lse, spec, score_mods_of_flat(mod_tensors, mod_numbers), seed, seqs=seqs)


@_attention_varlen_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
      causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32, seed, mod_tensors, mod_numbers):
    return tuple(map(empty_output, (q, k, v)))


@torch.library.custom_op("fused_transformer::attention_weights", mutates_args=())
def _attention_weights_op(
    q: Tensor, k: Tensor, lse: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
    query_lengths: Optional[Tensor], query_padding_mask: Optional[Tensor], is_causal: bool, causal_alignment: str,
    window_left: Optional[int], window_right: Optional[int], scale: float,
) -> Tensor:
    """``attention_weights`` with its options flat: ``[B, H, Lq, Lk]`` in q's dtype, zeros where masked."""
    masks = AttentionMasks(attn_mask, key_padding_mask, query_padding_mask, query_lengths)
    return _weights(q, k, lse, masks, _spec(is_causal, causal_alignment, window_left, window_right, 0.0, scale,
                                            False))


@_attention_weights_op.register_fake
def _(q, k, lse, attn_mask, key_padding_mask, query_lengths, query_padding_mask, is_causal, causal_alignment,
      window_left, window_right, scale):
    return q.new_empty((*q.shape[:3], k.shape[2]))


def attention_keep_mask(seed: Tensor, batch: int, heads: int, n_queries: int, n_keys: int, dropout_p: float,
                        device: torch.device) -> Tensor:
    """The bool ``[B, H, Lq, Lk]`` dropout keep-mask the kernels drew with the seed tensor ``seed`` (for the
    reference); for packed sequences ``[B, H, max_seqlen_q, max_seqlen_k]``, sequence b using its top-left
    ``[H, len_q, len_k]`` corner."""
    return dropout_keep_mask(seed, batch * heads * n_queries, n_keys, dropout_p, device).view(
        batch, heads, n_queries, n_keys)
