"""Every door through the route: ``explain()`` records each call at each door, one that ours serves and one that torch
keeps (or the reference runs), with the backend that ran it and why. The doors: the functional ops, a module handing
its input to torch.nn, torch's SDPA registry and the transformers interface."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import route
from fused_transformer.integrations import sdpa

needs_cpu_kernels = pytest.mark.skipif(ft.backend.cpu_unavailable_reason() is not None,
                                       reason=str(ft.backend.cpu_unavailable_reason()))
needs_registry = pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                                    reason="this torch has no flash-attention registry")


@pytest.fixture(autouse=True)
def unmeasured_cpu(monkeypatch):
    """A CPU no built-in row names (another instruction set): what each door records then rests on the rules and the
    defaults alone, not on the rows measured for the CPU the tests happen to run on."""
    facts = route.cpu_facts(1, "unmeasured")
    monkeypatch.setattr(route, "device_tag", lambda device: facts.tag if device.type == "cpu" else device.type)
    monkeypatch.setattr(route, "device_facts", lambda device: facts)
    monkeypatch.setattr(route, "_TABLES", {})
    monkeypatch.setattr(route, "_DECISIONS", {})


def _qkv(batch=2, heads=4, length=9, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=generator).to(dtype) for _ in range(3)]


def _only(records, op=None):
    """The one record (of ``op``, if given) in an ``explain`` block's list."""
    found = [r for r in records if op is None or r.op == op]
    assert len(found) == 1, [str(r) for r in records]
    return found[0]


# ------------------------------------------------------------------------------------------------- functional


@needs_cpu_kernels
def test_functional_ops_record_ours_and_torchs():
    q, k, v = _qkv()
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True
    x = torch.randn(3, 16)
    with ft.explain() as calls:
        ft.attention(q, k, v, key_padding_mask=padding)
        ft.layer_norm(x, torch.ones(16), torch.zeros(16))
    attention, norm = calls
    assert (attention.op, attention.door, attention.backend) == ("attention", "functional", "cpu")
    assert "masks" in attention.reason
    assert (norm.op, norm.door, norm.backend) == ("layer_norm", "functional", "torch")
    assert "nothing to fuse" in norm.reason


# ---------------------------------------------------------------------------------------------------- modules


@needs_cpu_kernels
def test_a_module_records_its_ops_and_its_fallback_to_torch_nn():
    torch.manual_seed(0)
    layer = ft.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.0).eval()
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with ft.explain() as plain:
        layer(torch.randn(2, 5, 16), src_key_padding_mask=padding)
    assert [(r.op, r.door) for r in plain][:2] == [("attention_varlen", "functional"), ("layer_norm", "functional")]
    assert _only(plain, "attention_varlen").backend == "cpu"  # the padded batch packed: varlen attention
    nested = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)])
    with ft.explain() as fallback, torch.no_grad():
        layer(nested)
    record = _only(fallback)
    assert (record.op, record.door, record.backend) == ("TransformerEncoderLayer", "module", "torch")
    assert "nested tensors" in record.reason


@needs_cpu_kernels
def test_layer_norm_handed_to_torch_nn_is_its_native_op_and_a_tensor_subclass_still_sees_f_layer_norm():
    torch.manual_seed(0)
    norm = ft.LayerNorm(16).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        norm(x)
        out = norm(x)
    assert route.module_verdicts(norm.__dict__) and torch.equal(out, F.layer_norm(x, (16,), norm.weight, norm.bias))
    seen = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    with torch.no_grad():
        norm(x.as_subclass(Traced))
    assert F.layer_norm in seen


@pytest.mark.parametrize("name", ["LayerNorm", "MultiheadAttention", "TransformerEncoderLayer",
                                  "TransformerDecoderLayer"])
