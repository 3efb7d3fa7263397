"""What the route decides an attention call on (``fused_transformer.route``): how each entry makes its ``route.Call``,
and the rows measured on GPUs and at torch's SDPA door.

Dense ``attention``'s size is its keys per sequence; ``attention_varlen``'s the longest sequence's keys and
``attention_with_kvcache``'s the keys the longest sequence attends, the new ones included (the cache's capacity where
the lengths are not read) (``SIZE_OF``). torch's path (SDPA) computes a dense call without masks but ``is_causal``
(top-left, or as many queries as keys), without dropout, score modifiers, sinks or the LSE (grouped-query heads:
``enable_gqa``); packed sequences have no torch op on every device. A KV-cache call on a contiguous cache whose lengths
the host holds, without a window, and where every query sees a key, is SDPA over the cache after the append, with a
bool mask (``torch_paths.kvcache_sdpa``; ``kvcache_refusal`` says why not elsewhere). A traced call (torch.compile,
torch.export) runs ours: one custom op, the same graph on every GPU.
"""
from __future__ import annotations

from typing import FrozenSet, Optional, Sequence

import torch

from ... import route
from ...contract import NO_SCORE_MODS, AttentionMasks, AttentionSpec, KVCache, KVCacheSpec, ScoreMods

Tensor = torch.Tensor

SIZE_OF = {"attention": "keys per sequence", "attention_varlen": "longest sequence's keys",
           "attention_with_kvcache": "keys the longest sequence attends"}
_TRACED = "a traced call (ours there: one custom op, the same graph on every device)"
_PACKED = "packed sequences or a KV cache (no torch op for them on every device)"
_WEIGHTS = "the weights of an LSE (no torch op computes them)"
_CAPPED = frozenset({"capped weights"})
_NO_TORCH_KERNEL = "this op on this device"  # at the SDPA door: varlen_attn's ops on the CPU
_PAGED = "a paged KV cache (SDPA reads no block table)"
_UNREAD = "cache lengths the host does not hold (unread, a query might see no key: SDPA's NaN, our zeros)"
_KEYLESS = "a query with no key (SDPA gives NaN where ours gives zeros)"


# The widest heads the Triton kernels take (kernels/attention/configs.py MAX_HEAD_DIM): beyond them a call needs a
# feature only the CPU kernels have, and torch's path runs it by default (Gemma's 256 in float32, for one).
FLOAT32_MAX_HEAD_DIM, MAX_HEAD_DIM = 128, 256
_WIDE_HEADS = "float32 head dims above 128: our Triton kernels stop at 128"
# Dense and causal attention where no row matches (a device, dtype or width nobody measured): torch's kernels
# (cuDNN, FlashAttention, its CPU flash kernel) beat ours there wherever it was measured (H200: 0.54-0.79x).
DENSE_PRIOR = "prior: torch for dense and causal attention without a measured row (ours 0.54-0.79x on the H200)"


def head_needs(dtype: torch.dtype, head_dim: int) -> FrozenSet[str]:
    """The features (``route.SUPPORTS``) heads of ``head_dim`` in ``dtype`` need beyond the Triton kernels' widths."""
    if head_dim > MAX_HEAD_DIM:
        return frozenset({"head dims above 256"})
    if dtype == torch.float32 and head_dim > FLOAT32_MAX_HEAD_DIM:
        return frozenset({"float32 head dims above 128"})
    return frozenset()


# A float attn_mask autograd differentiates (a trainable bias): the kernels of ours take masks as constants.
MASK_GRADIENTS = frozenset({"attn_mask gradients"})


def needs(mods: ScoreMods, sinks: Optional[Tensor], q: Optional[Tensor] = None,
          masks: Optional[AttentionMasks] = None) -> FrozenSet[str]:
    """The features (``route.SUPPORTS``) a call with ``mods``, ``sinks``, queries ``q`` and ``masks`` needs of a
    backend: "attn_mask gradients" where autograd would differentiate the float ``attn_mask`` (no backend of ours
    computes them: the reference does)."""
    wide = frozenset() if q is None else head_needs(q.dtype, q.shape[-1])
    if masks is not None and masks.attn_mask is not None and route.needs_grad(masks.attn_mask):
        wide = wide | MASK_GRADIENTS
    if mods is NO_SCORE_MODS and sinks is None:
        return wide
    given = frozenset(mods.given) | wide
    return given | {"sinks"} if sinks is not None else given


