"""torch's SDPA flash-attention registry: ``activate_flash_attention_impl("fused_transformer")`` routes
``F.scaled_dot_product_attention`` and ``varlen_attn`` to our kernels, and ``restore`` undoes it.

CPU calls go through the dispatcher to the C++ kernels. The CUDA implementations (Triton) are called directly, on
CUDA tensors where there is a GPU, else on CPU tensors under the Triton interpreter: their argument handling, layouts
and the dropout seed kept in ``rng_state`` are the same code either way."""
import contextlib
import inspect
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import reference
from fused_transformer.integrations import sdpa
from fused_transformer.ops.attention import facts as attention_facts

from tests.numerics import DEVICE, assert_close_to_reference

attention_registry = pytest.importorskip("torch.nn.attention")
if not hasattr(attention_registry, "register_flash_attention_impl"):
    pytest.skip("this torch has no flash-attention registry", allow_module_level=True)

from torch.nn.attention import (  # noqa: E402
    activate_flash_attention_impl, current_flash_attention_impl, list_flash_attention_impls,
    restore_flash_attention_impl,
)
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

# varlen_attn takes grouped-query K / V from torch 2.13 (enable_gqa); before, K and V have the query's heads.
VARLEN_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters


@contextlib.contextmanager
def activated(route: str = "ours"):
    """Our implementation activated; with ``route="ours"`` a backend of ours named (``use_backend``), which the door
    honours by running every call its kernels serve on them; ``"fastest"``: the route table decides."""
    activate_flash_attention_impl(sdpa.NAME)
    try:
        with ft.use_backend("cpu") if route == "ours" else contextlib.nullcontext():
            yield
    finally:
        restore_flash_attention_impl()


def _cpu_door(lk: int, is_causal: bool) -> bool:
    """Whether the route gives a float32 call of ``lk`` keys at SDPA's door on the CPU its rows were measured on (an
    AVX-512 CPU, 2 threads) to our kernel."""
    call = ft.route.Call("attention", "cpu-avx512-t2", torch.float32, door="sdpa", head_dim=8,
                         mask="causal" if is_causal else "none", size=lk, torch_default=attention_facts.DENSE_PRIOR)
    return ft.route.decide(call, "auto", "cpu", ft.route.table()).ours


# The CPU implementations are the C++ kernels: a GPU machine installed without the C++ build has none.
needs_cpu_kernels = pytest.mark.skipif(ft.backend.cpu_unavailable_reason() is not None,
                                       reason=str(ft.backend.cpu_unavailable_reason()))


@pytest.fixture
def kernel_calls(monkeypatch) -> Dict[str, List[str]]:
    """Which of our kernels ran, per device class and entry."""
    calls: Dict[str, List[str]] = {"cpu": [], "triton": []}
    for kernels in (sdpa.CPU.kernels, sdpa.CUDA.kernels):
        for entry in ("dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd"):
            original = getattr(kernels, entry)

            def spy(*args, _original=original, _entry=entry, _device=kernels.name):
                calls[_device].append(_entry)
                return _original(*args)

            monkeypatch.setattr(kernels, entry, spy)
    return calls


