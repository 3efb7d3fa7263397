"""The drop-in modules against their torch.nn namesakes: same parameters and state_dict keys, same outputs
and gradients for every mask combination, layout and option (float64: to round-off; float32: to float32
round-off), on whichever backend ``MODULE_BACKENDS`` lists."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_transformer as ft
from tests.numerics import DEVICE

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=2e-5)}


def twins(torch_cls, fused_cls, *args, dtype=torch.float64, **kwargs):
    """The same module built twice from the same seed: the fused one must draw identical parameters."""
    torch.manual_seed(1234)
    ref = torch_cls(*args, **kwargs).to(dtype)
    torch.manual_seed(1234)
    ours = fused_cls(*args, **kwargs).to(dtype)
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert list(ref_state) == list(our_state)
    for key in ref_state:
        assert torch.equal(ref_state[key], our_state[key]), key
    return ref, ours


def assert_same_forward_backward(ref, ours, inputs, run, dtype=torch.float64, padding=None):
    """Run ``run(module, *inputs)`` on both, compare outputs, input gradients and parameter gradients.

    ``padding``: bool, the first output's shape without its features, True at padded positions. Our layers run
    real tokens only and write zeros there (checked); torch.nn's values there are not compared, and the loss
    ignores them, as a training loss over padded batches does."""
    ref_inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    our_inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_out, our_out = run(ref, *ref_inputs), run(ours, *our_inputs)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    our_out = our_out if isinstance(our_out, tuple) else (our_out,)
    for i, (a, b) in enumerate(zip(ref_out, our_out)):
        if a is None:
            assert b is None
            continue
        if i == 0 and padding is not None:
            assert padding.any() and (b[padding] == 0).all()
            a = a.masked_fill(padding[..., None], 0)
        torch.testing.assert_close(b, a, **TOL[dtype])
    grad = torch.randn_like(ref_out[0])
    if padding is not None:
        grad = grad.masked_fill(padding[..., None], 0)
    (ref_out[0] * grad).sum().backward()
    (our_out[0] * grad).sum().backward()
    for a, b in zip(ref_inputs, our_inputs):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, **TOL[dtype])
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL[dtype], msg=lambda m: f"{name}: {m}")


def padding_mask(batch, length, lengths=None):
    """Right-padded bool mask (True = padding); every sequence keeps at least one key."""
    lengths = lengths or [max(1, length - 2 * i) for i in range(batch)]
    return torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]


# --------------------------------------------------------------------------------- MultiheadAttention

MHA_MASKS = ["none", "kpm_bool", "kpm_float", "mask_bool_2d", "mask_float_2d", "mask_bool_3d", "causal",
             "causal+kpm", "mask_float+kpm_bool", "kpm_left_padded"]


def mha_masks(kind, batch, heads, lq, lk, dtype):
    kpm = padding_mask(batch, lk)
    causal = nn.Transformer.generate_square_subsequent_mask(lq, dtype=dtype)
    random_bool = torch.rand(lq, lk) < 0.3
    random_bool[:, 0] = False  # True = masked in torch.nn; keep key 0 so no row is empty
    if kind == "none":
        return {}
    if kind == "kpm_bool":
        return dict(key_padding_mask=kpm)
    if kind == "kpm_float":
        return dict(key_padding_mask=torch.zeros(batch, lk, dtype=dtype).masked_fill(kpm, float("-inf")))
    if kind == "mask_bool_2d":
        return dict(attn_mask=random_bool)
    if kind == "mask_float_2d":
        return dict(attn_mask=torch.randn(lq, lk, dtype=dtype))
    if kind == "mask_bool_3d":
        mask = torch.rand(batch * heads, lq, lk) < 0.3
        mask[..., 0] = False
        return dict(attn_mask=mask)
    if kind == "causal":
        return dict(attn_mask=causal, is_causal=True)
    if kind == "causal+kpm":
        return dict(attn_mask=causal, is_causal=True, key_padding_mask=kpm)
    if kind == "mask_float+kpm_bool":
        return dict(attn_mask=torch.randn(lq, lk, dtype=dtype), key_padding_mask=kpm)
    if kind == "kpm_left_padded":
        return dict(key_padding_mask=kpm.flip(-1))
    raise AssertionError(kind)


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mask_kind", MHA_MASKS)
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_self_attention_matches_torch(mask_kind, batch_first, need_weights, average, dtype):
    batch, heads, length, dim = 3, 4, 7, 32
    ref, ours = twins(nn.MultiheadAttention, ft.MultiheadAttention, dim, heads, batch_first=batch_first, dtype=dtype)
    x = torch.randn((batch, length, dim) if batch_first else (length, batch, dim), dtype=dtype)
    masks = mha_masks(mask_kind, batch, heads, length, length, dtype)

    def run(module, x):
        return module(x, x, x, need_weights=need_weights, average_attn_weights=average, **masks)

    assert_same_forward_backward(ref, ours, [x], run, dtype)


@pytest.mark.parametrize("mask_kind", ["none", "kpm_bool", "mask_bool_2d", "mask_float+kpm_bool"])
@pytest.mark.parametrize("options", [dict(), dict(kdim=12, vdim=20), dict(add_bias_kv=True), dict(add_zero_attn=True),
                                     dict(add_bias_kv=True, add_zero_attn=True, kdim=12, vdim=12), dict(bias=False)])
def test_mha_cross_attention_options_match_torch(options, mask_kind):
    batch, heads, lq, lk, dim = 2, 4, 5, 9, 16
    ref, ours = twins(nn.MultiheadAttention, ft.MultiheadAttention, dim, heads, batch_first=True, **options)
    query = torch.randn(batch, lq, dim, dtype=torch.float64)
    key = torch.randn(batch, lk, options.get("kdim", dim), dtype=torch.float64)
    value = torch.randn(batch, lk, options.get("vdim", dim), dtype=torch.float64)
    masks = mha_masks(mask_kind, batch, heads, lq, lk, torch.float64)
    assert_same_forward_backward(ref, ours, [query, key, value], lambda m, q, k, v: m(q, k, v, **masks))
    # key is value (shared memory) takes the two-product projection path
    assert_same_forward_backward(ref, ours, [query, key], lambda m, q, k: m(q, k, k if "vdim" not in options else value, **masks))


def test_mha_unbatched_input_matches_torch():
    ref, ours = twins(nn.MultiheadAttention, ft.MultiheadAttention, 16, 2)
    x = torch.randn(6, 16, dtype=torch.float64)
    kpm = torch.tensor([False] * 4 + [True] * 2)
    mask3d = torch.rand(2, 6, 6) < 0.3
    mask3d[..., 0] = False
    for masks in (dict(key_padding_mask=kpm), dict(attn_mask=mask3d), dict(average_attn_weights=False)):
        assert_same_forward_backward(ref, ours, [x], lambda m, x: m(x, x, x, **masks))


def test_mha_fully_masked_row_gives_zeros_where_torch_gives_nan():
    ref, ours = twins(nn.MultiheadAttention, ft.MultiheadAttention, 16, 2, batch_first=True, bias=False)
    x = torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True  # query 2 may attend to nothing
    expected, _ = ref(x, x, x, attn_mask=mask)
    assert torch.isnan(expected[:, 2]).all()
    out, weights = ours(x, x, x, attn_mask=mask)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))  # no out_proj bias: exactly zero
    torch.testing.assert_close(out[:, [0, 1, 3]], expected[:, [0, 1, 3]], **TOL[torch.float64])
    assert torch.equal(weights[:, 2], torch.zeros_like(weights[:, 2]))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_mha_rejects_bad_input_clearly():
    mha = ft.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="query's last dim must be embed_dim=16"):
        mha(torch.randn(2, 5, 12), x, x)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[2, 5\]"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be one of"):
        mha(x, x, x, attn_mask=torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or float"):
        mha(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="different batch sizes"):
        mha(x, x[:1], x[:1])
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(AssertionError, match="embed_dim must be divisible by num_heads"):
        ft.MultiheadAttention(10, 4)  # torch.nn's own constructor check, unchanged


# ----------------------------------------------------------------------------------------- layers

@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", nn.GELU(approximate="tanh"), torch.tanh])
@pytest.mark.parametrize("mask_kind", ["none", "kpm", "causal", "causal+kpm", "float_mask+kpm"])
def test_encoder_layer_matches_torch(mask_kind, activation, batch_first, norm_first, dtype):
    batch, length, dim = 3, 6, 16
    ref, ours = twins(nn.TransformerEncoderLayer, ft.TransformerEncoderLayer, dim, 4, 24, dropout=0.1,
                      activation=activation, batch_first=batch_first, norm_first=norm_first, dtype=dtype)
    ref.eval(), ours.eval()  # dropout off, grads still on (so torch.nn takes its plain path)
    x = torch.randn((batch, length, dim) if batch_first else (length, batch, dim), dtype=dtype)
    kwargs, padding = {}, None
    if "kpm" in mask_kind:
        kwargs["src_key_padding_mask"] = padding_mask(batch, length)
        padding = kwargs["src_key_padding_mask"] if batch_first else kwargs["src_key_padding_mask"].t()
    if "causal" in mask_kind:
        kwargs.update(src_mask=nn.Transformer.generate_square_subsequent_mask(length, dtype=dtype), is_causal=True)
    if "float_mask" in mask_kind:
        kwargs["src_mask"] = torch.randn(length, length, dtype=dtype)
    assert_same_forward_backward(ref, ours, [x], lambda m, x: m(x, **kwargs), dtype, padding=padding)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal+kpm", "all"])
def test_decoder_layer_matches_torch(mask_kind, norm_first):
    batch, lt, ls, dim = 3, 5, 7, 16
    ref, ours = twins(nn.TransformerDecoderLayer, ft.TransformerDecoderLayer, dim, 4, 32, dropout=0.0,
                      activation="gelu", batch_first=True, norm_first=norm_first, bias=mask_kind != "all")
    tgt, memory = torch.randn(batch, lt, dim, dtype=torch.float64), torch.randn(batch, ls, dim, dtype=torch.float64)
    kwargs = {}
    if "causal" in mask_kind or mask_kind == "all":
        kwargs.update(tgt_mask=nn.Transformer.generate_square_subsequent_mask(lt, dtype=torch.float64), tgt_is_causal=True)
    if "kpm" in mask_kind or mask_kind == "all":
        kwargs.update(tgt_key_padding_mask=padding_mask(batch, lt), memory_key_padding_mask=padding_mask(batch, ls))
    if mask_kind == "all":
        memory_mask = torch.rand(lt, ls) < 0.3
        memory_mask[:, 0] = False
        kwargs["memory_mask"] = memory_mask
    assert_same_forward_backward(ref, ours, [tgt, memory], lambda m, t, s: m(t, s, **kwargs),
                                 padding=kwargs.get("tgt_key_padding_mask"))


def test_layers_in_training_mode_apply_dropout_like_torch():
    """Dropout draws differ from torch.nn's, so compare statistics: the mean over many draws converges
    to the eval output, and two draws differ."""
    layer = ft.TransformerEncoderLayer(16, 4, 32, dropout=0.3, batch_first=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)
    torch.manual_seed(7)
    c = layer(x)
    torch.manual_seed(7)
    assert torch.equal(c, layer(x))


# ----------------------------------------------------------------------------------------- stacks

@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_matches_torch_and_state_dicts_cross_load(norm_first):
    kwargs = dict(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, dropout=0.0,
                  batch_first=True, norm_first=norm_first)
    ref, ours = twins(nn.Transformer, ft.Transformer, **kwargs)
    assert all(type(layer) is ft.TransformerEncoderLayer for layer in ours.encoder.layers)
    assert type(ours.encoder) is ft.TransformerEncoder and type(ours.decoder.norm) is ft.LayerNorm
    batch, ls, lt = 3, 7, 5
    src, tgt = torch.randn(batch, ls, 16, dtype=torch.float64), torch.randn(batch, lt, 16, dtype=torch.float64)
    masks = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(lt, dtype=torch.float64),
                 src_key_padding_mask=padding_mask(batch, ls), memory_key_padding_mask=padding_mask(batch, ls),
                 tgt_key_padding_mask=padding_mask(batch, lt))
    assert_same_forward_backward(ref, ours, [src, tgt], lambda m, s, t: m(s, t, **masks),
                                 padding=masks["tgt_key_padding_mask"])

    # A state_dict saved from either loads strictly into the other.
    fresh_ours, fresh_ref = ft.Transformer(**kwargs).double(), nn.Transformer(**kwargs).double()
    fresh_ours.load_state_dict(ref.state_dict(), strict=True)
    fresh_ref.load_state_dict(ours.state_dict(), strict=True)
    ref.eval(), fresh_ours.eval()
    real = ~masks["tgt_key_padding_mask"]
    torch.testing.assert_close(fresh_ours(src, tgt, **masks)[real], ref(src, tgt, **masks)[real], **TOL[torch.float64])


def test_encoder_detects_a_causal_mask_like_torch(monkeypatch):
    encoder_layer = ft.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
    encoder = ft.TransformerEncoder(encoder_layer, 2, enable_nested_tensor=False)
    calls = []
    original = ft.functional.attention

    def spy(*args, **kwargs):
        calls.append(kwargs["is_causal"])
        return original(*args, **kwargs)

    x = torch.randn(5, 2, 16)
    monkeypatch.setattr(ft.functional, "attention", spy)
    encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(5))
    encoder(x, mask=torch.ones(5, 5, dtype=torch.bool).triu(1))
    encoder(x, mask=torch.zeros(5, 5))
    assert calls == [True, True, True, True, False, False]


def test_stacks_call_a_layer_that_is_no_module_class_as_torch_does():
    """PyTorch's test_train_with_is_causal puts a MagicMock among an encoder's layers: the stack calls it with
    torch.nn's arguments (no private ones), is_causal detected from the mask, instead of failing on the layer's type."""
    from unittest.mock import ANY, MagicMock

    for stack_class, layer_class in ((ft.TransformerEncoder, ft.TransformerEncoderLayer),
                                     (ft.TransformerDecoder, ft.TransformerDecoderLayer)):
        stack = stack_class(layer_class(4, 2, 8, dropout=0.0, batch_first=True), 2)
        x = torch.randn(1, 3, 4)
        mock_layer = MagicMock(nn.MultiheadAttention(4, 2), return_value=x)
        stack.layers[1] = mock_layer
        causal = torch.ones(3, 3, dtype=torch.bool).triu(1)
        if stack_class is ft.TransformerEncoder:
            stack(x, mask=causal)
            mock_layer.assert_called_with(ANY, src_mask=ANY, is_causal=True, src_key_padding_mask=ANY)
            # A mock that passes for one of our layers (isinstance) with a padding mask to pack: it runs padded.
            stack.layers[1] = mock_layer = MagicMock(stack.layers[0], return_value=x)
            padding = torch.tensor([[False, False, True]])
            stack(x, src_key_padding_mask=padding)
            mock_layer.assert_called_with(ANY, src_mask=None, is_causal=False, src_key_padding_mask=padding)
        else:
            stack(x, x, tgt_mask=causal)
            mock_layer.assert_called_with(ANY, ANY, tgt_mask=ANY, memory_mask=None, tgt_key_padding_mask=None,
                                          memory_key_padding_mask=None, tgt_is_causal=True, memory_is_causal=False)


def test_encoder_eval_no_grad_with_padding_matches_torch_on_real_tokens():
    """torch.nn converts padded input to a nested tensor here and writes zeros at padded positions;
    the real positions agree."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).double().eval()
    ours = ft.fuse(copy.deepcopy(ref))
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    kpm = padding_mask(3, 6)
    with torch.no_grad():
        expected, out = ref(x, src_key_padding_mask=kpm), ours(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out[~kpm], expected[~kpm], **TOL[torch.float64])


