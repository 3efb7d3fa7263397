"""attention_varlen, window and query_padding_mask through the public API, on the cpu and reference backends
(the Triton kernels have their own tests in test_attention_varlen_triton.py).

Two independent oracles: the reference backend (float64), and, for varlen, ``attention`` run on each sequence
alone (dense, float64), which is what packed sequences must equal.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend, contract, reference

from numerics import assert_close_to_reference
from fused_transformer.ops.attention import contract as attention_contract

BACKENDS = [name for name in ("cpu",) if backend.cpu_unavailable_reason() is None]


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.nn.functional.pad(torch.tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))


def packed(lengths_q, lengths_k, heads=4, kv_heads=2, dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, dim, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lengths_k), kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lengths_k), kv_heads, dim, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def run_with_grads(fn, inputs, grad_out_seed=1):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, g.to(out.dtype))
    return out.detach(), lse, grads


# Lengths: an empty sequence, lengths across the cpu kernel's 64 x 128 blocks, more keys than queries.
LENGTHS = [([3, 0, 5, 7], [4, 2, 5, 9]), ([130, 1, 70], [300, 17, 70])]
MASKS = list(itertools.product([False, True], ["top_left", "bottom_right"], [None, (3, None), (None, 2), (40, 5)]))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("lengths_q, lengths_k", LENGTHS)
@pytest.mark.parametrize("is_causal, alignment, window", MASKS)
def test_varlen_equals_each_sequence_alone(name, lengths_q, lengths_k, is_causal, alignment, window):
    """Forward, LSE and gradients of packed sequences equal dense attention on each sequence by itself."""
    q, k, v = packed(lengths_q, lengths_k)
    kwargs = dict(is_causal=is_causal, causal_alignment=alignment, window=window)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)

    def varlen(q, k, v):
        with ft.use_backend(name):
            return ft.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, **kwargs)

    def one_by_one(q, k, v):
        outs, lses = [], []
        for b in range(len(lengths_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            with ft.use_backend("reference"):
                out, lse = ft.attention(*(t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))),
                                        return_lse=True, **kwargs)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    out, lse, grads = run_with_grads(varlen, (q, k, v))
    ref_out, ref_lse, ref_grads = run_with_grads(one_by_one, (q, k, v))
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)  # -inf rows too
    for got, want, what in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"d{what}")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_low_precision_within_the_rule(name, dtype):
    lengths_q, lengths_k = [50, 0, 129], [70, 3, 129]
    q64, k64, v64 = packed(lengths_q, lengths_k, seed=5)
    args = (cu_seqlens(lengths_q), cu_seqlens(lengths_k), 129, 129)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", window=(20, None))

    def run(which, dt):
        def fn(q, k, v):
            with ft.use_backend(which):
                return ft.attention_varlen(q, k, v, *args, return_lse=True, **kwargs)
        return run_with_grads(fn, [t.to(dt) for t in (q64, k64, v64)])

    out, _, grads = run(name, dtype)
    ref, _, ref_grads = run("reference", torch.float64)
    base, _, base_grads = run("reference", dtype)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, base)
    for got, want, b, what in zip(grads, ref_grads, base_grads, "qkv"):
        assert_close_to_reference(got, want, b, name=f"d{what}")


@pytest.mark.parametrize("name", BACKENDS)
def test_varlen_dropout_replays_on_the_reference(name):
    """Dropout element (b, h, i, j) is element [b, h, i, j] of the [B, H, max_q, max_k] keep-mask."""
    from fused_transformer import cpu_ops

    lengths_q, lengths_k = [5, 9, 0, 12], [7, 9, 2, 4]
    q, k, v = packed(lengths_q, lengths_k, seed=7)
    args = (cu_seqlens(lengths_q), cu_seqlens(lengths_k), 12, 9)
    torch.manual_seed(3)
    seed = contract.draw_dropout_seed(q.device)
    torch.manual_seed(3)
    with ft.use_backend(name):
        out = ft.attention_varlen(q, k, v, *args, is_causal=True, dropout_p=0.3)
    keep = cpu_ops.dropout_keep_mask(seed, (4, q.shape[1], 12, 9), 0.3)
    want = reference.attention_varlen(q, k, v, *args, is_causal=True, dropout_p=0.3, keep_mask=keep)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert (out - reference.attention_varlen(q, k, v, *args, is_causal=True)).abs().max() > 0.1


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("is_causal, alignment, window", MASKS)
def test_query_padding_and_window_match_the_reference(name, is_causal, alignment, window):
    """Dense attention with query padding (holes, a padded tail, none) and key padding, bottom-right per sequence,
    forward and backward, against the reference in float64."""
    g = torch.Generator().manual_seed(11)
    batch, heads, lq, lk, dim = 3, 4, 150, 170, 16
    q = torch.randn(batch, heads, lq, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, 2, lk, dim, generator=g, dtype=torch.float64) for _ in range(2))
    query_padding = torch.rand(batch, lq, generator=g) < 0.2
    query_padding[0, 100:] = True
    query_padding[1] = False
    key_padding = torch.rand(batch, lk, generator=g) < 0.2
    key_padding[2, 120:] = True
    for qp, kp in ((query_padding, key_padding), (query_padding, None), (None, key_padding)):
        kwargs = dict(query_padding_mask=qp, key_padding_mask=kp, is_causal=is_causal, causal_alignment=alignment,
                      window=window)

        def on(which):
            def fn(q, k, v):
                with ft.use_backend(which):
                    return ft.attention(q, k, v, return_lse=True, **kwargs)
            return fn

        out, lse, grads = run_with_grads(on(name), (q, k, v))
        ref_out, ref_lse, ref_grads = run_with_grads(on("reference"), (q, k, v))
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        if qp is not None:
            assert (out[qp[:, None, :, None].expand_as(out)] == 0).all()
            assert lse[qp[:, None, :].expand_as(lse)].isneginf().all()


def test_reference_per_sequence_alignment_is_the_last_real_query_on_the_last_real_key():
    """bottom_right with query padding: right-padded sequences align as if unpadded, left-padded ones as the
    padded whole (both ends line up)."""
    lq, lk = 4, 6
    right_q = torch.tensor([[False, False, True, True]])  # 2 real queries
    right_k = torch.tensor([[False, False, False, True, True, True]])  # 3 real keys
    keep = reference.window_keep(lq, lk, reference.alignment_offset(lq, lk, "bottom_right", right_q, right_k),
                                 None, True, torch.device("cpu"))
    assert keep[0, 0, :2, :3].tolist() == [[True, True, False], [True, True, True]]
    left_q, left_k = right_q.flip(1), right_k.flip(1)
    keep = reference.window_keep(lq, lk, reference.alignment_offset(lq, lk, "bottom_right", left_q, left_k),
                                 None, True, torch.device("cpu"))
    assert keep[0, 0].tolist() == reference.causal_keep(lq, lk, "bottom_right", torch.device("cpu")).tolist()


@pytest.mark.parametrize("name", BACKENDS)
def test_window_skips_key_blocks_outside_it(name):
    """A NaN in a key block that no query of a tile can see stays out of the output: the block is never read
    (a masked key's NaN value would reach every row of a tile that reads it, through 0 * NaN in P @ V, as in
    torch's SDPA)."""
    lq = lk = 512
    q, k, v = (torch.randn(1, 1, n, 16, dtype=torch.float64) for n in (lq, lk, lk))
    v[0, 0, 400] = float("nan")  # only queries 390 .. 400 see key 400 through window (10, 0)
    with ft.use_backend(name):
        out = ft.attention(q, k, v, window=(10, 0))
    nan_rows = set(out[0, 0].isnan().any(dim=-1).nonzero().flatten().tolist())
    # Queries 400..410 see the key; the cpu kernel's 64-row tile 384..447 reads its block, no other tile does.
    assert set(range(400, 411)) <= nan_rows <= set(range(384, 448)), sorted(nan_rows)


@pytest.mark.parametrize("name", BACKENDS)
def test_varlen_under_torch_compile(name):
    lengths = [5, 0, 9]
    q, k, v = packed(lengths, lengths, dtype=torch.float32)
    args = (cu_seqlens(lengths), cu_seqlens(lengths), 9, 9)

    def fn(q, k, v):
        return ft.attention_varlen(q, k, v, *args, is_causal=True)

    with ft.use_backend(name):
        eager = fn(q, k, v)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(compiled, eager)


BAD_VARLEN = [
    ("cu dtype", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q must be int32"),
    ("cu rank", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][None]), TypeError, "cu_seqlens_k must be int32"),
    ("not from 0", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"] + 1), ValueError, "must start at 0"),
    ("wrong total", lambda a: a.update(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32)), ValueError,
     "end at the packed length 12"),
    ("decreasing", lambda a: a.update(cu_seqlens_q=torch.tensor([0, 10, 9], dtype=torch.int32)), ValueError,
     "non-decreasing"),
    ("too long", lambda a: a.update(max_seqlen_q=3), ValueError, "more than max_seqlen_q=3"),
    ("max not int", lambda a: a.update(max_seqlen_k=2.0), TypeError, "max_seqlen_k=2.0"),
    ("count", lambda a: a.update(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError,
     "same number of sequences"),
    ("q rank", lambda a: a.update(q=a["q"][None]), ValueError, "q must have 3 dims"),
    ("heads", lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of k/v's heads"),
    ("window", lambda a: a.update(window=(-1, 2)), ValueError, "window=(-1, 2)"),
]


@pytest.mark.parametrize("name", ["reference", *BACKENDS])
@pytest.mark.parametrize("case", BAD_VARLEN, ids=[c[0] for c in BAD_VARLEN])
def test_varlen_rejects_bad_input(name, case):
    _, change, error, text = case
    q, k, v = packed([4, 5], [5, 7])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens([4, 5]), cu_seqlens_k=cu_seqlens([5, 7]), max_seqlen_q=5,
                max_seqlen_k=7)
    change(args)
    with ft.use_backend(name), pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        ft.attention_varlen(**args)


def test_query_padding_mask_is_checked():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"query_padding_mask must be \[batch, seq_q\] = \[2, 5\]"):
        ft.attention(q, q, q, query_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="query_padding_mask must be bool"):
        ft.attention(q, q, q, query_padding_mask=torch.zeros(2, 5))


def test_self_attention_reads_its_one_offsets_tensor_once(monkeypatch):
    """One ``cu_seqlens`` tensor for queries and keys (self-attention) is checked once: on a GPU each read waits for
    the GPU. Two tensors, or other totals, are each checked."""
    reads = []
    check = attention_contract.check_cu_seqlens_values
    monkeypatch.setattr(attention_contract, "check_cu_seqlens_values", lambda name, *args: reads.append(name) or check(
        name, *args))
    q, k, v = packed([3, 5], [3, 5])
    cu_q = cu_seqlens([3, 5])
    ft.attention_varlen(q, k, v, cu_q, cu_q, 5, 5)
    assert reads == ["cu_seqlens_q"]
    ft.attention_varlen(q, k, v, cu_q, cu_q.clone(), 5, 5)
    assert reads == ["cu_seqlens_q", "cu_seqlens_q", "cu_seqlens_k"]
    with pytest.raises(ValueError, match="cu_seqlens_k"):  # the same tensor, another total: still checked
        ft.attention_varlen(q, k[:7], v[:7], cu_q, cu_q, 5, 5)