def test_a_module_whose_every_op_is_torchs_hands_the_call_to_torch_nn(name, monkeypatch):
    """The modules' door: the first call of a key runs the fused path and records its ops; where every op went to
    torch's path, the next calls run torch.nn's own forward (one record, the module's), with torch.nn's result. A
    call with a key padding mask (ours) keeps the fused path."""
    torch.manual_seed(0)
    args = {"LayerNorm": (16,), "MultiheadAttention": (16, 2)}.get(name, (16, 2, 32))
    kwargs = {} if name == "LayerNorm" else dict(dropout=0.1, batch_first=True)
    theirs = getattr(torch.nn, name)(*args, **kwargs).eval()
    ours = getattr(ft, name)(*args, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16)
    call = {"MultiheadAttention": lambda m, **kw: m(x, x, x, need_weights=False, **kw)[0],
            "TransformerDecoderLayer": lambda m, **kw: m(x, x, **kw)}.get(name, lambda m, **kw: m(x, **kw))
    with torch.no_grad():
        with ft.explain() as first:
            call(ours)
        assert first and all(r.backend == "torch" and r.door == "functional" for r in first), first
        asked, ask = [], route.module_verdicts
        monkeypatch.setattr(route, "module_verdicts", lambda owner: asked.append(owner) or ask(owner))
        with ft.explain() as later:
            out = call(ours)
        monkeypatch.setattr(route, "module_verdicts", ask)
        # torch.nn's forward calls the fused children (the decoder layer's attention and norms) as part of the call
        # the route gave it: they run torch.nn's forward too, without a door of their own.
        [record] = later
        assert (record.op, record.door, record.backend) == (name, "module", "torch") and record.reason == route.TORCH_NN
        assert len(asked) == 1 and asked[0] is ours.__dict__
        torch.testing.assert_close(out, call(theirs))
        if name == "LayerNorm":
            return
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[1, 2:] = True
        key = "key_padding_mask" if name == "MultiheadAttention" else (
            "src_key_padding_mask" if name == "TransformerEncoderLayer" else "tgt_key_padding_mask")
        for _ in range(2):
            with ft.explain() as padded:
                call(ours, **{key: padding})
            assert any(r.op.startswith("attention") and r.backend == "cpu" for r in padded), padded
    # In training, dropout makes attention ours (torch's random mask is not our seed's): no hand-off.
    ours.train()
    for _ in range(2):
        with ft.explain() as training:
            call(ours)
        assert not any(r.door == "module" for r in training), training


@needs_cpu_kernels
def test_a_norm_with_mixed_dtype_parameters_records_its_fallback():
    norm = ft.LayerNorm(16)
    norm.bias.data = norm.bias.data.double()
    with ft.explain() as calls, contextlib.suppress(RuntimeError):  # torch.nn's forward: torch's own error, if any
        norm(torch.randn(2, 16))
    record = _only(calls)
    assert (record.op, record.door, record.backend) == ("LayerNorm", "module", "torch")
    assert "mixed dtypes" in record.reason


# ----------------------------------------------------------------------------------------------- SDPA registry


@contextlib.contextmanager
def _activated():
    torch.nn.attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        yield
    finally:
        torch.nn.attention.restore_flash_attention_impl()


@needs_registry
@needs_cpu_kernels
def test_sdpa_door_records_ours_forward_and_backward():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with _activated(), ft.use_backend("cpu"), ft.explain() as calls:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert [(r.op, r.door, r.backend) for r in calls] == [("attention", "sdpa", "cpu")] * 2
    assert calls[0].reason == "use_backend('cpu')"


@needs_registry
@needs_cpu_kernels
@pytest.mark.parametrize("case, reason", [
    ("head dims", "head dims that differ"),
    ("dropout", "dropout (the CPU op's outputs keep no seed"),
    ("int mask", "attn_mask's dtype"),
    ("head counts", "head counts"),
])
def test_sdpa_door_records_what_only_torchs_kernel_serves(case, reason):
    q, k, v = _qkv()
    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    arguments = {
        "head dims": ((q, k, v[..., :8], 0.0, False), {}),
        "dropout": ((q, k, v, 0.5, False), {}),
        "int mask": ((q, k, v, 0.0, False), dict(attn_mask=torch.ones(9, 9, dtype=torch.int32))),
        "head counts": ((q, k[:, :3], v[:, :3], 0.0, False), {}),
    }[case]
    with _activated(), ft.use_backend("cpu"), ft.explain() as calls:
        with contextlib.suppress(RuntimeError):  # torch's kernel raises its own error where it refuses the call
            cpu_op(*arguments[0], **arguments[1])
    record = _only(calls)
    assert (record.op, record.door, record.backend) == ("attention", "sdpa", "torch")
    assert reason in record.reason and "ours does not serve" in record.reason


@needs_registry
@needs_cpu_kernels
def test_sdpa_door_under_the_reference_runs_and_records_torchs_kernel(monkeypatch):
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's own, not activated
    ran = []
    original = sdpa.CPU.kernels.dense_fwd
    monkeypatch.setattr(sdpa.CPU.kernels, "dense_fwd", lambda *args: ran.append(1) or original(*args))
    with _activated(), ft.use_backend("reference"), ft.explain() as calls:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    record = _only(calls)
    assert (record.door, record.backend, record.reason) == ("sdpa", "torch", "use_backend('reference')")
    assert ran == [] and torch.equal(out, expected)


