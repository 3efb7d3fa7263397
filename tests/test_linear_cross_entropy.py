"""``ft.linear_cross_entropy``: the LM head's product and its loss in chunks of rows. The loss and the gradients of
hidden, weight and bias against the float64 reference (the 2x rule) in every dtype, with ignored targets, label
smoothing, a softcap, a bias, every reduction and chunk sizes that do not divide the rows; the logits never kept
whole; bad input named; the route and ``explain()``; torch.compile without a graph break."""
import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import backend
from fused_transformer.ops import linear_cross_entropy as op
from tests.kernel_checks import DTYPES, check_against_reference
from tests.numerics import DEVICE

CASES = {  # name: options
    "plain": {},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "softcap_sum": {"softcap": 30.0, "reduction": "sum"},
    "none": {"reduction": "none"},
    "none_smoothing_softcap": {"reduction": "none", "label_smoothing": 0.2, "softcap": 5.0},
}


def _backends():
    found = ["reference"]
    if backend.triton_unavailable_reason() is None:
        found.append("triton")
    if DEVICE == "cpu" and backend.cpu_unavailable_reason() is None:
        found.append("cpu")
    return found


def _inputs(rows, hidden, vocab, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, rows, generator=g)
    target[torch.rand(rows, generator=g) < 0.15] = -100
    found = {"hidden": torch.randn(*rows, hidden, generator=g).to(DEVICE, dtype),
             "weight": (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(DEVICE, dtype),
             "target": target.to(DEVICE)}
    found["bias"] = (0.1 * torch.randn(vocab, generator=g)).to(DEVICE, dtype) if bias else None
    return found


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows, chunk_rows", [((2, 37), 16), ((77,), None)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _backends())
def test_loss_and_gradients_match_the_reference(name, dtype, rows, chunk_rows, case):
    options = dict(CASES[case])
    inputs = _inputs(rows, 64, 301, dtype, options.pop("bias", False), sum(rows) + len(case))
    reduction = options.get("reduction", "mean")
    out_grads = [torch.randn(rows if reduction == "none" else (), device=DEVICE)]

    def ours(hidden, weight, target, bias):
        with ft.use_backend(name):
            return ft.linear_cross_entropy(hidden, weight, target, bias, chunk_rows=chunk_rows, **options)

    def oracle(hidden, weight, target, bias):
        return ft.reference.linear_cross_entropy(hidden, weight, target, bias, **options)

    check_against_reference(ours, oracle, inputs, out_grads)


def test_it_is_torchs_loss_of_torchs_logits():
    """Against ``F.cross_entropy`` of ``F.linear`` itself (torch's path), 3-D hidden states and int32 targets."""
    inputs = _inputs((3, 20), 48, 97, torch.float64, True, 3)
    inputs["target"] = inputs["target"].int()
    for options in ({}, {"reduction": "sum", "label_smoothing": 0.3}, {"reduction": "none", "ignore_index": 5}):
        if "ignore_index" in options:
            inputs["target"] = inputs["target"].clamp(min=0)
        expected = F.cross_entropy(F.linear(inputs["hidden"], inputs["weight"], inputs["bias"]).transpose(1, 2),
                                   inputs["target"].long(), **options)
        with ft.use_backend("cpu" if backend.cpu_unavailable_reason() is None else "triton"):
            got = ft.linear_cross_entropy(**inputs, chunk_rows=7, **options)
        torch.testing.assert_close(got, expected)


def test_the_logits_are_never_made_whole():
    """No tensor the op makes, forward or backward, holds more than a chunk's rows of logits, and what autograd
    keeps for the backward holds none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor)]
            return out

    inputs = _inputs((4, 64), 32, 1000, torch.float32, False, 1)
    hidden, weight = inputs["hidden"].requires_grad_(), inputs["weight"].requires_grad_()
    saved = []
    with ft.use_backend("cpu" if backend.cpu_unavailable_reason() is None else "triton"), Shapes() as shapes:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = ft.linear_cross_entropy(hidden, weight, inputs["target"], chunk_rows=32)
        loss.backward()
    logits = [shape for shape in shapes.made if len(shape) == 2 and shape[1] == 1000]
    assert logits and max(rows for rows, _ in logits) <= 32, logits
    assert all(shape[-1:] != (1000,) for shape in saved), saved
    reference = ft.reference.linear_cross_entropy(hidden.detach().double(), weight.detach().double(),
                                                  inputs["target"])
    torch.testing.assert_close(loss.double(), reference)


def test_a_mean_over_no_target_is_nan_as_in_torch():
    inputs = _inputs((5,), 16, 11, torch.float32, False, 2)
    inputs["target"][:] = -100
    assert torch.isnan(ft.linear_cross_entropy(**inputs)) and torch.isnan(
        F.cross_entropy(F.linear(inputs["hidden"], inputs["weight"]), inputs["target"]))
    assert ft.linear_cross_entropy(**inputs, reduction="sum") == 0


def test_default_chunks_hold_about_as_many_floats_as_hidden():
    assert op.chunk_rows_of(4096, 512, 32000) == 128  # 4096 rows / 63 -> 66, up to a power of two
    assert op.chunk_rows_of(10, 4096, 1000) == 10  # vocab under hidden: every row at once
    assert op.chunk_rows_of(0, 64, 100) == 1


def test_default_chunks_on_the_cpu_hold_up_to_a_budget_of_floats():
    assert op.chunk_rows_of(4096, 512, 32000, "cpu") == 512  # 2**24 / 32000 -> 524, down to a power of two
    assert op.chunk_rows_of(300, 512, 32000, "cpu") == 300  # every row at once
    assert op.chunk_rows_of(1 << 20, 512, 32000, "cpu") == 1 << 15  # the GPU rule's 16645 rows, up: more
    assert op.chunk_rows_of(64, 64, 1 << 26, "cpu") == 1


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(target=torch.zeros(3, dtype=torch.float32)), TypeError, "target must be int64"),
    (dict(target=torch.zeros(4, dtype=torch.int64)), TypeError, "hidden's leading shape [3]"),
    (dict(weight=torch.randn(11, 5)), ValueError, "weight must be [vocab, hidden=8]"),
    (dict(bias=torch.randn(10)), ValueError, "bias must be [vocab=11]"),
    (dict(reduction="avg"), ValueError, "reduction='avg'"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing=1.5"),
    (dict(softcap=0.0), ValueError, "softcap=0.0"),
    (dict(chunk_rows=0), ValueError, "chunk_rows=0"),
    (dict(ignore_index=1.5), TypeError, "ignore_index=1.5"),
    (dict(target=torch.tensor([0, 11, -100])), ValueError, "target holds 11, outside [0, vocab=11)"),
    (dict(target=torch.tensor([0, -1, 2])), ValueError, "target holds -1"),
])
def test_bad_input_is_named(kwargs, error, words):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(11, 8), target=torch.zeros(3, dtype=torch.int64))
    args.update(kwargs)
    with pytest.raises(error) as raised:
        ft.linear_cross_entropy(**args)
    assert words in str(raised.value)


def test_explain_names_who_ran_it_and_the_route_falls_back_without_our_backend():
    inputs = _inputs((8,), 16, 50, torch.float32, False, 4)
    with ft.explain() as calls:
        ft.linear_cross_entropy(**inputs)
    assert [record.op for record in calls] == ["linear_cross_entropy"]
    assert calls[0].backend in ("cpu", "triton", "reference")
    with ft.use_backend("reference"), ft.explain() as calls:
        ft.linear_cross_entropy(**inputs)
    assert calls[0].backend == "reference"


def test_compiles_without_a_graph_break():
    inputs = _inputs((2, 16), 32, 100, torch.float32, True, 5)
    hidden = inputs["hidden"].requires_grad_()
    weight = inputs["weight"].requires_grad_()

    def step(hidden, weight, target, bias):
        return ft.linear_cross_entropy(hidden, weight, target, bias, label_smoothing=0.1, chunk_rows=8)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(hidden, weight, inputs["target"], inputs["bias"])
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected = step(hidden, weight, inputs["target"], inputs["bias"])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (hidden, weight)))
