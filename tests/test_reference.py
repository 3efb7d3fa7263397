"""The pure-PyTorch reference: the oracle every kernel is checked against, so it is checked first, against
independent formulations (torch's SDPA math, F.layer_norm, nn.Linear) and with gradcheck in float64."""
import math

import pytest
import torch
import torch.nn.functional as F

from fused_transformer import reference


def rand(*shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def sdpa_math(q, k, v, bool_allowed=None, additive=None, scale=None):
    """Independent textbook attention: explicit exp / sum, masks as -inf."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    if additive is not None:
        s = s + additive
    if bool_allowed is not None:
        s = s.masked_fill(~bool_allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_matches_textbook_formula(lq, lk, kv_heads):
    q, k, v = rand(2, 4, lq, 16), rand(2, kv_heads, lk, 16), rand(2, kv_heads, lk, 16)
    torch.testing.assert_close(reference.attention(q, k, v), sdpa_math(q, k, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(reference.attention(q, k, v, scale=0.3), sdpa_math(q, k, v, scale=0.3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignment_matches_sdpa(alignment):
    q, k, v = rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8)
    offset = 0 if alignment == "top_left" else 6 - 4
    allowed = torch.ones(4, 6, dtype=torch.bool).tril(offset)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    out = reference.attention(q, k, v, is_causal=True, causal_alignment=alignment)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    if alignment == "top_left":
        # SDPA's own is_causal is top-left aligned.
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=1e-12)


def test_every_mask_kind_combined_matches_textbook_formula():
    b, h, lq, lk = 3, 2, 6, 7
    q, k, v = rand(b, h, lq, 8), rand(b, h, lk, 8), rand(b, h, lk, 8)
    padding = torch.rand(b, lk) < 0.3
    padding[:, 0] = False  # every row keeps key 0, which top-left causal leaves to every query
    bool_mask = torch.rand(b, 1, lq, lk) > 0.3
    bool_mask[..., 0] = True
    additive = torch.randn(lq, lk, dtype=torch.float64)
    allowed = ~padding[:, None, None, :] & torch.ones(lq, lk, dtype=torch.bool).tril() & bool_mask
    expected = sdpa_math(q, k, v, bool_allowed=allowed, additive=additive)
    out = reference.attention(q, k, v, attn_mask=bool_mask, key_padding_mask=padding, is_causal=True)
    # bool and float attn masks are separate calls: the contract takes one attn_mask.
    torch.testing.assert_close(out, sdpa_math(q, k, v, bool_allowed=allowed), rtol=0, atol=1e-12)
    merged = additive.masked_fill(~bool_mask, float("-inf"))
    out = reference.attention(q, k, v, attn_mask=merged, key_padding_mask=padding, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_fully_masked_rows_give_zeros_zero_grads_and_lse_minus_inf():
    q, k, v = rand(2, 2, 5, 8, requires_grad=True), rand(2, 2, 5, 8, requires_grad=True), rand(2, 2, 5, 8, requires_grad=True)
    allowed = torch.ones(5, 5, dtype=torch.bool)
    allowed[1] = False  # query 1 may attend to nothing
    out, lse = reference.attention(q, k, v, attn_mask=allowed, return_lse=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, [0, 2, 3, 4]]).all()
    (out * torch.randn_like(out)).sum().backward()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_lse_and_weights_are_the_softmax_statistics():
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    _, lse = reference.attention(q, k, v, key_padding_mask=padding, return_lse=True)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(padding[:, None, None, :], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-12)
    weights = reference.attention_weights(q, k, lse, key_padding_mask=padding)
    torch.testing.assert_close(weights, torch.softmax(scores, -1), rtol=0, atol=1e-12)


def test_dropout_keep_mask_is_replayed_exactly():
    q, k, v = rand(2, 2, 4, 8), rand(2, 2, 4, 8), rand(2, 2, 4, 8)
    keep = torch.rand(2, 2, 4, 4) > 0.25
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    expected = (probs * keep / 0.75) @ v
    torch.testing.assert_close(reference.attention(q, k, v, dropout_p=0.25, keep_mask=keep), expected, rtol=0, atol=1e-12)
    torch.manual_seed(3)
    a = reference.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(a, reference.attention(q, k, v, dropout_p=0.5))
    assert not torch.equal(a, reference.attention(q, k, v, dropout_p=0.5))


def test_attention_gradcheck_float64():
    q, k, v = (rand(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    padding = torch.tensor([[False, False, True]])
    bias = rand(3, 3)
    torch.autograd.gradcheck(
        lambda q, k, v: reference.attention(q, k, v, attn_mask=bias, key_padding_mask=padding, is_causal=True,
                                            causal_alignment="bottom_right"),
        (q, k, v),
    )
    kv = rand(1, 1, 3, 4, requires_grad=True), rand(1, 1, 3, 4, requires_grad=True)
    torch.autograd.gradcheck(lambda q, k, v: reference.attention(q, k, v), (q, *kv))


@pytest.mark.parametrize("n", [1, 13, 64])
def test_layer_norm_matches_torch(n):
    x, r, w, b = rand(3, 5, n), rand(3, 5, n), rand(n), rand(n)
    torch.testing.assert_close(reference.layer_norm(x, w, b), F.layer_norm(x, (n,), w, b), rtol=0, atol=1e-12)
    torch.testing.assert_close(reference.layer_norm(x, None, None, 1e-3), F.layer_norm(x, (n,), eps=1e-3), rtol=0, atol=1e-12)
    y, z = reference.layer_norm(x, w, b, residual=r, prenorm=True)
    torch.testing.assert_close(z, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, F.layer_norm(x + r, (n,), w, b), rtol=0, atol=1e-12)
    keep = torch.rand(3, 5, n) > 0.1
    y = reference.layer_norm(x, w, b, residual=r, dropout_p=0.1, keep_mask=keep)
    torch.testing.assert_close(y, F.layer_norm(x * keep / 0.9 + r, (n,), w, b), rtol=0, atol=1e-12)


def test_layer_norm_low_precision_keeps_float32_statistics():
    x = torch.randn(4, 256, dtype=torch.bfloat16) * 30 + 100  # large mean: bf16 statistics would lose it
    w, b = torch.randn(256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16)
    out = reference.layer_norm(x, w, b)
    assert out.dtype == torch.bfloat16
    expected = F.layer_norm(x.double(), (256,), w.double(), b.double())
    assert (out.double() - expected).abs().max() < 0.1


def test_layer_norm_and_feed_forward_gradcheck_float64():
    x, r = rand(2, 3, 6, requires_grad=True), rand(2, 3, 6, requires_grad=True)
    w, b = rand(6, requires_grad=True), rand(6, requires_grad=True)
    torch.autograd.gradcheck(lambda x, r, w, b: reference.layer_norm(x, w, b, residual=r, prenorm=True), (x, r, w, b))
    w1, b1, w2, b2 = rand(10, 6, requires_grad=True), rand(10, requires_grad=True), rand(4, 10, requires_grad=True), rand(4, requires_grad=True)
    for activation in ("gelu", "gelu_tanh"):  # relu's kink makes finite differences unreliable
        torch.autograd.gradcheck(
            lambda x, w1, b1, w2, b2: reference.feed_forward(x, w1, b1, w2, b2, activation=activation),
            (x, w1, b1, w2, b2),
        )


@pytest.mark.parametrize("activation,module", [("relu", torch.nn.ReLU()), ("gelu", torch.nn.GELU()),
                                                ("gelu_tanh", torch.nn.GELU(approximate="tanh"))])
def test_feed_forward_matches_linear_stack(activation, module):
    lin1, lin2 = torch.nn.Linear(12, 30).double(), torch.nn.Linear(30, 7).double()
    x = rand(4, 5, 12)
    expected = lin2(module(lin1(x)))
    out = reference.feed_forward(x, lin1.weight, lin1.bias, lin2.weight, lin2.bias, activation=activation)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    keep = torch.rand(4, 5, 30) > 0.2
    out = reference.feed_forward(x, lin1.weight, None, lin2.weight, None, activation=activation, dropout_p=0.2, keep_mask=keep)
    expected = F.linear(module(F.linear(x, lin1.weight)) * keep / 0.8, lin2.weight)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
