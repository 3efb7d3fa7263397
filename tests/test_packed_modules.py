"""Packed modules: given a bool key padding mask, the encoder / decoder layers and stacks run on the real tokens
only (``attention_varlen``) and write zeros at padded positions. Each case runs the same module packed and
forced padded (``modules.packing.PACK_PADDING = False``, which zeroes padding too) and compares the whole output and
every input and parameter gradient (float64: to 1e-12), and compares torch.nn on the real tokens, on every
backend that implements ``attention_varlen``."""
import copy

import pytest
import torch
from torch import nn

import fused_transformer as ft
from fused_transformer import modules

pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]

D, HEADS, FF = 16, 4, 24
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}


@pytest.fixture(params=["reference", "cpu"])
def backend(request):
    if request.param == "cpu" and ft.backend.cpu_unavailable_reason() is not None:
        pytest.skip(ft.backend.cpu_unavailable_reason())
    with ft.use_backend(request.param):
        yield request.param


@pytest.fixture
def calls(monkeypatch):
    """Counts of the attention ops the modules run: proof of which path ran."""
    counts = {"attention": 0, "attention_varlen": 0}
    for op in counts:
        original = getattr(ft.functional, op)

        def spy(*args, _op=op, _original=original, **kwargs):
            counts[_op] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ft.functional, op, spy)
    return counts


def padding(kind, batch, length):
    """Bool [batch, length], True = padding: right or left padded, holes, one sequence all padding, or none."""
    lengths = torch.tensor([length - (i * 2) % max(length - 1, 1) for i in range(batch)])
    positions = torch.arange(length)[None, :]
    if kind == "right":
        return positions >= lengths[:, None]
    if kind == "left":
        return positions < (length - lengths)[:, None]
    if kind == "holes":
        g = torch.Generator().manual_seed(3)
        mask = torch.rand(batch, length, generator=g) < 0.4
        mask[:, 0] = False
        return mask
    if kind == "none":
        return torch.zeros(batch, length, dtype=torch.bool)
    if kind == "empty":
        mask = positions >= lengths[:, None]
        mask[1] = True
        return mask
    raise AssertionError(kind)


def layout(x, batch_first):
    """[B, L, d] as the module takes it."""
    return x if batch_first else x.transpose(0, 1).contiguous()


def real(out, mask, batch_first):
    """The real tokens of a module's output, [T, d]."""
    return (out if batch_first else out.transpose(0, 1))[~mask]


