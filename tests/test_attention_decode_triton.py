"""The Triton decoding kernels (``kernels/attention/decode.py``: split-KV decode and merge) against a float64 reference
written here: contiguous and paged KV caches, one and several queries per sequence (decoding, chunked prefill),
grouped heads, bottom-right causal masks and windows, softcap, ALiBi, attention sinks, sequences of different
lengths in one batch (one empty, one shorter than the queries), and every split count against no split.

Runs on CUDA when present, else on CPU tensors under the Triton interpreter (set up in conftest.py), whose decode
tile is 16 rows x 16 keys: the caches here cross several key tiles and splits.
"""
import math

import pytest
import torch

from fused_transformer import reference
from fused_transformer.contract import ScoreMods
from fused_transformer.kernels.attention import decode
from fused_transformer.kernels.attention.decode import attention_decode, decode_splits
from tests.numerics import DEVICE, assert_close_to_reference

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")


def reference_decode(q, k_cache, v_cache, cache_lens, block_table, *, is_causal=False, window_left=None,
                     window_right=None, scale=None, softcap=None, alibi_slopes=None, sinks=None):
    """Plain PyTorch in q's dtype: ``(out [B, Lq, H, D], lse [B, H, Lq])``, each sequence's keys gathered from the
    cache, query i at key position ``cache_lens[b] - Lq + i``."""
    batch, n_queries, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b in range(batch):
        n = int(cache_lens[b])
        positions = torch.arange(n, device=q.device)
        if block_table is None:
            keys, values = k_cache[b, :n], v_cache[b, :n]
        else:
            blocks = block_table[b, positions // k_cache.shape[1]].long()
            keys, values = k_cache[blocks, positions % k_cache.shape[1]], v_cache[blocks, positions % k_cache.shape[1]]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b], keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qpos = n - n_queries + torch.arange(n_queries, device=q.device)
        distance = qpos[:, None] - positions[None, :]  # [Lq, n]
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
            s = s - slopes.to(s.dtype)[:, None, None] * distance.abs().to(s.dtype)
        visible = torch.ones_like(distance, dtype=torch.bool)
        if is_causal:
            visible &= distance >= 0
        if window_left is not None:
            visible &= distance <= window_left
        if window_right is not None:
            visible &= -distance <= window_right
        s = s.masked_fill(~visible, -math.inf)
        logits = s if sinks is None else torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(-1, n_queries, 1)], -1)
        lse = torch.logsumexp(logits, dim=-1)  # [H, Lq]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: lse -inf
        outs.append(torch.einsum("hqk,khd->qhd", p, values))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _cache(lens, kv_heads, head_dim, seed, block_size=None, spare_blocks=2):
    """float64 k/v caches holding ``lens`` keys: contiguous [B, max(lens), Hkv, D] (block_size None), or paged
    [num_blocks, block_size, Hkv, D] with a shuffled int32 block table (some blocks belong to no sequence)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    if block_size is None:
        shape, table = (batch, max(max(lens), 1), kv_heads, head_dim), None
    else:
        max_blocks = max(math.ceil(max(lens) / block_size), 1)
        num_blocks = batch * max_blocks + spare_blocks
        table = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks)
        table = table.to(device=DEVICE, dtype=torch.int32)
        shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    return k.to(DEVICE), v.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), table


def _queries(batch, n_queries, heads, head_dim, seed):
    """float64 q [B, Lq, H, D] with the strides of a [B, H, Lq, D] tensor transposed (not contiguous)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch, heads, n_queries, head_dim, generator=g, dtype=torch.float64).to(DEVICE).transpose(1, 2)


def _run(q, k, v, lens, table, dtype, num_splits=None, softcap=None, alibi_slopes=None, **options):
    options = {**dict(is_causal=False, window_left=None, window_right=None, scale=q.shape[-1] ** -0.5, sinks=None),
               **options}
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return attention_decode(q, k, v, lens, table, num_splits=num_splits, mods=ScoreMods(softcap, alibi_slopes),
                            **options)


