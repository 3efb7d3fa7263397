"""The attention route (kernels/attention/routes.py): which calls a GPU's measured rows send to SDPA, and that
such a call runs SDPA, and nothing of ours, exactly where it should. CPU tensors stand in for a GPU's: the route
reads the compute capability through ``routes.capability_of``, which the tests answer."""
import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import autograd, contract
from fused_transformer.contract import AttentionMasks
from fused_transformer.kernels import attention as triton_attention
from fused_transformer.kernels.attention import routes

from numerics import assert_close_to_reference

H200 = 90


def _route(capability=H200, dtype=torch.bfloat16, head_dim=64, heads=8, kv_heads=8, query_len=128, key_len=128,
           mask="causal", needs_lse=False, needs_grad=False):
    return routes.route(capability, dtype, head_dim, heads, kv_heads, query_len, key_len, mask, needs_lse, needs_grad)


def test_the_measured_rows_send_dense_16_bit_calls_to_sdpa():
    for head_dim in (64, 128):
        for mask in ("none", "causal"):
            row = _route(head_dim=head_dim, mask=mask)
            assert row is not None and row.sdpa_backend == "cudnn_attention"
    assert _route(query_len=1, key_len=4096) is not None


@pytest.mark.parametrize("change", [
    dict(capability=None), dict(capability=80), dict(capability=100), dict(dtype=torch.float16),
    dict(dtype=torch.float32), dict(head_dim=96), dict(kv_heads=2), dict(mask=None), dict(needs_lse=True),
    dict(needs_grad=True), dict(query_len=0), dict(key_len=0),
], ids=lambda change: "-".join(f"{k}={v}" for k, v in change.items()))
def test_every_other_call_keeps_our_kernel(change):
    """No row (another GPU: the documented default), a dtype / head dim not measured, GQA, an LSE asked for, a
    gradient (SDPA's backward determinism unmeasured), an empty dim."""
    assert _route(**change) is None


NO_MODS = contract.NO_SCORE_MODS


def _spec(q, **options):
    options = {"is_causal": False, "causal_alignment": "top_left", "window": None, "dropout_p": 0.0, "scale": None,
               **options}
    return contract.attention_spec(q.shape[-1], options["is_causal"], options["causal_alignment"], options["window"],
                                   options["dropout_p"], options["scale"])


def test_mask_kind_names_only_what_sdpa_computes_alike():
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 9, 8)
    square = torch.randn(2, 4, 6, 8)
    plain = AttentionMasks()
    assert routes.mask_kind(q, k, plain, _spec(q), NO_MODS, None) == "none"
    assert routes.mask_kind(q, k, plain, _spec(q, is_causal=True), NO_MODS, None) == "causal"  # top-left, as SDPA's
    assert routes.mask_kind(q, k, plain, _spec(q, is_causal=True, causal_alignment="bottom_right"), NO_MODS,
                            None) is None
    assert routes.mask_kind(q, square, plain, _spec(q, is_causal=True, causal_alignment="bottom_right"),
                            NO_MODS, None) == "causal"
    others = [(AttentionMasks(key_padding_mask=torch.zeros(2, 9, dtype=torch.bool)), _spec(q), NO_MODS, None),
              (AttentionMasks(attn_mask=torch.ones(6, 9, dtype=torch.bool)), _spec(q), NO_MODS, None),
              (plain, _spec(q, dropout_p=0.1), NO_MODS, None), (plain, _spec(q, window=(2, 0)), NO_MODS, None),
              (plain, _spec(q), contract.ScoreMods(softcap=30.0), None),
              (plain, _spec(q), contract.ScoreMods(alibi_slopes=torch.ones(4)), None),
              (plain, _spec(q), NO_MODS, torch.zeros(4))]
    for masks, spec, mods, sinks in others:
        assert routes.mask_kind(q, k, masks, spec, mods, sinks) is None


@pytest.fixture
def stand_in_h200(monkeypatch):
    """An H200's answer to the capability query, and our kernels' entries refusing to run."""
    monkeypatch.setattr(routes, "capability_of", lambda device: H200)
    ran = []

    def ours(*args, **kwargs):
        ran.append("ours")
        raise AssertionError("our kernel ran")

    monkeypatch.setattr(ft.backend.ops("triton"), "attention_fwd", ours)
    return ran


def _inputs(requires_grad=False):
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(2, 4, 16, 64, generator=generator).to(torch.bfloat16).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_a_routed_call_is_sdpas_own(stand_in_h200, causal):
    q, k, v = _inputs()
    spec = _spec(q, is_causal=causal, scale=0.3)
    out, lse = autograd.attention("triton", q, k, v, AttentionMasks(), spec, NO_MODS, None, False)
    assert lse is None and stand_in_h200 == []
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3))
    # and it is our op's result: the float64 reference with the same mask and scale, within the usual rule
    inputs64 = [t.double() for t in (q, k, v)]
    oracle = ft.backend.ops("reference").attention
    ref64 = oracle(*inputs64, AttentionMasks(), spec, NO_MODS, None)[0]
    baseline = oracle(q, k, v, AttentionMasks(), spec, NO_MODS, None)[0]
    assert_close_to_reference(out, ref64, baseline)


def test_the_triton_backend_named_forces_our_kernel(stand_in_h200):
    q, k, v = _inputs()
    with ft.use_backend("triton"), pytest.raises(AssertionError, match="our kernel ran"):
        autograd.attention("triton", q, k, v, AttentionMasks(), _spec(q), NO_MODS, None, False)
    with pytest.raises(AssertionError, match="our kernel ran"):  # the LSE asked for
        autograd.attention("triton", q, k, v, AttentionMasks(), _spec(q), NO_MODS, None, True)
    with pytest.raises(AssertionError, match="our kernel ran"):  # the Triton entry, kernel-level options and all
        triton_attention.attention(q, k, v)
    assert stand_in_h200 == ["ours"] * 3


def test_calls_that_need_gradients_or_are_traced_keep_our_kernel(stand_in_h200, monkeypatch):
    q, k, v = _inputs(requires_grad=True)
    with pytest.raises(AssertionError, match="our kernel ran"):  # q, k, v need gradients: ours
        autograd.attention("triton", q, k, v, AttentionMasks(), _spec(q), NO_MODS, None, False)
    with torch.no_grad():
        assert autograd.attention("triton", q, k, v, AttentionMasks(), _spec(q), NO_MODS, None, False)[1] is None
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert routes.attention_composed(q, k, v, AttentionMasks(), _spec(q), NO_MODS, None, False, False) is None
    assert stand_in_h200 == ["ours"]


def test_off_a_gpu_there_is_no_capability():
    assert routes.capability_of(torch.device("cpu")) is None