def _tensors(dtype, batch=2, heads=4, kv_heads=4, lq=9, lk=9, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, lq, heads, dim, generator=generator, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(batch, lk, kv_heads, dim, generator=generator, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(batch, lk, kv_heads, dim, generator=generator, dtype=torch.float64).transpose(1, 2)
    dout = torch.randn(batch, heads, lq, dim, generator=generator, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _sdpa_with_grads(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal_lq_lt_lk": dict(is_causal=True, lk=13),
    "bool_mask": dict(attn_mask="bool"),
    "float_mask": dict(attn_mask="float"),
    "lq_ne_lk": dict(lk=5),
    "gqa": dict(kv_heads=2, enable_gqa=True),
    "scale": dict(scale=0.37),
}


def _case(dtype, case):
    options = dict(CASES[case])
    shapes = {name: options.pop(name) for name in ("lk", "kv_heads") if name in options}
    q, k, v, dout = _tensors(dtype, **shapes)
    mask = options.pop("attn_mask", None)
    generator = torch.Generator().manual_seed(1)
    if mask == "bool":
        options["attn_mask"] = torch.rand(q.shape[0], 1, q.shape[2], k.shape[2], generator=generator) > 0.3
        options["attn_mask"][..., 0] = True  # every row keeps a key (a fully masked row is NaN in torch)
    elif mask == "float":
        options["attn_mask"] = torch.randn(q.shape[2], k.shape[2], generator=generator).to(dtype)
    return (q, k, v, dout), options


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
@needs_cpu_kernels
def test_cpu_sdpa_runs_ours_within_native_error(dtype, case, kernel_calls):
    tensors, options = _case(dtype, case)
    native = _sdpa_with_grads(*tensors, **options)
    options64 = {name: (value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value)
                 for name, value in options.items()}
    exact = _sdpa_with_grads(*(t.double() for t in tensors), **options64)
    with activated():
        ours = _sdpa_with_grads(*tensors, **options)
    assert kernel_calls["cpu"] == ["dense_fwd", "dense_bwd"]
    for name, mine, theirs, ref in zip(("out", "dq", "dk", "dv"), ours, native, exact):
        assert mine.dtype == theirs.dtype and mine.stride() == theirs.stride(), name
        if dtype == torch.float64:
            assert (mine - ref).abs().max().item() <= 1e-12, name
        else:
            assert_close_to_reference(mine, ref, theirs, name)


@needs_cpu_kernels
def test_cpu_outputs_follow_the_meta_layouts():
    q, k, v, dout = _tensors(torch.bfloat16)
    with activated():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                                      True)
    with torch.device("meta"):
        meta = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*(t.to("meta") for t in (q, k, v)), 0.0,
                                                                          True)
    assert out.stride() == meta[0].stride() and lse.stride() == meta[1].stride() and lse.dtype == meta[1].dtype
    for grad, like in zip(grads, (q, k, v)):
        assert grad.shape == like.shape and grad.permute(0, 2, 1, 3).is_contiguous()


@needs_cpu_kernels
def test_restore_runs_torchs_kernels_again(kernel_calls):
    assert sdpa.NAME in list_flash_attention_impls()
    assert current_flash_attention_impl() is None  # importing registers, never activates
    q, k, v, dout = _tensors(torch.float32)
    with activated():
        assert current_flash_attention_impl() == sdpa.NAME
        F.scaled_dot_product_attention(q, k, v)
    assert current_flash_attention_impl() is None
    calls = list(kernel_calls["cpu"])
    _sdpa_with_grads(q, k, v, dout, is_causal=True)
    assert calls == ["dense_fwd"] and kernel_calls["cpu"] == calls


@needs_cpu_kernels
@pytest.mark.parametrize("lk, is_causal, ours", [(64, True, False), (128, True, True), (1024, True, True),
                                                   (2048, True, True), (127, False, False), (512, False, True)])
def test_fastest_route_sends_calls_where_measured_faster(lk, is_causal, ours, kernel_calls, monkeypatch):
    assert _cpu_door(lk, is_causal) is ours
    # This CPU routed as the one the door's rows were measured on (tests/conftest.py names an unmeasured one).
    monkeypatch.setenv("FUSED_TRANSFORMER_ROUTE_CPU", "cpu-avx512-t2")
    for cache in ("_CPU_TAGS", "_TABLES", "_DECISIONS"):
        monkeypatch.setattr(ft.route, cache, {})
    q = torch.randn(1, 2, 2, 8)
    k = v = torch.randn(1, 2, lk, 8)
    with activated(route="fastest"):
        F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert kernel_calls["cpu"] == (["dense_fwd"] if ours else [])


def test_a_failed_activation_leaves_torchs_kernels_in_place(monkeypatch):
    """An activation that fails half-way (here an op this torch lacks) registers nothing: the next one captures
    torch's own kernels as the ones to fall back on, not a leftover of ours (which would call itself)."""
    q, k, v, _ = _tensors(torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    every = sdpa.CUDA.implementations

    def with_a_missing_op():
        return [*every(), ("_no_such_flash_op", sdpa.CUDA.flash_forward)]

    monkeypatch.setattr(sdpa.CUDA, "implementations", with_a_missing_op)
    with pytest.raises(Exception) as failed:  # kept: its traceback holds the half-made library (as a REPL's would)
        sdpa.activate()
    monkeypatch.setattr(sdpa.CUDA, "implementations", every)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
    with activated(route="fastest"):  # route 'fastest' hands these 9 keys to the kernel registered before ours
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
    assert all(kernel is None or "sdpa.py" not in str(kernel) for device in sdpa.DEVICES
               for kernel in device.previous.kernels.values())
    assert failed.traceback


def test_every_implementation_overrides_an_op_this_torch_has():
    for device in sdpa.DEVICES:
        names = [name for name, _ in device.implementations()]
        assert names[:3] == [device.sdpa_op, device.sdpa_op + "_backward", "_flash_attention_forward"]
        assert all(hasattr(torch.ops.aten, name) for name in names)


def test_fastest_route_on_cuda_follows_the_measured_rows():
    """On a GPU the door reads the rows measured for every door: the H200's send dense bfloat16 calls without a mask
    or causal to torch's kernel (cuDNN there), and so does the prior where no row matches (another width, another
    GPU: the H200's rows as priors)."""
    h200, a100 = ft.route.MEASURED_DEVICES["H200"], ft.route.DeviceFacts("A100-SXM4-80GB", "cuda", (8, 0), 2039.0)
    for facts in (h200, a100):
        rows = ft.route.with_priors(facts, ft.route.table())
        for lk in (64, 512, 8192):
            for causal in (False, True):
                call = ft.route.Call("attention", facts.tag, torch.bfloat16, door="sdpa", head_dim=64,
                                     mask="causal" if causal else "none", size=lk,
                                     torch_default=attention_facts.DENSE_PRIOR)
                got = ft.route.decide(call, "auto", "triton", rows)
                assert got.backend == "torch" and (facts is h200) != ("prior from H200" in got.reason), got
                got = ft.route.decide(call._replace(head_dim=32), "auto", "triton", rows)
                assert got.backend == "torch" and got.reason == attention_facts.DENSE_PRIOR


def test_unserved_arguments_go_to_the_previous_kernel(kernel_calls):
    q, k, v, _ = _tensors(torch.float32)
    int_mask = torch.ones(9, 9, dtype=torch.int32)
    with pytest.raises(RuntimeError) as native:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=int_mask)
    with activated():
        torch.manual_seed(0)
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # SDPA's math path: never the flash op
        with pytest.raises(RuntimeError) as routed:  # torch's kernel got the call, and raised its own error
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=int_mask)
    assert str(routed.value) == str(native.value)
    assert torch.isfinite(dropped).all() and kernel_calls["cpu"] == []


