"""The C++ KV-cache kernel (``attention_with_kvcache_fwd``, backend "cpu") where tests/test_attention_kvcache.py does
not reach: key splits (few sequences and KV heads, long caches), caches read in place through strides (the Seq2Seq
model's [B, H, capacity, D] buffers seen as [B, capacity, H, D]), 16-bit caches converted chunk by chunk, long queries
(several row blocks), and results that do not depend on the thread count beyond round-off.

Skipped, with the reason, when the extension is not built, unless FUSED_TRANSFORMER_REQUIRE_CPU=1 (CI)."""
import os

import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend, contract, reference
from numerics import assert_close_to_reference
from test_attention_kvcache import from_scratch, make_cache, poison_unused
from fused_transformer.ops.attention import contract as attention_contract

UNAVAILABLE = backend.cpu_unavailable_reason()
if UNAVAILABLE is not None and os.environ.get("FUSED_TRANSFORMER_REQUIRE_CPU") != "1":
    pytest.skip(f"cpu backend unavailable: {UNAVAILABLE}", allow_module_level=True)


def options_of(mods, batch, heads, generator):
    options = {}
    if "softcap" in mods:
        options["softcap"] = 4.0
    if "alibi" in mods:
        options["alibi_slopes"] = torch.rand(batch, heads, generator=generator) * 0.05
    if "sinks" in mods:
        options["sinks"] = torch.randn(heads, generator=generator)
    if "window" in mods:
        options["window"] = (700, 0)
    return options


@pytest.mark.parametrize("block_size", [None, 64])
@pytest.mark.parametrize("mods", ["", "softcap+alibi+sinks+window"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_key_splits_match_attention_from_scratch(kv_heads, mods, block_size):
    """One sequence and one or two KV heads over 1,500 keys: each split takes a range of them, merged at the end."""
    batch, heads, dim, capacity = 1, 4, 16, 1600
    g = torch.Generator().manual_seed(kv_heads + 10 * len(mods) + (block_size or 0))
    k_cache, v_cache, table = make_cache(batch, capacity, kv_heads, dim, block_size, seed=kv_heads)
    lengths = torch.tensor([1500], dtype=torch.int32)
    poison_unused(k_cache, v_cache, table, lengths)
    q = torch.randn(batch, 2, heads, dim, generator=g)
    options = options_of(mods, batch, heads, g)
    with ft.use_backend("cpu"):
        out, lse = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                             return_lse=True, **options)
    expected = from_scratch(q, k_cache, v_cache, table, lengths, **options)
    assert (out.double() - expected).abs().max().item() < 2e-6
    cache = contract.KVCache(k_cache, v_cache, lengths, table)
    spec = attention_contract.kvcache_spec(dim, True, options.get("window"), None, None)
    mods = contract.ScoreMods(options.get("softcap"), options.get("alibi_slopes"))
    _, ref_lse = reference.attention_with_kvcache(q.double(), cache._replace(k=k_cache.double(), v=v_cache.double()),
                                                  mods, options.get("sinks"), spec)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-5


def test_strided_cache_is_read_in_place():
    """A cache that is a view of [B, H, capacity, D] buffers (rows of one head contiguous, heads apart) and a q with
    gaps between heads give the results of contiguous copies, bit for bit."""
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, dim, capacity = 3, 4, 2, 16, 50
    k_buffer, v_buffer = (torch.randn(batch, kv_heads, capacity, dim, generator=g) for _ in range(2))
    k_cache, v_cache = k_buffer.transpose(1, 2), v_buffer.transpose(1, 2)
    q = torch.randn(batch, 3, heads, 2 * dim, generator=g)[..., :dim]
    lengths = torch.tensor([50, 7, 31], dtype=torch.int32)
    options = dict(softcap=3.0, alibi_slopes=torch.rand(heads, generator=g) * 0.2,
                   sinks=torch.randn(heads, generator=g))
    with ft.use_backend("cpu"):
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **options)
        copied = ft.attention_with_kvcache(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                           cache_seqlens=lengths, **options)
    assert torch.equal(out, copied)
    expected = from_scratch(q, k_cache, v_cache, None, lengths, **options)
    assert (out.double() - expected).abs().max().item() < 2e-6


