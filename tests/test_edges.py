"""Edges where every backend must do what torch does (issue 18): empty sizes (head_dim, Lq, Lk, the normalised
dim, zero rows), float16 scores past float16's range, and NaN, which ReLU and attention propagate as torch does
while rows that masks leave without a key keep giving zeros. Each case is compared with torch's own result in
float64 (SDPA's math backend, F.layer_norm, F.linear / F.relu), NaN positions included."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_transformer as ft
from fused_transformer import backend

# (backend, dtype) pairs: the Triton kernels take no float64, the others are held to it as well.
CASES = [
    ("reference", torch.float64), ("reference", torch.float32),
    ("cpu", torch.float64), ("cpu", torch.float32),
    ("triton", torch.float32),
]
CASE_IDS = [f"{name}-{str(dtype).split('.')[-1]}" for name, dtype in CASES]
TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=2e-5),
              torch.float16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(autouse=True)
def _seeded():
    """Random inputs, the same on every run."""
    torch.manual_seed(18)


def device_for(name: str) -> str:
    """Where backend ``name`` runs its tests; skips, with the reason, when it cannot run here."""
    reason = {"cpu": backend.cpu_unavailable_reason(), "triton": backend.triton_unavailable_reason()}.get(name)
    if reason is not None:
        pytest.skip(reason)
    return "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    """(backend name, dtype, device)."""
    name, dtype = request.param
    return name, dtype, device_for(name)


def assert_matches_torch(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``ours`` (in ``dtype``) equals torch's float64 ``expected`` to ``dtype``'s round-off, NaN where it is NaN."""
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype}, expected {dtype}"
    assert ours.shape == expected.shape, f"{what}: shape {tuple(ours.shape)}, torch's {tuple(expected.shape)}"
    torch.testing.assert_close(ours.detach().cpu().double(), expected.detach().cpu().double(), equal_nan=True,
                               msg=lambda m: f"{what}: {m}", **TOLERANCES[dtype])


def outputs_and_grads(fn, inputs, grad_outs, dtype, device):
    """``fn(*inputs)`` with the inputs as fresh leaves in ``dtype`` on ``device``, and their gradients for
    ``grad_outs`` (one per leading output)."""
    leaves = [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs[:len(grad_outs)], leaves,
                                [g.to(device=device, dtype=o.dtype) for o, g in zip(outs, grad_outs)])
    return [o.detach() for o in outs], list(grads)


def torch_attention(q, k, v, attn_mask=None, scale=None):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def torch_scores(q, k, attn_mask=None):
    """The scaled scores plus the float mask (for an empty head dim the scores are 0, whatever the scale)."""
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    return scores if attn_mask is None else scores + attn_mask


def check_attention(case, q, k, v, attn_mask=None):
    """Output, LSE and the gradients of q, k, v against torch's, for a random output gradient."""
    name, dtype, device = case
    grad_out = torch.randn(q.shape[:3] + v.shape[-1:], dtype=torch.float64)
    mask = attn_mask.to(device=device, dtype=dtype) if attn_mask is not None else None
    with ft.use_backend(name):
        (out, lse), grads = outputs_and_grads(
            lambda q, k, v: ft.attention(q, k, v, attn_mask=mask, return_lse=True), [q, k, v], [grad_out],
            dtype, device)
        weights = ft.attention_weights(*(t.to(device=device, dtype=dtype) for t in (q, k)), lse, attn_mask=mask)
    (expected,), expected_grads = outputs_and_grads(
        lambda q, k, v: torch_attention(q, k, v, attn_mask), [q, k, v], [grad_out], torch.float64, "cpu")
    assert_matches_torch(out, expected, dtype, "out")
    scores = torch_scores(q.double(), k.double(), attn_mask)
    expected_lse = torch.logsumexp(scores, dim=-1)
    assert lse.shape == expected_lse.shape
    torch.testing.assert_close(lse.cpu().double(), expected_lse, equal_nan=True, **TOLERANCES[dtype])
    # The softmax of SDPA's math backend: zeros for a row with every score -inf.
    assert_matches_torch(weights, torch.ops.aten._safe_softmax(scores, -1), dtype, "attention_weights")
    for what, grad, expected_grad in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_matches_torch(grad, expected_grad, dtype, what)


# ----------------------------------------------------------------------------------------- empty sizes


def test_attention_head_dim_zero(case):
    """torch: an empty output and empty gradients. The scores are all 0, so the LSE and the weights follow
    the float mask alone: no 1 / sqrt(0) anywhere."""
    q, k, v = torch.randn(2, 3, 5, 0), torch.randn(2, 3, 7, 0), torch.randn(2, 3, 7, 0)
    check_attention(case, q, k, v, attn_mask=torch.randn(5, 7, dtype=torch.float64))


