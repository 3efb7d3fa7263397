"""``attention_with_kvcache``: the in-place append, contiguous and paged caches, and every option, on every backend
(triton on the GPU, else under the interpreter) against attention computed from scratch in float64; the checks that
refuse a call before the cache is touched. (The Triton decode kernels alone, split counts included:
tests/test_attention_decode_triton.py.)"""
import pytest
import torch

import fused_transformer as ft
from fused_transformer import reference
from tests.numerics import DEVICE, assert_close_to_reference
from fused_transformer.ops.attention import contract as attention_contract

CPU_UNAVAILABLE = ft.backend.cpu_unavailable_reason()  # on a GPU machine installed without the C++ build
BACKENDS = (["reference"] + (["cpu"] if CPU_UNAVAILABLE is None else [])
            + (["triton"] if ft.backend.triton_unavailable_reason() is None else []))


def make_cache(batch, capacity, kv_heads, dim, block_size=None, dtype=torch.float32, seed=0):
    """``(k_cache, v_cache, block_table)``: contiguous, or paged in a shuffled pool with spare blocks."""
    generator = torch.Generator().manual_seed(seed)
    if block_size is None:
        shape = (batch, capacity, kv_heads, dim)
        return (*(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)), None)
    blocks = -(-capacity // block_size)
    pool = batch * blocks + 3
    shape = (pool, block_size, kv_heads, dim)
    table = torch.randperm(pool, generator=generator)[:batch * blocks].view(batch, blocks).to(torch.int32)
    return (*(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)), table)