def test_layer_norm_module_matches_torch_for_any_normalized_shape():
    for shape, kwargs in (((16,), {}), ((4, 5), {}), ((8,), dict(elementwise_affine=False)), ((8,), dict(bias=False))):
        ref, ours = twins(nn.LayerNorm, ft.LayerNorm, shape, eps=1e-6, **kwargs)
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_()
            ours.load_state_dict(ref.state_dict())
        x = torch.randn(3, 2, *shape, dtype=torch.float64)
        assert_same_forward_backward(ref, ours, [x], lambda m, x: m(x))
    with pytest.raises(ValueError, match="does not end in normalized_shape"):
        ft.LayerNorm(8)(torch.randn(2, 7))


# ------------------------------------------------------------------------------------------- fuse

class Seq2Seq(nn.Module):
    """The shape of model our users write: embeddings, a torch.nn Transformer, an output projection."""

    def __init__(self, vocab=20, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, 4, 2, 2, 32, dropout=0.0, batch_first=True)
        self.extra_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True,
                             src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0)
        return self.out(self.extra_norm(h))


def test_fuse_swaps_modules_in_place_sharing_parameters():
    torch.manual_seed(0)
    model = Seq2Seq()
    before = {name: p for name, p in model.named_parameters()}
    src = torch.randint(1, 20, (3, 7))
    src[1, 5:] = 0
    tgt = torch.randint(1, 20, (3, 5))
    expected = model(src, tgt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    assert ft.fuse(model) is model
    assert type(model.transformer) is ft.Transformer
    assert type(model.transformer.encoder.layers[1].self_attn) is ft.MultiheadAttention
    assert type(model.transformer.decoder.layers[0].norm3) is ft.LayerNorm
    assert type(model.extra_norm) is ft.LayerNorm and type(model.out) is nn.Linear
    assert all(p is before[name] for name, p in model.named_parameters())
    out = model(src, tgt)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])

    F.cross_entropy(out.flatten(0, 1), tgt.flatten()).backward()
    optimizer.step()  # the optimizer holds the same parameter objects
    assert not torch.allclose(model(src, tgt), out)