def mask_kind(query_len: int, key_len: int, masks: Optional[AttentionMasks], spec: AttentionSpec,
              mods: ScoreMods = NO_SCORE_MODS) -> str:
    """``"none"`` or ``"causal"`` where SDPA computes our masking from ``is_causal`` alone, ``"alibi"`` or
    ``"causal+alibi"`` where it adds ALiBi as a float bias on top (``torch_paths.sdpa_mask``), else ``"other"``."""
    if (masks is not None and not masks.unmasked) or spec.window is not None:
        return "other"
    if not spec.is_causal:
        kind = "none"
    elif not spec.bottom_right or query_len == key_len:
        kind = "causal"
    else:
        return "other"
    if mods.alibi_slopes is None:
        return kind
    return "alibi" if kind == "none" else "causal+alibi"


def decide(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, spec: AttentionSpec, mods: ScoreMods,
           sinks: Optional[Tensor], needs_lse: bool, remember_as: Optional[tuple] = None) -> route.Decision:
    """Who runs a dense attention call of checked arguments ``q [B, H, Lq, D]``, ``k, v [B, Hkv, Lk, D]``.
    ``remember_as``: the caller's own key of the call, under which the decision and ``spec`` are kept
    (``route.recall``)."""
    if mods is NO_SCORE_MODS and sinks is None and masks.unmasked and not torch.compiler.is_compiling():
        key = remember_as or ("attention", q.device, q.dtype, q.shape, k.shape[1], k.shape[2], spec,
                              route.needs_grad(q, k, v), needs_lse, torch.are_deterministic_algorithms_enabled(),
                              route.backend.get_backend())
        return route.remembered(key, lambda: (call(q, k, v, masks, spec, mods, sinks, needs_lse), q.device), spec)
    return route.choose(call(q, k, v, masks, spec, mods, sinks, needs_lse), q.device)


def call(q: Tensor, k: Tensor, v: Tensor, masks: Optional[AttentionMasks], spec: AttentionSpec, mods: ScoreMods,
         sinks: Optional[Tensor], needs_lse: bool, needs_grad: Optional[bool] = None,
         device: Optional[torch.device] = None) -> route.Call:
    """The ``route.Call`` of a dense call (``needs_grad`` None: from the tensors; ``device``: q's unless given)."""
    device = q.device if device is None else device
    cannot = ""
    if min(q.shape[2], k.shape[2], q.shape[3]) == 0:
        cannot = "empty dims"
    elif spec.dropout_p > 0.0:
        cannot = "dropout (SDPA's random mask is not our seed's)"
    elif torch.compiler.is_compiling():
        cannot = _TRACED
    mask = mask_kind(q.shape[2], k.shape[2], masks, spec, mods)
    prior = "" if mask.endswith("alibi") else DENSE_PRIOR  # ALiBi: ours, wherever it was measured
    return route.Call("attention", route.device_tag(device), q.dtype, head_dim=q.shape[3],
                      mask=mask, dropout=spec.dropout_p > 0.0,
                      size=route.size(k.shape[2]),
                      needs_grad=route.needs_grad(q, k, v, sinks) if needs_grad is None else needs_grad,
                      needs_lse=needs_lse, deterministic=torch.are_deterministic_algorithms_enabled(),
                      needs=needs(mods, sinks, q, masks), torch_cannot=cannot,
                      torch_default=_WIDE_HEADS if head_needs(q.dtype, q.shape[3]) else prior)


def decide_packed(op: str, q: Tensor, max_keys: int, mods: ScoreMods, sinks: Optional[Tensor],
                  needs_grad: bool = False) -> route.Decision:
    """Who runs ``attention_varlen`` (``op``) on queries ``q`` (head dim last): ours (``_PACKED``)."""
    return route.choose(packed_call(op, q, max_keys, mods, sinks, needs_grad), q.device)


def packed_call(op: str, q: Tensor, max_keys: int, mods: ScoreMods, sinks: Optional[Tensor], needs_grad: bool = False,
                *, mask: str = "none", needs_lse: bool = False, torch_cannot: str = _PACKED) -> route.Call:
    """The ``route.Call`` of ``attention_varlen`` or ``attention_with_kvcache`` (``op``) on queries ``q`` (head dim
    last); ``torch_cannot``: why torch's path does not serve it ("": it does; ``kvcache_refusal``)."""
    return route.Call(op, route.device_tag(q.device), q.dtype, head_dim=q.shape[-1], mask=mask,
                      size=route.size(max_keys), needs_grad=needs_grad, needs_lse=needs_lse,
                      needs=needs(mods, sinks, q), torch_cannot=torch_cannot)


