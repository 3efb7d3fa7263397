"""Softcap, ALiBi and attention sinks in the C++ CPU kernels (backend "cpu"), forward and backward, against the float64
reference: ``attention`` under every mask the kernel has (causal top-left and bottom-right, window, key and query
padding, GQA, Lq != Lk), ``attention_varlen``, the 2x rule in float32 / bfloat16 and round-off in float64, with the
gradients of q, k, v and the sinks. (``attention_with_kvcache`` with these options: tests/test_attention_kvcache.py.)

Skipped, with the reason, when the extension is not built, unless FUSED_TRANSFORMER_REQUIRE_CPU=1 (CI)."""
import os

import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend, contract, reference, route
from numerics import assert_close_to_reference

UNAVAILABLE = backend.cpu_unavailable_reason()
if UNAVAILABLE is not None and os.environ.get("FUSED_TRANSFORMER_REQUIRE_CPU") != "1":
    pytest.skip(f"cpu backend unavailable: {UNAVAILABLE}", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
NAMES = ["out", "lse", "dq", "dk", "dv", "dsinks"]


def randn(*shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def score_mods(mods, batch, heads, generator):
    """The call's softcap / alibi_slopes / sinks (float64; cast per run) from names such as "softcap+sinks"."""
    options = {}
    for mod in mods.split("+"):
        if mod == "softcap":
            options["softcap"] = 2.5
        elif mod == "alibi":  # ALiBi's geometric slopes, jittered so that no two heads share one
            options["alibi_slopes"] = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float64)) * (
                1 + 0.1 * torch.rand(heads, generator=generator, dtype=torch.float64))
        elif mod == "alibi_batch":
            options["alibi_slopes"] = torch.rand(batch, heads, generator=generator, dtype=torch.float64) * 0.3
        elif mod == "sinks":
            options["sinks"] = randn(heads, generator=generator) * 2
        else:
            raise AssertionError(mod)
    return options


