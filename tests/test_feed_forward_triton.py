"""Triton feed-forward against the float64 reference: output and the gradients of x, w1, b1, w2, b2.

Runs on CUDA when present, else on CPU tensors under the Triton interpreter (set up in conftest.py).
"""
import pytest
import torch

from fused_transformer import backend, functional, reference
from fused_transformer.kernels import feed_forward as triton_ffn
from tests.kernel_checks import DTYPES, check_against_reference, replayed_keep_mask
from tests.numerics import DEVICE, assert_close_to_reference

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

ACTIVATIONS = triton_ffn.ACTIVATIONS


def _random_inputs(lead, d_model, d_ff, d_out, dtype, *, b1=True, b2=True):
    # Scaled like nn.Linear's init, so activations stay O(1) and the low-precision baselines are meaningful.
    return {
        "x": torch.randn(*lead, d_model, device=DEVICE, dtype=dtype),
        "w1": torch.randn(d_ff, d_model, device=DEVICE, dtype=dtype) / d_model**0.5,
        "b1": torch.randn(d_ff, device=DEVICE, dtype=dtype) if b1 else None,
        "w2": torch.randn(d_out, d_ff, device=DEVICE, dtype=dtype) / d_ff**0.5,
        "b2": torch.randn(d_out, device=DEVICE, dtype=dtype) if b2 else None,
    }