def poison_unused(k_cache, v_cache, block_table, lengths):
    """NaN in every cache slot past each sequence's keys: an op that reads one shows it."""
    for b, n in enumerate(lengths.tolist()):
        if block_table is None:
            k_cache[b, n:] = float("nan")
            v_cache[b, n:] = float("nan")
            continue
        block_size = k_cache.shape[1]
        for position in range(n, block_table.shape[1] * block_size):
            block, row = block_table[b, position // block_size], position % block_size
            k_cache[block, row] = float("nan")
            v_cache[block, row] = float("nan")


def from_scratch(q, k_cache, v_cache, block_table, lengths, *, is_causal=True, window=None, softcap=None,
                 alibi_slopes=None, sinks=None, scale=None):
    """Each sequence alone, in float64 on the CPU: its keys gathered, scores built by hand (an independent oracle)."""
    q, k_cache, v_cache, lengths = (t.cpu() for t in (q, k_cache, v_cache, lengths))
    block_table, alibi_slopes, sinks = (None if t is None else t.cpu() for t in (block_table, alibi_slopes, sinks))
    outs = []
    cache = ft.contract.KVCache(k_cache, v_cache, lengths, block_table)
    keys, values = reference.cached_keys(cache)
    batch, lq, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    for b in range(batch):
        n = int(lengths[b])
        k = keys[b, :n].double().repeat_interleave(heads // keys.shape[2], dim=1).transpose(0, 1)  # [H, n, D]
        v = values[b, :n].double().repeat_interleave(heads // keys.shape[2], dim=1).transpose(0, 1)
        scores = q[b].double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, Lq, n]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(lq)[:, None] + n - lq
        kpos = torch.arange(n)[None, :]
        if alibi_slopes is not None:
            slopes = (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes).double()
            scores = scores - slopes[:, None, None] * (qpos - kpos).abs()
        keep = torch.ones(lq, n, dtype=torch.bool)
        left, right = window if window is not None else (None, None)
        if is_causal:
            keep &= kpos <= qpos
        if left is not None:
            keep &= kpos >= qpos - left
        if right is not None:
            keep &= kpos <= qpos + right
        scores = scores.masked_fill(~keep, float("-inf"))
        if sinks is not None:  # a key with the sink's score and a zero value
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(heads, lq, 1)], dim=-1)
            v = torch.cat([v, torch.zeros(heads, 1, dim, dtype=torch.float64)], dim=1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
        outs.append((probs @ v).transpose(0, 1))
    return torch.stack(outs)


CASES = {
    "decode": dict(lq=1),
    "chunk": dict(lq=7),
    "gqa4": dict(lq=3, heads=8, kv_heads=2),
    "gqa8": dict(lq=1, heads=8, kv_heads=1),
    "window": dict(lq=4, window=(5, 0)),
    "not_causal": dict(lq=3, is_causal=False, window=(3, 2)),
    "softcap": dict(lq=2, softcap=3.0),
    "alibi": dict(lq=3, alibi="heads"),
    "alibi_batch": dict(lq=1, alibi="batch"),
    "sinks": dict(lq=2, sinks=True),
    "everything": dict(lq=5, heads=4, kv_heads=2, window=(6, 0), softcap=5.0, alibi="heads", sinks=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [None, 16, 256])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_attention_from_scratch(backend, block_size, case):
    """float32 within 2e-6 of float64 on the CPU (the reference and cpu backends, the Triton interpreter); on a GPU,
    whose kernels take exp2 and divisions approximate, within the project's 2x rule (tests/numerics.py)."""
    device = DEVICE if backend == "triton" else "cpu"
    options = dict(CASES[case])
    lq, heads, kv_heads = options.pop("lq"), options.pop("heads", 4), options.pop("kv_heads", 4)
    batch, dim, capacity = 3, 16, 40
    generator = torch.Generator().manual_seed(1)
    if options.pop("alibi", None) is not None:
        shape = (heads,) if CASES[case]["alibi"] == "heads" else (batch, heads)
        options["alibi_slopes"] = torch.rand(shape, generator=generator) * 0.5
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(heads, generator=generator)
    k_cache, v_cache, table = make_cache(batch, capacity, kv_heads, dim, block_size)
    lengths = torch.tensor([9, 0, 31], dtype=torch.int32)[:batch]  # one sequence starts empty
    new = 2
    q = torch.randn(batch, lq, heads, dim, generator=generator)
    k_new, v_new = (torch.randn(batch, new, kv_heads, dim, generator=generator) for _ in range(2))
    poison_unused(k_cache, v_cache, table, lengths + new)
    k_cache, v_cache, lengths, q, k_new, v_new = (t.to(device) for t in (k_cache, v_cache, lengths, q, k_new, v_new))
    table = None if table is None else table.to(device)
    options = {name: value.to(device) if torch.is_tensor(value) else value for name, value in options.items()}
    before, v_before = k_cache.clone(), v_cache.clone()
    with ft.use_backend(backend):
        out, lse = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                             block_table=table, return_lse=True, **options)
    after = lengths + new
    keys, values = reference.cached_keys(ft.contract.KVCache(k_cache, v_cache, after, table))
    for b in range(batch):  # the append, bit-exact, and nothing else written
        assert torch.equal(keys[b, lengths[b]:after[b]], k_new[b]) and torch.equal(values[b, lengths[b]:after[b]],
                                                                                   v_new[b])
    untouched = reference.cached_keys(ft.contract.KVCache(before, before, after, table))[0]
    for b in range(batch):
        assert torch.equal(keys[b, :lengths[b]], untouched[b, :lengths[b]])
        assert keys[b, after[b]:].isnan().all()  # nothing written past the new keys
    expected = from_scratch(q, k_cache, v_cache, table, after, **options)
    assert out.shape == q.shape and lse.shape == (batch, heads, lq) and lse.dtype == torch.float32
    if out.device.type == "cpu":
        assert (out.double() - expected).abs().max().item() < 2e-6
    else:
        with ft.use_backend("reference"):  # PyTorch's own float32 error, on the same device
            baseline = ft.attention_with_kvcache(q, before, v_before, cache_seqlens=lengths, k_new=k_new,
                                                 v_new=v_new, block_table=table, **options)
        assert_close_to_reference(out.cpu(), expected, baseline.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_torchs_error(dtype):
    batch, heads, dim = 2, 4, 32
    k_cache, v_cache, table = make_cache(batch, 64, 2, dim, 16, dtype=dtype)
    lengths = torch.tensor([17, 40], dtype=torch.int32)
    q = torch.randn(batch, 3, heads, dim, dtype=torch.float64).to(dtype)
    out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    expected = from_scratch(q, k_cache, v_cache, table, lengths)
    cache = ft.contract.KVCache(k_cache, v_cache, lengths, table)
    spec = attention_contract.kvcache_spec(dim, True, None, None, None)
    baseline, _ = reference.attention_with_kvcache(q, cache, ft.contract.NO_SCORE_MODS, None, spec)  # PyTorch's dtype
    assert_close_to_reference(out, expected, baseline)


@pytest.mark.skipif(CPU_UNAVAILABLE is not None, reason=str(CPU_UNAVAILABLE))
def test_float64_runs_to_round_off_on_the_cpu_kernel():
    k_cache, v_cache, table = make_cache(2, 48, 2, 16, dtype=torch.float64)
    lengths = torch.tensor([5, 48], dtype=torch.int32)
    q = torch.randn(2, 4, 4, 16, dtype=torch.float64)
    with ft.use_backend("cpu"):
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window=(7, 0))
    expected = from_scratch(q, k_cache, v_cache, table, lengths, window=(7, 0))
    assert (out - expected).abs().max().item() < 1e-13


def _call(**overrides):
    k_cache, v_cache, table = make_cache(2, 32, 2, 8, 8)
    args = dict(q=torch.randn(2, 1, 4, 8), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=torch.tensor([3, 30], dtype=torch.int32), k_new=torch.randn(2, 2, 2, 8),
                v_new=torch.randn(2, 2, 2, 8), block_table=table)
    args.update(overrides)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return q, k_cache, v_cache, args


@pytest.mark.parametrize("overrides, error, match", [
    (dict(cache_seqlens=torch.tensor([3, 31], dtype=torch.int32)), ValueError, "within the cache"),
    (dict(cache_seqlens=torch.tensor([3, 30])), TypeError, "cache_seqlens must be int32"),
    (dict(block_table=torch.tensor([[0, 1, 2, 3], [4, 5, 99, 7]], dtype=torch.int32)), ValueError, "block ids"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(k_new=torch.randn(2, 2, 4, 8), v_new=torch.randn(2, 2, 4, 8)), ValueError, "k_new must be"),
    (dict(v_new=None), ValueError, "k_new and v_new"),
    (dict(q=torch.randn(2, 1, 3, 8)), ValueError, "multiple"),
    (dict(q=torch.randn(2, 1, 4, 8, dtype=torch.float64)), TypeError, "dtype"),
    (dict(alibi_slopes=torch.ones(3)), TypeError, "alibi_slopes must be float32"),
    (dict(sinks=torch.ones(4, dtype=torch.float64)), TypeError, "sinks must be float32"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(num_splits=0), ValueError, "num_splits"),
])
def test_bad_calls_are_refused_before_the_cache_is_touched(overrides, error, match):
    q, k_cache, v_cache, args = _call(**overrides)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(error, match=match):
        ft.attention_with_kvcache(q, k_cache, v_cache, **args)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_int_cache_seqlens_and_no_new_keys():
    k_cache, v_cache, _ = make_cache(2, 16, 1, 8)
    q = torch.randn(2, 1, 2, 8)
    out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)
    expected = from_scratch(q, k_cache, v_cache, None, torch.tensor([10, 10]))
    assert (out.double() - expected).abs().max().item() < 2e-6