def _packed(dtype, lengths=(5, 1, 7), heads=4, kv_heads=2, dim=16):
    generator = torch.Generator().manual_seed(3)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, h, dim, generator=generator, dtype=torch.float64).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, cu, max(lengths)


@needs_cpu_kernels
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (1, 2)])
def test_varlen_attn_runs_on_cpu(window, kernel_calls):
    q, k, v, cu, longest = _packed(torch.float32, kv_heads=2 if VARLEN_GQA else 4)
    gqa = dict(enable_gqa=True) if VARLEN_GQA else {}
    with pytest.raises(NotImplementedError):
        varlen_attn(q, k, v, cu, cu, longest, longest, **gqa)  # torch has no CPU kernel
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with activated(route="fastest"):  # nothing else to run on: ours whatever the route
        out = varlen_attn(*leaves, cu, cu, longest, longest, window_size=window, **gqa)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
    assert kernel_calls["cpu"] == ["varlen_fwd", "varlen_bwd"]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    side = [None if w < 0 else w for w in window]
    ref = reference.attention_varlen(*exact, cu, cu, longest, longest, is_causal=window == (-1, 0),
                                     causal_alignment="bottom_right", window=tuple(side))
    ref_grads = torch.autograd.grad(ref, exact, dout.double())
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert (mine.double() - theirs).abs().max().item() < 2e-6, name


@needs_cpu_kernels
def test_flash_ops_keep_the_dropout_seed_for_their_backward():
    """The backward of a dropped forward is that forward's exact derivative: the seed travelled in rng_state."""
    q, k, v, cu, longest = _packed(torch.float64)
    aten = torch.ops.aten

    def forward(query):
        torch.manual_seed(11)  # the seed our forward draws
        return aten._flash_attention_forward(query, k, v, cu, cu, longest, longest, 0.3, True, False)

    with activated():
        out, lse, rng_state, offset, _ = forward(q)
        dout = torch.randn_like(out)
        dq, _, _ = aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, 0.3, True,
                                                  rng_state, offset)
        direction = torch.randn_like(q)
        eps = 1e-6
        numeric = ((forward(q + eps * direction)[0] - forward(q - eps * direction)[0]) * dout).sum() / (2 * eps)
    assert rng_state.dtype == torch.uint64 and lse.dtype == torch.float32
    assert (out == 0).any()  # dropped
    assert abs((dq * direction).sum().item() - numeric.item()) < 1e-4 * max(1.0, abs(numeric.item()))


