"""The C++ CPU kernels (backend "cpu") against the float64 reference: forward and every gradient, with the 2x rule
in float32 / bfloat16 / float16, exactly (to round-off) in float64, plus gradcheck, dropout replay and
reproducibility, and torch.compile / profiler visibility of the registered operators.

Skipped, with the reason, when the extension is not built, unless FUSED_TRANSFORMER_REQUIRE_CPU=1 (CI), where
its absence fails loudly."""
import os

import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend, contract, reference
from fused_transformer.ops.attention.function import AttentionFunction, AttentionVarlenFunction
from fused_transformer.ops.feed_forward import FeedForwardFunction, FeedForwardSpec
from fused_transformer.ops.layer_norm import LayerNormSpec, NormFunction
from numerics import assert_close_to_reference
from fused_transformer.ops.attention import contract as attention_contract

UNAVAILABLE = backend.cpu_unavailable_reason()
REQUIRED = os.environ.get("FUSED_TRANSFORMER_REQUIRE_CPU") == "1"
if UNAVAILABLE is not None and not REQUIRED:
    pytest.skip(f"cpu backend unavailable: {UNAVAILABLE}", allow_module_level=True)

LOW_PRECISION = [torch.float32, torch.bfloat16]


def cpu_ops():
    from fused_transformer import cpu_ops as module

    return module


def test_cpu_extension_is_built():
    assert UNAVAILABLE is None, UNAVAILABLE


