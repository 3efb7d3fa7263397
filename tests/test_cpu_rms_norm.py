"""The C++ CPU norm kernels with rms_norm=True (RMSNorm: the ops ``fused_transformer_cpu::layer_norm_fwd`` /
``layer_norm_bwd`` that LayerNorm and RMSNorm share), called on rows ``[rows, N]`` directly, against a float64
pure-PyTorch RMSNorm differentiated by autograd: forward and every gradient, with the 2x rule in float32 / bfloat16 /
float16, to round-off in float64; dropout through the replayed keep-mask.

Skipped, with the reason, when the extension is not built, unless FUSED_TRANSFORMER_REQUIRE_CPU=1 (CI), where
its absence fails loudly."""
import os

import pytest
import torch

from fused_transformer import backend
from numerics import assert_close_to_reference

UNAVAILABLE = backend.cpu_unavailable_reason()
REQUIRED = os.environ.get("FUSED_TRANSFORMER_REQUIRE_CPU") == "1"
if UNAVAILABLE is not None and not REQUIRED:
    pytest.skip(f"cpu backend unavailable: {UNAVAILABLE}", allow_module_level=True)

EPS = 1e-5
OPTIONS = [dict(weight=w, bias=b, residual=r, dropout_p=p)
           for w in (False, True) for b in (False, True) for r in (False, True) for p in (0.0, 0.1)]


def option_id(options):
    return "+".join(k if v is True else f"p{v}" for k, v in options.items() if v) or "plain"


def ops():
    from fused_transformer import cpu_ops  # noqa: F401  (loads fused_transformer._C)

    return torch.ops.fused_transformer_cpu


def keep_mask(seed, shape, dropout_p):
    from fused_transformer import cpu_ops

    return cpu_ops.dropout_keep_mask(seed, shape, dropout_p)


def reference(x, residual, weight, bias, keep, dropout_p):
    """y, z of RMSNorm in x's dtype, PyTorch only: z = dropout(x) + residual, y = z * rsqrt(mean(z^2) + eps) * w + b.
    As fused_transformer.reference does, z is in x's dtype and the rest in float32 (float64 for float64): in float16
    the float16 derivative of rsqrt overflows (to NaN) on a row of zeros, which dropout makes of a one-feature row."""
    z = x * keep / (1 - dropout_p) if dropout_p > 0 else x
    if residual is not None:
        z = z + residual
    zs = z.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    y = zs * torch.rsqrt(zs.square().mean(-1, keepdim=True) + EPS)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), z


def reference_with_grads(inputs, dtype, dy, dz, keep, dropout_p):
    """[y, z, dx, dresidual, dweight, dbias] (absent inputs left out) of the reference run in dtype."""
    leaves = {k: v.to(dtype).requires_grad_() for k, v in inputs.items() if v is not None}
    y, z = reference(leaves["x"], leaves.get("residual"), leaves.get("weight"), leaves.get("bias"), keep, dropout_p)
    outputs, grads = (y, z), (dy.to(dtype), None if dz is None else dz.to(dtype))
    if dz is None:
        outputs, grads = (y,), grads[:1]
    gradients = torch.autograd.grad(outputs, list(leaves.values()), grads)
    return [y.detach(), z.detach()] + list(gradients)


def kernel_with_grads(inputs, dtype, dy, dz, seed, dropout_p):
    """The same list from the C++ kernels: forward, then backward from the forward's own z, mean and rstd."""
    x, residual, weight, bias = (None if inputs[k] is None else inputs[k].to(dtype)
                                 for k in ("x", "residual", "weight", "bias"))
    store_z = residual is not None or dropout_p > 0
    y, z, mean, rstd = ops().layer_norm_fwd(x, weight, bias, residual, EPS, dropout_p, seed, store_z, rms_norm=True)
    assert mean.shape == (0,) and mean.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rstd.shape == (x.shape[0],) and rstd.dtype == mean.dtype
    z = z if store_z else x
    dx, dresidual, dweight, dbias = ops().layer_norm_bwd(
        dy.to(dtype), None if dz is None else dz.to(dtype), z, weight, bias, mean, rstd, dropout_p, seed,
        residual is not None, rms_norm=True)
    present = [t for t, name in ((dresidual, "residual"), (dweight, "weight"), (dbias, "bias"))
               if inputs[name] is not None]
    return [y, z, dx] + present


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("hidden", [1, 33, 256])
@pytest.mark.parametrize("rows", [1, 7, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_matches_reference(dtype, rows, hidden, options):
    g = torch.Generator().manual_seed(1000 * rows + hidden)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    inputs = dict(x=randn(rows, hidden), residual=randn(rows, hidden) if options["residual"] else None,
                  weight=1 + randn(hidden) / 4 if options["weight"] else None,
                  bias=randn(hidden) if options["bias"] else None)
    dy = randn(rows, hidden)
    # The returned z (pre-norm residual stream) gets a gradient of its own when there is a residual.
    dz = randn(rows, hidden) if options["residual"] else None
    dropout_p = options["dropout_p"]
    seed = torch.randint(0, 2**62, (1,), generator=g, dtype=torch.int64) if dropout_p > 0 else None
    keep = keep_mask(seed, (rows, hidden), dropout_p) if dropout_p > 0 else None

    ours = kernel_with_grads(inputs, dtype, dy, dz, seed, dropout_p)
    ref64 = reference_with_grads(inputs, torch.float64, dy, dz, keep, dropout_p)
    baseline = reference_with_grads(inputs, dtype, dy, dz, keep, dropout_p)
    names = ["y", "z", "dx"] + [f"d{k}" for k in ("residual", "weight", "bias") if inputs[k] is not None]
    assert len(ours) == len(ref64) == len(names)
    for out, r, b, name in zip(ours, ref64, baseline, names):
        assert out.dtype == dtype, name
        assert_close_to_reference(out, r, b, name)


def test_rms_norm_backward_ignores_mean_and_is_deterministic():
    g = torch.Generator().manual_seed(5)
    rows, hidden = 300, 96
    x, residual, dy = (torch.randn(rows, hidden, generator=g) for _ in range(3))
    weight, bias = 1 + torch.randn(hidden, generator=g) / 4, torch.randn(hidden, generator=g)
    seed = torch.tensor([123], dtype=torch.int64)
    _, z, mean, rstd = ops().layer_norm_fwd(x, weight, bias, residual, EPS, 0.1, seed, True, rms_norm=True)

    def backward(mean, threads):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return ops().layer_norm_bwd(dy, None, z, weight, bias, mean, rstd, 0.1, seed, True, rms_norm=True)
        finally:
            torch.set_num_threads(saved)

    first = backward(mean, 1)
    for grads in (backward(torch.full((rows,), float("nan")), 1), backward(mean, 2), backward(mean, 1)):
        for a, b in zip(first, grads):
            assert torch.equal(a, b)


def test_rms_norm_checks_name_the_op():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="rms_norm: weight must be"):
        ops().layer_norm_fwd(x, torch.ones(4), None, None, EPS, 0.0, None, False, rms_norm=True)
    with pytest.raises(ValueError, match="layer_norm: weight must be"):
        ops().layer_norm_fwd(x, torch.ones(4), None, None, EPS, 0.0, None, False)