@pytest.mark.parametrize("lq,lk", [(0, 6), (5, 0), (0, 0)])
def test_attention_empty_sequences(case, lq, lk):
    """torch: Lq = 0 gives an empty output and zero dk, dv; Lk = 0 gives zeros and zero dq (LSE -inf)."""
    q, k, v = torch.randn(2, 3, lq, 8), torch.randn(2, 3, lk, 8), torch.randn(2, 3, lk, 8)
    check_attention(case, q, k, v)


@pytest.mark.parametrize("shape", [(3, 0), (2, 0, 5), (0, 5), (0, 0), (0,)])
@pytest.mark.parametrize("prenorm", [False, True])
def test_layer_norm_empty_dims(case, shape, prenorm):
    """torch: empty y and gradients; with no rows the weight and bias gradients are zeros."""
    name, dtype, device = case
    n = shape[-1]
    x, residual, weight, bias = torch.randn(shape), torch.randn(shape), torch.randn(n), torch.randn(n)
    grad_y = torch.randn(shape, dtype=torch.float64)

    def ours(x, residual, weight, bias):
        out = ft.layer_norm(x, weight, bias, residual=residual, prenorm=prenorm)
        return out[0] if prenorm else out

    with ft.use_backend(name):
        (y,), grads = outputs_and_grads(ours, [x, residual, weight, bias], [grad_y], dtype, device)
    (expected,), expected_grads = outputs_and_grads(
        lambda x, residual, weight, bias: F.layer_norm(x + residual, (n,), weight, bias),
        [x, residual, weight, bias], [grad_y], torch.float64, "cpu")
    assert_matches_torch(y, expected, dtype, "y")
    for what, grad, expected_grad in zip(("dx", "dresidual", "dweight", "dbias"), grads, expected_grads):
        assert_matches_torch(grad, expected_grad, dtype, what)


@pytest.mark.parametrize("tokens,d_model,d_ff,d_out", [(0, 6, 10, 4), (5, 0, 10, 4), (5, 6, 0, 4), (5, 6, 10, 0)])
def test_feed_forward_empty_dims(case, tokens, d_model, d_ff, d_out):
    """torch's F.linear handles every empty size: an empty input dim gives the bias, empty grads elsewhere."""
    name, dtype, device = case
    inputs = [torch.randn(2, tokens, d_model), torch.randn(d_ff, d_model), torch.randn(d_ff), torch.randn(d_out, d_ff),
              torch.randn(d_out)]
    grad_y = torch.randn(2, tokens, d_out, dtype=torch.float64)
    with ft.use_backend(name):
        (y,), grads = outputs_and_grads(
            lambda *a: ft.feed_forward(*a, activation="relu"), inputs, [grad_y], dtype, device)
    (expected,), expected_grads = outputs_and_grads(
        lambda x, w1, b1, w2, b2: F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), inputs, [grad_y], torch.float64,
        "cpu")
    assert_matches_torch(y, expected, dtype, "y")
    for what, grad, expected_grad in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, expected_grads):
        assert_matches_torch(grad, expected_grad, dtype, what)


# ------------------------------------------------------------------------------------------------- NaN


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_propagates_nan_like_torch(case, activation):
    """torch.relu(NaN) is NaN and its gradient there is the incoming one (threshold_backward keeps the gradient
    where not output <= 0): token 1's pre-activations are all NaN, so its output is NaN while its dx is not."""
    name, dtype, device = case
    x = torch.randn(3, 4, 6)
    x[0, 1, 2] = float("nan")
    d_ff = 19  # two full 8-lane vectors and a tail in the C++ kernel
    inputs = [x, torch.randn(d_ff, 6), torch.randn(d_ff), torch.randn(5, d_ff), torch.randn(5)]
    grad_y = torch.randn(3, 4, 5, dtype=torch.float64)
    torch_activation = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}
    with ft.use_backend(name):
        (y,), grads = outputs_and_grads(
            lambda *a: ft.feed_forward(*a, activation=activation), inputs, [grad_y], dtype, device)
    (expected,), expected_grads = outputs_and_grads(
        lambda x, w1, b1, w2, b2: F.linear(torch_activation[activation](F.linear(x, w1, b1)), w2, b2),
        inputs, [grad_y], torch.float64, "cpu")
    assert torch.isnan(expected[0, 1]).all() and torch.isfinite(expected[0, 0]).all()
    if activation == "relu":
        assert torch.isfinite(expected_grads[0][0, 1]).all()
    assert_matches_torch(y, expected, dtype, "y")
    for what, grad, expected_grad in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, expected_grads):
        assert_matches_torch(grad, expected_grad, dtype, what)