def test_fuse_leaves_user_subclasses_alone_and_returns_a_swapped_root():
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    layer = MyLayer(16, 4)
    assert ft.fuse(layer) is layer and type(layer.self_attn) is ft.MultiheadAttention
    root = nn.MultiheadAttention(16, 4)
    fused = ft.fuse(root)
    assert type(fused) is ft.MultiheadAttention and fused.in_proj_weight is root.in_proj_weight


def test_fuse_says_what_it_swapped(caplog):
    model = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, batch_first=True), 2,
                                               enable_nested_tensor=False), nn.Linear(16, 4))
    with caplog.at_level(logging.INFO, logger="fused_transformer"):
        fused, summary = ft.fuse(model, return_summary=True)
    assert fused is model and summary.attn_implementation is None
    assert summary.swapped == {"TransformerEncoder": 1, "TransformerEncoderLayer": 2, "MultiheadAttention": 2,
                               "LayerNorm": 4}
    assert "2 MultiheadAttention" in caplog.text and "4 LayerNorm" in caplog.text
    with pytest.warns(UserWarning, match="nothing to fuse|no torch.nn Transformer module"):
        _, again = ft.fuse(model, return_summary=True)  # already fused: nothing left
    assert again.swapped == {} and str(again) == "nothing to fuse"