def kvcache_refusal(q: Tensor, cache: KVCache, host_lengths: Optional[Sequence[int]], new_len: int,
                    spec: KVCacheSpec) -> str:
    """Why torch's path of ``attention_with_kvcache`` (``torch_paths.kvcache_sdpa``) does not compute a call as ours
    does, "" where it does: ``q [B, Lq, H, D]``, ``cache`` before the append, ``host_lengths`` its lengths as the host
    holds them (None: unread), ``new_len`` the keys appended. Score modifiers, sinks and the LSE the route refuses
    itself (``route.torch_refuses``)."""
    if torch.compiler.is_compiling():
        return _TRACED
    if cache.block_table is not None:
        return _PAGED
    if host_lengths is None:
        return _UNREAD
    if q.numel() == 0 or cache.k.shape[-1] == 0:
        return "empty dims"
    if spec.window is not None:
        return "a window (SDPA's mask would cost a dense one, and rows left without a key differ)"
    if min(host_lengths) + new_len < (q.shape[1] if spec.is_causal else 1):
        return _KEYLESS
    return ""


def kvcache_call(q: Tensor, cache: KVCache, host_lengths: Optional[Sequence[int]], new_len: int, mods: ScoreMods,
                 sinks: Optional[Tensor], spec: KVCacheSpec, needs_lse: bool) -> route.Call:
    """The ``route.Call`` of an ``attention_with_kvcache`` call (``kvcache_refusal``'s arguments): its size the keys
    the longest sequence attends (the capacity where the host holds no lengths), its mask causal where more than one
    query each sequence has."""
    size = max(host_lengths) + new_len if host_lengths else cache.capacity
    mask = "other" if spec.window is not None else ("causal" if spec.is_causal and q.shape[1] > 1 else "none")
    return packed_call("attention_with_kvcache", q, size, mods, sinks, mask=mask, needs_lse=needs_lse,
                       torch_cannot=kvcache_refusal(q, cache, host_lengths, new_len, spec))


def decide_kvcache(q: Tensor, cache: KVCache, host_lengths: Optional[Sequence[int]], new_len: int, mods: ScoreMods,
                   sinks: Optional[Tensor], spec: KVCacheSpec, needs_lse: bool) -> route.Decision:
    """Who runs an ``attention_with_kvcache`` call (``kvcache_call``)."""
    return route.choose(kvcache_call(q, cache, host_lengths, new_len, mods, sinks, spec, needs_lse), q.device)


def weights_call(q: Tensor, k: Tensor, softcap: Optional[float]) -> route.Call:
    """The ``route.Call`` of ``attention_weights`` on queries ``q [B, H, Lq, D]`` and keys ``k``: torch has no op
    for it; with ``softcap`` it needs "capped weights", which the weights kernels lack (the reference computes it),
    and heads wider than the Triton kernels take need the backend that takes them."""
    return route.Call("attention_weights", route.device_tag(q.device), q.dtype, head_dim=q.shape[-1],
                      size=route.size(k.shape[2]),
                      needs=head_needs(q.dtype, q.shape[-1]) | (_CAPPED if softcap is not None else frozenset()),
                      torch_cannot=_WEIGHTS)


def sdpa_door(q: Tensor, key_len: int, is_causal: bool, ours: str, torch_keeps: str = "",
              torch_has_kernel: bool = True) -> route.Decision:
    """Who runs a call of torch's SDPA / FlashAttention ops once our implementation is activated: ``ours`` (the
    backend behind the door on this device) or ``"torch"``, the kernel the op had before. The forward and its
    backward decide alike, from the shapes and what the door found of the arguments alone (the door cannot see
    whether autograd will differentiate): ``torch_keeps``, what of the call only torch's kernel serves ("" for
    nothing); ``torch_has_kernel`` False where the op has no kernel of torch's on this device (ours runs it)."""
    return route.at_door(route.Call("attention", route.device_tag(q.device), q.dtype, door="sdpa",
                                    head_dim=q.shape[-1], mask="causal" if is_causal else "none",
                                    size=route.size(key_len), needs=head_needs(q.dtype, q.shape[-1]),
                                    deterministic=torch.are_deterministic_algorithms_enabled(),
                                    torch_cannot="" if torch_has_kernel else _NO_TORCH_KERNEL,
                                    torch_keeps=torch_keeps, torch_default=DENSE_PRIOR), q.device, ours)