def randn(*shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def run_with_grads(fn, inputs, dtype, grad_out, **kwargs):
    """fn(*inputs in dtype) -> (outputs..., gradients of each input) with output gradient grad_out."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outputs[0], leaves, grad_out.to(dtype))
    return [o.detach() for o in outputs] + list(grads)


def compare_all(fn_ours, fn_ref, inputs, dtype, grad_out, names, **kwargs):
    """Ours (cpu backend) in dtype vs the reference in float64, allowing 2x the reference's own error in dtype."""
    with ft.use_backend("cpu"):
        ours = run_with_grads(fn_ours, inputs, dtype, grad_out, **kwargs)
    ref64 = run_with_grads(fn_ref, inputs, torch.float64, grad_out, **kwargs)
    baseline = run_with_grads(fn_ref, inputs, dtype, grad_out, **kwargs)
    return [assert_close_to_reference(o, r, b, name) for o, r, b, name in zip(ours, ref64, baseline, names)]


# ------------------------------------------------------------------------------------------- attention

MASK_KINDS = ["none", "padding_right", "padding_holes", "causal_top_left", "causal_bottom_right", "bool_mask",
              "float_mask_broadcast", "causal_bottom_right+padding+float_mask", "fully_masked_rows"]


def attention_masks(kind, batch, heads, lq, lk, generator):
    lengths = torch.tensor([max(1, lk - 3 * b) for b in range(batch)])
    right_padded = torch.arange(lk)[None, :] >= lengths[:, None]
    if kind == "none":
        return {}
    if kind == "padding_right":
        return dict(key_padding_mask=right_padded)
    if kind == "padding_holes":
        holes = torch.rand(batch, lk, generator=generator) < 0.3
        holes[:, 0] = False
        return dict(key_padding_mask=holes)
    if kind == "causal_top_left":
        return dict(is_causal=True)
    if kind == "causal_bottom_right":
        return dict(is_causal=True, causal_alignment="bottom_right")
    if kind == "bool_mask":
        mask = torch.rand(batch, 1, lq, lk, generator=generator) < 0.7
        mask[..., 0] = True
        return dict(attn_mask=mask)
    if kind == "float_mask_broadcast":
        return dict(attn_mask=torch.randn(heads, 1, lk, generator=generator, dtype=torch.float64))
    if kind == "causal_bottom_right+padding+float_mask":
        return dict(is_causal=True, causal_alignment="bottom_right", key_padding_mask=right_padded,
                    attn_mask=torch.randn(lq, lk, generator=generator, dtype=torch.float64))
    if kind == "fully_masked_rows":
        mask = torch.rand(lq, lk, generator=generator) < 0.7
        mask[::2] = False  # every other query row sees no key
        padding = right_padded.clone()
        padding[0] = True  # and batch 0 has no key at all
        return dict(attn_mask=mask, key_padding_mask=padding)
    raise AssertionError(kind)


def check_attention(dtype, batch, heads, kv_heads, lq, lk, dim, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(batch, heads, lq, dim, generator=g), randn(batch, kv_heads, lk, dim, generator=g), randn(
        batch, kv_heads, lk, dim, generator=g)
    masks = attention_masks(kind, batch, heads, lq, lk, g)
    if "attn_mask" in masks and masks["attn_mask"].is_floating_point():
        masks["attn_mask"] = masks["attn_mask"].to(torch.float32 if dtype != torch.float64 else dtype)
    grad_out = randn(batch, heads, lq, dim, generator=g)

    def fn(q, k, v, impl):
        return impl.attention(q, k, v, return_lse=True, **masks)

    ratios = compare_all(lambda *a: fn(*a, ft), lambda *a: fn(*a, reference), [q, k, v], dtype, grad_out,
                         ["out", "lse", "dq", "dk", "dv"])
    if kind == "fully_masked_rows":
        with ft.use_backend("cpu"):
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out, lse = fn(*leaves, ft)
            out.backward(grad_out.to(dtype))
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
        assert torch.equal(out[1, :, ::2], torch.zeros_like(out[1, :, ::2]))
        assert all(torch.isfinite(t.grad).all() for t in leaves)
        assert torch.equal(leaves[0].grad[0], torch.zeros_like(leaves[0].grad[0]))
    return ratios


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("lq,lk,dim", [(1, 1, 16), (7, 7, 48), (77, 130, 64), (130, 77, 16)])
def test_attention_float32_matches_reference(kind, lq, lk, dim):
    check_attention(torch.float32, 2, 4, 2, lq, lk, dim, kind)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision_matches_reference(kind, dtype):
    check_attention(dtype, 2, 4, 1, 77, 130, 64, kind)


@pytest.mark.parametrize("kind", ["none", "causal_bottom_right+padding+float_mask", "padding_holes"])
def test_attention_float64_matches_reference_to_round_off(kind):
    ratios = check_attention(torch.float64, 2, 4, 4, 33, 70, 16, kind)
    assert max(ratios) < 2.0


def test_attention_long_sequences_cross_block_boundaries():
    check_attention(torch.float32, 1, 2, 1, 200, 300, 64, "causal_bottom_right+padding+float_mask")


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_attention_large_forward_tiles_match_reference(kind):
    """Lengths that cross the forward's tiles: the tiled forward's 64-row tasks and 256-key blocks, and the BLAS
    path's 256 x 512 tiles (masks it does not serve, 128 queries or more without a causal mask)."""
    check_attention(torch.float32, 2, 4, 2, 300, 700, 32, kind)


def attention_dropout_case(dtype, dropout_p=0.3, large_tiles=False):
    """Causal with padding on small tiles, or (``large_tiles``) with padding alone on the large forward tiles."""
    g = torch.Generator().manual_seed(5)
    lq, lk = (300, 700) if large_tiles else (37, 50)
    q, k, v = randn(2, 4, lq, 16, generator=g), randn(2, 2, lk, 16, generator=g), randn(2, 2, lk, 16, generator=g)
    kpm = torch.arange(lk)[None, :] >= torch.tensor([lk, lk // 2 - 5])[:, None]
    return [t.to(dtype) for t in (q, k, v)], dict(key_padding_mask=kpm, is_causal=not large_tiles,
                                                  causal_alignment="bottom_right", dropout_p=dropout_p)


def seeded_call(fn, manual_seed=1234):
    """Run ``fn`` after torch.manual_seed; return its result and the dropout seed the op drew."""
    torch.manual_seed(manual_seed)
    seed = contract.draw_dropout_seed(torch.device("cpu"))
    torch.manual_seed(manual_seed)
    return fn(), seed


@pytest.mark.parametrize("large_tiles", [False, True])
def test_attention_dropout_matches_reference_fed_the_keep_mask(large_tiles):
    (q, k, v), kwargs = attention_dropout_case(torch.float64, large_tiles=large_tiles)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with ft.use_backend("cpu"):
        out, seed = seeded_call(lambda: ft.attention(*leaves, **kwargs))
    keep = cpu_ops().dropout_keep_mask(seed, (*q.shape[:3], k.shape[2]), kwargs["dropout_p"])
    assert 0.6 < keep.float().mean() < 0.8
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*ref_leaves, keep_mask=keep, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, ref_leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dropout_is_reproducible_with_manual_seed():
    (q, k, v), kwargs = attention_dropout_case(torch.float32)
    x = torch.randn(5, 13)
    with ft.use_backend("cpu"):
        for run in (lambda: ft.attention(q, k, v, **kwargs), lambda: ft.layer_norm(x, None, None, dropout_p=0.4),
                    lambda: ft.feed_forward(x, torch.randn(8, 13), None, torch.randn(3, 8), None, dropout_p=0.4)):
            first, _ = seeded_call(run, 7)
            again, _ = seeded_call(run, 7)
            other, _ = seeded_call(run, 8)
            assert torch.equal(first, again)
            assert not torch.equal(first, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_strided_inputs_without_copies_and_writes_heads_interleaved(dtype):
    """q/k/v as views of one fused projection (gaps between heads) and k/v broadcast over the batch give
    bitwise the results of contiguous copies; out and the gradients come back laid out as [B, L, H, D]."""
    g = torch.Generator().manual_seed(5)
    batch, length, heads, dim = 3, 11, 4, 16
    qkv = randn(batch, length, 3, heads, dim, generator=g).to(dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    k, v = k[:1].expand(batch, -1, -1, -1), v[:1].expand(batch, -1, -1, -1)
    assert not (q.is_contiguous() or k.is_contiguous())
    padding = torch.arange(length)[None, :] >= torch.tensor([[11], [7], [4]])
    grad_out = randn(batch, heads, length, dim, generator=g).to(dtype)

    def run(q, k, v):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with ft.use_backend("cpu"):
            out = ft.attention(*leaves, key_padding_mask=padding, is_causal=True, causal_alignment="bottom_right")
        out.backward(grad_out)
        return out, [t.grad for t in leaves]

    out, grads = run(q, k, v)
    expected_out, expected_grads = run(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(out, expected_out)
    assert out.transpose(1, 2).is_contiguous()
    for grad, expected in zip(grads, expected_grads):
        assert torch.equal(grad, expected)

    # Rows broadcast along the sequence (stride 0) are copied first: BLAS refuses a row stride below D.
    q_long, k_long = (randn(batch, heads, 70, dim, generator=g).to(dtype) for _ in range(2))
    v_rows = randn(batch, heads, 1, dim, generator=g).to(dtype).expand(-1, -1, 70, -1)
    with ft.use_backend("cpu"):
        out = ft.attention(q_long, k_long, v_rows, is_causal=True)
        assert torch.equal(out, ft.attention(q_long, k_long, v_rows.contiguous(), is_causal=True))
    torch.testing.assert_close(out, v_rows, rtol=1e-2, atol=1e-2)  # every row averages copies of one value


def test_ops_without_gradients_give_the_same_results_outside_autograd():
    g = torch.Generator().manual_seed(6)
    q, k, v = (randn(2, 4, 7, 16, generator=g).float() for _ in range(3))
    x, residual = randn(5, 32, generator=g).float(), randn(5, 32, generator=g).float()
    w1, w2 = randn(64, 32, generator=g).float(), randn(32, 64, generator=g).float()
    padding = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    runs = [
        lambda q, k, v, x, r: ft.attention(q, k, v, key_padding_mask=padding, is_causal=True, return_lse=True),
        lambda q, k, v, x, r: ft.layer_norm(x, None, None, residual=r, prenorm=True),
        lambda q, k, v, x, r: (ft.feed_forward(x, w1, None, w2, None, activation="relu"),),
    ]
    with ft.use_backend("cpu"):
        for run in runs:
            tracked = run(*(t.clone().requires_grad_() for t in (q, k, v, x, residual)))
            untracked = run(q, k, v, x, residual)
            assert all(t.grad_fn is not None for t in tracked[:1])
            assert all(t.grad_fn is None and not t.requires_grad for t in untracked)
            for a, b in zip(tracked, untracked):
                assert torch.equal(a.detach(), b)


def _spec(causal, bottom_right, window, dropout_p, scale=0.3):
    return contract.AttentionSpec(causal, "bottom_right" if bottom_right else "top_left",
                                  contract.window_of_bounds(*window), dropout_p, scale)


def test_attention_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = randn(1, 2, 5, 8, generator=g), randn(1, 1, 6, 8, generator=g), randn(1, 1, 6, 8, generator=g)
    bias = torch.randn(5, 6, dtype=torch.float64)
    padding = torch.tensor([[False, True, False, False, False, True]])  # a hole and a padded tail
    query_padding = torch.tensor([[False, False, True, False, True]])
    # is_causal, bottom_right (offset Lk - Lq = 1), window, query padding, dropout
    cases = ((False, False, (-1, -1), None, 0.0), (True, True, (-1, -1), None, 0.0), (True, False, (-1, -1), None, 0.4),
             (False, True, (1, 2), query_padding, 0.0), (True, True, (2, -1), query_padding, 0.3))
    for causal, bottom_right, window, q_padding, dropout_p in cases:
        def fn(q, k, v):
            torch.manual_seed(11)  # one dropout mask for every call gradcheck makes
            return AttentionFunction.apply(q, k, v, None, bias, padding, q_padding, None, contract.NO_SCORE_MODS,
                                           _spec(causal, bottom_right, window, dropout_p), "cpu")[0]

        assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v)])


def test_attention_varlen_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    q, k, v = randn(9, 2, 8, generator=g), randn(11, 1, 8, generator=g), randn(11, 1, 8, generator=g)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9], dtype=torch.int32), torch.tensor([0, 3, 5, 11], dtype=torch.int32)
    for causal, bottom_right, window, dropout_p in ((False, False, (-1, -1), 0.0), (True, True, (1, -1), 0.0),
                                                     (True, False, (-1, -1), 0.3), (False, True, (2, 1), 0.0)):
        def fn(q, k, v):
            torch.manual_seed(5)
            return AttentionVarlenFunction.apply(q, k, v, None, cu_q, cu_k, contract.NO_SCORE_MODS, 5, 6,
                                                 _spec(causal, bottom_right, window, dropout_p), "cpu")[0]

        assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v)])