@pytest.mark.parametrize("not_a_module", [None, "model", [nn.Linear(2, 2)]])
def test_fuse_refuses_what_is_not_a_module(not_a_module):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ft.fuse(not_a_module)


@pytest.mark.parametrize("batch,lt,ls", [(1, 1, 1), (1, 1, 5), (2, 4, 1)])
def test_tiny_and_single_token_shapes_match_torch(batch, lt, ls):
    ref, ours = twins(nn.TransformerDecoderLayer, ft.TransformerDecoderLayer, 8, 2, 16, dropout=0.0, batch_first=True)
    tgt, memory = torch.randn(batch, lt, 8, dtype=torch.float64), torch.randn(batch, ls, 8, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(lt, dtype=torch.float64)
    assert_same_forward_backward(ref, ours, [tgt, memory], lambda m, t, s: m(t, s, tgt_mask=causal, tgt_is_causal=True))


def test_non_contiguous_inputs_match_torch():
    ref, ours = twins(nn.TransformerEncoderLayer, ft.TransformerEncoderLayer, 16, 4, 32, dropout=0.0, batch_first=True)
    x = torch.randn(6, 3, 16, dtype=torch.float64).transpose(0, 1)  # batch_first view of a seq-first buffer
    assert not x.is_contiguous()
    kpm = padding_mask(6, 3).t()  # [3, 6], a transposed view too
    assert_same_forward_backward(ref, ours, [x], lambda m, x: m(x, src_key_padding_mask=kpm), padding=kpm)


# ------------------------------------------------------------------------------------ triton backend

@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["kpm", "causal+kpm", "float_mask+kpm"])
def test_encoder_layer_on_the_triton_backend_matches_torch(mask_kind, norm_first):
    """Every op of the layer (attention, LayerNorm, feed-forward) on the Triton kernels, float32, on the GPU when
    there is one (else on CPU tensors under the interpreter), against torch.nn on the same device."""
    batch, length, dim = 3, 40, 32
    ref, ours = twins(nn.TransformerEncoderLayer, ft.TransformerEncoderLayer, dim, 4, 48, dropout=0.1,
                      activation="gelu", batch_first=True, norm_first=norm_first, dtype=torch.float32)
    ref.eval().to(DEVICE), ours.eval().to(DEVICE)
    x = torch.randn(batch, length, dim).to(DEVICE)
    kwargs = {"src_key_padding_mask": padding_mask(batch, length, [40, 33, 5]).to(DEVICE)}
    if "causal" in mask_kind:
        kwargs.update(src_mask=nn.Transformer.generate_square_subsequent_mask(length, device=DEVICE), is_causal=True)
    if "float_mask" in mask_kind:
        kwargs["src_mask"] = torch.randn(length, length).to(DEVICE)
    with ft.use_backend("triton"):
        assert_same_forward_backward(ref, ours, [x], lambda m, x: m(x, **kwargs), torch.float32,
                                     padding=kwargs["src_key_padding_mask"])


