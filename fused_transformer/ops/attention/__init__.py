"""Attention, described once: scaled dot-product attention with every mask, window, dropout, score modifier and
sink in the kernel, over dense batches, packed sequences and a KV cache.

The package reads top-down: ``contract`` (the checks and their errors; the types the backends take are
``fused_transformer.contract``'s), ``facts`` (what the route decides a call on, and the rows measured), ``function``
(the autograd Functions over the backends' entries, ``backend.ops(name)``), ``api`` (the public entries),
``torch_paths`` (torch's own path of each entry), ``cases`` (the calls the tools run) and ``rivals`` (what else bench
times). The float64 reference is the reference backend's (``fused_transformer.reference.attention`` and its
siblings), which the kernels below also use.

Registered ops: ``attention``, ``attention_weights`` (check's cases of the probabilities from an LSE),
``attention_varlen`` and ``attention_with_kvcache`` (bench's ``decode`` suite).
"""
from __future__ import annotations

from typing import Dict

import torch

from ... import reference
from ...contract import NO_SCORE_MODS, AttentionMasks, ScoreMods
from .. import Op, register
from . import cases, facts, rivals, torch_paths
from .api import attention, attention_varlen, attention_weights, attention_with_kvcache
from .contract import attention_spec

__all__ = ["attention", "attention_varlen", "attention_weights", "attention_with_kvcache"]

Tensor = torch.Tensor


def _call(tensors: Dict[str, Tensor], options: dict, device: torch.device, grad: bool) -> object:
    """The route's ``Call`` of a dense example (``Op.route_call``)."""
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    masks = AttentionMasks(tensors.get("attn_mask"), tensors.get("key_padding_mask"), tensors.get("query_padding_mask"))
    spec = attention_spec(q.shape[-1], options.get("is_causal", False), options.get("causal_alignment", "top_left"),
                          options.get("window"), options.get("dropout_p", 0.0), options.get("scale"))
    mods = ScoreMods(options.get("softcap"), tensors.get("alibi_slopes"))
    return facts.call(q, k, v, masks, spec, mods if mods.given else NO_SCORE_MODS, tensors.get("sinks"),
                      False, needs_grad=grad, device=device)


def _weights_reference(q: Tensor, k: Tensor, v: Tensor, **options: object):
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    return reference.attention_weights(q, k, lse, **options), lse, out


ATTENTION = register(Op(
    name="attention", function=attention, torch_path=torch_paths.torch_path, reference=reference.attention,
    size_of=facts.SIZE_OF["attention"], outputs=("out",), check=cases.CHECK, bench=cases.bench,
    lengths={"cpu": ((128, 256, 512, 1024, 2048), (128, 512)),
             "cuda": ((512, 1024, 2048, 4096, 8192, 16384), (1024, 4096))},
    work=cases.work, throughput=("tflops", "TFLOP/s (attended pairs counted)"), describe=cases.describe,
    overhead=cases.OVERHEAD, overhead_target={"fwd": 2.5, "fwd+bwd": 2.5}, tune=cases.tune, call_of=_call,
    route_examples=(cases.dense("", 2, 8, 8, 1024, 1024, 64, "none"),
                    cases.dense("causal", 2, 8, 8, 1024, 1024, 64, "causal"),
                    cases.dense("padded", 2, 8, 8, 1024, 1024, 64, "padding")),
    measured=facts.MEASURED, constants=cases.CONSTANTS, float32=cases.FLOAT32_ARGUMENTS, baseline="sdpa",
    rivals=rivals.SdpaRivals(), variants=cases.VARIANTS,
))
ATTENTION_WEIGHTS = register(Op(
    name="attention_weights", function=cases.weights_of_call, torch_path=None, reference=_weights_reference,
    size_of=facts.SIZE_OF["attention"], outputs=("weights", "lse", "out"), check=cases.WEIGHTS_CHECK,
    constants=cases.CONSTANTS, float32=cases.FLOAT32_ARGUMENTS, differentiable=False,
))
ATTENTION_VARLEN = register(Op(
    name="attention_varlen", function=attention_varlen, torch_path=torch_paths.varlen_torch_path,
    reference=reference.attention_varlen, size_of=facts.SIZE_OF["attention_varlen"], outputs=("out",),
    overhead=cases.VARLEN_OVERHEAD, overhead_target={"fwd": None}, constants=("cu_seqlens_q", "cu_seqlens_k"),
    float32=cases.FLOAT32_ARGUMENTS, baseline="sdpa", rivals=rivals.VarlenRivals(),
))
ATTENTION_WITH_KVCACHE = register(Op(
    name="attention_with_kvcache", function=attention_with_kvcache, torch_path=torch_paths.kvcache_torch_path,
    size_of=facts.SIZE_OF["attention_with_kvcache"], outputs=("out",), bench=cases.decode_bench, suite="decode",
    lengths={"cpu": ((512, 2048), (512,)), "cuda": ((512, 2048, 8192, 32768), (2048, 8192))},
    work=cases.decode_work, throughput=("gb_per_s", "GB/s of cache read"), describe=cases.describe_decode,
    overhead=cases.KVCACHE_OVERHEAD, overhead_target={"fwd": None}, constants=("cache_seqlens",),
    float32=cases.FLOAT32_ARGUMENTS, baseline="sdpa", rivals=rivals.DecodeRivals(), bench_modes=("eval",),
    variants=cases.DECODE_VARIANTS, tune=cases.decode_tune,
))
