"""``ft.rms_norm`` and ``ft.RMSNorm``: forward and every gradient against the float64 reference (the 2x rule), on
the Triton kernels (a GPU, or the interpreter) and the C++ ones, with residual, dropout and prenorm; torch.nn's
RMSNorm swapped by ``fuse`` with its state_dict; torch.compile without a graph break; bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_transformer as ft
from fused_transformer import backend, contract, cpu_ops
from fused_transformer.ops import rms_norm as op
from tests.kernel_checks import DTYPES, check_against_reference, replayed_keep_mask
from tests.numerics import DEVICE

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

EPS = 1e-6
CASES = {  # name: (residual, prenorm, dropout_p, weight)
    "weight": (False, False, 0.0, True),
    "no_weight": (False, False, 0.0, False),
    "residual_prenorm": (True, True, 0.0, True),
    "residual_dropout": (True, False, 0.3, True),
    "residual_dropout_prenorm": (True, True, 0.3, False),
}


def _backends():
    found = []
    if backend.triton_unavailable_reason() is None:
        found.append("triton")
    if DEVICE == "cpu" and backend.cpu_unavailable_reason() is None:
        found.append("cpu")
    return found


def _keep_mask(name, x, dropout_p):
    """The keep-mask the op draws for its dropout after ``torch.manual_seed(7)``, on backend ``name``."""
    n = x.shape[-1]
    if name == "triton":
        return replayed_keep_mask(7, x.numel() // n, n, dropout_p, x.device).reshape(x.shape)
    torch.manual_seed(7)
    return cpu_ops.dropout_keep_mask(contract.draw_dropout_seed(x.device), x.shape, dropout_p)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", [(37, 13), (2, 9, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _backends())
def test_rms_norm_matches_reference(name, dtype, shape, case):
    residual, prenorm, dropout_p, weight = CASES[case]
    torch.manual_seed(sum(shape))
    n = shape[-1]
    inputs = {"x": torch.randn(shape, device=DEVICE, dtype=dtype),
              "weight": 1.0 + 0.5 * torch.randn(n, device=DEVICE, dtype=dtype) if weight else None,
              "residual": torch.randn(shape, device=DEVICE, dtype=dtype) if residual else None}
    keep = _keep_mask(name, inputs["x"], dropout_p) if dropout_p > 0 else None
    out_grads = [torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2 if prenorm else 1)]

    def ours(x, weight, residual):
        torch.manual_seed(7)
        with ft.use_backend(name):
            return ft.rms_norm(x, weight, EPS, residual=residual, dropout_p=dropout_p, prenorm=prenorm)

    def oracle(x, weight, residual):
        return ft.reference.rms_norm(x, weight, EPS, residual=residual, dropout_p=dropout_p, prenorm=prenorm,
                                     keep_mask=keep)

    check_against_reference(ours, oracle, inputs, out_grads)


def test_eps_none_is_the_dtypes_eps_as_in_torch():
    x, weight = torch.randn(5, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    with ft.use_backend("reference"):
        ours = ft.rms_norm(x, weight)
    torch.testing.assert_close(ours, F.rms_norm(x, (32,), weight))
    assert op._eps(None, x) == torch.finfo(torch.float32).eps


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(x=torch.randn(3, 4), weight=torch.randn(5)), ValueError, "weight must be [4]"),
    (dict(x=torch.randint(0, 3, (3, 4)), weight=None), TypeError, "x"),
    (dict(x=torch.randn(3, 4), weight=None, residual=torch.randn(3, 5)), ValueError, "residual must have x's shape"),
    (dict(x=torch.randn(3, 4), weight=None, dropout_p=1.5), ValueError, "dropout_p"),
    (dict(x=torch.randn(3, 4), weight=None, eps=-1.0), ValueError, "eps"),
    (dict(x=torch.randn(()), weight=None), ValueError, "at least 1 dim"),
])
def test_rejects_bad_input(kwargs, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        ft.rms_norm(**kwargs)


@pytest.mark.parametrize("shape, affine", [((32,), True), ((4, 8), True), ((32,), False)])
def test_fuse_swaps_torch_rms_norm_with_its_state_dict(shape, affine):
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(32, 32), nn.RMSNorm(shape, eps=1e-5, elementwise_affine=affine))
    if affine:
        with torch.no_grad():
            theirs[1].weight.add_(0.3 * torch.randn(shape))
    ours = ft.fuse(nn.Sequential(nn.Linear(32, 32), nn.RMSNorm(shape, eps=1e-5, elementwise_affine=affine)))
    assert type(ours[1]) is ft.RMSNorm and isinstance(ours[1], nn.RMSNorm)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(3, 7, *(shape if len(shape) > 1 else (32,))).reshape(3, 7, 32)
    if len(shape) > 1:
        x = x.view(3, 7, *shape)
        theirs[0], ours[0] = nn.Identity(), nn.Identity()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_fused_module_rejects_a_wrong_trailing_shape():
    norm = ft.RMSNorm(16)
    with pytest.raises(ValueError, match="normalized_shape"):
        norm(torch.randn(2, 15))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_compiles_fullgraph_without_a_graph_break(dropout_p):
    """Forward and loss, then the AOT backward, on the backend the route picks (torch's path without dropout, our
    kernel with it)."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    residual = torch.randn(4, 9, 64, device=DEVICE)

    def loss(x, weight):
        y, z = ft.rms_norm(x, weight, residual=residual, dropout_p=dropout_p, prenorm=True)
        return (y.sin() + z).mean()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(x, weight)
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    got = compiled(x, weight)
    grads = torch.autograd.grad(got, (x, weight))
    torch.manual_seed(3)
    want = loss(x, weight)
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, (x, weight))):
        torch.testing.assert_close(g, w)