@pytest.mark.skipif(not torch.cuda.is_available() or "triton" not in BACKENDS, reason="needs a GPU and Triton")
def test_lengths_kept_on_the_host_cost_no_device_read():
    """A decoding step with ``cache_seqlens`` on the CPU checks them there and never waits for the GPU (torch's sync
    debug mode raises on any synchronising call), and gives what the same lengths on the GPU give."""
    k_cache, v_cache, _ = make_cache(2, 64, 2, 16)
    k_cache, v_cache = k_cache.cuda(), v_cache.cuda()
    twins = k_cache.clone(), v_cache.clone()
    q, k_new, v_new = (torch.randn(2, 1, n, 16, device="cuda") for n in (4, 2, 2))
    lengths = torch.tensor([7, 40], dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = ft.attention_with_kvcache(q, *twins, cache_seqlens=lengths.cuda(), k_new=k_new, v_new=v_new)
    assert torch.equal(out, expected) and torch.equal(k_cache, twins[0]) and torch.equal(v_cache, twins[1])
    with pytest.raises(ValueError, match="within the cache"):  # and still refuses what does not fit
        ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([7, 64], dtype=torch.int32),
                                  k_new=k_new, v_new=v_new)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_with_a_strided_head_dim_is_written_in_place(backend):
    """A cache whose head dim is not contiguous (a transposed view of its buffer): the new keys land in it, in place
    (the Triton backend appends them with torch ops there), and the step attends to them."""
    device = DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(29)
    k_cache, v_cache = (torch.randn(2, 16, 8, 2, generator=g).to(device).transpose(2, 3) for _ in range(2))
    assert k_cache.stride(-1) != 1
    q, k_new, v_new = (torch.randn(2, 1, n, 8, generator=g).to(device) for n in (4, 2, 2))
    lengths = torch.tensor([3, 9], dtype=torch.int32, device=device)
    with ft.use_backend(backend):
        out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    for b, n in enumerate((3, 9)):
        assert torch.equal(k_cache[b, n], k_new[b, 0]) and torch.equal(v_cache[b, n], v_new[b, 0])
    expected = from_scratch(q, k_cache, v_cache, None, lengths + 1)
    if out.device.type == "cpu":
        assert (out.double() - expected).abs().max().item() < 2e-6
    else:
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=0)