def run_with_grads(fn, inputs, sinks, dtype, grad_out):
    """fn(q, k, v, sinks) with q, k, v in dtype and the sinks float32 (float64 with float64 inputs) -> out, lse and the
    gradients of q, k, v and the sinks (None without sinks)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    sink_leaf = None if sinks is None else sinks.detach().to(stats).requires_grad_()
    out, lse = fn(*leaves, sink_leaf)
    wrt = leaves + ([sink_leaf] if sink_leaf is not None else [])
    grads = list(torch.autograd.grad(out, wrt, grad_out.to(dtype)))
    return [out.detach(), lse] + grads + ([None] if sink_leaf is None else [])


def compare(call, inputs, options, dtype, grad_out):
    """``call(impl, q, k, v, **options)`` on the cpu backend in dtype against the reference in float64 (and, for the
    2x rule, in dtype), all three on the same values: the inputs rounded to dtype, the slopes and sinks to float32
    (float64 with float64 inputs), as flash-attention's tests do. Otherwise the rounding of the inputs, common to ours
    and PyTorch's, dominates both errors, and a gradient summed over every row (the sinks') could by chance be closer
    for PyTorch. Returns the errors by name."""
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    inputs, grad_out = [t.to(dtype).double() for t in inputs], grad_out.to(dtype).double()
    options = {name: t.to(stats).double() if name in ("alibi_slopes", "sinks") else t for name, t in options.items()}
    sinks = options.get("sinks")
    fixed = {name: (t.to(stats) if name == "alibi_slopes" else t) for name, t in options.items() if name != "sinks"}

    def fn(impl):
        return lambda q, k, v, s: call(impl, q, k, v, **fixed, **({} if s is None else {"sinks": s}))

    with ft.use_backend("cpu"):
        ours = run_with_grads(fn(ft), inputs, sinks, dtype, grad_out)
    ref64 = run_with_grads(fn(reference), inputs, sinks, torch.float64, grad_out)
    errors = {}
    if dtype == torch.float64:
        for name, got, want in zip(NAMES, ours, ref64):
            if got is not None:
                errors[name] = ft.tools.numerics.max_error(got, want)
                assert errors[name] < 1e-10, f"{name}: {errors[name]:.3e}"
        return errors
    baseline = run_with_grads(fn(reference), inputs, sinks, dtype, grad_out)
    for name, got, want, base in zip(NAMES, ours, ref64, baseline):
        if got is not None:
            assert_close_to_reference(got, want, base, name)
            errors[name] = ft.tools.numerics.max_error(got, want)
    return errors


# (mods, mask options, batch, heads, kv_heads, lq, lk): lengths that cross the kernel's 64-query, 128-key blocks.
CASES = {
    "softcap_causal": ("softcap", dict(is_causal=True), 2, 4, 4, 70, 70),
    "alibi_not_causal": ("alibi", {}, 2, 4, 2, 37, 150),
    "alibi_bottom_right": ("alibi", dict(is_causal=True, causal_alignment="bottom_right"), 2, 4, 4, 37, 150),
    "alibi_batch_key_padding": ("alibi_batch", dict(key_padding="holes"), 2, 4, 2, 70, 53),
    "sinks_window": ("sinks", dict(window=(9, 4)), 2, 4, 1, 70, 150),
    "sinks_query_padding": ("sinks", dict(query_padding=True, key_padding="right"), 2, 4, 2, 37, 53),
    "alibi_query_padding_bottom_right": ("alibi_batch", dict(is_causal=True, causal_alignment="bottom_right",
                                                            query_padding=True, key_padding="right"), 2, 4, 2, 37, 53),
    "softcap_alibi_window_top_left": ("softcap+alibi", dict(is_causal=True, window=(20, None)), 2, 4, 2, 150, 70),
    "large_tiles": ("softcap+alibi_batch+sinks", dict(key_padding="right"), 2, 4, 2, 150, 300),  # 256 x 512 tiles
    "all_three": ("softcap+alibi+sinks", dict(is_causal=True, causal_alignment="bottom_right", key_padding="right",
                                              query_padding=True, attn_mask=True), 2, 4, 2, 70, 150),
}


def dense_case(name, generator):
    mods, masks, batch, heads, kv_heads, lq, lk = CASES[name]
    dim = 16
    inputs = [randn(batch, heads, lq, dim, generator=generator), randn(batch, kv_heads, lk, dim, generator=generator),
              randn(batch, kv_heads, lk, dim, generator=generator)]
    options = score_mods(mods, batch, heads, generator)
    masks = dict(masks)
    kind = masks.pop("key_padding", None)
    if kind == "holes":
        padding = torch.rand(batch, lk, generator=generator) < 0.3
        padding[:, 0] = False
        masks["key_padding_mask"] = padding
    elif kind == "right":
        masks["key_padding_mask"] = torch.arange(lk)[None, :] >= torch.tensor([lk, lk // 2 + 3])[:, None]
    if masks.pop("query_padding", False):
        padding = torch.arange(lq)[None, :] >= torch.tensor([lq - 5, lq // 2])[:, None]
        padding[0, 3] = True  # a hole before the last real query
        masks["query_padding_mask"] = padding
    if masks.pop("attn_mask", False):
        masks["attn_mask"] = torch.rand(lq, lk, generator=generator) < 0.8
    return inputs, {**options, **masks}, randn(batch, heads, lq, dim, generator=generator)


def attention_call(impl, q, k, v, **options):
    return impl.attention(q, k, v, return_lse=True, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_reference(case, dtype):
    inputs, options, grad_out = dense_case(case, torch.Generator().manual_seed(sorted(CASES).index(case)))
    compare(attention_call, inputs, options, dtype, grad_out)


def cu_seqlens(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))


VARLEN_CASES = {
    "sinks_alibi_batch_bottom_right": ("alibi_batch+sinks", dict(is_causal=True, causal_alignment="bottom_right")),
    "softcap_window": ("softcap", dict(window=(6, 3))),
    "all_three_top_left": ("softcap+alibi+sinks", dict(is_causal=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_attention_varlen_matches_reference(case, dtype):
    g = torch.Generator().manual_seed(100 + sorted(VARLEN_CASES).index(case))
    mods, masks = VARLEN_CASES[case]
    lengths_q, lengths_k = [5, 0, 70, 9], [9, 4, 130, 9]  # an empty sequence; one across the blocks
    heads, kv_heads, dim = 4, 2, 16
    inputs = [randn(sum(lengths_q), heads, dim, generator=g), randn(sum(lengths_k), kv_heads, dim, generator=g),
              randn(sum(lengths_k), kv_heads, dim, generator=g)]
    options = {**score_mods(mods, len(lengths_q), heads, g), **masks}
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)

    def call(impl, q, k, v, **options):
        return impl.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, **options)

    compare(call, inputs, options, dtype, randn(*inputs[0].shape, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sink_rows_with_every_key_masked_give_zeros_and_lse_sink(dtype):
    """A real query that sees no key attends to its sink alone: out 0, lse = sink, zero gradients; a padding query
    stays 0 with lse -inf; the sinks' gradient flows from the other rows only."""
    g = torch.Generator().manual_seed(7)
    batch, heads, lq, lk, dim = 2, 3, 6, 9, 8
    q, k, v = (randn(batch, heads, n, dim, generator=g).to(dtype).requires_grad_() for n in (lq, lk, lk))
    sinks = randn(heads, generator=g).to(dtype).requires_grad_()
    keep = torch.ones(lq, lk, dtype=torch.bool)
    keep[1] = False  # query 1 sees no key in either sequence
    key_padding = torch.zeros(batch, lk, dtype=torch.bool)
    key_padding[1] = True  # and sequence 1 has no key at all
    query_padding = torch.zeros(batch, lq, dtype=torch.bool)
    query_padding[0, 4] = True
    with ft.use_backend("cpu"):
        out, lse = ft.attention(q, k, v, attn_mask=keep, key_padding_mask=key_padding, query_padding_mask=query_padding,
                                sinks=sinks, return_lse=True)
    sink_lse = sinks.detach()[:, None].expand(heads, lq)
    assert torch.equal(out[1].detach(), torch.zeros_like(out[1])) and torch.equal(lse[1], sink_lse)
    assert torch.equal(out[0, :, 1].detach(), torch.zeros_like(out[0, :, 1]))
    assert torch.equal(lse[0, :, 1], sinks.detach())
    assert torch.equal(out[0, :, 4].detach(), torch.zeros_like(out[0, :, 4])) and lse[0, :, 4].isneginf().all()
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), torch.randn_like(out))
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dq[0, :, 1], torch.zeros_like(dq[0, :, 1]))
    assert all(t.isfinite().all() for t in (dq, dk, dv, dsinks)) and (dsinks != 0).all()
    ref = reference.attention(*(t.detach().double().requires_grad_() for t in (q, k, v)), attn_mask=keep,
                              key_padding_mask=key_padding, query_padding_mask=query_padding,
                              sinks=sinks.detach().double(), return_lse=True)
    torch.testing.assert_close(out.detach().double(), ref[0].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref[1].detach(), rtol=0, atol=1e-5)


