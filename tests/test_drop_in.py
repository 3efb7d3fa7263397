"""The fused modules inside the ways people train: torch.autocast, torch.compile (fullgraph, no graph break,
no recompile per step), torch.export, torch.jit.script, DDP and FSDP2 (gloo, 2 CPU processes), what falls
back to torch.nn's own forward, and fuse() in place. Runs on the default (auto) backend."""
import copy
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import distributed_training
import fused_transformer as ft
from numerics import DEVICE, assert_close_to_reference

D, HEADS, FF = 32, 4, 64


def inputs():
    g = torch.Generator().manual_seed(7)
    x, memory = torch.randn(2, 7, D, generator=g), torch.randn(2, 9, D, generator=g)
    src_padding = torch.arange(7)[None, :] >= torch.tensor([7, 5])[:, None]
    memory_padding = torch.arange(9)[None, :] >= torch.tensor([9, 6])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    return x, memory, src_padding, memory_padding, causal


# name -> (torch.nn module builder(dropout), call(module, x, memory, src_padding, memory_padding, causal)). GELU:
# through relu, a last-bit difference upstream flips a pre-activation near 0 and changes its gradients by O(1)
# in torch.nn's own low-precision run as much as in ours, so a comparison would measure luck.
MODULES = {
    "MultiheadAttention": (
        lambda p: nn.MultiheadAttention(D, HEADS, dropout=p, batch_first=True),
        lambda m, x, mem, sp, mp_, causal: m(x, mem, mem, key_padding_mask=mp_)[0],
    ),
    "TransformerEncoderLayer": (
        lambda p: nn.TransformerEncoderLayer(D, HEADS, FF, dropout=p, activation="gelu", batch_first=True),
        lambda m, x, mem, sp, mp_, causal: m(x, src_key_padding_mask=sp),
    ),
    "TransformerDecoderLayer": (
        lambda p: nn.TransformerDecoderLayer(D, HEADS, FF, dropout=p, activation="gelu", batch_first=True,
                                                  norm_first=True),
        lambda m, x, mem, sp, mp_, causal: m(x, mem, tgt_mask=causal, memory_key_padding_mask=mp_),
    ),
    "TransformerEncoder": (
        lambda p: nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, dropout=p, activation="gelu"), 2,
                                        enable_nested_tensor=False),
        lambda m, x, mem, sp, mp_, causal: m(x.transpose(0, 1), mask=causal, src_key_padding_mask=sp),
    ),
    "TransformerDecoder": (
        lambda p: nn.TransformerDecoder(
            nn.TransformerDecoderLayer(D, HEADS, FF, dropout=p, activation="gelu", batch_first=True), 2),
        lambda m, x, mem, sp, mp_, causal: m(x, mem, tgt_mask=causal, memory_key_padding_mask=mp_),
    ),
    "Transformer": (
        lambda p: nn.Transformer(D, HEADS, 1, 1, FF, dropout=p, activation="gelu", batch_first=True),
        lambda m, x, mem, sp, mp_, causal: m(mem, x, tgt_mask=causal, src_key_padding_mask=mp_,
                                             memory_key_padding_mask=mp_),
    ),
}


def real_tokens(name, src_padding):
    """1.0 at output positions that are real tokens, 0.0 at padding, where our encoders write zeros (they run real
    tokens only) and torch.nn leaves values no loss should read; None when the output has no padded positions."""
    real = {"TransformerEncoderLayer": ~src_padding, "TransformerEncoder": ~src_padding.t()}.get(name)
    return None if real is None else real[..., None].double()


def twins(name, dropout=0.0):
    """(torch.nn module, fused copy with the same weights)."""
    build, _ = MODULES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = build(dropout)
    return reference, ft.fuse(copy.deepcopy(reference))


def call(name, module, *args):
    return MODULES[name][1](module, *(args or inputs()))


# ------------------------------------------------------------------------------------------ autocast


@pytest.mark.parametrize("name", list(MODULES))
def test_autocast_follows_torch_nn_dtypes_and_its_accuracy(name):
    reference, fused = twins(name)
    exact = copy.deepcopy(reference).double()
    args = inputs()
    real = real_tokens(name, args[2])
    weight = 1.0 if real is None else real
    ref64 = call(name, exact, *(t.double() if t.is_floating_point() else t for t in args)) * weight
    ref64.backward(torch.ones_like(ref64))
    outs = {}
    for label, module in (("torch.nn", reference), ("fused", fused)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call(name, module, *args)
        out = out * (weight if real is None else weight.to(out.dtype))
        out.float().sum().backward()
        outs[label] = out
    assert outs["fused"].dtype == outs["torch.nn"].dtype
    assert_close_to_reference(outs["fused"], ref64.to(outs["fused"].dtype).double(), outs["torch.nn"], name)
    for (pname, ours), (_, theirs), (_, p64) in zip(fused.named_parameters(), reference.named_parameters(),
                                                  exact.named_parameters()):
        assert ours.grad.dtype == theirs.grad.dtype, pname
        assert_close_to_reference(ours.grad, p64.grad, theirs.grad, f"{name} d({pname})")


# ------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", list(MODULES))
def test_compile_fullgraph_has_no_graph_break(name, mode):
    _, fused = twins(name, dropout=0.1)
    getattr(fused, mode)()
    args = inputs()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda: call(name, fused, *args))()
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]