def test_attention_weights_follow_the_forward_lse():
    g = torch.Generator().manual_seed(2)
    q, k, v = (randn(1, 2, 9, 16, generator=g).float() for _ in range(3))
    with ft.use_backend("cpu"):
        out, lse = ft.attention(q, k, v, is_causal=True, return_lse=True)
        weights = ft.attention_weights(q, k, lse, is_causal=True)
    torch.testing.assert_close(weights @ v, out, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ layer_norm

LAYER_NORM_OPTIONS = [dict(), dict(residual=True), dict(residual=True, prenorm=True),
                      dict(residual=True, prenorm=True, dropout_p=0.2), dict(dropout_p=0.2, no_affine=True)]


@pytest.mark.parametrize("options", LAYER_NORM_OPTIONS, ids=lambda o: "+".join(o) or "plain")
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("hidden", [1, 13, 768, 1000])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_layer_norm_matches_reference(dtype, hidden, rows, options):
    g = torch.Generator().manual_seed(hidden + rows)
    x, residual = randn(rows, hidden, generator=g), randn(rows, hidden, generator=g)
    weight, bias = 1 + randn(hidden, generator=g) / 4, randn(hidden, generator=g)
    dropout_p = options.get("dropout_p", 0.0)
    prenorm = options.get("prenorm", False)
    inputs = [x] + ([residual] if options.get("residual") else []) + ([] if options.get("no_affine") else [weight, bias])
    grad_out = randn(rows, hidden, generator=g)
    _, seed = seeded_call(lambda: None)
    keep = cpu_ops().dropout_keep_mask(seed, (rows, hidden), dropout_p)

    def unpack(args):
        x, rest = args[0], list(args[1:])
        residual = rest.pop(0) if options.get("residual") else None
        weight, bias = rest if rest else (None, None)
        return x, residual, weight, bias

    def ours(*args):
        x, residual, weight, bias = unpack(args)
        torch.manual_seed(1234)
        return ft.layer_norm(x, weight, bias, residual=residual, dropout_p=dropout_p, prenorm=prenorm)

    def ref(*args):
        x, residual, weight, bias = unpack(args)
        return reference.layer_norm(x, weight, bias, residual=residual, dropout_p=dropout_p, prenorm=prenorm,
                                    keep_mask=keep)

    names = ["y"] + (["z"] if prenorm else []) + [f"gradient of input {i}" for i in range(len(inputs))]
    compare_all(ours, ref, inputs, dtype, grad_out, names)


def test_layer_norm_gradcheck_float64_with_prenorm_output_used():
    g = torch.Generator().manual_seed(9)
    leaves = [randn(4, 6, generator=g), randn(6, generator=g), randn(6, generator=g), randn(4, 6, generator=g)]

    def fn(x, weight, bias, residual):
        torch.manual_seed(17)
        y, z = NormFunction.apply(x, weight, bias, residual, LayerNormSpec(1e-5, 0.3, True), "cpu")
        return y, z * 0.5

    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in leaves])


