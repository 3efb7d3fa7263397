"""What an attention entry derives from its arguments before it launches (``fwd.attention_fwd``,
``bwd.attention_bwd`` and their packed twins): its outputs, the masks and arguments in kernel form (``LaunchArgs``,
made once per shapes, strides and spec for a dense call without mask tensors, and left in ``for_backward`` for the
backward of the same call), and the options flat, as the custom ops' schemas take them."""
from typing import Dict, Optional, Tuple

import torch

from ...contract import (
    NO_SCORE_MODS, SCORE_MOD_TENSORS, AttentionMasks, AttentionSpec, PackedSequences, ScoreMods, Seed, window_bounds,
    window_of_bounds,
)
from .._common import runtime_keys, seed_args
from .launch import (
    LaunchArgs, Layout, check_inputs, empty_lse, empty_output, mask_args, shared_args, varlen_mask_args,
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


# The launch arguments of dense calls without masks, sinks or score modifiers that are tensors (nothing but shapes,
# strides, the spec and the modifiers' numbers decides them), by what decides them: (the LaunchArgs, the shared
# arguments before the seed, after it). The LaunchArgs is the call's own where it has no seed (no dropout); with one,
# its args are empty and each call's are made with its seed.
_CACHED_LAUNCH_ARGS: Dict[tuple, Tuple[LaunchArgs, tuple, tuple]] = {}
_MAX_CACHED_LAUNCH_ARGS = 256


def launch_args_of(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, sinks: Optional[Tensor],
                masks: Optional[AttentionMasks], seqs: Optional[PackedSequences], seed: Optional[Seed]) -> LaunchArgs:
    """The ``LaunchArgs`` of a launch: dense with ``masks``, packed with ``seqs``; made once per shape, strides and
    spec for a dense call without mask tensors."""
    seed_pair = seed_args(seed, q.device)
    if seqs is not None:
        layout = Layout.packed(q, k, v, seqs.cu_seqlens_q.shape[0] - 1, seqs.max_seqlen_q, seqs.max_seqlen_k)
        kernel_masks = varlen_mask_args(seqs, spec, mods, sinks)
        return LaunchArgs(layout, kernel_masks, shared_args(layout, kernel_masks, spec.scale, spec.dropout_p,
                                                            seed_pair))
    no_tensors = sinks is None and masks.unmasked and (  # no tensor but q, k, v
        mods is NO_SCORE_MODS or all(getattr(mods, name) is None for name in SCORE_MOD_TENSORS))
    if no_tensors:
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), spec, mods)
        found = _CACHED_LAUNCH_ARGS.get(key)
        if found is not None:
            cached, before_seed, after_seed = found
            if seed is None and cached.args:
                return cached
            return LaunchArgs(cached.layout, cached.masks, (*before_seed, *seed_pair, *after_seed), cached.args_key,
                              cached.keyed_args)
    layout, kernel_masks = Layout.dense(q, k, v), mask_args(q, k, masks, spec, mods, sinks)
    args = shared_args(layout, kernel_masks, spec.scale, spec.dropout_p, seed_pair)
    if not no_tensors:
        return LaunchArgs(layout, kernel_masks, args)
    if len(_CACHED_LAUNCH_ARGS) >= _MAX_CACHED_LAUNCH_ARGS:
        _CACHED_LAUNCH_ARGS.clear()
    at = len(args) - len(kernel_masks.score_args()) - len(seed_pair)  # the seed's place
    assert args[at:at + len(seed_pair)] == seed_pair
    launch_args = LaunchArgs(layout, kernel_masks, args, runtime_keys(args[:at]), at)
    _CACHED_LAUNCH_ARGS[key] = (launch_args if seed is None else launch_args._replace(args=()), args[:at],
                                args[at + len(seed_pair):])
    return launch_args


def forward_outputs(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, sinks: Optional[Tensor],
                    seed: Optional[Seed], float_output: bool, masks: Optional[AttentionMasks] = None,
                    seqs: Optional[PackedSequences] = None,
                    for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Optional[LaunchArgs]]:
    """A forward's ``o``, ``lse`` and launch arguments (None where there is no query row to launch for: a grid of 0
    programs is an error on a GPU), dense with ``masks``, packed with ``seqs``; the launch arguments go into
    ``for_backward`` for the backward. The caller makes their ``masks.launches`` before its own."""
    check_inputs(q, k, v)
    o = empty_output(q, torch.float32 if float_output else None)
    lse = empty_lse(q, packed=seqs is not None)
    if lse.numel() == 0:
        return o, lse, None
    launch_args = launch_args_of(q, k, v, spec, mods, sinks, masks, seqs, seed)
    if for_backward is not None:  # the backward reads what the forward's launches computed: it makes none of them
        made = launch_args.masks.launches
        for_backward["launch"] = launch_args._replace(masks=launch_args.masks._replace(launches=())) if made \
            else launch_args
    return o, lse, launch_args


def backward_outputs(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mods: ScoreMods, seed: Optional[Seed],
                     masks: Optional[AttentionMasks] = None, seqs: Optional[PackedSequences] = None,
                     for_backward: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor, Optional[LaunchArgs]]:
    """A backward's ``dq``, ``dk``, ``dv`` and launch arguments (None where there is nothing to launch: the gradients
    are zeros), the forward's taken from ``for_backward`` where it left them."""
    dq, dk = empty_output(q), empty_output(k)
    dv = dk.new_empty_strided(dk.shape, dk.stride())  # v has k's shape
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None
    launch_args = for_backward.get("launch") if for_backward is not None else None
    if launch_args is None:
        launch_args = launch_args_of(q, k, v, spec, mods, None, masks, seqs, seed)
    elif launch_args.masks.sinks is not None:  # in the LSE: the backward kernels take none
        kernel_masks = launch_args.masks._replace(sinks=None)
        launch_args = LaunchArgs(launch_args.layout, kernel_masks, shared_args(
            launch_args.layout, kernel_masks, spec.scale, spec.dropout_p, seed_args(seed, q.device)))
    return dq, dk, dv, launch_args