def _check(lens, n_queries, heads, kv_heads, dtype=torch.float32, head_dim=16, block_size=None, num_splits=None,
           seed=0, **options):
    """The kernel's out and LSE against float64, within twice PyTorch's own error in ``dtype``; returns them."""
    k, v, cache_lens, table = _cache(lens, kv_heads, head_dim, seed, block_size)
    q = _queries(len(lens), n_queries, heads, head_dim, seed)
    got = _run(q, k, v, cache_lens, table, dtype, num_splits, **options)
    ref = reference_decode(q, k, v, cache_lens, table, **options)
    base = reference_decode(*(t.to(dtype) for t in (q, k, v)), cache_lens, table, **options)
    for name, out, ref64, baseline in zip(("out", "lse"), got, ref, base):
        assert out.shape == baseline.shape, name
        assert out.dtype == (dtype if name == "out" else torch.float32), name
        assert_close_to_reference(out, ref64, baseline, f"{name} ({dtype}, Lq={n_queries}, {options})")
    return got


# One long sequence, one empty, one shorter than 7 queries, one in between; paged: more than one block each.
LENS = [50, 0, 5, 33]
LAYOUTS = {"contiguous": None, "paged16": 16, "paged256": 256}
LAYOUT_LENS = {"contiguous": LENS, "paged16": [60, 0, 5, 33], "paged256": [300, 3, 0]}
HEADS = [(2, 2), (8, 2), (8, 1)]  # groups 1, 4, 8


# The longest cache (paged256) with one group size.
@pytest.mark.parametrize("layout,heads,kv_heads", [
    *((layout, heads, kv_heads) for layout in ("contiguous", "paged16") for heads, kv_heads in HEADS),
    ("paged256", 4, 1),
])
@pytest.mark.parametrize("n_queries", [1, 7])
def test_decode_matches_reference(layout, n_queries, heads, kv_heads):
    _check(LAYOUT_LENS[layout], n_queries, heads, kv_heads, block_size=LAYOUTS[layout], is_causal=True, num_splits=3)


