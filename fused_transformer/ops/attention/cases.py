"""Attention's cases, the calls the tools run (``fused_transformer.ops.Op``): check's grid of masks and score
modifiers, bench's suites (what else they time: ``rivals``), the overhead suite's tiny calls, tune's series, the
variants suite's launches, and the work a case counts.

Work counted is the work needed: ``4 * D`` FLOPs per (query, key) pair a query may attend (``attention_flops``), so
causal (top-left) counts ``L (L + 1) / 2`` pairs per head and padding only the kept keys; forward+backward is 3.5x the
forward (the backward does five matmuls to the forward's two). Padding: sequences alternately keep ``1 - 3p/2`` and
``1 - p/2`` of their keys (p = 0.5: a quarter and three quarters), right-padded (``kept_lengths``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import Example, TuneSeries, VariantCases, Work
from .torch_paths import kvcache_torch_path, torch_path

Tensor = torch.Tensor
GPU_TOKENS = 16384  # tokens per batch on a GPU: batch = 16384 // L (at least 2), 2048 / D heads


# ------------------------------------------------------------------------------------------------ the work


def kept_lengths(batch: int, length: int, padding: float) -> List[int]:
    """Keys kept per sequence for a padding ratio p: alternately ``1 - p - s`` and ``1 - p + s`` of ``length``,
    ``s = min(p, 1 - p) / 2``."""
    if not 0.0 <= padding < 1.0:
        raise ValueError(f"padding={padding} must be in [0, 1)")
    spread = min(padding, 1.0 - padding) / 2
    fractions = (1.0 - padding - spread, 1.0 - padding + spread)
    return [max(1, round(length * fractions[b % 2])) for b in range(batch)]


def padding_ratio(kept: Sequence[int], length: int) -> float:
    return 1.0 - sum(kept) / (len(kept) * length)


def attention_pairs(q_len: int, kept: int, causal: bool) -> int:
    """(query, key) pairs one head attends: every query sees ``kept`` keys, or with a top-left causal mask query ``i``
    sees ``min(i + 1, kept)``."""
    if not causal:
        return q_len * kept
    if kept >= q_len:
        return q_len * (q_len + 1) // 2
    return kept * (kept + 1) // 2 + (q_len - kept) * kept


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, *, causal: bool = False,
                    kept: Optional[Sequence[int]] = None, backward: bool = False) -> float:
    """FLOPs attention needs: ``4 * head_dim`` per attended (query, key) pair (``q kᵀ`` and ``p v``), summed over the
    batch's key lengths ``kept`` (default: no padding); 3.5x that with the backward."""
    kept = [seq_len] * batch if kept is None else kept
    if len(kept) != batch:
        raise ValueError(f"kept has {len(kept)} entries for batch {batch}")
    pairs = sum(attention_pairs(seq_len, k, causal) for k in kept)
    return 4.0 * head_dim * heads * pairs * (3.5 if backward else 1.0)


def work(example: Example, itemsize: int, backward: bool) -> Work:
    shape = example.shape
    kept = kept_lengths(shape["batch"], shape["seq_len"], shape.get("padding_asked", 0.0))
    return Work(flops=attention_flops(shape["batch"], shape["heads"], shape["seq_len"], shape["head_dim"],
                                      causal=bool(shape.get("causal")), kept=kept, backward=backward))


def decode_work(example: Example, itemsize: int, backward: bool) -> Work:
    """A decoding step reads the cache: its keys and values."""
    shape = example.shape
    return Work(nbytes=2.0 * shape["batch"] * shape["seq_len"] * shape["kv_heads"] * shape["head_dim"] * itemsize)


# ------------------------------------------------------------------------------------------------- check


def _padding(kept: Sequence[int], length: int, device: torch.device) -> Tensor:
    """``[B, length]`` bool, True = padding (the torch.nn convention), right-padded after ``kept`` keys."""
    return torch.arange(length, device=device)[None, :] >= torch.tensor(list(kept), device=device)[:, None]


