"""softcap, ALiBi and attention sinks in ``attention`` and ``attention_varlen``: the Triton kernels (on CUDA, else under
the interpreter) forward and backward against the float64 reference, the sinks' gradient included; the reference
against a direct formula; and the checks of the functional API.

Conventions under test (FlashAttention's): scores scaled, then ``softcap * tanh(s / softcap)``, then ``-slope |i + o -
j|`` (o the causal alignment's offset), then the masks; a sink logit per head joins each real row's denominator.
"""
import math

import pytest
import torch

import fused_transformer as ft
from fused_transformer import autograd, contract, reference
from fused_transformer.kernels import attention as triton_attention
from tests.numerics import DEVICE, assert_close_to_reference
from tests.test_attention_triton import _take_tma_path, tma_available
from tests.test_attention_varlen_triton import LENS_Q, LENS_K, _cu_seqlens
from fused_transformer.ops.attention import contract as attention_contract
from fused_transformer.ops.attention import function as attention_function

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _inputs(shape_q, shape_kv, heads, batch, alibi, sinks, seed):
    """float64 q, k, v, do and the slopes ([H], [B, H] or None) and sinks ([H] or None)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g, dtype=torch.float64)
    k = torch.randn(*shape_kv, generator=g, dtype=torch.float64)
    v = torch.randn(*shape_kv, generator=g, dtype=torch.float64)
    do = torch.randn(*shape_q, generator=g, dtype=torch.float64)
    slopes = None
    if alibi == "per_head":
        slopes = torch.rand(heads, generator=g, dtype=torch.float64) * 0.5
    elif alibi == "per_batch":
        slopes = torch.rand(batch, heads, generator=g, dtype=torch.float64) * 0.5
    sink = torch.randn(heads, generator=g, dtype=torch.float64) * 2 if sinks else None
    return [None if t is None else t.to(DEVICE) for t in (q, k, v, do, slopes, sink)]


def _run(fn, q, k, v, do, slopes, sinks, dtype, *args, **options):
    """out, lse, dq, dk, dv and the sinks' gradient of ``fn`` on the inputs cast to ``dtype`` (the slopes and sinks in
    float32, float64 for float64)."""
    side = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if sinks is not None:
        sinks = sinks.detach().to(side).requires_grad_()
        leaves.append(sinks)
    slopes = None if slopes is None else slopes.to(side)
    out, lse = fn(q, k, v, *args, alibi_slopes=slopes, sinks=sinks, return_lse=True, **options)
    loss = (out * do.to(out.dtype)).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * 0.5).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out, lse, *grads)


def _check(fn, ref_fn, q, k, v, do, slopes, sinks, dtype, *args, **options):
    got = _run(fn, q, k, v, do, slopes, sinks, dtype, *args, **options)
    ref = _run(ref_fn, q, k, v, do, slopes, sinks, torch.float64, *args, **options)
    base = _run(ref_fn, q, k, v, do, slopes, sinks, dtype, *args, **options)
    for name, out, ref64, baseline in zip(NAMES, got, ref, base):
        assert out.shape == baseline.shape and out.dtype == baseline.dtype, name
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref64)), f"{name}: -inf rows differ"
        finite = ~torch.isneginf(ref64)
        assert_close_to_reference(out[finite], ref64[finite], baseline[finite], f"{name} ({options}, {dtype})")
    return got


DENSE_CASES = {
    "softcap_causal": dict(softcap=1.5, is_causal=True),
    "alibi_heads_cross_bottom_right": dict(alibi="per_head", causal_alignment="bottom_right"),
    "alibi_batch_causal_top_left": dict(alibi="per_batch", is_causal=True),
    "sinks_key_padding": dict(sinks=True, key_padding=True),
    "all_padding_causal_bottom_right": dict(softcap=2.0, alibi="per_batch", sinks=True, key_padding=True,
                                            query_padding=True, is_causal=True, causal_alignment="bottom_right"),
    "all_window_gqa": dict(softcap=3.0, alibi="per_head", sinks=True, window=(9, 4), kv_heads=1),
}


def _dense(case, dtype, seed=0, batch=2, heads=2, lq=37, lk=45, head_dim=16):
    options = dict(DENSE_CASES[case])
    kv_heads = options.pop("kv_heads", heads)
    alibi, sinks = options.pop("alibi", None), options.pop("sinks", False)
    g = torch.Generator().manual_seed(seed + 1)
    if options.pop("key_padding", False):
        padding = torch.rand(batch, lk, generator=g) < 0.25
        padding[0, 30:] = True  # right padding in one sequence, scattered in both
        options["key_padding_mask"] = padding.to(DEVICE)
    if options.pop("query_padding", False):
        options["query_padding_mask"] = (torch.rand(batch, lq, generator=g) < 0.2).to(DEVICE)
    q, k, v, do, slopes, sink = _inputs((batch, heads, lq, head_dim), (batch, kv_heads, lk, head_dim), heads, batch,
                                        alibi, sinks, seed)
    return (q, k, v, do, slopes, sink), options


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_triton_dense_matches_reference(case, dtype):
    tensors, options = _dense(case, dtype)
    _check(triton_attention.attention, reference.attention, *tensors, dtype, **options)


@pytest.mark.parametrize("options", [
    dict(softcap=2.0, alibi="per_batch", sinks=True, is_causal=True, causal_alignment="bottom_right"),
    dict(alibi="per_head", sinks=True, window=(6, 2), causal_alignment="bottom_right", kv_heads=1),
    dict(softcap=1.0, is_causal=True),
], ids=["all_causal_bottom_right", "alibi_sinks_window_gqa", "softcap_causal_top_left"])
def test_triton_varlen_matches_reference(options):
    options = dict(options)
    heads, kv_heads = 2, options.pop("kv_heads", 2)
    alibi, sinks = options.pop("alibi", None), options.pop("sinks", False)
    q, k, v, do, slopes, sink = _inputs((sum(LENS_Q), heads, 16), (sum(LENS_K), kv_heads, 16), heads, len(LENS_Q),
                                        alibi, sinks, seed=3)
    seqlens = (_cu_seqlens(LENS_Q), _cu_seqlens(LENS_K), max(LENS_Q), max(LENS_K))
    _check(triton_attention.attention_varlen, reference.attention_varlen, q, k, v, do, slopes, sink, torch.bfloat16,
           *seqlens, **options)


def test_ops_with_score_mods_pass_opcheck():
    """Schema and fake functions of the forward (with its float32 output for trainable sinks) and backward ops with
    softcap, ALiBi and sinks, as torch.compile needs them."""
    q, k, v, do, slopes, sinks = _inputs((1, 2, 9, 16), (1, 1, 7, 16), 2, 1, "per_head", True, seed=6)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    slopes, sinks = slopes.float(), sinks.float()
    # masks, spec (causal, alignment, window, dropout, scale, tf32), seed, the modifiers' tensors and numbers
    options = (None, None, None, None, True, "bottom_right", 3, None, 0.0, 0.25, False, None, [slopes], [2.0])
    forward = (q, k, v, *options, sinks, True)
    torch.library.opcheck(torch.ops.fused_transformer.attention_fwd, forward,
                          test_utils=("test_schema", "test_faketensor"))
    o, lse = torch.ops.fused_transformer.attention_fwd(*forward)
    assert o.dtype == torch.float32 and o.transpose(1, 2).is_contiguous()
    torch.library.opcheck(torch.ops.fused_transformer.attention_bwd,
                          (do, None, q, k, v, o.to(q.dtype), lse, *options),
                          test_utils=("test_schema", "test_faketensor"))


def test_triton_tma_path_matches_reference(monkeypatch):
    decisions = _take_tma_path(monkeypatch)
    tensors, options = _dense("all_window_gqa", torch.bfloat16, head_dim=32)
    _check(triton_attention.attention, reference.attention, *tensors, torch.bfloat16, **options)
    assert decisions and all(decision == tma_available() for decision in decisions), decisions


@pytest.mark.parametrize("fn", [triton_attention.attention, reference.attention], ids=["triton", "reference"])
def test_sink_row_without_keys_is_zero_with_the_sink_as_lse(fn):
    """A query whose keys are all padding attends to the sink alone: output 0, LSE the sink's logit; a padding query
    stays a padding query (zeros, LSE -inf)."""
    q, k, v = (torch.randn(2, 2, 5, 8, device=DEVICE) for _ in range(3))
    padding = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    padding[1] = True
    query_padding = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    query_padding[0, 4] = True
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    out, lse = fn(q, k, v, key_padding_mask=padding, query_padding_mask=query_padding, sinks=sinks, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(lse[1], sinks[:, None].expand(2, 5))
    assert torch.isneginf(lse[0, :, 4]).all() and not out[0, :, 4].any()
    assert torch.isfinite(lse[0, :, :4]).all() and (out[0, :, :4].abs().sum(-1) > 0).all()


def test_reference_matches_the_formula():
    """The reference (and so every kernel checked against it) computes the convention the docs state."""
    q, k, v, _, slopes, sink = _inputs((2, 2, 5, 8), (2, 2, 9, 8), 2, 2, "per_head", True, seed=4)
    cap = 1.7
    out, lse = reference.attention(q, k, v, is_causal=True, causal_alignment="bottom_right", softcap=cap,
                                   alibi_slopes=slopes, sinks=sink, return_lse=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = cap * torch.tanh(s / cap)
    i = torch.arange(5, device=q.device)[:, None] + 9 - 5
    j = torch.arange(9, device=q.device)[None, :]
    s = s - slopes[None, :, None, None] * (i - j).abs()
    s = s.masked_fill(j > i, float("-inf"))
    full = torch.cat([s, sink[None, :, None, None].expand(2, 2, 5, 1)], dim=-1)
    torch.testing.assert_close(out, full.softmax(-1)[..., :-1] @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(full, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("head_dim_last", [False, True], ids=["dense", "packed"])
def test_sinks_gradient_is_the_autograd_one(head_dim_last):
    """``function.sinks_gradient``, which every backend's backward uses, against autograd through the reference."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 2] = True
    out, lse = reference.attention(q, k, v, query_padding_mask=padding, is_causal=True, sinks=sinks, return_lse=True)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    expected, = torch.autograd.grad((out * do).sum() + (torch.where(lse.isinf(), 0, lse) * dlse).sum(), [sinks])
    out, lse, do, dlse = out.detach(), lse.detach(), do, torch.where(lse.isinf(), 0, dlse)
    if head_dim_last:  # the packed layouts: out / do [T, H, D], lse [H, T]
        out, do = (t.transpose(1, 2).flatten(0, 1) for t in (out, do))
        lse, dlse = (t.transpose(0, 1).flatten(1, 2) for t in (lse, dlse))
    got = attention_function.sinks_gradient(sinks.detach(), lse, do, out, dlse, head_dim_last)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_alibi_and_softcap_change_the_result():
    """Neither option is silently ignored: each moves the output far beyond rounding."""
    q, k, v = (torch.randn(1, 2, 9, 8, device=DEVICE) for _ in range(3))
    plain = triton_attention.attention(q, k, v)
    slopes = torch.tensor([0.5, 1.0], device=DEVICE)
    assert (triton_attention.attention(q, k, v, alibi_slopes=slopes) - plain).abs().max() > 1e-2
    capped = triton_attention.attention(q * 4, k, v, softcap=0.5)
    assert (capped - triton_attention.attention(q * 4, k, v)).abs().max() > 1e-2


