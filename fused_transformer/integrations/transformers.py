"""Hugging Face transformers (5.x) on fused_transformer's attention kernels.

``register()`` adds ``"fused_transformer"`` to transformers' ``AttentionInterface`` (the function every attention layer
calls) and to its ``AttentionMaskInterface`` (the function that builds the masks the layers receive), so that::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())
    # or, on a model already built:  select(model)

runs each attention layer's ``softmax(q k^T * scale + mask) v`` on ``fused_transformer.functional.attention``. Masks
are built as for ``"sdpa"`` (transformers' ``sdpa_mask``: a bool ``[B, 1, Lq, Lk]`` mask, True = may attend, or None
where ``is_causal`` alone says it); without the mask registration a model hands an unknown implementation no mask
at all and padding would be silently attended.

Importing this module imports transformers; ``import fused_transformer`` never does.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from .. import functional, route
from ..contract import Window, stats_dtype

try:
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the [hf] extra
    raise ImportError(
        "fused_transformer.integrations.transformers needs Hugging Face transformers: pip install fused_transformer[hf]"
    ) from exc

Tensor = torch.Tensor

DEFAULT_NAME = "fused_transformer"

def register(name: str = DEFAULT_NAME) -> str:
    """Make ``name`` a transformers attention implementation that runs on fused_transformer's kernels.

    Registers ``attention_forward`` with ``transformers.AttentionInterface`` and transformers' ``sdpa_mask`` with
    ``AttentionMaskInterface`` under ``name``; calling it again changes nothing. Returns ``name``, to pass as
    ``attn_implementation=`` or to ``model.set_attn_implementation``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def select(model: object, name: str = DEFAULT_NAME) -> Optional[str]:
    """Switch a transformers model's attention layers to fused_transformer's kernels.

    Returns ``name`` when ``model`` is a ``transformers.PreTrainedModel`` (after ``register(name)`` and
    ``model.set_attn_implementation(name)``), None for any other object. Safe to call on any module: it looks for
    transformers only among the modules already imported, so it never imports it for a model that is not one.
    """
    loaded = sys.modules.get("transformers")
    if loaded is None or not isinstance(model, loaded.PreTrainedModel):
        return None
    model.set_attn_implementation(register(name))
    return name


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[Tensor] = None,
    **kwargs: object,
) -> Tuple[Tensor, Optional[Tensor]]:
    """transformers' attention interface on ``fused_transformer.functional.attention``.

    Args:
        module: the calling attention layer; its ``is_causal`` attribute is read when ``is_causal`` is None.
        query: ``[B, H, Lq, D]``; key, value: ``[B, Hkv, Lk, D]`` with ``H`` a multiple of ``Hkv`` (grouped-query
            attention runs in the kernel, key / value are not repeated).
        attention_mask: None, or broadcastable to ``[B, H, Lq, Lk]``: bool (True = may attend) or float (added).
            Passed to the kernel as it is, strides and all.
        dropout: the attention dropout probability (transformers passes 0 in eval mode).
        scaling: the score scale, ``1 / sqrt(D)`` when None (Whisper and T5 pass 1.0).
        is_causal: overrides ``module.is_causal``. As with transformers' ``"sdpa"``, the causal mask comes from the
            kernel's flag only when ``attention_mask`` is None and ``Lq > 1``, aligned top-left: transformers leaves
            the mask out only where that is right (``Lq == Lk``, or a prefill into an empty static cache whose later
            slots hold no keys yet). Otherwise the mask carries causality.
        position_bias: a float bias broadcastable to ``[B, H, Lq, Lk]`` added to the scores (T5), combined with
            ``attention_mask`` (a bool mask as ``where(mask, bias, finfo.min)``, a float one added). When it needs a
            gradient, the kernel runs with it detached and a second autograd node gives its gradient,
            ``P * (dO V^T - rowsum(dO * O))`` with ``P`` recomputed from the kernel's LSE (our kernels do not
            differentiate a float mask); with ``dropout > 0``, softcap or sinks that formula would need the kernel's
            dropout mask or their derivatives, so the mask goes to ``attention`` as it is and the route runs the
            call on the plain-PyTorch ``"reference"`` backend, differentiated by autograd (``explain()`` says so).
        **kwargs: ``sliding_window`` ``W`` (a causal query at ``q`` keeps keys ``kv > q - W``): the mask encodes it,
            and for ``Lq == Lk`` the kernel also gets ``window=(W - 1, 0)`` so that key tiles outside it are
            skipped. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` with ``max_length_q`` / ``max_length_k`` (a packed batch,
            ``B == 1``): runs ``attention_varlen``, each sequence on its own. ``output_attentions=True`` (or the
            module's ``config.output_attentions``): also return the probabilities ``[B, H, Lq, Lk]``. ``softcap``
            (Gemma 2: ``softcap * tanh(scores / softcap)``) and ``s_aux`` (gpt-oss's attention sinks, ``[H]``, a
            logit per head in each row's denominator, trainable) run in the kernel. Anything else
            (``position_ids``, ``cache_position``...) is ignored.

    Returns:
        ``(out, weights)``: ``out`` ``[B, Lq, H, D]`` contiguous in query's dtype, ``weights`` the attention
        probabilities when asked for, else None.
    """
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if sinks is not None:  # the kernels take the sinks in the statistics dtype (a float32 copy of a bf16 parameter)
        sinks = sinks.to(stats_dtype(query.dtype))
    module_is_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    want_weights = bool(kwargs.get("output_attentions") or getattr(getattr(module, "config", None),
                                                                 "output_attentions", False))
    lq, lk = query.shape[2], key.shape[2]
    sliding_window = kwargs.get("sliding_window")
    window: Window = None
    if sliding_window is not None and module_is_causal and lq == lk:
        # Only where the queries and keys are the same positions: with a cache, the key slots of a static one
        # need not end at the last query, so there the mask alone says which keys are in the window.
        window = (int(sliding_window) - 1, 0)

    if kwargs.get("cu_seq_lens_q") is not None and position_bias is None and not want_weights:
        return _packed_forward(query, key, value, kwargs, module_is_causal, window, dropout, scaling, softcap,
                               sinks), None

    causal = lq > 1 and attention_mask is None and module_is_causal
    mask = attention_mask if position_bias is None else _biased_mask(position_bias, attention_mask)
    options = dict(is_causal=causal, causal_alignment="bottom_right" if window is not None else "top_left",
                   window=window, scale=scaling)
    # A trainable float mask (a bias) gets its gradient beside the kernel (MaskGradient) without dropout, softcap or
    # sinks, whose derivatives its formula lacks; with them the mask goes to the op as it is, and the route runs the
    # call where autograd differentiates it (the reference: no kernel of ours computes "attn_mask gradients").
    mask_gradient = (mask is not None and mask.is_floating_point() and route.needs_grad(mask) and dropout == 0.0
                     and softcap is None and sinks is None)
    if want_weights or mask_gradient:  # the LSE makes the weights and the mask's gradient
        out, lse = functional.attention(query, key, value, attn_mask=mask.detach() if mask_gradient else mask,
                                        dropout_p=dropout, return_lse=True, softcap=softcap, sinks=sinks, **options)
        if mask_gradient:
            out = MaskGradient.apply(out, mask, query, key, value, lse, options)
    else:  # without the LSE, torch's SDPA may run the call where the route finds it faster
        out = functional.attention(query, key, value, attn_mask=mask, dropout_p=dropout, softcap=softcap, sinks=sinks,
                                   **options)
    weights = None
    if want_weights:  # capped weights: the route sends them to the reference (the weights kernels do not cap)
        weights = functional.attention_weights(query.detach(), key.detach(), lse,
                                               attn_mask=mask.detach() if mask is not None else None,
                                               softcap=softcap, **options)
    return out.transpose(1, 2).contiguous(), weights


