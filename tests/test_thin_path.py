"""The thin path (docs/layout.md, "The route of a call"): an eager call launches its Triton kernel without going
through a custom op, a traced call goes through one; a call that needs no gradient records no autograd node, one
that does records the op's one Function, whichever backend runs it."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fused_transformer as ft
from fused_transformer import autograd, backend, functional
from fused_transformer.kernels.attention import launch
from fused_transformer.kernels.attention.fwd import attention_fwd_kernel

CALLS = {
    "attention_fwd": lambda q, x, w: ft.attention(q, q, q, is_causal=True),
    "layer_norm_fwd": lambda q, x, w: functional.layer_norm(x, w, w),
    "feed_forward_fwd": lambda q, x, w: functional.feed_forward(x, w[:, None].expand(32, 32), None,
                                                                w[None, :].expand(32, 32), None),
}


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, 8, 16, generator=generator), torch.randn(4, 32, generator=generator),
            torch.randn(32, generator=generator))


def _profiled_ops(fn) -> set:
    with torch.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("op", list(CALLS))
def test_eager_calls_skip_the_custom_op_and_traced_calls_go_through_it(op):
    inputs = _inputs()
    with backend.use_backend("triton"):
        eager = _profiled_ops(lambda: CALLS[op](*inputs))
        graph = make_fx(CALLS[op])(*inputs).graph
    assert f"fused_transformer::{op}" not in eager
    assert any(f"fused_transformer.{op}" in str(node.target) for node in graph.nodes), graph


@pytest.mark.parametrize("name", ["triton", "cpu"])
def test_one_function_per_op_records_autograd_only_when_a_gradient_is_needed(name):
    if name == "cpu" and backend.cpu_unavailable_reason() is not None:
        pytest.skip(backend.cpu_unavailable_reason())
    q, x, w = _inputs()
    with backend.use_backend(name):
        assert ft.attention(q, q, q).grad_fn is None
        with torch.no_grad():
            assert functional.layer_norm(x.requires_grad_(), w, w).grad_fn is None
        leaf = q.clone().requires_grad_()
        out = ft.attention(leaf, q, q)
        y = functional.layer_norm(x, w, w, dropout_p=0.1)  # with dropout: no backend has a composed form
    assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
    assert _node_names(y.grad_fn) >= {"ViewBackward0", "LayerNormFunctionBackward"}
    assert autograd.AttentionFunction.__module__ == "fused_transformer.autograd"


def _node_names(node, depth: int = 2) -> set:
    """The autograd nodes from ``node`` back ``depth`` steps."""
    if node is None or depth == 0:
        return set()
    return {type(node).__name__}.union(*(_node_names(n, depth - 1) for n, _ in node.next_functions))


def test_launch_options_are_made_once_per_kind_of_launch(monkeypatch):
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    q, _, _ = _inputs()
    with backend.use_backend("triton"):
        ft.attention(q, q, q)
        planned = dict(launch._LAUNCHES)
        ft.attention(q, q, q)
        ft.attention(q * 2, q, q)
        assert len(planned) == 1 and launch._LAUNCHES == planned
        ft.attention(q, q, q, is_causal=True)
    assert len(launch._LAUNCHES) == 2
    (found,) = planned.values()
    # the constexprs, positional: the kernel's last parameters, in its order
    names = attention_fwd_kernel.arg_names[-len(found.constexprs):]
    constexprs = dict(zip(names, found.constexprs))
    assert constexprs == {**constexprs, **found.plan.constexprs(), "IS_CAUSAL": False, "HEAD_DIM": 16}
    assert found.num_warps == found.plan.tile.num_warps