def forward_backward(module, inputs, run, grad_mask=None, batch_first=True):
    """Output, and input and parameter gradients of ``sum(out * g)``, ``g`` random and zero where
    ``grad_mask`` (True = padding) says."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    module.zero_grad(set_to_none=True)
    out = run(module, *inputs)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(11))
    if grad_mask is not None:
        g = g.masked_fill(grad_mask[..., None] if batch_first else grad_mask.t()[..., None], 0.0)
    (out * g).sum().backward()
    return out.detach(), [t.grad for t in inputs], {n: p.grad for n, p in module.named_parameters()}


def assert_packed_equals_padded(module, inputs, run, dtype=torch.float64):
    """Packed against forced padded, both with zeros at padding: the whole output, every gradient."""
    packed = forward_backward(module, inputs, run)
    modules.packing.PACK_PADDING = False
    try:
        padded = forward_backward(module, inputs, run)
    finally:
        modules.packing.PACK_PADDING = True
    torch.testing.assert_close(packed[0], padded[0], **TOL[dtype])
    for a, b in zip(packed[1], padded[1]):
        torch.testing.assert_close(a, b, **TOL[dtype])
    for name in packed[2]:
        torch.testing.assert_close(packed[2][name], padded[2][name], **TOL[dtype], msg=lambda m: f"{name}: {m}")
    return packed


def assert_matches_torch_on_real_tokens(ours, theirs, inputs, run, mask, batch_first):
    """torch.nn on the same weights, compared on the real tokens; gradients too when torch.nn's output is
    finite (a padded query that sees no key gives NaN there, and NaN gradients)."""
    out, input_grads, param_grads = forward_backward(ours, inputs, run, mask, batch_first)
    t_out, t_input_grads, t_param_grads = forward_backward(theirs, inputs, run, mask, batch_first)
    torch.testing.assert_close(real(out, mask, batch_first), real(t_out, mask, batch_first), **TOL[torch.float64])
    if not torch.isfinite(t_out).all():
        return
    for a, b in zip(input_grads, t_input_grads):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
    for name in param_grads:
        torch.testing.assert_close(param_grads[name], t_param_grads[name], **TOL[torch.float64],
                                   msg=lambda m: f"{name}: {m}")


def twins(build):
    torch.manual_seed(0)
    theirs = build().double()
    return ft.fuse(copy.deepcopy(theirs)), theirs


# ------------------------------------------------------------------------------------------ layers


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["right", "left", "holes", "empty", "none"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu"), (False, "gelu"), (True, "relu")])
def test_encoder_layer_packed_equals_padded_and_torch(backend, calls, norm_first, activation, batch_first, kind,
                                                      causal):
    ours, theirs = twins(lambda: nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation=activation,
                                                            batch_first=batch_first, norm_first=norm_first))
    batch, length = 4, 7
    mask = padding(kind, batch, length)
    x = layout(torch.randn(batch, length, D, dtype=torch.float64), batch_first)
    kwargs = dict(src_key_padding_mask=mask)
    if causal:
        kwargs.update(src_mask=nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64),
                      is_causal=True)

    def run(m, x):
        return m(x, **kwargs)

    out, (grad,), _ = assert_packed_equals_padded(ours, [x], run)
    assert calls["attention_varlen"] == 1 and calls["attention"] == 1  # packed once, then the padded run
    pad = mask if batch_first else mask.t()
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert torch.equal(grad[pad], torch.zeros_like(grad[pad]))  # padded inputs reach nothing
    assert_matches_torch_on_real_tokens(ours, theirs, [x], run, mask, batch_first)


def test_encoder_layer_in_float32_matches_the_padded_path_to_round_off(backend):
    ours, _ = twins(lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True))
    ours.float()
    x = torch.randn(5, 19, 32)
    mask = padding("holes", 5, 19)
    assert_packed_equals_padded(ours, [x], lambda m, x: m(x, src_key_padding_mask=mask), torch.float32)


def test_unbatched_input_packs_too(backend, calls):
    ours, theirs = twins(lambda: nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0))
    x = torch.randn(6, D, dtype=torch.float64)
    mask = torch.tensor([False, False, True, False, True, True])
    out, _, _ = assert_packed_equals_padded(ours, [x], lambda m, x: m(x, src_key_padding_mask=mask))
    assert calls["attention_varlen"] == 1
    assert torch.equal(out[mask], torch.zeros_like(out[mask]))
    torch.testing.assert_close(out[~mask], theirs(x, src_key_padding_mask=mask)[~mask], **TOL[torch.float64])


def test_every_sequence_padded_gives_zeros(backend):
    ours, _ = twins(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0,
                                                                             batch_first=True), 2,
                                                  norm=nn.LayerNorm(D), enable_nested_tensor=False))
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    out = ours(x, src_key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["tgt+memory", "memory", "tgt"])
def test_decoder_layer_packed_equals_padded_and_torch(backend, calls, batch_first, masks):
    ours, theirs = twins(lambda: nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first,
                                                            norm_first=True))
    batch, lt, ls = 3, 6, 8
    tgt_mask, memory_mask = padding("right", batch, lt), padding("left", batch, ls)
    tgt = layout(torch.randn(batch, lt, D, dtype=torch.float64), batch_first)
    memory = layout(torch.randn(batch, ls, D, dtype=torch.float64), batch_first)
    kwargs = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(lt, dtype=torch.float64))
    if "tgt" in masks:
        kwargs["tgt_key_padding_mask"] = tgt_mask
    if "memory" in masks:
        kwargs["memory_key_padding_mask"] = memory_mask

    def run(m, t, s):
        return m(t, s, **kwargs)

    assert_packed_equals_padded(ours, [tgt, memory], run)
    assert calls["attention_varlen"] == 2  # self- and cross-attention, the causal mask recognised by value
    no_padding = torch.zeros(batch, lt, dtype=torch.bool)
    assert_matches_torch_on_real_tokens(ours, theirs, [tgt, memory], run, kwargs.get("tgt_key_padding_mask",
                                                                                      no_padding), batch_first)


# ------------------------------------------------------------------------------------------ stacks


@pytest.mark.parametrize("kind", ["right", "left", "empty"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_packs_once_for_every_layer_and_the_final_norm(backend, calls, monkeypatch, norm_first,
                                                                     batch_first, kind):
    ours, theirs = twins(lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first), 3,
        norm=nn.LayerNorm(D), enable_nested_tensor=False))
    packs = []
    original = modules.stacks.pack
    monkeypatch.setattr(modules.stacks, "pack", lambda *args: packs.append(1) or original(*args))
    batch, length = 4, 9
    mask = padding(kind, batch, length)
    x = layout(torch.randn(batch, length, D, dtype=torch.float64), batch_first)
    causal = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)

    def run(m, x):
        return m(x, mask=causal, src_key_padding_mask=mask)  # causal recognised by value

    out, _, _ = assert_packed_equals_padded(ours, [x], run)
    assert len(packs) == 1 and calls["attention_varlen"] == 3
    pad = mask if batch_first else mask.t()
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))  # the final norm ran on real tokens only
    assert_matches_torch_on_real_tokens(ours, theirs, [x], run, mask, batch_first)


@pytest.mark.parametrize("kind", ["right", "left", "empty"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_with_memory_padding_and_causal_target(backend, calls, norm_first, batch_first, kind):
    ours, theirs = twins(lambda: nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=batch_first,
                                                norm_first=norm_first))
    batch, ls, lt = 3, 8, 6
    src_mask, tgt_mask = padding(kind, batch, ls), padding("right", batch, lt)
    src = layout(torch.randn(batch, ls, D, dtype=torch.float64), batch_first)
    tgt = layout(torch.randn(batch, lt, D, dtype=torch.float64), batch_first)
    masks = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(lt, dtype=torch.float64), tgt_is_causal=True,
                 src_key_padding_mask=src_mask, memory_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_mask)

    def run(m, s, t):
        return m(s, t, **masks)

    out, _, _ = assert_packed_equals_padded(ours, [src, tgt], run)
    assert calls["attention_varlen"] == 2 + 2 * 2
    pad = tgt_mask if batch_first else tgt_mask.t()
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    if kind != "empty":  # a source of padding only: torch.nn's target tokens attend to no key and give NaN
        assert_matches_torch_on_real_tokens(ours, theirs, [src, tgt], run, tgt_mask, batch_first)


# ------------------------------------------------------------------------------------ training, fallbacks


def test_dropout_in_training_runs_packed(backend, calls):
    ours, _ = twins(lambda: nn.Transformer(D, HEADS, 1, 1, FF, dropout=0.3, batch_first=True))
    ours.train()
    src, tgt = torch.randn(3, 8, D, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, D, dtype=torch.float64)
    src_mask, tgt_mask = padding("right", 3, 8), padding("left", 3, 5)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)

    def run():
        return ours(src, tgt, tgt_mask=causal, src_key_padding_mask=src_mask, memory_key_padding_mask=src_mask,
                    tgt_key_padding_mask=tgt_mask)

    a, b = run(), run()
    assert calls["attention_varlen"] == 6 and calls["attention"] == 0
    assert not torch.allclose(a, b) and torch.isfinite(a).all()
    assert torch.equal(a[tgt_mask], torch.zeros_like(a[tgt_mask]))
    torch.manual_seed(5)
    c = run()
    torch.manual_seed(5)
    assert torch.equal(c, run())
    c.sum().backward()
    assert torch.isfinite(src.grad).all()
    assert torch.equal(src.grad[src_mask], torch.zeros_like(src.grad[src_mask]))


def test_other_masks_run_padded_with_zeros_at_padding(backend, calls):
    ours, theirs = twins(lambda: nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True))
    x = torch.randn(3, 6, D, dtype=torch.float64)
    mask = padding("right", 3, 6)
    src_mask = torch.randn(6, 6, dtype=torch.float64)
    out = ours(x, src_mask=src_mask, src_key_padding_mask=mask)
    assert calls == {"attention": 1, "attention_varlen": 0}
    assert torch.equal(out[mask], torch.zeros_like(out[mask]))
    torch.testing.assert_close(out[~mask], theirs(x, src_mask=src_mask, src_key_padding_mask=mask)[~mask],
                               **TOL[torch.float64])
    # A float padding mask, or a hook on the attention module (it expects to see its forward called): padded.
    float_mask = torch.zeros(3, 6, dtype=torch.float64).masked_fill(mask, float("-inf"))
    ours(x, src_key_padding_mask=float_mask)
    seen = []
    handle = ours.self_attn.register_forward_hook(lambda *args: seen.append(1))
    ours(x, src_key_padding_mask=mask)
    handle.remove()
    assert seen == [1] and calls == {"attention": 3, "attention_varlen": 0}
    ours(x, src_key_padding_mask=mask)
    assert calls["attention_varlen"] == 1


def test_a_stack_that_cannot_pack_runs_every_layer_as_torch_nn_and_zeroes_once(backend, calls):
    """A hook on one layer's attention keeps the whole stack padded; no layer packs or zeroes on its own, so
    each computes what torch.nn's does at every position (what a hook reading padded rows sees)."""
    ours, theirs = twins(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0,
                                                                                  batch_first=True), 2,
                                                       enable_nested_tensor=False))
    x = torch.randn(3, 6, D, dtype=torch.float64)
    mask = padding("right", 3, 6)
    seen = {}
    for name, model in (("ours", ours), ("torch", theirs)):
        model.layers[1].self_attn.register_forward_hook(lambda m, args, out, name=name: seen.update({name: args[0]}))
    out, expected = ours(x, src_key_padding_mask=mask), theirs(x, src_key_padding_mask=mask)
    assert calls == {"attention": 2, "attention_varlen": 0}
    torch.testing.assert_close(seen["ours"], seen["torch"], **TOL[torch.float64])  # padded rows included
    assert torch.equal(out[mask], torch.zeros_like(out[mask]))
    torch.testing.assert_close(out[~mask], expected[~mask], **TOL[torch.float64])


def test_compiled_encoder_runs_padded_without_graph_break_and_matches_eager(backend):
    ours, _ = twins(lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0,
                                                                             batch_first=True), 2,
                                                  enable_nested_tensor=False))
    x = torch.randn(3, 7, D, dtype=torch.float64)
    mask = padding("left", 3, 7)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ours(x, mask=causal, src_key_padding_mask=mask), backend="eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x), ours(x, mask=causal, src_key_padding_mask=mask), **TOL[torch.float64])