@pytest.mark.parametrize("name", ["TransformerEncoderLayer", "TransformerDecoder", "Transformer"])
def test_compiled_training_matches_eager_and_never_recompiles(name):
    _, fused = twins(name)
    eager = copy.deepcopy(fused).train()
    fused.train()
    args = inputs()
    torch._dynamo.reset()
    # sin: a loss that moves with every output value (the mean square of a LayerNorm output is about 1)
    step = torch.compile(lambda m: call(name, m, *args).sin().mean(), backend="aot_eager", fullgraph=True)
    loss = step(fused)
    loss.backward()
    eager_loss = call(name, eager, *args).sin().mean()
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for (pname, p), (_, q) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{pname}: {m}")

    # With dropout on, each step draws a new mask from torch's generator, inside the graph: no recompile.
    for module in fused.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.1
    step(fused)  # the dropout probability is a new constant: one recompile, then none
    losses = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            losses.append(float(step(fused)))
    assert len(set(losses)) == 3, losses
    torch.manual_seed(5)
    first = float(step(fused))
    torch.manual_seed(5)
    assert float(step(fused)) == first  # torch.manual_seed reproduces compiled dropout too


@pytest.mark.skipif(ft.backend.triton_unavailable_reason() is not None, reason="triton is not installed")
@pytest.mark.parametrize("name", ["TransformerEncoderLayer", "TransformerDecoderLayer"])
def test_compile_on_the_triton_backend_traces_its_custom_ops(name):
    """The Triton ops are custom ops with fake kernels: on a GPU, or without one on CPU tensors under the
    interpreter, a compiled training step has no graph break and matches eager."""
    _, fused = twins(name, dropout=0.1)
    fused.to(DEVICE).train()
    args = [t.to(DEVICE) for t in inputs()]
    with ft.use_backend("triton"):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(lambda: call(name, fused, *args))()
        assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
        for module in fused.modules():  # exact comparison: no dropout
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0
        eager = copy.deepcopy(fused)
        step = torch.compile(lambda m: call(name, m, *args).sin().mean(), backend="aot_eager", fullgraph=True)
        loss, eager_loss = step(fused), call(name, eager, *args).sin().mean()
        loss.backward()
        eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for (pname, p), (_, q) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{pname}: {m}")


@pytest.mark.slow
def test_inductor_compiled_transformer_training_step_matches_eager():
    _, fused = twins("Transformer")
    eager = copy.deepcopy(fused)
    args = inputs()
    torch._dynamo.reset()
    step = torch.compile(lambda m: call("Transformer", m, *args).sin().mean(), fullgraph=True)
    loss = step(fused)
    loss.backward()
    eager_loss = call("Transformer", eager, *args).sin().mean()
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
    for (pname, p), (_, q) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{pname}: {m}")


# -------------------------------------------------------------------------------- export and script


@pytest.mark.parametrize("name", ["TransformerEncoder", "Transformer"])
def test_export_round_trip_gives_the_eager_output(name):
    _, fused = twins(name)
    fused.eval()
    x, memory, src_padding, memory_padding, causal = inputs()
    if name == "TransformerEncoder":
        args, kwargs = (x.transpose(0, 1).contiguous(),), dict(mask=causal, src_key_padding_mask=src_padding)
    else:
        args, kwargs = (memory, x), dict(tgt_mask=causal, src_key_padding_mask=memory_padding,
                                          memory_key_padding_mask=memory_padding)
    exported = torch.export.export(fused, args, kwargs)
    torch.testing.assert_close(exported.module()(*args, **kwargs), fused(*args, **kwargs))