def _check(inputs, *, activation, dropout_p=0.0, recompute=False, via_functional=False):
    """Kernel (dropout seeded by torch.manual_seed(7)) vs the reference replaying the kernel's keep-mask."""
    x, w1 = inputs["x"], inputs["w1"]
    tokens, d_ff = x.numel() // x.shape[-1], w1.shape[0]
    keep = None
    if dropout_p > 0:
        keep = replayed_keep_mask(7, tokens, d_ff, dropout_p, x.device, quads=True).reshape(*x.shape[:-1], d_ff)
    out_grads = [torch.randn(*x.shape[:-1], inputs["w2"].shape[0], device=DEVICE)]

    def kernel_fn(x, w1, b1, w2, b2):
        torch.manual_seed(7)
        if via_functional:
            with backend.use_backend("triton"):
                return functional.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p)
        return triton_ffn.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p,
                                       recompute=recompute)

    def reference_fn(x, w1, b1, w2, b2):
        return reference.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, keep_mask=keep)

    check_against_reference(kernel_fn, reference_fn, inputs, out_grads)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("d_model, d_ff", [(13, 37), (64, 96), (1, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feed_forward_matches_reference(dtype, d_model, d_ff, activation):
    torch.manual_seed(d_model * d_ff)
    _check(_random_inputs((37,), d_model, d_ff, d_model, dtype), activation=activation)


VARIANTS = {
    # name: (leading dims, biases (b1, b2), dropout_p, recompute, activation)
    "one_token": ((1,), (True, True), 0.0, False, "gelu"),
    "batch_seq": ((2, 5), (True, True), 0.0, False, "relu"),
    "no_bias": ((37,), (False, False), 0.0, False, "gelu_tanh"),
    "b1_only_recompute": ((37,), (True, False), 0.0, True, "gelu"),
    "dropout": ((37,), (True, True), 0.3, False, "gelu"),
    "dropout_recompute": ((3, 7), (False, True), 0.3, True, "relu"),
    "dropout_one_token": ((1,), (True, True), 0.5, False, "gelu_tanh"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_feed_forward_variants(dtype, variant):
    lead, (b1, b2), dropout_p, recompute, activation = VARIANTS[variant]
    torch.manual_seed(len(variant))
    inputs = _random_inputs(lead, 13, 37, 21, dtype, b1=b1, b2=b2)  # d_out != d_model
    _check(inputs, activation=activation, dropout_p=dropout_p, recompute=recompute)


@pytest.fixture
def small_blocks(monkeypatch):
    """64-element blocks of the activation pass: many programs, a partial last one (37 x 50 is 1850 elements)."""
    monkeypatch.setattr(triton_ffn, "BLOCK", 64)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d_ff", [50, 48])  # dropout: a Philox call per element, and per four (whole groups a row)
def test_feed_forward_many_blocks(small_blocks, dtype, recompute, d_ff):
    torch.manual_seed(11)
    inputs = _random_inputs((37,), 40, d_ff, 33, dtype)
    _check(inputs, activation="gelu", dropout_p=0.25, recompute=recompute)


def test_dropout_is_reproducible_from_torch_seed():
    inputs = _random_inputs((37,), 13, 64, 13, torch.float32)

    def run(seed):
        torch.manual_seed(seed)
        return triton_ffn.feed_forward(**inputs, dropout_p=0.5)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    keep = replayed_keep_mask(1, 37, 64, 0.5, DEVICE, quads=True)
    assert 0.4 < keep.float().mean().item() < 0.6


def test_recompute_gives_the_same_gradients_bit_for_bit():
    torch.manual_seed(0)
    inputs = _random_inputs((37,), 13, 37, 13, torch.bfloat16)
    grads = []
    for recompute in (False, True):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        torch.manual_seed(5)
        triton_ffn.feed_forward(**leaves, dropout_p=0.2, recompute=recompute).sum().backward()
        grads.append([leaves[k].grad for k in sorted(leaves)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["strided_rows", "transposed"])
def test_non_contiguous_x(layout):
    torch.manual_seed(1)
    inputs = _random_inputs((37,), 13, 37, 13, torch.float32)
    if layout == "strided_rows":
        x = torch.randn(37, 20, device=DEVICE)[:, 3:16]  # rows 20 apart, last dim contiguous
    else:
        x = torch.randn(13, 37, device=DEVICE).t()  # last dim not contiguous: copied
    expected = reference.feed_forward(x.double(), *(t.double() for t in list(inputs.values())[1:]))
    baseline = reference.feed_forward(x, *list(inputs.values())[1:])
    out = triton_ffn.feed_forward(x, *list(inputs.values())[1:])
    assert_close_to_reference(out, expected, baseline)


def test_through_functional_with_triton_backend():
    torch.manual_seed(2)
    _check(_random_inputs((2, 3), 13, 37, 13, torch.bfloat16), activation="gelu", dropout_p=0.1,
           via_functional=True)


def test_float64_is_rejected():
    inputs = _random_inputs((4,), 8, 8, 8, torch.float64)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        triton_ffn.feed_forward(**inputs)


def test_custom_ops_pass_opcheck():
    torch.manual_seed(0)
    inputs = _random_inputs((5,), 8, 24, 8, torch.float32)
    x, w1, b1, w2, b2 = inputs.values()
    seed = torch.tensor([123], device=x.device)
    args = (x, w1, b1, w2, b2, "gelu", 0.1, seed, True, False)
    torch.library.opcheck(torch.ops.fused_transformer.feed_forward_fwd, args)
    y, pre = torch.ops.fused_transformer.feed_forward_fwd(*args)
    bwd = torch.ops.fused_transformer.feed_forward_bwd
    torch.library.opcheck(bwd, (torch.randn_like(y), x, w1, b1, w2, pre, True, "gelu", 0.1, seed, False))
    torch.library.opcheck(bwd, (torch.randn_like(y), x, w1, None, w2, None, False, "relu", 0.0, None, False))


def test_the_four_lanes_of_a_philox_call_drop_independently():
    """The LayerNorm / feed-forward stream takes four numbers a Philox call: each lane keeps 1 - p of its elements,
    and the lanes of one call are not tied (all four kept as often as (1 - p)^4 says); rows of a width that is not a
    multiple of 4 start groups of their own."""
    keep = replayed_keep_mask(3, 512, 64, 0.5, DEVICE, quads=True).view(512, 16, 4).float()
    for lane in range(4):
        assert 0.47 < keep[..., lane].mean().item() < 0.53
    assert 0.05 < keep.prod(-1).mean().item() < 0.075
    assert torch.corrcoef(keep.reshape(-1, 4).t())[0, 1:].abs().max().item() < 0.05  # 1 / sqrt(8192) = 0.011
    odd = replayed_keep_mask(3, 4, 6, 0.5, DEVICE, quads=True)
    quads = replayed_keep_mask(3, 4, 8, 0.5, DEVICE, quads=True)  # cdiv(6, 4) = 2 groups a row, as with 8 columns
    assert torch.equal(odd, quads[:, :6])
