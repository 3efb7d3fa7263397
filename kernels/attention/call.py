"""What an attention entry derives from its arguments before it launches (``fwd.attention_fwd``,
``bwd.attention_bwd`` and their packed twins): its outputs, the masks and arguments in kernel form (``LaunchForm``,
made once per shapes, strides and spec for a dense call without mask tensors, and left in ``prepared`` for the
backward of the same call), and the flat form of the options that the custom ops' schemas take."""
from typing import Dict, Optional, Tuple

import torch

from ...contract import (
    NO_SCORE_MODS, SCORE_MOD_TENSORS, AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed, window_bounds,
    window_of_bounds,
)
from .._common import runtime_keys, seed_args
from .launch import (
    LaunchForm, Layout, check_inputs, empty_lse, empty_output, mask_args, shared_args, varlen_mask_args,
)

Tensor = torch.Tensor


def flat_masks(masks: AttentionMasks) -> tuple:
    """The masks in the custom ops' order."""
    return masks.attn_mask, masks.key_padding_mask, masks.query_lengths, masks.query_padding_mask


def flat_spec(spec: AttentionSpec) -> tuple:
    """The spec in the custom ops' order (``spec_of_flat``'s arguments); the seed follows it."""
    return (spec.is_causal, spec.causal_alignment, *window_bounds(spec.window), spec.dropout_p, spec.scale,
            spec.allow_tf32)


def spec_of_flat(is_causal: bool, causal_alignment: str, window_left: Optional[int], window_right: Optional[int],
                 dropout_p: float, scale: float, allow_tf32: bool) -> AttentionSpec:
    return AttentionSpec(is_causal, causal_alignment, window_of_bounds(window_left, window_right), dropout_p, scale,
                         allow_tf32)


# The launch forms of dense calls without masks, sinks or score modifiers that are tensors (nothing but shapes,
# strides, the spec and the modifiers' numbers decides them), by what decides them: (the form, the shared arguments
# before the seed, after it). The form is the call's own where it has no seed (no dropout); with one, its args are
# empty and each call's are made with its seed.
_PLAIN_FORMS: Dict[tuple, Tuple[LaunchForm, tuple, tuple]] = {}
_MAX_PLAIN_FORMS = 256


def launch_form(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, sinks: Optional[Tensor],
                masks: Optional[AttentionMasks], seqs: Optional[PackedSequences], seed: Optional[Seed]) -> LaunchForm:
    """The ``LaunchForm`` of a launch: dense with ``masks``, packed with ``seqs``; made once per shape, strides and
    spec for a dense call without mask tensors."""
    seed_pair = seed_args(seed, q.device)
    if seqs is not None:
        layout = Layout.packed(q, k, v, seqs.cu_seqlens_q.shape[0] - 1, seqs.max_seqlen_q, seqs.max_seqlen_k)
        kernel_masks = varlen_mask_args(seqs, spec, mods, sinks)
        return LaunchForm(layout, kernel_masks, shared_args(layout, kernel_masks, spec.scale, spec.dropout_p,
                                                            seed_pair))
    no_tensors = sinks is None and masks.unmasked and (  # no tensor but q, k, v
        mods is NO_SCORE_MODS or all(getattr(mods, name) is None for name in SCORE_MOD_TENSORS))
    if no_tensors:
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
    if not no_tensors:
        return LaunchForm(layout, kernel_masks, args)
    if len(_PLAIN_FORMS) >= _MAX_PLAIN_FORMS:
        _PLAIN_FORMS.clear()
    at = len(args) - len(kernel_masks.score_args()) - len(seed_pair)  # the seed's place
    assert args[at:at + len(seed_pair)] == seed_pair
    form = LaunchForm(layout, kernel_masks, args, runtime_keys(args[:at]), at)
    _PLAIN_FORMS[key] = (form if seed is None else form._replace(args=()), args[:at], args[at + len(seed_pair):])
    return form


def forward_outputs(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, sinks: Optional[Tensor],
                    seed: Optional[Seed], float_output: bool, masks: Optional[AttentionMasks] = None,
                    seqs: Optional[PackedSequences] = None,
                    prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Optional[LaunchForm]]:
    """A forward's ``o``, ``lse`` and launch form (None where there is no query row to launch for: a grid of 0
    programs is an error on a GPU), dense with ``masks``, packed with ``seqs``; the form goes into ``prepared`` for
    the backward. The caller makes the form's ``masks.launches`` before its own."""
    check_inputs(q, k, v)
    o = empty_output(q, torch.float32 if float_output else None)
    lse = empty_lse(q, packed=seqs is not None)
    if lse.numel() == 0:
        return o, lse, None
    form = launch_form(q, k, v, spec, mods, sinks, masks, seqs, seed)
    if prepared is not None:  # the backward reads what the forward's launches computed: it makes none of them
        prepared["launch"] = form._replace(masks=form.masks._replace(launches=())) if form.masks.launches else form
    return o, lse, form


def backward_outputs(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, seed: Optional[Seed],
                     masks: Optional[AttentionMasks] = None, seqs: Optional[PackedSequences] = None,
                     prepared: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor, Optional[LaunchForm]]:
    """A backward's ``dq``, ``dk``, ``dv`` and launch form (None where there is nothing to launch: the gradients are
    zeros), the forward's taken from ``prepared`` where it left one."""
    dq, dk = empty_output(q), empty_output(k)
    dv = dk.new_empty_strided(dk.shape, dk.stride())  # v has k's shape
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None
    form = prepared.get("launch") if prepared is not None else None
    if form is None:
        form = launch_form(q, k, v, spec, mods, None, masks, seqs, seed)
    elif form.masks.sinks is not None:  # in the LSE: the backward kernels take none
        kernel_masks = form.masks._replace(sinks=None)
        form = LaunchForm(form.layout, kernel_masks, shared_args(form.layout, kernel_masks, spec.scale,
                                                                 spec.dropout_p, seed_args(seed, q.device)))
    return dq, dk, dv, form