def test_the_custom_ops_flat_form_of_the_modifiers_gives_them_back():
    """``contract.score_mods_flat`` / ``score_mods_of_flat``, the custom ops' form of the modifiers: tensors and numbers
    in two lists, NaN for a number absent (a given one is finite); none at all comes back as ``NO_SCORE_MODS``."""
    slopes = torch.rand(3)
    for mods in (contract.ScoreMods(), contract.ScoreMods(softcap=2.5), contract.ScoreMods(alibi_slopes=slopes),
                 contract.ScoreMods(softcap=0.75, alibi_slopes=slopes)):
        tensors, numbers = contract.score_mods_flat(mods)
        assert len(tensors) == len(contract.SCORE_MOD_TENSORS) and all(isinstance(n, float) for n in numbers)
        again = contract.score_mods_of_flat(tensors, numbers)
        assert again.given == mods.given and again.softcap == mods.softcap and again.alibi_slopes is mods.alibi_slopes
    assert contract.score_mods_of_flat(*contract.score_mods_flat(contract.ScoreMods())) is contract.NO_SCORE_MODS
    q = torch.randn(2, 3, 4, 8)
    assert attention_contract.score_mods(q, 2, 3) is contract.NO_SCORE_MODS  # what the hot path tests by identity


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(softcap=0.0), ValueError, "softcap=0.0 must be None or a finite number > 0"),
    (dict(softcap=True), ValueError, "softcap=True"),
    (dict(softcap=float("inf")), ValueError, "softcap=inf"),
    (dict(alibi_slopes=torch.ones(3)), TypeError, r"alibi_slopes must be float32 of shape \[2\] or \[2, 2\]"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "alibi_slopes .* dtype torch.float16"),
    (dict(alibi_slopes=[0.5, 0.5]), TypeError, "alibi_slopes must be a torch.Tensor or None, got list"),
    (dict(sinks=torch.ones(2, 2)), TypeError, r"sinks must be float32 of shape \[2\]"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), ValueError, "alibi_slopes requires grad"),
], ids=["softcap_zero", "softcap_bool", "softcap_inf", "alibi_heads", "alibi_dtype", "alibi_list", "sinks_shape",
        "alibi_requires_grad"])