@pytest.mark.parametrize("options", [
    {},
    {"window_left": 6, "is_causal": True},
    {"window_left": 4, "window_right": 3},
    {"window_right": 0},
    {"softcap": 2.0, "is_causal": True},
    {"alibi_slopes": "heads", "is_causal": True},
    {"alibi_slopes": "batch_heads"},
    {"sinks": True, "is_causal": True},
    {"sinks": True, "softcap": 5.0, "alibi_slopes": "heads", "window_left": 9, "is_causal": True, "scale": 0.7},
], ids=["full", "causal_window", "window", "right_only", "softcap", "alibi", "alibi_per_batch", "sinks", "all"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_features(options, num_splits):
    options = dict(options)
    batch, heads = len(LENS), 4
    g = torch.Generator().manual_seed(3)
    if options.get("alibi_slopes") == "heads":
        options["alibi_slopes"] = torch.rand(heads, generator=g).to(DEVICE)
    elif options.get("alibi_slopes") == "batch_heads":
        options["alibi_slopes"] = torch.rand(batch, heads, generator=g).to(DEVICE)
    if options.get("sinks"):
        options["sinks"] = (torch.randn(heads, generator=g) * 2).to(DEVICE)
    _check(LENS, 7, heads, 2, num_splits=num_splits, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("n_queries", [1, 7])
def test_decode_low_precision(dtype, layout, n_queries):
    g = torch.Generator().manual_seed(5)
    _check(LAYOUT_LENS[layout], n_queries, 8, 2, dtype=dtype, head_dim=24, block_size=LAYOUTS[layout], num_splits=2,
           is_causal=True, softcap=4.0, sinks=torch.randn(8, generator=g).to(DEVICE))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n_queries", [1, 7])
def test_every_split_count_matches_no_split(layout, n_queries):
    """Splits 1..8 (more than some sequences' key tiles: those splits see no key) give the one-split result, and
    the split count the launcher picks does too."""
    lens, block_size = LAYOUT_LENS[layout], LAYOUTS[layout]
    k, v, cache_lens, table = _cache(lens, 2, 16, seed=7, block_size=block_size)
    q = _queries(len(lens), n_queries, 8, 16, seed=7)
    g = torch.Generator().manual_seed(9)
    options = dict(is_causal=True, window_left=40, sinks=torch.randn(8, generator=g).to(DEVICE))
    out1, lse1 = _run(q, k, v, cache_lens, table, torch.float32, 1, **options)
    ref_out, ref_lse = reference_decode(q, k, v, cache_lens, table, **options)
    assert (out1.double() - ref_out).abs().max() < 1e-5 and (lse1.double() - ref_lse).abs().max() < 1e-5
    for num_splits in [*range(2, 9), None]:
        out, lse = _run(q, k, v, cache_lens, table, torch.float32, num_splits, **options)
        torch.testing.assert_close(out, out1, atol=1e-5, rtol=0, msg=f"out, {num_splits} splits")
        torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=0, msg=f"lse, {num_splits} splits")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("new", [1, 5, 21])
def test_the_append_kernel_is_the_torch_append(layout, new):
    """The append kernel (``append_new_keys``: lengths before the new keys) writes them into the cache bit-exactly,
    touches no other slot, and returns the lengths after them; more new keys than one program writes included."""
    lens, block_size = LAYOUT_LENS[layout], LAYOUTS[layout]
    k, v, after, table = _cache([n + new for n in lens], 2, 16, seed=19, block_size=block_size)
    k, v, before = k.float(), v.float(), after - new
    g = torch.Generator().manual_seed(21)
    k_new, v_new = (torch.randn(len(lens), new, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    k_in, v_in = k.clone(), v.clone()
    lengths = decode.append_new_keys(decode.KVCache(k_in, v_in, before, table), k_new, v_new)
    appended = reference.append_to_cache(decode.KVCache(k, v, before, table), k_new, v_new)
    assert lengths.dtype == torch.int32 and torch.equal(lengths, appended.lengths) and torch.equal(lengths, after)
    assert torch.equal(k_in, k) and torch.equal(v_in, v)


def test_the_append_never_writes_outside_the_cache_whatever_the_lengths():
    """Where nobody checked the lengths and block ids (torch.compile and CUDA graph capture skip the host's check),
    the append kernel writes no key past a sequence's cache, outside the pool, or for a sequence whose new keys do
    not fit: a cache inside a guard buffer keeps the guard, and those sequences' slots, as they were."""
    g = torch.Generator().manual_seed(23)
    guard = torch.randn(3, 48, 2, 16, generator=g).to(DEVICE)
    k, v = guard[:, 8:40], guard.clone()[:, 8:40]  # capacity 32, 8 guard rows on each side of each sequence
    k_guard, v_guard = k._base.clone(), v._base.clone()
    k_new, v_new = (torch.randn(3, 4, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    lens = torch.tensor([30, -3, 40], dtype=torch.int32, device=DEVICE)  # past the end, negative, beyond
    decode.append_new_keys(decode.KVCache(k, v, lens, None), k_new, v_new)
    assert torch.equal(k._base, k_guard) and torch.equal(v._base, v_guard)

    pool_k, pool_v = (torch.randn(6, 8, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    k, v = pool_k[1:5], pool_v[1:5]  # blocks 0 and 5 of the pool are the guard
    table = torch.tensor([[0, 99, -1, 1], [2, 3, 0, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([14, 6], dtype=torch.int32, device=DEVICE)  # sequence 0's new keys go to blocks 99 and -1
    k_pool, v_pool = pool_k.clone(), pool_v.clone()
    decode.append_new_keys(decode.KVCache(k, v, lens, table), k_new[:2], v_new[:2])
    for pool, old in ((pool_k, k_pool), (pool_v, v_pool)):
        assert torch.equal(pool[0], old[0]) and torch.equal(pool[5], old[5])
    assert torch.equal(k[2, 6:8], k_new[1, :2]) and torch.equal(k[3, :2], k_new[1, 2:4])  # sequence 1's, 6 .. 9


def test_the_decode_never_reads_outside_the_pool_whatever_the_block_ids():
    """Block ids nobody checked (torch.compile, CUDA graph capture): a key in a block outside the pool is left out,
    never read. The pool lies inside a guard of NaN blocks that the ids 4 and -1 would reach; the step gives what
    the same step gives with those keys cut off the sequence's end."""
    g = torch.Generator().manual_seed(37)
    guard_k, guard_v = (torch.full((6, 8, 2, 16), float("nan"), device=DEVICE) for _ in range(2))
    k, v = guard_k[1:5], guard_v[1:5]
    k.copy_(torch.randn(4, 8, 2, 16, generator=g)), v.copy_(torch.randn(4, 8, 2, 16, generator=g))
    q = torch.randn(2, 1, 4, 16, generator=g).to(DEVICE)
    bad = torch.tensor([[2, 0, 4], [3, 1, -1]], dtype=torch.int32, device=DEVICE)  # their third blocks: the guard
    good = torch.tensor([[2, 0, 0], [3, 1, 0]], dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        got = _run(q, k, v, torch.tensor([20, 24], dtype=torch.int32, device=DEVICE), bad, torch.float32, num_splits)
        want = _run(q, k, v, torch.tensor([16, 16], dtype=torch.int32, device=DEVICE), good, torch.float32, num_splits)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_rows_without_keys_give_zeros_and_lse_minus_inf():
    """Lq = 7 causal queries over 0 and 3 keys: the first rows see nothing (zeros, LSE -inf); with a sink their LSE
    is the sink's logit."""
    k, v, cache_lens, _ = _cache([3, 0], 1, 16, seed=11)
    q = _queries(2, 7, 2, 16, seed=11)
    for num_splits in (1, 2):
        out, lse = _run(q, k, v, cache_lens, None, torch.float32, num_splits, is_causal=True)
        assert torch.all(out[0, :4] == 0) and torch.all(out[1] == 0)
        assert torch.all(lse[0, :, :4] == -math.inf) and torch.all(lse[1] == -math.inf)
        assert torch.isfinite(lse[0, :, 4:]).all()
        sinks = torch.tensor([0.5, -1.0], device=DEVICE)
        out, lse = _run(q, k, v, cache_lens, None, torch.float32, num_splits, is_causal=True, sinks=sinks)
        assert torch.all(out[1] == 0) and torch.equal(lse[1], sinks[:, None].expand(2, 7))


def test_cache_read_through_strides():
    """A cache that is a slice of a wider buffer (head dim and kv heads strided) gives what its copy gives."""
    k, v, cache_lens, table = _cache([40, 9], 4, 32, seed=13, block_size=16)
    k, v = k[:, :, 1:3, :16], v[:, :, 1:3, :16]  # [num_blocks, 16, 2, 16] with the strides of [.., 16, 4, 32]
    q = _queries(2, 3, 4, 16, seed=13)
    got = _run(q, k, v, cache_lens, table, torch.float32, 2, is_causal=True)
    want = _run(q, k.contiguous(), v.contiguous(), cache_lens, table, torch.float32, 2, is_causal=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_fake_kernel_gives_the_shapes_under_torch_compile():
    k, v, cache_lens, table = _cache([20, 7], 2, 16, seed=17, block_size=16)
    q = _queries(2, 1, 4, 16, seed=17).float()
    k, v = k.float(), v.float()

    def step(q, k, v, cache_lens, table):
        return attention_decode(q, k, v, cache_lens, table, is_causal=True, window_left=None, window_right=None,
                                scale=0.25, mods=ScoreMods(softcap=2.0), sinks=None, num_splits=2)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, v, cache_lens, table), step(q, k, v, cache_lens, table)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# (batch, kv_heads, query_tiles, max_keys, sm_count, block_n) -> splits
@pytest.mark.parametrize("sizes,expected", [
    ((1, 8, 1, 8192, 132, 64), 17),  # 8 programs: 17 splits give every SM one (136)
    ((1, 8, 1, 8192, 108, 64), 14),
    ((32, 8, 1, 2048, 132, 64), 1),  # 256 programs fill the SMs
    ((1, 8, 1, 512, 132, 64), 8),  # 8 key blocks: 8 splits at most
    ((128, 8, 1, 32768, 132, 64), 1),
    ((8, 2, 1, 4096, 132, 64), 9),
    ((1, 1, 1, 10**6, 132, 64), 128),  # capped
    ((1, 8, 1, 64, 132, 64), 1),  # one key block
    ((1, 8, 1, 0, 132, 64), 1),  # no key
])
def test_decode_splits(sizes, expected):
    assert decode_splits(*sizes) == expected


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 17, 33, 132, 1000])
@pytest.mark.parametrize("max_keys", [1, 63, 64, 65, 1000, 8192, 10**5])
@pytest.mark.parametrize("sm_count", [84, 108, 132])
def test_decode_splits_fill_the_sms_with_one_key_block_per_split_at_least(batch, max_keys, sm_count):
    programs = batch * 8
    splits = decode_splits(batch, 8, 1, max_keys, sm_count, 64)
    key_blocks = math.ceil(max_keys / 64)
    assert 1 <= splits <= max(key_blocks, 1) and splits <= decode.MAX_SPLITS
    if programs >= sm_count:
        assert splits == 1
    elif splits < min(key_blocks, decode.MAX_SPLITS):
        assert programs * splits >= sm_count and programs * (splits - 1) < sm_count


def test_programs_per_sm_fill_an_h100_for_one_sequence():
    assert decode.programs_per_sm(1, 8, 8192, 1, 32, 90) >= 1.0
    assert decode.programs_per_sm(32, 8, 2048, 1, 32, 90) == 256 / 132

