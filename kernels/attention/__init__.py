"""Fused scaled-dot-product attention on Triton (FlashAttention-2 style), forward and backward, every mask in the
kernel: ``attention``, ``attention_varlen`` and ``attention_weights`` check their arguments as
``fused_transformer.functional`` does and add kernel-level options.

The package reads top-down, one pass a file: ``jit.py`` (the helpers the kernels share: masks, sequence bounds, the
score modifiers), ``fwd.py`` (forward kernel and launcher), ``bwd.py`` (dq and dk/dv kernels and launcher),
``weights.py`` (the probabilities for ``need_weights``), ``decode.py`` (split-KV decoding over a contiguous or paged
KV cache, and its backend entry), ``lengths.py`` (a padding mask's lengths), ``launch.py`` (masks, sizes and grids in
kernel form), ``configs.py`` (the tile plan every launch and the AOT report read), ``ops.py`` (the backend's raw
entries, and the custom ops that tracing goes through) and ``aot.py`` (what the report compiles).

The entries below add the kernel-level options to the functional ops; their checks and autograd are the op's
(``fused_transformer.ops.attention``), the only module above the kernels they call (at call time).
"""
import re
from typing import Optional, Tuple, Union

import torch

from ... import contract
from ...contract import AttentionMasks
from .aot import aot_configs
from .configs import INTERPRETER_TILE, TILE_ROWS, Plan, Tile, TileRow, head_dim_bucket, plan
from .decode import attention_decode, attention_with_kvcache, decode_splits, programs_per_sm
from .ops import (
    attention_bwd, attention_fwd, attention_keep_mask, attention_varlen_bwd, attention_varlen_fwd,
    attention_weights as weights_of_lse,
)

Tensor = torch.Tensor

# The configs docs/report.md shows (the report prints every one): bfloat16 at head dims 64 and 128, every feature on
# and the plain (causal, two-loop) launch.
MARKDOWN_ROWS = re.compile(r"^bf16/D(64|128)/[^/]+(/causal)?(/tma)?$")

__all__ = [
    "attention", "attention_varlen", "attention_weights", "attention_keep_mask", "attention_fwd", "attention_bwd",
    "attention_varlen_fwd", "attention_varlen_bwd", "weights_of_lse", "attention_with_kvcache", "plan", "Plan",
    "Tile", "TileRow", "TILE_ROWS", "INTERPRETER_TILE", "head_dim_bucket", "aot_configs", "attention_decode",
    "decode_splits", "programs_per_sm",
]


def attention(q: Tensor, k: Tensor, v: Tensor, *, query_lengths: Optional[Tensor] = None, allow_tf32: bool = False,
              **options: object) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``fused_transformer.functional.attention`` on Triton, checked as there (``options``: its keyword arguments),
    plus two kernel-level options.

    Args:
        query_lengths: ``[B]`` integers; rows ``i >= query_lengths[b]`` give zeros (LSE ``-inf``). With a
            ``query_padding_mask`` too, those rows count as padding (also for ``bottom_right`` alignment).
        allow_tf32: float32 products on tensor cores in TF32 (default: full float32 precision).

    Returns:
        ``[B, H, Lq, D]`` in q's dtype, laid out as ``[B, Lq, H, D]`` (``out.transpose(1, 2)`` is contiguous),
        and the float32 LSE ``[B, H, Lq]`` with ``return_lse``. Inputs need only a contiguous last dim (copied
        otherwise); float16 / bfloat16 / float32, head dims 0..256 (float32: 0..128).
    """
    checks, function = _op()
    options = contract.options_of("attention", options, checks.ATTENTION_OPTIONS)
    masks = AttentionMasks(options["attn_mask"], options["key_padding_mask"], options["query_padding_mask"])
    checks.check_attention_args(q, k, v, masks)
    mods, sinks = _mods_and_sinks(q, q.shape[0], options)
    spec = _spec(q, options, allow_tf32)
    if query_lengths is not None and tuple(query_lengths.shape) != (q.shape[0],):
        raise ValueError(f"query_lengths must be [batch={q.shape[0]}], got shape {tuple(query_lengths.shape)}")
    o, lse = function.run("triton", q, k, v, masks._replace(query_lengths=query_lengths), spec, mods, sinks)
    return (o, lse) if options["return_lse"] else o


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, allow_tf32: bool = False, **options: object
                     ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``fused_transformer.functional.attention_varlen`` on Triton, plus ``allow_tf32`` as in ``attention``.
    Checked as there but for the values of cu_seqlens, which the kernels read on the device (no host sync)."""
    checks, function = _op()
    options = contract.options_of("attention_varlen", options, checks.ATTENTION_VARLEN_OPTIONS)
    checks.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods, sinks = _mods_and_sinks(q, cu_seqlens_q.shape[0] - 1, options)
    spec = _spec(q, options, allow_tf32)
    seqs = checks.packed_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.device)
    o, lse = function.run_varlen("triton", q, k, v, seqs, spec, mods, sinks)
    return (o, lse) if options["return_lse"] else o


def attention_weights(q: Tensor, k: Tensor, lse: Tensor, *, query_lengths: Optional[Tensor] = None,
                      **options: object) -> Tensor:
    """``fused_transformer.functional.attention_weights`` on Triton (``weights_of_lse``), plus ``query_lengths`` as in
    ``attention``."""
    checks, _ = _op()
    options = contract.options_of("attention_weights", options, checks.ATTENTION_WEIGHTS_OPTIONS)
    masks = AttentionMasks(options["attn_mask"], options["key_padding_mask"], options["query_padding_mask"],
                           query_lengths)
    checks.check_attention_args(q, k, k, masks)
    return weights_of_lse(q, k, lse, masks, _spec(q, options, False))


def _spec(q: Tensor, options: dict, allow_tf32: bool) -> contract.AttentionSpec:
    spec = _op()[0].attention_spec(q.shape[-1], options["is_causal"], options["causal_alignment"],
                                   options["window"], options.get("dropout_p", 0.0), options["scale"])
    return spec._replace(allow_tf32=bool(allow_tf32))


def _mods_and_sinks(q: Tensor, batch: int, options: dict) -> Tuple[contract.ScoreMods, Optional[Tensor]]:
    """The checked score modifiers and sinks of ``options`` for q's heads over ``batch`` sequences."""
    checks = _op()[0]
    mods = checks.score_mods(q, batch, q.shape[1], **{name: options[name] for name in contract.ScoreMods._fields})
    checks.check_sinks(q, q.shape[1], options["sinks"])
    return mods, options["sinks"]


def _op():
    """The attention op's checks and Functions (``fused_transformer.ops.attention``), the floor above the kernels:
    imported at call time."""
    from ...ops.attention import contract as checks, function

    return checks, function
