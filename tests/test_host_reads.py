"""No host waits in an eager call: with its inputs on a device, no op reads a tensor's values on the host (a
device-to-host copy that waits for the GPU). Counted with a dispatch mode (``aten._local_scalar_dense`` behind
``.item()`` / ``int()``, ``aten.equal``, ``aten.is_nonzero``, ``aten.nonzero``, copies to the CPU) and a spy on
``Tensor.tolist``, which reads without dispatching. Without a GPU the CPU tensors stand for device tensors
(``contract._on_host`` answers False), on the C++ backend; the named exception is the modules' packing of a
padded batch, whose number of real tokens sizes the packed tensor."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_transformer as ft
from fused_transformer import backend, contract

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.equal, aten.is_nonzero, aten.nonzero}

pytestmark = pytest.mark.skipif(backend.cpu_unavailable_reason() is not None, reason="needs the C++ kernels")


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in READS:
            self.reads.append(str(func))
        elif func.overloadpacket in (aten._to_copy, aten.copy_) and args and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device") if func.overloadpacket is aten._to_copy else args[0].device
            source = args[0] if func.overloadpacket is aten._to_copy else args[1]
            if target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu":
                self.reads.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def device_inputs(monkeypatch):
    """Count host reads, with CPU tensors taken for device tensors."""
    monkeypatch.setattr(contract, "_on_host", lambda t: False)
    counted = HostReads()
    tolist = torch.Tensor.tolist

    def spy(self):
        counted.reads.append("Tensor.tolist")
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    return counted


def _qkv(*shape, grad=False):
    return [torch.randn(*shape, requires_grad=grad) for _ in range(3)]


def test_attention_reads_nothing_on_the_host(device_inputs):
    q, k, v = _qkv(2, 4, 16, 8, grad=True)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 11:] = True
    mask = torch.rand(2, 1, 16, 16) > 0.2
    with ft.use_backend("cpu"), device_inputs:
        for kwargs in ({}, dict(is_causal=True), dict(key_padding_mask=padding), dict(attn_mask=mask),
                       dict(is_causal=True, dropout_p=0.1), dict(query_padding_mask=padding, is_causal=True)):
            out = ft.attention(q, k, v, **kwargs)
            torch.autograd.grad(out.sum(), (q, k, v))
    assert device_inputs.reads == []


def test_varlen_and_kvcache_read_nothing_on_the_host(device_inputs):
    q, k, v = _qkv(12, 4, 8, grad=True)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cache_k, cache_v = (torch.randn(2, 32, 2, 8) for _ in range(2))
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    new = [torch.randn(2, 1, 2, 8) for _ in range(2)]
    blocks = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    paged = [torch.randn(4, 16, 2, 8) for _ in range(2)]
    with ft.use_backend("cpu"), device_inputs:
        out = ft.attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))
        ft.attention_with_kvcache(torch.randn(2, 1, 4, 8), cache_k, cache_v, cache_seqlens=lengths, k_new=new[0],
                                  v_new=new[1])
        ft.attention_with_kvcache(torch.randn(2, 1, 4, 8), *paged, cache_seqlens=lengths, block_table=blocks)
    assert device_inputs.reads == []


def test_layer_norm_and_feed_forward_read_nothing_on_the_host(device_inputs):
    x = torch.randn(6, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    w1, w2 = torch.randn(64, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    with device_inputs:
        for name in ("cpu", "auto"):
            with ft.use_backend(name):
                y = ft.layer_norm(x, w, b, residual=x.detach(), dropout_p=0.1) + ft.layer_norm(x, w, b)
                y = ft.feed_forward(y, w1, None, w2, None, dropout_p=0.1) + ft.feed_forward(y, w1, None, w2, None)
                y.sum().backward()
    assert device_inputs.reads == []


def test_asked_for_the_checks_read_the_values(device_inputs):
    """``set_device_value_checks(True)`` reads the lengths on the device to check them (and refuses bad ones);
    by default the call reads none."""
    cache_k, cache_v = (torch.randn(2, 8, 2, 8) for _ in range(2))
    too_long = torch.tensor([3, 9], dtype=torch.int32)
    contract.set_device_value_checks(True)
    try:
        with device_inputs, pytest.raises(ValueError, match="cache_seqlens"):
            ft.attention_with_kvcache(torch.randn(2, 1, 4, 8), cache_k, cache_v, cache_seqlens=too_long)
    finally:
        contract.set_device_value_checks(False)
    assert device_inputs.reads == ["Tensor.tolist"]


def test_the_modules_packing_reads_the_number_of_real_tokens(device_inputs):
    """The named exception: an encoder layer packing a padded batch (its real tokens are the packed tensor's size,
    which the host must know) reads it once, a ``nonzero`` and the lengths' copy."""
    layer = ft.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with torch.no_grad(), device_inputs:
        layer(x, src_key_padding_mask=padding)
    expected = {"aten.nonzero.default", "aten._local_scalar_dense.default"}
    assert device_inputs.reads and set(device_inputs.reads) <= expected