# ---------------------------------------------------------------------------------------- feed_forward


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_feed_forward_matches_reference(dtype, activation, dropout_p):
    g = torch.Generator().manual_seed(4)
    x = randn(3, 13, 64, generator=g)
    hidden = 203  # eight lanes at a time, and a tail of three
    w1, b1 = randn(hidden, 64, generator=g) / 8, randn(hidden, generator=g)
    w2, b2 = randn(48, hidden, generator=g) / 16, randn(48, generator=g)
    grad_out = randn(3, 13, 48, generator=g)
    _, seed = seeded_call(lambda: None)
    keep = cpu_ops().dropout_keep_mask(seed, (3, 13, hidden), dropout_p)

    def ours(*args):
        torch.manual_seed(1234)
        return ft.feed_forward(*args, activation=activation, dropout_p=dropout_p)

    def ref(*args):
        return reference.feed_forward(*args, activation=activation, dropout_p=dropout_p, keep_mask=keep)

    compare_all(ours, ref, [x, w1, b1, w2, b2], dtype, grad_out, ["out", "dx", "dw1", "db1", "dw2", "db2"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_feed_forward_relu_gradients_round_like_pytorch_in_16_bit(dtype):
    """The bias is added before the pre-activation is rounded to 16 bits: rounding first pushes values near 0
    across ReLU's kink (a few in 10^4 here), and their gradients flip between 0 and 1."""
    g = torch.Generator().manual_seed(11)
    x = randn(4, 37, 64, generator=g)
    w1, b1 = randn(256, 64, generator=g) / 8, randn(256, generator=g)
    w2, b2 = randn(64, 256, generator=g) / 16, randn(64, generator=g)
    grad_out = randn(4, 37, 64, generator=g)

    def ours(*args):
        return ft.feed_forward(*args, activation="relu")

    def ref(*args):
        return reference.feed_forward(*args, activation="relu")

    compare_all(ours, ref, [x, w1, b1, w2, b2], dtype, grad_out, ["out", "dx", "dw1", "db1", "dw2", "db2"])


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_gradcheck_float64(activation, dropout_p):
    """Both CPU paths: ATen's products and activation without dropout, the C++ bias-activation pass with it."""
    g = torch.Generator().manual_seed(6)
    leaves = [randn(5, 4, generator=g), randn(7, 4, generator=g), randn(7, generator=g), randn(3, 7, generator=g),
              randn(3, generator=g)]

    def fn(x, w1, b1, w2, b2):
        torch.manual_seed(23)
        return FeedForwardFunction.apply(x, w1, b1, w2, b2, FeedForwardSpec(activation, dropout_p), "cpu")

    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in leaves])