@pytest.mark.parametrize("cache_seqlens", [20, "tensor"])
def test_new_keys_are_written_through_the_caches_strides(cache_seqlens):
    """The kernel's own append (the Seq2Seq model's call: an int length, [B, H, capacity, D] buffers, k_new a strided
    view) writes exactly the new rows, and the attention sees them."""
    g = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, dim, capacity = 2, 4, 2, 8, 32
    k_buffer, v_buffer = (torch.randn(batch, kv_heads, capacity, dim, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(batch, kv_heads, 3, dim, generator=g).transpose(1, 2) for _ in range(2))
    lengths = torch.tensor([20, 20], dtype=torch.int32) if cache_seqlens == "tensor" else cache_seqlens
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    expected_k[:, :, 20:23], expected_v[:, :, 20:23] = k_new.transpose(1, 2), v_new.transpose(1, 2)
    q = torch.randn(batch, 2, heads, dim, generator=g)
    with ft.use_backend("cpu"):
        out = ft.attention_with_kvcache(q, k_buffer.transpose(1, 2), v_buffer.transpose(1, 2), cache_seqlens=lengths,
                                        k_new=k_new, v_new=v_new)
    assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)
    expected = from_scratch(q, expected_k.transpose(1, 2), expected_v.transpose(1, 2), None, torch.tensor([23, 23]))
    assert (out.double() - expected).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [None, 16])
def test_16_bit_cache_within_twice_torchs_error(dtype, block_size):
    batch, heads, kv_heads, dim = 2, 8, 2, 64
    k_cache, v_cache, table = make_cache(batch, 300, kv_heads, dim, block_size, dtype=dtype, seed=5)
    lengths = torch.tensor([300, 129], dtype=torch.int32)
    q = torch.randn(batch, 1, heads, dim, dtype=torch.float64).to(dtype)
    options = dict(softcap=8.0, sinks=torch.randn(heads))
    with ft.use_backend("cpu"):
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, **options)
    expected = from_scratch(q, k_cache, v_cache, table, lengths, **options)
    cache = contract.KVCache(k_cache, v_cache, lengths, table)
    spec = attention_contract.kvcache_spec(dim, True, None, None, None)
    mods = contract.ScoreMods(softcap=options["softcap"])
    baseline, _ = reference.attention_with_kvcache(q, cache, mods, options["sinks"], spec)  # PyTorch in that dtype
    assert out.dtype == dtype
    assert_close_to_reference(out, expected, baseline)


def test_long_queries_span_several_row_blocks():
    """A chunk of 40 queries with 4 heads per KV head is 160 rows: ten blocks of rows per KV head."""
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache, table = make_cache(2, 200, 2, 32, 32, seed=8)
    lengths = torch.tensor([200, 45], dtype=torch.int32)
    q = torch.randn(2, 40, 8, 32, generator=g)
    options = dict(window=(30, 0), alibi_slopes=torch.rand(8, generator=g) * 0.1)
    with ft.use_backend("cpu"):
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, **options)
    expected = from_scratch(q, k_cache, v_cache, table, lengths, **options)
    assert (out.double() - expected).abs().max().item() < 2e-6


def test_thread_counts_agree():
    """One thread (no key splits) and two (four splits here) differ by round-off only."""
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache, _ = make_cache(1, 2048, 1, 64, seed=9)
    q = torch.randn(1, 1, 4, 64, generator=g)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with ft.use_backend("cpu"):
                results.append(ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=2048, return_lse=True))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_bad_lengths_and_block_ids_are_refused_by_the_op():
    """Under torch.compile the functional op skips its host read of the values: the kernel still never reads outside
    the cache."""
    ops = torch.ops.fused_transformer_cpu
    k_cache, v_cache, table = make_cache(2, 32, 2, 8, 8)
    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.attention_with_kvcache_fwd(q, k_cache, v_cache, torch.tensor([3, 33], dtype=torch.int32), table, None, None,
                                       True, -1, -1, 0.3, None, None, None)
    table[1, 1] = 999
    with pytest.raises(ValueError, match="block_table holds 999"):
        ops.attention_with_kvcache_fwd(q, k_cache, v_cache, torch.tensor([3, 12], dtype=torch.int32), table, None, None,
                                       True, -1, -1, 0.3, None, None, None)


def test_registered_op_passes_opcheck():
    """Schema (the caches written in place when new keys come), fake tensor and dispatch checks."""
    k_cache, v_cache, table = make_cache(2, 32, 2, 8, 8)
    new = (torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8))
    for keys in (new, (None, None)):
        args = (torch.randn(2, 3, 4, 8), k_cache, v_cache, torch.tensor([3, 27], dtype=torch.int32), table, *keys, True,
                4, 0, 0.3, 2.0, torch.rand(4), torch.randn(4))
        torch.library.opcheck(torch.ops.fused_transformer_cpu.attention_with_kvcache_fwd.default, args)