def test_attention_nan_scores_give_nan_rows_and_masked_rows_zeros(case):
    """torch (SDPA, math backend): a row with a NaN score is NaN in the output and in every gradient it
    reaches; a row whose keys are all masked by -inf gives zeros and zero gradients. 130 keys put the NaNs
    in the C++ kernel's first key block (its vector loop) and in the second one (its tail)."""
    lq, lk = 6, 130
    q, k, v = torch.randn(2, 2, lq, 16), torch.randn(2, 2, lk, 16), torch.randn(2, 2, lk, 16)
    mask = torch.randn(2, 2, lq, lk, dtype=torch.float64)
    mask[0, 0, 1] = float("nan")  # a whole row
    mask[1, 0, 2, 3] = float("nan")  # one key of the first block
    mask[1, 0, 4, 129] = float("nan")  # one key of the second block
    mask[1, 1, 0] = float("-inf")  # fully masked: zeros, not NaN
    check_attention(case, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_kind", ["bool", "padding", "causal"])
def test_attention_nan_at_a_masked_key_stays_hidden(case, mask_kind):
    """A key that a bool mask, padding or the causal mask hides is out of the softmax whatever its score: a NaN
    there does not reach the row (the kernels do not even read padded or causally hidden key blocks). Here we
    differ from torch on purpose: SDPA's math backend adds its masks, and NaN + -inf is NaN. So the result to
    match is torch's with that key's score finite."""
    name, dtype, device = case
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    keep = torch.rand(4, 9) < 0.7
    keep[:, 0] = True
    keep[:, 8] = False  # key 8 is hidden from every query by each kind of mask
    ours, torch_mask = {
        "bool": (dict(attn_mask=keep), keep),
        "padding": (dict(key_padding_mask=~keep[:2]), keep[:2, None, None, :]),
        "causal": (dict(is_causal=True), torch.ones(4, 9, dtype=torch.bool).tril()),
    }[mask_kind]
    expected = torch_attention(q.double(), k.double(), v.double(), torch_mask)
    k[:, :, 8, 3] = float("nan")
    with ft.use_backend(name):
        out = ft.attention(*(t.to(device=device, dtype=dtype) for t in (q, k, v)),
                           **{key: m.to(device) if torch.is_tensor(m) else m for key, m in ours.items()})
    assert torch.isfinite(out).all()
    assert_matches_torch(out, expected, dtype, "out")


def test_attention_nan_at_a_float_masked_key_is_nan_as_in_torch(case):
    """A float mask is added to the scores as torch adds it, so -inf does not hide a NaN score (NaN + -inf is
    NaN): every row that sees the NaN key's column is NaN, on every backend as in torch."""
    name, dtype, device = case
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.randn(4, 9, dtype=torch.float64)
    mask[:, 8] = float("-inf")
    k[0, :, 8, 3] = float("nan")  # batch 0 only: batch 1 stays finite
    expected = torch_attention(q.double(), k.double(), v.double(), mask)
    assert torch.isnan(expected[0]).all() and torch.isfinite(expected[1]).all()
    with ft.use_backend(name):
        out = ft.attention(*(t.to(device=device, dtype=dtype) for t in (q, k, v)), attn_mask=mask.to(device, dtype))
    assert_matches_torch(out, expected, dtype, "out")


# ------------------------------------------------------------------------------------- float16 range


@pytest.mark.parametrize("name", ["reference", "cpu", "triton"])
def test_attention_float16_scores_past_the_float16_range(name):
    """Scores of about 2.5e4 (q·k about 1e5 before the scale, past float16's 65504): torch's float16 SDPA stays
    finite, and so does every backend, the reference included (its scores are computed in float32)."""
    direction = torch.randn(16)
    direction = 4 * direction / direction.norm()  # q and k near 80 * direction: q·k near 6400 * 16
    q = (80 * (direction + 0.1 * torch.randn(1, 2, 5, 16))).half()
    k = (80 * (direction + 0.1 * torch.randn(1, 2, 7, 16))).half()
    v = torch.randn(1, 2, 7, 16).half()
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > 65504  # float16 q @ k^T would overflow
    assert torch.isfinite(F.scaled_dot_product_attention(q, k, v)).all()
    device = device_for(name)
    with ft.use_backend(name):
        out = ft.attention(q.to(device), k.to(device), v.to(device))
    assert torch.isfinite(out).all()
    assert_matches_torch(out, torch_attention(q.double(), k.double(), v.double()), torch.float16, "out")
