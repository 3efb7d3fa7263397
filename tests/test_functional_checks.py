"""Bad input gets a clear ValueError/TypeError naming the argument, from every public op, on every backend."""
import inspect

import pytest
import torch

import fused_transformer as ft
from fused_transformer.ops.attention import contract as attention_contract


def qkv(b=2, h=4, lq=5, lk=6, d=8, kv_heads=None, dtype=torch.float32):
    kv_heads = h if kv_heads is None else kv_heads
    return torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, kv_heads, lk, d, dtype=dtype), torch.randn(b, kv_heads, lk, d, dtype=dtype)


ATTENTION_CASES = [
    # (description, builder of (args, kwargs), error type, text the message must contain)
    ("3-D q", lambda q, k, v: ((q[0], k, v), {}), ValueError, "q must have 4 dims"),
    ("int k", lambda q, k, v: ((q, k.long(), v), {}), TypeError, "k must be float16"),
    ("list v", lambda q, k, v: ((q, k, v.tolist()), {}), TypeError, "v must be a torch.Tensor"),
    ("mixed dtypes", lambda q, k, v: ((q, k.double(), v), {}), TypeError, "k has dtype torch.float64"),
    ("batch mismatch", lambda q, k, v: ((q, k[:1], v[:1]), {}), ValueError, "k must be [batch=2"),
    ("head_dim mismatch", lambda q, k, v: ((q, k[..., :4], v[..., :4]), {}), ValueError, "head_dim=8"),
    ("v shape", lambda q, k, v: ((q, k, v[:, :, :3]), {}), ValueError, "v must have k's shape"),
    ("heads not a multiple", lambda q, k, v: ((q, k[:, :3], v[:, :3]), {}), ValueError, "multiple of k/v's heads"),
    ("mask shape", lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(5, 7, dtype=torch.bool)}), ValueError, "attn_mask of shape (5, 7)"),
    ("mask dtype", lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(5, 6, dtype=torch.int32)}), TypeError, "attn_mask must be bool"),
    ("padding dtype", lambda q, k, v: ((q, k, v), {"key_padding_mask": torch.zeros(2, 6)}), TypeError, "key_padding_mask must be bool"),
    ("padding shape", lambda q, k, v: ((q, k, v), {"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)}), ValueError, "key_padding_mask must be [batch, seq_k]"),
    ("alignment", lambda q, k, v: ((q, k, v), {"is_causal": True, "causal_alignment": "diagonal"}), ValueError, "causal_alignment='diagonal'"),
    ("dropout 1", lambda q, k, v: ((q, k, v), {"dropout_p": 1.0}), ValueError, "dropout_p=1.0"),
    ("dropout negative", lambda q, k, v: ((q, k, v), {"dropout_p": -0.1}), ValueError, "dropout_p=-0.1"),
    ("is_causal tensor", lambda q, k, v: ((q, k, v), {"is_causal": torch.tensor(True)}), TypeError, "is_causal must be a bool"),
    ("scale string", lambda q, k, v: ((q, k, v), {"scale": "0.1"}), TypeError, "scale must be a number"),
]


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_rejects_bad_input(case, backend):
    _, build, error, text = case
    args, kwargs = build(*qkv())
    with ft.use_backend(backend), pytest.raises(error, match=text.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ft.attention(*args, **kwargs)


def test_attention_rejects_mixed_devices():
    q, k, v = qkv()
    meta_k = torch.empty(k.shape, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        ft.attention(q, meta_k, v)


def test_attention_weights_rejects_wrong_lse_shape():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"lse must be a tensor of shape \[B, H, Lq\]"):
        ft.attention_weights(q, k, torch.zeros(2, 4, 6))


def test_layer_norm_rejects_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        ft.layer_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        ft.layer_norm(x, None, torch.ones(8, 1))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        ft.layer_norm(x, None, None, residual=torch.randn(3, 7))
    with pytest.raises(TypeError, match="residual has dtype torch.float64"):
        ft.layer_norm(x, None, None, residual=torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be float16"):
        ft.layer_norm(x.long(), None, None)
    with pytest.raises(ValueError, match="eps=-1"):
        ft.layer_norm(x, None, None, eps=-1)
    with pytest.raises(ValueError, match="dropout_p=2"):
        ft.layer_norm(x, None, None, dropout_p=2)
    with pytest.raises(ValueError, match="x must have at least 1 dim"):
        ft.layer_norm(torch.tensor(1.0), None, None)


def test_feed_forward_rejects_bad_input():
    x, w1, b1, w2, b2 = torch.randn(4, 6), torch.randn(10, 6), torch.randn(10), torch.randn(3, 10), torch.randn(3)
    with pytest.raises(ValueError, match=r"w1 must be \[d_ff, d_model=6\]"):
        ft.feed_forward(x, w1[:, :5], b1, w2, b2)
    with pytest.raises(ValueError, match=r"w2 must be \[d_out, d_ff=10\]"):
        ft.feed_forward(x, w1, b1, w2[:, :9], b2)
    with pytest.raises(ValueError, match=r"b1 must be \[10\]"):
        ft.feed_forward(x, w1, b1[:9], w2, b2)
    with pytest.raises(ValueError, match=r"w2 must have 2 dims"):
        ft.feed_forward(x, w1, b1, w2[None], b2)
    with pytest.raises(TypeError, match="w1 has dtype torch.float64"):
        ft.feed_forward(x, w1.double(), b1, w2, b2)
    with pytest.raises(ValueError, match="activation='swish'"):
        ft.feed_forward(x, w1, b1, w2, b2, activation="swish")
    with pytest.raises(ValueError, match="dropout_p=1"):
        ft.feed_forward(x, w1, b1, w2, b2, dropout_p=1)


@pytest.mark.parametrize("op, options", [
    (ft.functional.attention, attention_contract.ATTENTION_OPTIONS),
    (ft.functional.attention_varlen, attention_contract.ATTENTION_VARLEN_OPTIONS),
    # softcap is functional's alone: the weights kernels do not cap (the route runs capped weights on the reference)
    (ft.functional.attention_weights, {**attention_contract.ATTENTION_WEIGHTS_OPTIONS, "softcap": None}),
    (ft.functional.layer_norm, ft.ops.layer_norm.OPTIONS),
    (ft.functional.feed_forward, ft.ops.feed_forward.OPTIONS),
], ids=lambda x: getattr(x, "__name__", ""))
def test_kernel_level_options_are_functionals_keyword_arguments(op, options):
    """The kernel-level entries take functional's keyword arguments as **options, with the defaults the contract
    lists: the two must name the same arguments with the same defaults."""
    keyword_only = {name: p.default for name, p in inspect.signature(op).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword_only == options


def test_a_call_seen_before_still_checks_what_differs():
    """A call without masks seen before skips its checks (its facts are kept under everything they read); any
    argument that differs, bad ones included, is checked again."""
    q = torch.randn(2, 2, 8, 16)
    ft.attention(q, q, q)
    ft.attention(q, q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        ft.attention(q, q, q, dropout_p=[0.1])
    with pytest.raises(TypeError, match="is_causal"):
        ft.attention(q, q, q, is_causal="yes")
    with pytest.raises(ValueError, match="k must be"):
        ft.attention(q, q[..., :8], q)
    with pytest.raises(TypeError, match="k has dtype torch.float64"):
        ft.attention(q, q.double(), q)