@pytest.mark.filterwarnings("ignore:Support for mismatched")
def test_decoder_layer_and_attention_weights_on_the_triton_backend_match_torch():
    batch, lt, ls, dim = 2, 35, 37, 32
    ref, ours = twins(nn.TransformerDecoderLayer, ft.TransformerDecoderLayer, dim, 4, 48, dropout=0.0,
                      batch_first=True, norm_first=False, dtype=torch.float32)
    ref.to(DEVICE), ours.to(DEVICE)
    tgt, memory = torch.randn(batch, lt, dim).to(DEVICE), torch.randn(batch, ls, dim).to(DEVICE)
    kwargs = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(lt, device=DEVICE), tgt_is_causal=True,
                  tgt_key_padding_mask=padding_mask(batch, lt).to(DEVICE),
                  memory_key_padding_mask=padding_mask(batch, ls, [37, 20]).to(DEVICE))
    with ft.use_backend("triton"):
        assert_same_forward_backward(ref, ours, [tgt, memory], lambda m, t, s: m(t, s, **kwargs), torch.float32,
                                     padding=kwargs["tgt_key_padding_mask"])
        q = torch.randn(batch, lt, dim).to(DEVICE)
        for average in (True, False):
            options = dict(key_padding_mask=kwargs["memory_key_padding_mask"], average_attn_weights=average)
            expected_out, expected_weights = ref.multihead_attn(q, memory, memory, **options)
            got_out, got_weights = ours.multihead_attn(q, memory, memory, **options)
            torch.testing.assert_close(got_out, expected_out, **TOL[torch.float32])
            torch.testing.assert_close(got_weights, expected_weights, **TOL[torch.float32])