def test_block_table_entries_past_a_sequence_are_never_read():
    k_cache, v_cache, table = make_cache(2, 32, 2, 8, 8)
    table[0, 1:] = -1  # sequence 0 uses one block; FlashAttention's callers leave the rest as they like
    lengths = torch.tensor([3, 30], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 8)
    out = ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    expected = from_scratch(q, k_cache, v_cache, table, lengths)
    assert (out.double() - expected).abs().max().item() < 2e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [None, 16])
def test_a_step_with_new_keys_compiles_whole_and_writes_what_eager_writes(backend, block_size):
    """``torch.compile(fullgraph=True)`` of a decoding step that appends: the traced call writes the new keys with
    torch ops (the Triton backend's eager call writes them in its append kernel); the caches and the output are those
    of the eager step, bit for bit."""
    device = DEVICE if backend == "triton" else "cpu"
    k_cache, v_cache, table = (None if t is None else t.to(device)
                               for t in make_cache(2, 32, 2, 8, block_size, seed=31))
    g = torch.Generator().manual_seed(31)
    q, k_new, v_new = (torch.randn(2, 3, n, 8, generator=g).to(device) for n in (4, 2, 2))
    lengths = torch.tensor([5, 20], dtype=torch.int32, device=device)

    def step(q, k_cache, v_cache, lengths, k_new, v_new, table):
        return ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                         block_table=table, softcap=4.0)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    with ft.use_backend(backend):
        want = step(q, *caches[0], lengths, k_new, v_new, table)
        torch._dynamo.reset()
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, *caches[1], lengths, k_new, v_new, table)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert not torch.equal(caches[0][0], k_cache)  # the step wrote its keys
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    expected = from_scratch(q, *caches[0], table, lengths + 3, softcap=4.0)
    assert (want.cpu().double() - expected).abs().max().item() < 1e-4


# ------------------------------------------------------------------------------------------- torch's path