@needs_registry
@needs_cpu_kernels
def test_sdpa_door_varlen_on_the_cpu_is_ours_whatever_was_named():
    """torch has no CPU kernel for varlen_attn's ops: ours runs them, even under use_backend('reference')."""
    from torch.nn.attention.varlen import varlen_attn

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 4, 16, generator=generator) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with _activated(), ft.use_backend("reference"), ft.explain() as calls:
        varlen_attn(q, k, v, cu, cu, 7, 7)
    record = _only(calls)
    assert (record.door, record.backend) == ("sdpa", "cpu")
    assert "torch has no kernel" in record.reason


def test_door_facts_decide_before_any_backend_named():
    """``torch_keeps`` sends a door call to torch's kernel under every choice; ``torch_cannot`` at a door to ours."""
    call = ft.route.Call("attention", "cpu", torch.float32, door="sdpa", head_dim=16, size=512)
    for choice in ("auto", "cpu", "reference"):
        kept = ft.route.decide(call._replace(torch_keeps="alibi_slopes"), choice, "cpu", ())
        assert kept == ("torch", "the kernel torch had: ours does not serve alibi_slopes")
        ours = ft.route.decide(call._replace(torch_cannot="this op on this device"), choice, "cpu", ())
        assert ours.backend == "cpu" and "torch has no kernel" in ours.reason
    assert ft.route.decide(call, "reference", "cpu", ()).backend == "reference"  # at_door maps it to torch


# ---------------------------------------------------------------------------------------- transformers interface


def _attention_forward():
    return pytest.importorskip("fused_transformer.integrations.transformers",
                               reason="transformers is not installed").attention_forward


@needs_cpu_kernels
def test_transformers_door_records_ours():
    attention_forward = _attention_forward()
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    with ft.explain() as calls:
        attention_forward(torch.nn.Module(), q, k, v, mask)
    record = _only(calls)
    assert (record.op, record.door, record.backend) == ("attention", "functional", "cpu")
    assert "masks" in record.reason


@needs_cpu_kernels
@pytest.mark.parametrize("named", ["auto", "cpu"])
def test_transformers_door_trainable_mask_with_dropout_runs_on_the_reference(named):
    attention_forward = _attention_forward()
    q, k, v = (t.requires_grad_() for t in _qkv())
    bias = torch.randn(1, 4, 9, 9, requires_grad=True)
    with ft.use_backend(named), ft.explain() as calls:
        out, _ = attention_forward(torch.nn.Module(), q, k, v, bias, dropout=0.2, is_causal=False)
    out.sum().backward()
    record = _only(calls)
    assert (record.op, record.backend) == ("attention", "reference")
    assert record.reason.endswith("does not compute attn_mask gradients")
    assert bias.grad is not None and bias.grad.abs().sum() > 0


@needs_cpu_kernels
def test_transformers_door_capped_weights_run_on_the_reference():
    attention_forward = _attention_forward()
    q, k, v = _qkv()
    with ft.explain() as calls:
        out, weights = attention_forward(torch.nn.Module(), q, k, v, None, is_causal=False, softcap=2.0,
                                         output_attentions=True)
    attention, weights_record = _only(calls, "attention"), _only(calls, "attention_weights")
    assert attention.backend == "cpu"  # the cap runs in the kernel
    assert (weights_record.door, weights_record.backend) == ("functional", "reference")
    assert weights_record.reason == "cpu does not compute capped weights"
    expected = ft.reference.attention_weights(q, k, ft.reference.attention(q, k, v, softcap=2.0, return_lse=True)[1],
                                              softcap=2.0)
    torch.testing.assert_close(weights, expected, rtol=0, atol=2e-6)
    with ft.explain() as uncapped:
        attention_forward(torch.nn.Module(), q, k, v, None, is_causal=False, output_attentions=True)
    assert _only(uncapped, "attention_weights").backend == "cpu"


@needs_cpu_kernels
def test_a_module_that_kept_verdicts_still_scripts():
    """The modules' door keeps its verdicts in the module; ``torch.jit.script`` (which gets the torch.nn twin) must not
    see them: TorchScript cannot type their keys."""
    torch.manual_seed(0)
    model = ft.fuse(torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        model(x, x)
        model(x, x)
        assert any("_route_verdicts" in m.__dict__ for m in model.modules())
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x, x), model(x, x), rtol=1e-5, atol=1e-5)