# Arguments kept in float32 in every precision (float64 for the oracle): the ALiBi slopes and the sinks.
FLOAT32_ARGUMENTS = ("alibi_slopes", "sinks")
CONSTANTS = ("attn_mask", "key_padding_mask", "query_padding_mask", "alibi_slopes")


def _uniform(draw: Callable[..., Tensor], *shape: int) -> Tensor:
    """Uniform numbers in (0, 1) from a normal draw (its distribution function)."""
    return torch.special.ndtr(draw(*shape))


def mask_options(kind: str) -> Dict[str, object]:
    """The options (not tensors) of the masks ``kind``, a '+'-joined list of names (``mask_tensors``)."""
    found: Dict[str, object] = {}
    for part in kind.split("+"):
        if part == "softcap":
            found["softcap"] = 2.0
        elif part == "causal":
            found["is_causal"] = True
        elif part == "causal-br":
            found.update(is_causal=True, causal_alignment="bottom_right")
    return found


def mask_tensors(kind: str, draw: Callable[..., Tensor], b: int, h: int, lq: int, lk: int,
                 device: torch.device) -> Dict[str, Tensor]:
    """The mask and score-modifier tensors of the masks ``kind`` on ``device``."""
    found: Dict[str, Tensor] = {}
    for part in kind.split("+"):
        if part == "alibi":  # per batch and head
            found["alibi_slopes"] = _uniform(draw, b, h) * 0.5
        elif part == "sinks":  # differentiated, as an input
            found["sinks"] = draw(h, scale=2.0)
        elif part == "padding":
            found["key_padding_mask"] = _padding([lk - 3 * i * lk // 10 for i in range(b)], lk, device)
        elif part == "holes":  # a key padding mask that is not right-padded: the kernels cannot skip it
            holes = _uniform(draw, b, lk) < 0.25
            holes[:, 0] = False
            found["key_padding_mask"] = holes
        elif part == "bool":  # True = may attend; broadcast over heads
            keep = _uniform(draw, b, 1, lq, lk) > 0.3
            keep[..., 0] = True
            found["attn_mask"] = keep
        elif part == "float":  # added to the scores, some -inf; broadcast over batch and heads
            bias, blocked = draw(lq, lk), _uniform(draw, lq, lk) < 0.1
            blocked[:, 0] = False
            found["attn_mask"] = bias.masked_fill(blocked, float("-inf"))
        elif part not in ("none", "softcap", "causal", "causal-br"):
            raise ValueError(f"unknown mask {part!r}")
    return found


def dense(label: str, b: int, h: int, hkv: int, lq: int, lk: int, d: int, masks: str, quick: bool = False,
          **options: object) -> Example:
    """An ``attention`` call: q ``[b, h, lq, d]``, k / v ``[b, hkv, lk, d]``, the masks ``masks``."""
    def tensors(draw):
        q = draw(b, h, lq, d)
        return {"q": q, "k": draw(b, hkv, lk, d), "v": draw(b, hkv, lk, d),
                **mask_tensors(masks, draw, b, h, lq, lk, q.device)}

    return Example(label, tensors, {**mask_options(masks), **options}, quick,
                   {"batch": b, "seq_len": lq, "heads": h, "head_dim": d, "d_model": h * d,
                    "causal": "causal" in masks}, size=lk)


# (quick, B, H, H_kv, Lq, Lk, D, masks)
GRID = (
    (True, 2, 2, 1, 33, 47, 64, "causal-br+padding"),
    (True, 1, 2, 2, 47, 33, 48, "bool"),
    (True, 1, 2, 2, 31, 31, 64, "causal+float"),
    (False, 2, 4, 2, 77, 130, 64, "none"),
    (False, 2, 4, 2, 77, 130, 64, "causal"),
    (False, 2, 4, 2, 77, 130, 64, "causal-br+padding"),
    (False, 2, 4, 2, 77, 130, 64, "bool"),
    (False, 2, 4, 2, 77, 130, 64, "float"),
    (False, 2, 3, 3, 130, 77, 48, "causal-br"),  # Lq > Lk: the first 53 queries see no key (zeros)
    (False, 2, 3, 1, 63, 63, 48, "holes+float"),
    (True, 2, 4, 2, 33, 47, 64, "causal-br+padding+softcap+alibi+sinks"),
    (False, 2, 4, 2, 77, 130, 64, "causal+softcap+alibi+sinks"),
)
WEIGHTS_GRID = (
    (True, 2, 2, 1, 33, 47, 64, "causal-br+padding"),
    (False, 2, 4, 2, 77, 130, 64, "causal-br+padding"),
    (False, 2, 3, 3, 63, 63, 48, "float"),
)


def _label(b: int, h: int, hkv: int, lq: int, lk: int, d: int, masks: str) -> str:
    return f"B{b} H{h}/{hkv} L{lq}x{lk} D{d} {masks}"


CHECK = tuple(dense(_label(b, h, hkv, lq, lk, d, masks), b, h, hkv, lq, lk, d, masks, quick)
              for quick, b, h, hkv, lq, lk, d, masks in GRID)
WEIGHTS_CHECK = tuple(dense(f"{_label(b, h, hkv, lq, lk, d, masks)} (with its lse)", b, h, hkv, lq, lk, d, masks, quick)
                      for quick, b, h, hkv, lq, lk, d, masks in WEIGHTS_GRID)


# ------------------------------------------------------------------------------------------------- bench

BENCH_MASKS = (("none", False, 0.0), ("causal", True, 0.0), ("pad50%", False, 0.5))
GPU_BENCH_MASKS = (("causal+pad50%", True, 0.5),)
EXTRA_MASKS = (("B1H1 causal", True, 0.0), ("causal+alibi", True, 0.0))


def alibi_slopes(heads: int, device: torch.device) -> Tensor:
    """The ALiBi paper's slopes for ``heads`` heads (a power of two): ``2^(-8 (h + 1) / heads)``."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, dtype=torch.float32, device=device) / heads)


def bench_example(label: str, batch: int, heads: int, length: int, head_dim: int, causal: bool, padding: float,
                  alibi: bool) -> Example:
    """A self-attention call of the attention suite: ``padding`` of the keys padded (``kept_lengths``), ALiBi with the
    paper's slopes."""
    kept = kept_lengths(batch, length, padding)

    def tensors(draw):
        q = draw(batch, heads, length, head_dim)
        found = {"q": q, "k": draw(batch, heads, length, head_dim), "v": draw(batch, heads, length, head_dim)}
        if padding:
            found["key_padding_mask"] = _padding(kept, length, q.device)
        if alibi:
            found["alibi_slopes"] = alibi_slopes(heads, q.device)
        return found

    shape = {"batch": batch, "seq_len": length, "heads": heads, "head_dim": head_dim, "d_model": heads * head_dim,
             "causal": causal, "padding": padding_ratio(kept, length), "padding_asked": padding}
    return Example(label, tensors, {"is_causal": causal}, shape=shape, size=length)


def bench(gpu: bool, lengths: Sequence[int]) -> List[Example]:
    """No mask, causal, 50% key padding (and causal + padding on a GPU), one (batch, head) pair causal, causal ALiBi;
    head dim 64 on the CPU (B 8, H 8), 64 and 128 on a GPU (``GPU_TOKENS`` a batch, 2048 / D heads)."""
    found = []
    for head_dim in (64, 128) if gpu else (64,):
        for mask, causal, padding in BENCH_MASKS + (GPU_BENCH_MASKS if gpu else ()) + EXTRA_MASKS:
            for length in lengths:
                batch, heads = (max(GPU_TOKENS // length, 2), 2048 // head_dim) if gpu else (8, 8)
                if mask.startswith("B1H1"):
                    batch, heads = 1, 1
                found.append(bench_example(mask, batch, heads, length, head_dim, causal, padding,
                                           mask.endswith("alibi")))
    return found


def describe(gpu: bool) -> str:
    if gpu:
        return f"batch {GPU_TOKENS} / L (at least 2), 2048 / D heads, D 64 and 128, dropout 0"
    return "batch 8, 8 heads, D 64, dropout 0"


# ------------------------------------------------------------------------------------- the decoding step

DECODE_HEADS = ((8, 8), (32, 8))  # (query heads, KV heads): plain and grouped-query, head dim 64 (128 on CUDA)


def decode_example(batch: int, length: int, heads: int, kv_heads: int, head_dim: int) -> Example:
    """One decoding step on a contiguous cache holding ``length - 1`` keys: the new key and value appended, one query
    per sequence; the lengths on the host (checked there without waiting for the GPU)."""
    def tensors(draw):
        q = draw(batch, 1, heads, head_dim)
        return {"q": q, "k_cache": draw(batch, length, kv_heads, head_dim),
                "v_cache": draw(batch, length, kv_heads, head_dim), "k_new": draw(batch, 1, kv_heads, head_dim),
                "v_new": draw(batch, 1, kv_heads, head_dim),
                "cache_seqlens": torch.full((batch,), length - 1, dtype=torch.int32)}

    return Example(f"B{batch} H{heads}/{kv_heads}", tensors, {},
                   shape={"batch": batch, "seq_len": length, "heads": heads, "kv_heads": kv_heads,
                          "head_dim": head_dim, "causal": True, "tokens": batch}, size=length)


def decode_bench(gpu: bool, lengths: Sequence[int]) -> List[Example]:
    """Batch 1, 8, 32 (and 128 on CUDA), 8 KV heads with 8 or 32 query heads, head dim 64 (128 on CUDA)."""
    return [decode_example(batch, length, heads, kv_heads, 128 if gpu else 64)
            for batch in ((1, 8, 32, 128) if gpu else (1, 8, 32)) for heads, kv_heads in DECODE_HEADS
            for length in lengths]


def describe_decode(gpu: bool) -> str:
    return (f"one decoding step (1 query per sequence, the new key appended first) on a contiguous cache of L keys, "
            f"head dim {128 if gpu else 64}, KV heads 8, query heads 8 and 32; GB/s counts the cache read")


# ---------------------------------------------------------------------------------------------- overhead

OVERHEAD_SHAPE = dict(batch=2, heads=2, seq_len=8, head_dim=16)
VARLEN_LENGTHS = (8, 5)  # the packed sequences of the varlen call; the key padding call pads the keys past them


def _overhead(label: str, padding: bool) -> Example:
    b, h, length, d = (OVERHEAD_SHAPE[n] for n in ("batch", "heads", "seq_len", "head_dim"))

    def tensors(draw):
        q = draw(b, h, length, d)
        found = {"q": q, "k": draw(b, h, length, d), "v": draw(b, h, length, d)}
        if padding:
            found["key_padding_mask"] = _padding(VARLEN_LENGTHS, length, q.device)
        return found

    return Example(label, tensors, {}, shape={**OVERHEAD_SHAPE, "d_model": h * d}, size=length)


OVERHEAD = (_overhead("B2 H2 L8 D16", False), _overhead("key padding", True))


def _varlen_overhead() -> Example:
    h, d, longest = OVERHEAD_SHAPE["heads"], OVERHEAD_SHAPE["head_dim"], max(VARLEN_LENGTHS)

    def tensors(draw):
        tokens = sum(VARLEN_LENGTHS)
        q = draw(tokens, h, d)
        cu = F.pad(torch.tensor(VARLEN_LENGTHS, device=q.device).cumsum(0, dtype=torch.int32), (1, 0))
        return {"q": q, "k": draw(tokens, h, d), "v": draw(tokens, h, d), "cu_seqlens_q": cu, "cu_seqlens_k": cu}

    return Example("packed 8+5", tensors, {"max_seqlen_q": longest, "max_seqlen_k": longest},
                   shape={**OVERHEAD_SHAPE, "tokens": sum(VARLEN_LENGTHS)}, size=longest)


VARLEN_OVERHEAD = (_varlen_overhead(),)
KVCACHE_OVERHEAD = (decode_example(OVERHEAD_SHAPE["batch"], OVERHEAD_SHAPE["seq_len"], OVERHEAD_SHAPE["heads"],
                                   OVERHEAD_SHAPE["heads"], OVERHEAD_SHAPE["head_dim"]),)


# -------------------------------------------------------------------------------------------------- tune


def tune(device_type: str, dtype: torch.dtype, quick: bool) -> Tuple[TuneSeries, ...]:
    """No mask, causal and causal + ALiBi, head dims 64 and 128 on a GPU, 32 (the study notes' model's) and 64 on the
    CPU, keys per sequence 512 to 4096 with 16k tokens a batch on a GPU, 16 to 2048 on the CPU (B 1, H 4); quick: 64
    keys, no mask, the first head dim."""
    sizes = (64,) if quick else ((512, 1024, 4096) if device_type == "cuda" else (16, 128, 512, 2048))
    head_dims = (64, 128) if device_type == "cuda" else (64, 32)
    series = []
    for head_dim in head_dims[:1] if quick else head_dims:
        for mask in ("none",) if quick else ("none", "causal", "causal+alibi"):
            examples = []
            for size in sizes:
                batch, heads = ((max(1, GPU_TOKENS // size), max(1, 2048 // head_dim)) if device_type == "cuda"
                                else (1, 4))
                examples.append(dense(f"L{size}", batch, heads, heads, size, size, head_dim, mask))
            series.append(TuneSeries("no", tuple(examples), head_dim=str(head_dim), mask=mask))
    return tuple(series)


def decode_tune(device_type: str, dtype: torch.dtype, quick: bool) -> Tuple[TuneSeries, ...]:
    """``attention_with_kvcache``'s decoding step (one query per sequence, the new key appended, no mask), forward only:
    caches of 16, 128 and 1024 keys with B 32 on the CPU, 128 to 8192 with B 128 on a GPU; H 8, D 64, and on the CPU
    D 32 too (the study notes' model's decoding step); quick: the first size and head dim."""
    gpu = device_type == "cuda"
    sizes = (128, 1024, 8192) if gpu else (16, 128, 1024)
    batch = 128 if gpu else 32
    head_dims = (64,) if gpu or quick else (64, 32)
    return tuple(TuneSeries("no", tuple(decode_example(batch, size, 8, 8, head_dim)
                                        for size in (sizes[:1] if quick else sizes)),
                            head_dim=str(head_dim), mask="none", passes=("forward",)) for head_dim in head_dims)


def weights_of_call(q: Tensor, k: Tensor, v: Tensor, **options: object) -> Tuple[Tensor, Tensor, Tensor]:
    """An ``attention`` call returning its LSE, then ``attention_weights`` from that LSE: ``(weights, lse, out)``."""
    from .api import attention, attention_weights

    out, lse = attention(q, k, v, return_lse=True, **options)
    return attention_weights(q, k, lse, **options), lse, out


# ---------------------------------------------------------------------------------------------- variants

VARIANT_LENGTHS = {(True, False): (1024, 4096, 16384), (True, True): (4096,), (False, False): (40,),
                   (False, True): (40,)}
DECODE_KEYS = {True: (8192, 32768), False: (512,)}
DECODE_BATCHES = {True: (1, 8), False: (2,)}  # from 32 x 8 KV heads the grid fills an H100 without splits


def variant_examples(gpu: bool, quick: bool) -> Tuple[Example, ...]:
    """No mask and causal, head dims 64 and 128 (64 on the CPU), L 1024, 4096 and 16384 (quick: 4096) with 16k tokens
    a batch and 2048 / D heads; the CPU's interpreter runs one tiny case a mask (B 2, H 2, L 40)."""
    found = []
    for head_dim in (64, 128) if gpu else (64,):
        for masks in ("none", "causal"):
            for length in VARIANT_LENGTHS[(gpu, quick)]:
                batch, heads = (max(GPU_TOKENS // length, 1), 2048 // head_dim) if gpu else (2, 2)
                found.append(dense(f"L{length}", batch, heads, heads, length, length, head_dim, masks))
    return tuple(found)


def variant_shape_class(example: Example, dtype: torch.dtype) -> str:
    from ...kernels.attention.configs import shape_class

    shape = example.shape
    return shape_class(dtype, shape["head_dim"], example.size, bool(shape["causal"]), True)


def _variants_that_change(kernels: Tuple[str, ...]) -> Callable[..., Sequence[str]]:
    def choose(example: Example, device: torch.device, dtype: torch.dtype, names: Sequence[str]) -> Sequence[str]:
        """The variants whose plan for ``kernels`` differs from the default's on this launch."""
        from ...kernels.attention import configs
        from ...kernels.attention.launch import launch_target

        shape = example.shape
        target = launch_target(device)
        tma = shape["batch"] * shape["heads"] * example.size * example.size >= configs.TMA_MIN_SCORES
        return [names[0], *(name for name in names[1:] if any(
            configs.plan(kernel, dtype, shape["head_dim"], target, tma_addressable=tma, scores_only=True,
                         variant=name).variant == name for kernel in kernels))]
    return choose


def _cudnn(device: torch.device) -> Tuple[str, Callable[..., Tensor]]:
    """SDPA's cuDNN backend on CUDA (the vendor's kernel), SDPA elsewhere."""
    if device.type != "cuda":
        return "sdpa", torch_path

    def cudnn(q: Tensor, k: Tensor, v: Tensor, **options: object) -> Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch_path(q, k, v, **options)
    return "sdpa:cudnn_attention", cudnn


def decode_variant_examples(gpu: bool, quick: bool) -> Tuple[Example, ...]:
    """One query per sequence on a full contiguous cache (no new keys), 8 KV heads of 32 query heads, head dim 128, on
    8192 and 32768 keys (quick: 8192), batch 1 and 8: where the split rules' counts differ; the CPU's a tiny one."""
    heads, kv_heads, head_dim = (32, 8, 128) if gpu else (4, 2, 16)
    found = []
    for keys in DECODE_KEYS[gpu][:1] if quick else DECODE_KEYS[gpu]:
        for batch in DECODE_BATCHES[gpu]:
            def tensors(draw, batch=batch, keys=keys):
                return {"q": draw(batch, 1, heads, head_dim), "k_cache": draw(batch, keys, kv_heads, head_dim),
                        "v_cache": draw(batch, keys, kv_heads, head_dim),
                        "cache_seqlens": torch.full((batch,), keys, dtype=torch.int32)}  # on the host: no GPU wait
            found.append(Example(f"B{batch} L{keys}", tensors, {}, shape={
                "batch": batch, "seq_len": keys, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "causal": True, "tokens": batch}, size=keys))
    return tuple(found)


def decode_shape_class(example: Example, dtype: torch.dtype) -> str:
    from ...kernels.attention.decode import shape_class

    return shape_class(example.shape["batch"], example.shape["kv_heads"], example.size)


def decode_splits_that_change(example: Example, device: torch.device, dtype: torch.dtype,
                              names: Sequence[str]) -> Sequence[str]:
    """The split rules whose split count differs from the default's on this step (elsewhere they launch the same
    grid)."""
    from ...kernels.attention import decode
    from ...kernels.attention.launch import sm_count_of

    shape = example.shape
    tile = decode.decode_tile(shape["heads"] // shape["kv_heads"], dtype)

    def splits(rule: str) -> int:
        return decode.decode_splits(shape["batch"], shape["kv_heads"], 1, example.size, sm_count_of(device),
                                    tile.block_n, rule)

    return [names[0], *(name for name in names[1:] if splits(name) != splits(names[0]))]


VARIANTS = (
    VariantCases("attention.fwd", False, variant_examples, variant_shape_class, _variants_that_change(("fwd",)),
                 _cudnn, torch.bfloat16),
    VariantCases("attention.bwd", True, variant_examples, variant_shape_class,
                 _variants_that_change(("bwd_dq", "bwd_dkdv")), _cudnn, torch.bfloat16),
)
DECODE_VARIANTS = (
    VariantCases("decode.split", False, decode_variant_examples, decode_shape_class, decode_splits_that_change,
                 lambda device: ("sdpa", kvcache_torch_path)),
)