def _garbage_past(k_cache, v_cache, lengths):
    """Large finite values in every cache slot past each sequence's keys: SDPA's bool mask multiplies a masked value
    by 0, so NaN there would be NaN in the output even unread; a slot read by mistake shows as a wrong result."""
    g = torch.Generator().manual_seed(5)
    for b, n in enumerate(lengths.tolist()):
        for cache in (k_cache, v_cache):
            rest = cache[b, n:]
            rest.copy_((torch.randn(rest.shape, generator=g, dtype=torch.float64) * 1e4).to(cache.dtype))


TORCH_PATH_CASES = {  # (lq, heads, kv_heads, lengths before the append, new keys, is_causal)
    "decode": (1, 4, 4, 9, 1, True),  # an int: every sequence alike, no mask
    "decode_ragged": (1, 4, 4, [9, 0, 31], 1, True),
    "chunk": (5, 4, 4, [9, 0, 31], 5, True),
    "gqa": (3, 8, 2, [12, 4, 30], 3, True),
    "not_causal": (3, 4, 2, [12, 0, 30], 2, False),
    "no_new_keys": (2, 4, 4, [12, 7, 30], 0, True),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(TORCH_PATH_CASES))
def test_torch_path_matches_the_reference(case, dtype):
    """``kvcache_torch_path`` (the route's torch path from the public arguments): the new keys written where ours
    writes them and nothing else, and the output the float64 reference's, within twice PyTorch's own error in float32
    and bfloat16."""
    from fused_transformer.ops.attention.torch_paths import kvcache_torch_path

    lq, heads, kv_heads, given, new, is_causal = TORCH_PATH_CASES[case]
    batch, dim, capacity = 3, 16, 40
    g = torch.Generator().manual_seed(len(case))
    lengths = torch.tensor(given if isinstance(given, list) else [given] * batch, dtype=torch.int32)
    k_cache, v_cache, _ = make_cache(batch, capacity, kv_heads, dim, dtype=dtype, seed=len(case))
    _garbage_past(k_cache, v_cache, lengths + new)
    q = torch.randn(batch, lq, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    k_new = v_new = None
    if new:
        k_new, v_new = (torch.randn(batch, new, kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
                        for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    out = kvcache_torch_path(q, k_cache, v_cache, cache_seqlens=given if isinstance(given, int) else lengths,
                             k_new=k_new, v_new=v_new, is_causal=is_causal)
    after = lengths + new
    for b in range(batch):
        n, m = int(lengths[b]), int(after[b])
        for cache, old, written in ((k_cache, before[0], k_new), (v_cache, before[1], v_new)):
            assert torch.equal(cache[b, :n], old[b, :n]) and torch.equal(cache[b, m:], old[b, m:])
            if new:
                assert torch.equal(cache[b, n:m], written[b])
    expected = from_scratch(q, k_cache, v_cache, None, after, is_causal=is_causal)
    assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float64:
        assert (out - expected).abs().max().item() < 1e-12
        return
    spec = attention_contract.kvcache_spec(dim, is_causal, None, None, None)
    baseline, _ = reference.attention_with_kvcache(q, ft.contract.KVCache(k_cache, v_cache, after, None),
                                                   ft.contract.NO_SCORE_MODS, None, spec)  # PyTorch's own dtype
    assert_close_to_reference(out, expected, baseline)


def _kvcache_rows(speedup):
    return ft.route.parse_rows(f"attention_with_kvcache  forward  *  *  *  *  *  *  *  {speedup}  -  synthetic")


@pytest.fixture
def routed_by(monkeypatch):
    """``routed_by(rows)``: the route table of every device is ``rows`` until the test ends."""
    def use(rows):
        monkeypatch.setattr(ft.route, "_with_tuned", lambda device_type, index: tuple(rows))
        ft.route.forget_tuned()
    yield use
    monkeypatch.undo()
    ft.route.forget_tuned()


def _kvcache_call(q, k_cache, v_cache, lengths, host, new_len, block_table=None, window=None, softcap=None,
                  sinks=None, return_lse=False):
    from fused_transformer.ops.attention import facts

    cache = ft.contract.KVCache(k_cache, v_cache, lengths, block_table)
    spec = attention_contract.kvcache_spec(q.shape[-1], True, window, None, None)
    mods = attention_contract.score_mods(q, q.shape[0], q.shape[2], softcap, None)
    return facts.kvcache_call(q, cache, host, new_len, mods, sinks, spec, return_lse)


@pytest.mark.skipif(CPU_UNAVAILABLE is not None, reason=str(CPU_UNAVAILABLE))
def test_the_route_sends_a_kvcache_call_where_its_row_says():
    """A decoding step goes to torch's path under a row where torch wins, to ours under one where ours wins and
    without a row; calls the path does not compute as ours stay ours whatever the row."""
    k_cache, v_cache, table = make_cache(2, 32, 2, 8, 8)
    q = torch.randn(2, 1, 4, 8)
    lengths = torch.tensor([3, 20], dtype=torch.int32)
    torch_wins, ours_wins = _kvcache_rows("0.60"), _kvcache_rows("1.30")
    call = _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, [3, 20], 1)
    assert call.torch_cannot == "" and call.size == 21 and call.mask == "none"
    assert ft.route.decide(call, "auto", "cpu", torch_wins).backend == "torch"
    assert ft.route.decide(call, "auto", "cpu", ours_wins).backend == "cpu"
    assert ft.route.decide(call, "auto", "cpu", []).backend == "cpu"
    refused = {
        "paged": _kvcache_call(q, k_cache, v_cache, lengths, [3, 20], 1, block_table=table),
        "unread": _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, None, 1),
        "window": _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, [3, 20], 1, window=(4, 0)),
        "no key": _kvcache_call(torch.randn(2, 3, 4, 8), k_cache[:2], v_cache[:2], lengths, [1, 20], 1),
        "softcap": _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, [3, 20], 1, softcap=2.0),
        "sinks": _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, [3, 20], 1, sinks=torch.zeros(4)),
        "lse": _kvcache_call(q, k_cache[:2], v_cache[:2], lengths, [3, 20], 1, return_lse=True),
    }
    for why, refused_call in refused.items():
        got = ft.route.decide(refused_call, "auto", "cpu", torch_wins)
        assert got.backend == "cpu" and "torch's path does not serve" in got.reason, (why, got)