# ---------------------------------------------------------------------------------- operator plumbing


def test_ops_trace_under_torch_compile_and_show_in_the_profiler():
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))

    def block(q, k, v):  # with dropout: without it, layer_norm runs on ATen's kernel
        out = ft.attention(q, k, v, is_causal=True)
        return ft.layer_norm(out, None, None, residual=q, dropout_p=0.1)

    with ft.use_backend("cpu"):
        torch.manual_seed(0)
        eager = block(q, k, v)
        torch.manual_seed(0)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=False)(q, k, v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            block(q, k, v)
    torch.testing.assert_close(compiled, eager)
    names = {event.name for event in prof.events()}
    assert {"fused_transformer_cpu::attention_fwd", "fused_transformer_cpu::layer_norm_fwd"} <= names


def test_non_cpu_tensors_are_rejected_clearly():
    q = torch.empty(1, 1, 2, 4, device="meta")
    with pytest.raises(ValueError, match="q is on meta"):
        cpu_ops().attention_fwd(q, q, q, contract.AttentionMasks(), attention_contract.attention_spec(4, False, "top_left",
                                                                                            None, 0.0, None),
                                contract.NO_SCORE_MODS, None, None, False)


def test_auto_backend_uses_the_cpu_kernels_for_float32_and_the_reference_for_float64():
    assert backend.current("cpu", torch.float32) == "cpu"
    assert backend.current("cpu", torch.float64) == "reference"


@pytest.mark.parametrize("heads, kv_heads, masks", [
    (1, 1, dict(is_causal=True)),
    (4, 1, dict(key_padding_mask=torch.arange(300)[None, :] >= 170)),
])
def test_backward_with_fewer_heads_than_threads_splits_the_keys(heads, kv_heads, masks):
    """One (batch, kv head) is split into chunks of key blocks (one task would leave a thread idle and let BLAS
    thread every small block product): dq, summed over the chunks, dk and dv still match float64, bitwise
    repeatably."""
    g = torch.Generator().manual_seed(21)
    q, k, v = randn(1, heads, 200, 32, generator=g), randn(1, kv_heads, 300, 32, generator=g), randn(
        1, kv_heads, 300, 32, generator=g)
    grad_out = randn(1, heads, 200, 32, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ft.use_backend("cpu"):
            got = run_with_grads(ft.attention, [q, k, v], torch.float64, grad_out, **masks)
            again = run_with_grads(ft.attention, [q, k, v], torch.float64, grad_out, **masks)
    finally:
        torch.set_num_threads(threads)
    with ft.use_backend("reference"):
        expected = run_with_grads(ft.attention, [q, k, v], torch.float64, grad_out, **masks)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, again, expected):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("batch, kv_heads, k_len, threads, at_least", [
    (1, 1, 4096, 2, 4), (1, 1, 32768, 2, 4), (1, 1, 4096, 16, 32), (2, 1, 1000, 2, 4), (1, 1, 100, 2, 1),
    (8, 8, 4096, 2, 64),
])
def test_backward_plans_a_task_per_thread_at_least(batch, kv_heads, k_len, threads, at_least):
    """B1 H1 used to be one task: now the keys are split so that each thread gets two tasks where there are
    key blocks enough (128 keys a block), and heads alone serve when they suffice."""
    tasks = torch.ops.fused_transformer_cpu.attention_bwd_tasks(batch, kv_heads, k_len, threads)
    assert at_least <= tasks <= max(at_least, batch * kv_heads * -(-k_len // 128))
    if batch * kv_heads >= 2 * threads:
        assert tasks == batch * kv_heads


ISA_CALLS = """
import sys, torch, fused_transformer as ft
from fused_transformer import cpu_ops
torch.manual_seed(0)  # the dropout seeds
g = torch.Generator().manual_seed(11)
r = lambda *shape: torch.randn(*shape, generator=g)
q, k, v = r(2, 4, 37, 24), r(2, 2, 37, 24), r(2, 2, 37, 24)
cache = [r(2, 48, 2, 24) for _ in range(2)]
x, w1, w2 = r(9, 40), r(64, 40), r(40, 64)
def tiled(q, k, v, **options):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ft.attention(q, k, v, **options)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), r(*out.shape)))
with ft.use_backend("cpu"):
    results = [ft.attention(q, k, v, is_causal=True, softcap=5.0),
               # across the tiled kernels' 64-row blocks, 256-key blocks and register tiles' tails, with gradients
               # (the forward's tiles serve a right window from 512 keys)
               *tiled(r(1, 4, 150, 40), r(1, 2, 560, 40), r(1, 2, 560, 40), window=(90, 20), alibi_slopes=r(4).abs()),
               *tiled(r(1, 2, 130, 64), r(1, 2, 520, 64), r(1, 2, 520, 64)),
               ft.attention_with_kvcache(r(2, 1, 4, 24), *cache, cache_seqlens=torch.tensor([5, 30], dtype=torch.int32),
                                         k_new=r(2, 1, 2, 24), v_new=r(2, 1, 2, 24), softcap=4.0),
               ft.layer_norm(x, r(40), r(40), dropout_p=0.2),
               ft.feed_forward(x, w1, None, w2, None, activation="gelu", dropout_p=0.1)]
torch.save(results, sys.argv[1])
print(cpu_ops.cpu_capability())
"""


@pytest.mark.parametrize("capability, expected", [("avx512", "AVX512"), ("avx2", "AVX2"), ("default", "baseline")])
def test_every_instruction_set_runs_the_same_computation(capability, expected, tmp_path):
    """The float loops are compiled for AVX-512, AVX2 and the baseline ISA and follow ATen's capability
    (ATEN_CPU_CAPABILITY): each path runs (a lambda left out of line once crashed the AVX clones) and agrees with the
    others to float32 round-off (FMA or not)."""
    import subprocess
    import sys

    if capability == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU has no AVX-512")
    outputs = {}
    for name in (capability, "default"):
        path = tmp_path / f"{name}.pt"
        done = subprocess.run([sys.executable, "-c", ISA_CALLS, str(path)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "ATEN_CPU_CAPABILITY": name})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[name] = (done.stdout.strip(), torch.load(path))
    assert outputs[capability][0] == expected and outputs["default"][0] == "baseline"
    for mine, baseline in zip(outputs[capability][1], outputs["default"][1]):
        mine, baseline = (t[0] if isinstance(t, tuple) else t for t in (mine, baseline))
        torch.testing.assert_close(mine, baseline, rtol=1e-4, atol=2e-4)