# ------------------------------------------------------------------------ CUDA's implementations (Triton)

needs_triton = pytest.mark.skipif(
    ft.backend.triton_unavailable_reason() is not None, reason="triton is not installed or too old")


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_triton_sdpa_op_matches_reference(causal, kernel_calls):
    q, k, v, dout = (t.to(DEVICE) for t in _tensors(torch.float32, kv_heads=2, lq=7, lk=7))
    with ft.use_backend("triton"):
        out, lse, _, _, max_q, max_k, rng_state, _, debug = sdpa.CUDA.sdpa_forward(q, k, v, 0.0, causal)
        grads = sdpa.CUDA.sdpa_backward(dout, q, k, v, out, lse, None, None, max_q, max_k, 0.0, causal, rng_state,
                                        rng_state)
    assert kernel_calls["triton"] == ["dense_fwd", "dense_bwd"]
    assert out.stride() == torch.empty_like(q).stride() and lse.shape == (2, 4, 7) and debug.numel() == 0
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference.attention(*leaves, is_causal=causal, causal_alignment="bottom_right", return_lse=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert mine.stride() == torch.empty_like(mine).stride(), name
        assert (mine.double() - theirs).abs().max().item() < 1e-5, name


@needs_triton
def test_triton_flash_ops_packed_and_dense(kernel_calls):
    q, k, v, cu, longest = _packed(torch.float32)
    q, k, v, cu = (t.to(DEVICE) for t in (q, k, v, cu))
    with ft.use_backend("triton"):
        out, lse, rng_state, offset, _ = sdpa.CUDA.flash_forward(q, k, v, cu, cu, longest, longest, 0.0, False,
                                                                 False, window_size_left=2, window_size_right=1)
        inplace = torch.full_like(q, float("nan"))
        lse2 = sdpa.CUDA.flash_forward_inplace(inplace, q, k, v, cu, cu, longest, longest, 0.0, False, False,
                                               window_size_left=2, window_size_right=1)
        dense_q, dense_k, dense_v = (t[:5].unsqueeze(0) for t in (q, k, v))  # [1, L, H, D]
        dense_out, dense_lse, *_ = sdpa.CUDA.flash_forward(dense_q, dense_k, dense_v, None, None, 5, 5, 0.0, True,
                                                           False)
        dout = torch.randn_like(out)
        dq, dk, dv = sdpa.CUDA.flash_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, False,
                                              rng_state, offset, window_size_left=2, window_size_right=1)
    assert torch.equal(out, inplace) and torch.equal(lse, lse2) and lse.shape == (4, q.shape[0])
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention_varlen(*leaves, cu, cu, longest, longest, causal_alignment="bottom_right",
                                     window=(2, 1))
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_grads)):
        assert mine.shape == theirs.shape and (mine.double() - theirs).abs().max().item() < 1e-5, name
    dense_ref = reference.attention(*(t.double().transpose(1, 2) for t in (dense_q, dense_k, dense_v)),
                                    is_causal=True, causal_alignment="bottom_right")
    assert dense_out.shape == dense_q.shape and dense_lse.shape == (1, 4, 5)
    assert (dense_out.double().transpose(1, 2) - dense_ref).abs().max().item() < 1e-5


@needs_cpu_kernels
def test_compiled_sdpa_runs_ours_in_the_graph(kernel_calls):
    """Inductor calls the flash op it traced; the dispatcher gives it ours, in the layouts the graph asserts."""
    torch._dynamo.reset()

    def block(x, w):
        q, k, v = (x @ w).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32)

    x = torch.randn(2, 16, 32, requires_grad=True)
    w = (torch.randn(32, 96) / 32**0.5).requires_grad_()
    with activated():
        compiled = torch.compile(block, fullgraph=True)
        out = compiled(x, w)
        (grad,) = torch.autograd.grad(out.sum(), w)
    assert kernel_calls["cpu"] == ["dense_fwd", "dense_bwd"]
    expected = block(x, w)
    (expected_grad,) = torch.autograd.grad(expected.sum(), w)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)