@pytest.mark.parametrize("name", list(MODULES))
def test_torchscript_scripts_the_torch_nn_module_sharing_the_weights(name):
    _, fused = twins(name)
    fused.eval()
    scripted = torch.jit.script(fused)
    assert type(fused).__module__ == "fused_transformer.modules"  # scripting swapped nothing in place
    real = real_tokens(name, inputs()[2])
    weight = 1.0 if real is None else real.float()
    with torch.no_grad():
        torch.testing.assert_close(call(name, scripted) * weight, call(name, fused) * weight, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ fallbacks


def same_behaviour(run_torch, run_fused):
    """Both return equal results, or both raise the same exception type."""
    try:
        expected = run_torch()
    except Exception as exc:  # noqa: BLE001 (the type is what is compared)
        with pytest.raises(type(exc)):
            run_fused()
        return
    torch.testing.assert_close(run_fused(), expected)


def test_nested_tensor_inputs_run_torch_nn():
    reference, fused = twins("MultiheadAttention")
    reference.eval(), fused.eval()
    nested = torch.nested.nested_tensor([torch.randn(3, D), torch.randn(5, D)])
    with torch.no_grad():
        ours, theirs = fused(nested, nested, nested, need_weights=False)[0], reference(nested, nested, nested,
                                                                                        need_weights=False)[0]
    assert ours.is_nested
    for a, b in zip(ours.unbind(), theirs.unbind()):
        torch.testing.assert_close(a, b)
    layer_ref, layer = twins("TransformerEncoderLayer")
    layer_ref.eval(), layer.eval()
    with torch.no_grad():
        for a, b in zip(layer(nested).unbind(), layer_ref(nested).unbind()):
            torch.testing.assert_close(a, b)


class Halve(nn.Module):
    def forward(self, x):
        return x / 2


@pytest.mark.parametrize("name", ["TransformerEncoderLayer", "TransformerDecoderLayer"])
def test_replaced_dropout_modules_run_torch_nn(name):
    reference, fused = twins(name)
    for module in (reference, fused):
        module.dropout1 = Halve()
        module.dropout = Halve()
    same_behaviour(lambda: call(name, reference), lambda: call(name, fused))


def test_mixed_parameter_dtypes_behave_as_torch_nn():
    reference, fused = twins("MultiheadAttention")
    for module in (reference, fused):
        module.double()
        module.in_proj_bias.data = module.in_proj_bias.data.half()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    same_behaviour(lambda: reference(x, x, x)[0], lambda: fused(x, x, x)[0])
    norm_ref = nn.LayerNorm(D).double()
    norm_ref.bias.data = norm_ref.bias.data.float()
    norm = ft.fuse(copy.deepcopy(norm_ref))
    same_behaviour(lambda: norm_ref(x), lambda: norm(x))


def test_bad_mha_shapes_raise_both_assertion_and_value_errors():
    fused = ft.MultiheadAttention(D, HEADS)
    with pytest.raises(AssertionError, match="key_padding_mask"):
        fused(torch.randn(5, 2, D), torch.randn(5, 2, D), torch.randn(5, 2, D),
              key_padding_mask=torch.zeros(3, 5).bool())
    with pytest.raises(ValueError, match="embed_dim=32"):
        fused(torch.randn(5, 2, D + 1), torch.randn(5, 2, D), torch.randn(5, 2, D))


def test_ignored_causal_mask_is_not_shape_checked_as_torch_nn():
    reference, fused = twins("MultiheadAttention")
    x = torch.randn(1, 3, D)
    wrong = nn.Transformer.generate_square_subsequent_mask(2)  # torch.nn drops it unread with this combination
    same_behaviour(lambda: reference(x, x, x, attn_mask=wrong, is_causal=True, need_weights=False)[0],
                   lambda: fused(x, x, x, attn_mask=wrong, is_causal=True, need_weights=False)[0])


def test_fuse_swaps_classes_in_place_keeping_objects_and_hooks():
    torch.manual_seed(0)
    model = nn.Transformer(D, HEADS, 1, 1, FF, dropout=0.0, batch_first=True)
    x, memory, *_ = inputs()
    layer, attention = model.encoder.layers[0], model.decoder.layers[0].multihead_attn
    calls = []
    attention.register_forward_hook(lambda *_: calls.append(1))
    expected = model(memory, x)
    assert ft.fuse(model) is model
    assert type(model) is ft.Transformer and type(model.encoder) is ft.TransformerEncoder
    assert model.encoder.layers[0] is layer and type(layer) is ft.TransformerEncoderLayer
    assert type(attention) is ft.MultiheadAttention and model.decoder.layers[0].multihead_attn is attention
    torch.testing.assert_close(model(memory, x), expected, rtol=1e-4, atol=1e-5)
    assert calls == [1, 1]


# ------------------------------------------------------------------------------------------ dropout RNG


def test_dropout_is_reproduced_by_manual_seed_and_differs_between_calls():
    _, fused = twins("TransformerEncoderLayer", dropout=0.3)
    fused.train()
    args = inputs()
    torch.manual_seed(11)
    first, second = call("TransformerEncoderLayer", fused, *args), call("TransformerEncoderLayer", fused, *args)
    torch.manual_seed(11)
    assert torch.equal(call("TransformerEncoderLayer", fused, *args), first)
    assert not torch.equal(first, second)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_draw_new_dropout_masks():
    _, fused = twins("TransformerEncoderLayer", dropout=0.3)
    fused.cuda().train()
    x = torch.randn(2, 7, D, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused(x)  # warm-up outside capture (autotuning, allocations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(out, first)


# -------------------------------------------------------------------------------------------- DDP, FSDP2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_distributed_training_matches_torch_nn(strategy, tmp_path):
    mp.spawn(distributed_training.worker, args=(2, strategy, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        assert rank["fused"].keys() == rank["torch"].keys()
        for name, p in rank["torch"].items():
            torch.testing.assert_close(rank["fused"][name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for name, p in ranks[0]["fused"].items():  # the ranks trained on different data and stayed in sync
        assert torch.equal(ranks[1]["fused"][name], p), name
    initial = distributed_training.build(fused=False).state_dict()
    assert any(not torch.equal(initial[name], p) for name, p in ranks[0]["torch"].items())