# The rows measured on GPUs, on CPUs and at the SDPA door, newest first (``route.parse_rows``).
MEASURED = """
# H200, torch 2.11 + cuDNN 9.19, triton 3.6, bfloat16; bench --device cuda:0 --quick (16k tokens a batch, L 1024
# and 4096): SDPA picks cuDNN. cuDNN's backward is taken as not deterministic until gpu-check measures it.
attention     forward   H200           bfloat16          64,128    none,causal  no       *           *               0.55-0.79  -          H200 bench --quick bdb1535 2026-11-28
attention     training  H200           bfloat16          64,128    none,causal  no       *           *               0.54-0.71  no         H200 bench --quick bdb1535 2026-11-28
# causal + ALiBi against SDPA with the float bias (docs/benchmarks.md "On a GPU", L 1024 and 4096)
attention     forward   H200           bfloat16          64,128    causal+alibi  no       *           *               1.78-2.21  -          H200 bench --quick bdb1535 2026-11-28
attention     training  H200           bfloat16          64,128    causal+alibi  no       *           *               1.15-1.79  no         H200 bench --quick bdb1535 2026-11-28
# CPU, at torch's SDPA door (its dispatcher in front of our kernel), against torch's CPU flash kernel, 2 threads,
# B 2, H 8, D 64, register-tiled kernels (docs/integrations.md). The door decides a forward and its
# backward alike from the shapes; where the two disagree the row keeps the forward's figure and the table in
# docs/integrations.md gives both (float32 below 128 keys: training 0.47-1.09; bfloat16 causal 128-256: 1.29-1.82).
# float16 was not measured: its rows are bfloat16's (both convert to float32 at the op boundary).
attention     *         cpu-avx512-t2  float32           *         none,causal  *        sdpa        0..128          0.34-0.91  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  float32           *         none,causal  *        sdpa        128..           1.14-1.75  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         none,causal  *        sdpa        0..128          0.65-0.81  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         none         *        sdpa        128..724        1.09-1.87  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         none         *        sdpa        724..1448       0.93-0.96  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         none         *        sdpa        1448..          1.05-1.23  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         causal       *        sdpa        128..362        0.72-0.91  -          CPU sdpa door fefb871 2026-12-06
attention     *         cpu-avx512-t2  bfloat16,float16  *         causal       *        sdpa        362..           1.11-1.50  -          CPU sdpa door fefb871 2026-12-06
# The functional door on the CPU: python -m fused_transformer tune --device cpu at f0f0518 (308 s and 248 s), 2 threads,
# torch 2.13, on an AMD EPYC with AVX-512 and again under ATEN_CPU_CAPABILITY=avx2 (torch's and our kernels' AVX2
# paths), the machine otherwise idle.
attention     forward   cpu-avx512-t2  float32           64        none         no       functional  0..45           0.81       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           64        none         no       functional  45..            1.15-1.46  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           64        causal       no       functional  0..45           0.91       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           64        causal       no       functional  45..            1.39-1.45  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           64        causal+alibi  no       functional  *               1.84-9.27  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           32        none         no       functional  0..45           0.83       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           32        none         no       functional  45..            1.25-1.29  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           32        causal       no       functional  0..45           0.88       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           32        causal       no       functional  45..            1.18-1.27  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  float32           32        causal+alibi  no       functional  *               2.03-11.43  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention_with_kvcache  forward   cpu-avx512-t2  float32           64        none         no       functional  *               1.45-1.72  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention_with_kvcache  forward   cpu-avx512-t2  float32           32        none         no       functional  *               1.59-2.07  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          64        none         no       functional  0..256          0.50-0.98  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          64        none         no       functional  256..           1.19-1.29  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          64        causal       no       functional  0..256          0.53-0.95  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          64        causal       no       functional  256..           1.22-1.56  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          64        causal+alibi  no       functional  *               1.27-6.72  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          32        none         no       functional  0..45           0.56       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          32        none         no       functional  45..            1.13-1.31  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          32        causal       no       functional  0..45           0.59       -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          32        causal       no       functional  45..            1.02-1.37  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx512-t2  bfloat16          32        causal+alibi  no       functional  *               1.68-9.62  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention_with_kvcache  forward   cpu-avx512-t2  bfloat16          64        none         no       functional  *               1.85-6.25  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention_with_kvcache  forward   cpu-avx512-t2  bfloat16          32        none         no       functional  *               2.47-4.74  -          CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        none         no       functional  0..45           0.88       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        none         no       functional  45..            1.06-1.30  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        causal       no       functional  0..45           0.56       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        causal       no       functional  45..            1.11-1.69  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        causal+alibi  no       functional  0..45           0.97       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           64        causal+alibi  no       functional  45..            1.29-3.65  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        none         no       functional  0..45           0.77       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        none         no       functional  45..            1.21-1.37  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        causal       no       functional  0..45           0.92       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        causal       no       functional  45..            1.02-1.59  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        causal+alibi  no       functional  0..45           0.99       yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  float32           32        causal+alibi  no       functional  45..            1.55-5.70  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          64        none         no       functional  *               1.16-1.67  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          64        causal       no       functional  *               1.10-1.81  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          64        causal+alibi  no       functional  *               1.60-2.95  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          32        none         no       functional  *               1.09-2.01  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          32        causal       no       functional  *               1.14-1.81  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     training  cpu-avx512-t2  bfloat16          32        causal+alibi  no       functional  *               1.81-4.77  yes        CPU tune f0f0518 (AVX-512) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        none         no       functional  0..45           0.61       -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        none         no       functional  45..1024        1.04-1.23  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        none         no       functional  1024..          0.96       -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        causal       no       functional  0..45           0.81       -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        causal       no       functional  45..            1.26-2.08  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           64        causal+alibi  no       functional  *               2.03-7.29  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           32        none         no       functional  0..45           0.90       -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           32        none         no       functional  45..            1.00-1.22  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           32        causal       no       functional  0..45           0.79       -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           32        causal       no       functional  45..            1.22-1.93  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    float32           32        causal+alibi  no       functional  *               2.28-11.51  -          CPU tune f0f0518 (avx2) 2026-12-07
attention_with_kvcache  forward   cpu-avx2-t2    float32           64        none         no       functional  *               1.49-2.24  -          CPU tune f0f0518 (avx2) 2026-12-07
attention_with_kvcache  forward   cpu-avx2-t2    float32           32        none         no       functional  *               1.42-2.33  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          64        none         no       functional  0..256          0.48-0.96  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          64        none         no       functional  256..           1.09-1.10  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          64        causal       no       functional  0..256          0.51-0.96  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          64        causal       no       functional  256..           1.20-1.80  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          64        causal+alibi  no       functional  *               1.30-4.43  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          32        none         no       functional  0..256          0.60-0.98  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          32        none         no       functional  256..           1.03-1.20  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          32        causal       no       functional  0..256          0.47-0.98  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          32        causal       no       functional  256..           1.21-1.80  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     forward   cpu-avx2-t2    bfloat16          32        causal+alibi  no       functional  *               1.59-6.77  -          CPU tune f0f0518 (avx2) 2026-12-07
attention_with_kvcache  forward   cpu-avx2-t2    bfloat16          64        none         no       functional  *               1.91-3.98  -          CPU tune f0f0518 (avx2) 2026-12-07
attention_with_kvcache  forward   cpu-avx2-t2    bfloat16          32        none         no       functional  *               2.35-4.17  -          CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           64        none         no       functional  0..45           0.72       yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           64        none         no       functional  45..            1.07-1.09  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           64        causal       no       functional  0..45           0.69       yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           64        causal       no       functional  45..            1.15-1.79  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           64        causal+alibi  no       functional  *               1.00-3.88  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           32        none         no       functional  0..45           0.66       yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           32        none         no       functional  45..            1.07-1.48  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           32        causal       no       functional  0..45           0.70       yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           32        causal       no       functional  45..            1.29-1.96  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    float32           32        causal+alibi  no       functional  *               1.17-5.85  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          64        none         no       functional  *               1.02-1.58  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          64        causal       no       functional  *               1.18-1.80  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          64        causal+alibi  no       functional  *               1.47-2.79  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          32        none         no       functional  *               1.19-2.03  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          32        causal       no       functional  *               1.44-2.26  yes        CPU tune f0f0518 (avx2) 2026-12-07
attention     training  cpu-avx2-t2    bfloat16          32        causal+alibi  no       functional  *               1.74-3.43  yes        CPU tune f0f0518 (avx2) 2026-12-07
"""