@pytest.mark.parametrize("op", ["attention", "attention_varlen"])
def test_bad_arguments_are_refused_by_name(op, kwargs, error, match):
    if op == "attention":
        q = torch.randn(2, 2, 3, 4)
        call = lambda: ft.attention(q, q, q, **kwargs)  # noqa: E731
    else:
        q = torch.randn(6, 2, 4)
        cu = torch.tensor([0, 3, 6], dtype=torch.int32)
        call = lambda: ft.attention_varlen(q, q, q, cu, cu, 3, 3, **kwargs)  # noqa: E731
    with pytest.raises(error, match=match):
        call()


def test_functional_autocast_leaves_slopes_and_sinks_in_float32():
    """Under autocast q, k and v run in bfloat16; the float32 slopes and sinks stay float32 (and the sinks get their
    gradient)."""
    q, k, v = (torch.randn(1, 2, 6, 8, device=DEVICE) for _ in range(3))
    sinks = torch.zeros(2, device=DEVICE, requires_grad=True)
    with ft.backend.use_backend("reference"), torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ft.attention(q, k, v, alibi_slopes=torch.ones(2, device=DEVICE), sinks=sinks, softcap=5.0)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.float32 and sinks.grad.abs().sum() > 0


def test_compiled_training_step_with_score_mods_has_no_graph_break():
    """``torch.compile(fullgraph=True)`` traces softcap, ALiBi and trainable sinks through the custom ops (forward and
    backward, the sinks' gradient included) and gives the eager step's results."""
    q, k, v, do, slopes, sinks = (t.float() for t in _inputs((1, 2, 9, 16), (1, 2, 9, 16), 2, 1, "per_head", True,
                                                              seed=7))
    sinks.requires_grad_()

    def loss(q, k, v, sinks):
        out = triton_attention.attention(q, k, v, is_causal=True, softcap=2.0, alibi_slopes=slopes, sinks=sinks)
        return (out * do).sum()

    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + [sinks]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    expected = torch.autograd.grad(loss(*inputs), inputs)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_plumbing_names_no_score_modifier():
    """A score modifier lives in ``contract.ScoreMods``, the reference, ``kernels/attention/jit.py`` and the public
    keywords (docs/attention.md, "Adding a score modifier"): the layers between pass ``ScoreMods`` on as it is. No
    name in their code (comments and strings aside) is a modifier's, nor its place in the kernels' tuples."""
    import io
    import pathlib
    import tokenize

    import fused_transformer.kernels as kernels

    package, kernels_dir = pathlib.Path(ft.__file__).parent, pathlib.Path(kernels.__file__).parent
    plumbing = [package / name for name in ("autograd.py", "backend.py", "route.py")] + [
        kernels_dir / "backend.py", *(kernels_dir / "attention" / f"{name}.py" for name in (
            "__init__", "fwd", "bwd", "decode", "weights", "launch", "ops", "configs", "aot"))]
    modifiers = {*contract.ScoreMods._fields, "SOFTCAP", "ALIBI", "alibi", "slope", "slopes"}
    for path in plumbing:
        names = {token.string for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                 if token.type == tokenize.NAME}
        assert not names & modifiers, (path.name, sorted(names & modifiers))