@pytest.mark.skipif(CPU_UNAVAILABLE is not None, reason=str(CPU_UNAVAILABLE))
@pytest.mark.parametrize("lengths", [7, [7, 0, 25]])
def test_a_step_routed_to_torch_writes_and_returns_what_ours_does(routed_by, lengths):
    """The whole call under each row: torch's path runs where the row says so (``explain``), writes the caches as
    ours writes them, bit for bit, and returns ours' output to round-off."""
    g = torch.Generator().manual_seed(41)
    k_cache, v_cache, _ = make_cache(3, 32, 2, 16, seed=41)
    cache_seqlens = lengths if isinstance(lengths, int) else torch.tensor(lengths, dtype=torch.int32)
    q, k_new, v_new = (torch.randn(3, 2, n, 16, generator=g) for n in (4, 2, 2))
    results = {}
    for speedup in ("0.60", "1.30"):
        routed_by(_kvcache_rows(speedup))
        caches = k_cache.clone(), v_cache.clone()
        with ft.explain() as calls:
            out = ft.attention_with_kvcache(q, *caches, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new)
        results[calls[-1].backend] = out, caches
    assert sorted(results) == ["cpu", "torch"]
    (theirs, their_caches), (ours, our_caches) = results["torch"], results["cpu"]
    assert torch.equal(their_caches[0], our_caches[0]) and torch.equal(their_caches[1], our_caches[1])
    assert not torch.equal(our_caches[0], k_cache)
    torch.testing.assert_close(theirs, ours, atol=2e-6, rtol=0)