def _biased_mask(position_bias: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """``position_bias`` with ``attention_mask`` folded in: one float mask for the kernel."""
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        # finfo.min, not -inf, as transformers' own paths: a row with every key masked then averages over the keys
        # instead of giving zeros, so padding rows match "eager" and "sdpa" too.
        return torch.where(attention_mask, position_bias, torch.finfo(position_bias.dtype).min)
    return position_bias + attention_mask


def _packed_forward(query: Tensor, key: Tensor, value: Tensor, kwargs: dict, is_causal: bool, window: Window,
                    dropout: float, scaling: Optional[float], softcap: Optional[float],
                    sinks: Optional[Tensor]) -> Tensor:
    """A padding-free packed batch (``B == 1``, sequences delimited by ``cu_seq_lens_*``) on ``attention_varlen``:
    ``[1, T, H, D]``."""
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q describes a packed batch, which must have batch size 1; got query "
                         f"{tuple(query.shape)}")
    cu_seqlens_q = kwargs["cu_seq_lens_q"]
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    # Without the maxima, the packed lengths bound every sequence's length (at the cost of a larger grid).
    max_length_q, max_length_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    max_length_q = query.shape[2] if max_length_q is None else int(max_length_q)
    max_length_k = key.shape[2] if max_length_k is None else int(max_length_k)
    as_int32 = dict(device=query.device, dtype=torch.int32)
    out = functional.attention_varlen(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        cu_seqlens_q.to(**as_int32), cu_seqlens_k.to(**as_int32), max_length_q, max_length_k,
        is_causal=is_causal, window=window, dropout_p=dropout, scale=scaling, softcap=softcap, sinks=sinks,
    )
    return out.unsqueeze(0)


class MaskGradient(torch.autograd.Function):
    """The gradient of a float attention mask (a trainable bias), beside a kernel call that ran with it detached.

    ``apply(out, mask, q, k, v, lse, options)`` returns ``out`` unchanged; its backward passes ``dout`` through to
    ``out`` (whose own node, the kernel's, gives dq, dk, dv without recomputing anything) and gives the mask its
    gradient: with ``P`` the probabilities and ``s = q k^T * scale + mask`` the scores,
    ``dL/ds = P * (dout v^T - rowsum(dout * out))``, summed over the dims the mask broadcasts along. Without dropout
    only: with it, ``out`` is not ``P v``.
    """

    @staticmethod
    def forward(ctx, out, mask, q, k, v, lse, options):
        ctx.save_for_backward(out, mask, q, k, v, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        out, mask, q, k, v, lse = ctx.saved_tensors
        grad_mask = None
        if ctx.needs_input_grad[1]:
            dtype = stats_dtype(q.dtype)
            probs = functional.attention_weights(q.to(dtype), k.to(dtype), lse, attn_mask=mask, **ctx.options)
            kv_heads, heads = v.shape[1], q.shape[1]
            grouped_dout = dout.to(dtype).unflatten(1, (kv_heads, heads // kv_heads))  # [B, Hkv, G, Lq, D]
            dprobs = torch.matmul(grouped_dout, v.to(dtype).unsqueeze(2).transpose(-1, -2)).flatten(1, 2)
            row_dot = (dout.to(dtype) * out.to(dtype)).sum(dim=-1, keepdim=True)  # [B, H, Lq, 1]
            grad_mask = (probs * (dprobs - row_dot)).sum_to_size(mask.shape).to(mask.dtype)
        return dout, grad_mask, None, None, None, None, None