def test_without_score_mods_the_results_are_bitwise_unchanged():
    """softcap=None, no slopes and no sinks run the kernels exactly as before: an ALiBi slope of 0 and a sink of -inf
    give bitwise the same output (the modified path agrees with the plain one where it must)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (randn(2, 4, n, 16, generator=g).float() for n in (33, 70, 70))
    with ft.use_backend("cpu"):
        plain, plain_lse = ft.attention(q, k, v, is_causal=True, return_lse=True)
        zero = ft.attention(q, k, v, is_causal=True, alibi_slopes=torch.zeros(4), sinks=torch.full((4,), -torch.inf),
                            return_lse=True)
    assert torch.equal(plain, zero[0]) and torch.equal(plain_lse, zero[1])


def test_gradcheck_float64():
    """The autograd Functions' gradients over the C++ kernels, the sinks' included, against finite differences."""
    from fused_transformer.ops.attention.function import AttentionFunction, AttentionVarlenFunction

    g = torch.Generator().manual_seed(11)
    q, k, v = randn(1, 2, 5, 8, generator=g), randn(1, 1, 6, 8, generator=g), randn(1, 1, 6, 8, generator=g)
    sinks, slopes = randn(2, generator=g), torch.tensor([0.3, 0.1], dtype=torch.float64)
    key_padding = torch.tensor([[False, True, False, False, False, True]])
    query_padding = torch.tensor([[False, False, True, False, True]])
    for causal, bottom_right, window, q_padding in ((False, False, (-1, -1), None), (True, True, (-1, -1), None),
                                                    (False, True, (1, 2), query_padding)):
        def fn(q, k, v, sinks):
            spec = contract.AttentionSpec(causal, "bottom_right" if bottom_right else "top_left",
                                          contract.window_of_bounds(*window), 0.0, 0.3)
            mods = contract.ScoreMods(softcap=1.5, alibi_slopes=slopes)
            return AttentionFunction.apply(q, k, v, sinks, None, key_padding, q_padding, None, mods, spec, "cpu")[0]

        assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v, sinks)])
    cu_q, cu_k = cu_seqlens([2, 3]), cu_seqlens([4, 2])
    q, k, v = randn(5, 2, 8, generator=g), randn(6, 1, 8, generator=g), randn(6, 1, 8, generator=g)

    def varlen(q, k, v, sinks):
        spec = contract.AttentionSpec(True, "bottom_right", None, 0.0, 0.3)
        mods = contract.ScoreMods(softcap=2.0, alibi_slopes=slopes)
        return AttentionVarlenFunction.apply(q, k, v, sinks, cu_q, cu_k, mods, 3, 4, spec, "cpu")[0]

    assert torch.autograd.gradcheck(varlen, [t.clone().requires_grad_() for t in (q, k, v, sinks)])


def test_a_modifier_the_kernels_do_not_compute_runs_on_the_reference(monkeypatch):
    """The route: a call with a score modifier outside its backend's ``route.SUPPORTS`` runs on the reference,
    which computes every one (forward, gradients, the kv-cache step), and never reaches the backend's kernels; the
    modifiers the backend computes stay on it."""
    cpu = backend.ops("cpu")
    launched = []
    for name in ("attention_fwd", "attention_varlen_fwd", "attention_with_kvcache"):
        def spy(*args, original=getattr(cpu, name), name=name):
            launched.append(name)
            return original(*args)
        monkeypatch.setattr(cpu, name, spy)
    monkeypatch.setitem(route.SUPPORTS, "cpu", frozenset({"softcap", "sinks"}))  # as if its kernels had no ALiBi
    monkeypatch.setattr(route, "_DECISIONS", {})  # decided afresh, and forgotten after
    g = torch.Generator().manual_seed(13)
    q, k, v = (randn(2, 4, 9, 8, generator=g).float().requires_grad_() for _ in range(3))
    slopes = torch.rand(4, generator=g) * 0.5
    with ft.use_backend("cpu"):
        out = ft.attention(q, k, v, is_causal=True, alibi_slopes=slopes, softcap=3.0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        packed = ft.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                     cu_seqlens([4, 5]), cu_seqlens([4, 5]), 5, 5, alibi_slopes=slopes)
        cache = k.detach().transpose(1, 2).contiguous(), v.detach().transpose(1, 2).contiguous()
        step = ft.attention_with_kvcache(q.detach()[:, :, :1].transpose(1, 2), *cache, cache_seqlens=7,
                                         alibi_slopes=slopes)
    assert launched == []
    expected = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes, softcap=3.0)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))))
    with ft.use_backend("reference"):
        assert torch.equal(packed, ft.attention_varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_seqlens([4, 5]), cu_seqlens([4, 5]),
            5, 5, alibi_slopes=slopes))
        assert torch.equal(step, ft.attention_with_kvcache(q.detach()[:, :, :1].transpose(1, 2), *cache,
                                                           cache_seqlens=7, alibi_slopes=slopes))
    with ft.use_backend("cpu"):
        ft.attention(q, k, v, softcap=3.0)
    assert launched == ["attention_fwd"]
