"""The custom ops the Triton backend's attention entries go through when traced (``torch.compile``, ``torch.export``,
a FakeTensor trace): the entries (``fwd.attention_fwd``, ``bwd.attention_bwd`` and their packed twins, and
``attention_weights`` here) launch directly in eager mode; traced, they call these ops, whose fake kernels give the
graph its shapes. The ops take the call's options flat (their schema, ``call.flat_spec``), and rebuild the masks and
spec the entries take."""
from typing import List, Optional, Tuple

import torch

from ...contract import AttentionMasks, AttentionSpec, PackedSequences, score_mods_of_flat
from .._common import contiguous_last_dims, dropout_keep_mask, launch_kernel, traced
from .bwd import attention_bwd, attention_varlen_bwd
from .call import flat_masks, flat_spec, spec_of_flat
from .fwd import attention_fwd, attention_varlen_fwd
from .launch import Layout, check_inputs, empty_lse, empty_output, mask_args
from .weights import launch_weights

Tensor = torch.Tensor

# ------------------------------------------------------------------------------------ attention weights


def _weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    check_inputs(q, k, k)
    layout = Layout.dense(q, k, k)
    weights = torch.empty((*q.shape[:3], layout.n_keys), dtype=q.dtype, device=q.device)
    if weights.numel() == 0:
        return weights
    kernel_masks = mask_args(q, k, masks, spec)
    for launch in kernel_masks.launches:
        launch_kernel(*launch)
    launch_weights(q, k, lse.contiguous(), weights, layout, kernel_masks, spec.scale)
    return weights


def attention_weights(q: Tensor, k: Tensor, lse: Tensor, masks: AttentionMasks, spec: AttentionSpec) -> Tensor:
    """The probabilities ``[B, H, Lq, Lk]`` (q's dtype, before dropout) that a forward with this LSE used, recomputed
    by a separate kernel; only modules asked for ``need_weights`` run it. Not differentiable (``torch.nn`` returns
    these weights for inspection)."""
    (q, k), lse = contiguous_last_dims(q, k), lse.float()
    if traced():
        return torch.ops.fused_transformer.attention_weights(q, k, lse, *flat_masks(masks), *flat_spec(spec)[:4],
                                                             spec.scale)
    return _weights(q, k, lse, masks, spec)


# -------------------------------------------------------------------------- custom ops, for tracing


# The custom ops take the spec flat (``call.flat_spec``), then the seed, then the score modifiers as
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
    spec = spec_of_flat(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return attention_fwd(q, k, v, masks, spec, score_mods_of_flat(mod_tensors, mod_numbers), sinks, seed, float_output)


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
    spec = spec_of_flat(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return attention_bwd(do, dlse, q, k, v, o, lse, masks, spec, score_mods_of_flat(mod_tensors, mod_numbers), seed)


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
    spec = spec_of_flat(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return attention_varlen_fwd(q, k, v, seqs, spec, score_mods_of_flat(mod_tensors, mod_numbers), sinks, seed,
                                float_output)


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
    spec = spec_of_flat(is_causal, causal_alignment, window_left, window_right, dropout_p, scale, allow_tf32)
    return attention_varlen_bwd(do, dlse, q, k, v, o, lse, seqs, spec, score_mods_of_flat(mod_tensors, mod_numbers),
                                seed)


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
    return _weights(q, k, lse, masks, spec_of_flat(is_causal, causal_alignment, window_left, window_right, 0.0, scale,
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
