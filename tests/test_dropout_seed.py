"""The dropout seed without a launch: an eager call on a CUDA device draws it on the host from the generator's Philox
seed and offset (``contract.host_seed``), passed to the kernels by value; traced calls, CUDA-graph captures, functorch
transforms and CPU calls draw a tensor. Without a GPU, CPU tensors stand for device ones
(``launches.cpu_draws_as_on_a_gpu``) and the Triton kernels run under the interpreter; the tests marked for a GPU run
the real generator."""
import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import autograd, backend, contract
from fused_transformer.kernels._common import dropout_keep_mask
from fused_transformer.tools.launches import PhiloxState, cpu_draws_as_on_a_gpu, launches
from tests.numerics import DEVICE

P = 0.25


def test_host_seeds_follow_the_generators_state():
    state = PhiloxState(1234)
    seeds = [contract.host_seed(state) for _ in range(6)]
    assert state.get_offset() == 24  # 4 a draw, as torch's random ops advance it
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds) and len(set(seeds)) == 6
    state.set_offset(8)  # a restored state (activation checkpointing's recompute) draws the same seeds again
    assert [contract.host_seed(state) for _ in range(4)] == seeds[2:]
    assert contract.host_seed(PhiloxState(1234)) == seeds[0]  # manual_seed: offset 0 again
    assert contract.host_seed(PhiloxState(1235)) != seeds[0]
    state.set_offset(40)  # another op advanced the offset in between: a seed not drawn before
    assert contract.host_seed(state) not in seeds


def test_where_the_seed_is_drawn():
    assert isinstance(contract.draw_dropout_seed("cpu"), torch.Tensor)  # the CPU generator keeps no offset
    with cpu_draws_as_on_a_gpu(7) as state:
        assert isinstance(contract.draw_dropout_seed(torch.device("cpu")), int) and state.get_offset() == 4
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():  # a trace keeps the draw in its graph
            assert isinstance(contract.draw_dropout_seed(torch.device("cpu")), torch.Tensor)
        drawn = torch.func.vmap(lambda x: x + contract.draw_dropout_seed(x.device), randomness="same")(
            torch.zeros(3, 1, dtype=torch.int64))
        assert drawn.shape == (3, 1)  # under a functorch transform: a tensor, drawn by the transform's rule
        assert state.get_offset() == 4
    assert torch.compile(lambda x: contract.draw_dropout_seed(x.device) + x, fullgraph=True)(
        torch.zeros(1, dtype=torch.int64)).dtype == torch.int64


def _layer_norm():
    x, r = (torch.randn(6, 40, device=DEVICE, requires_grad=True) for _ in range(2))
    w, b = torch.randn(40, device=DEVICE, requires_grad=True), torch.randn(40, device=DEVICE, requires_grad=True)

    def run():
        y = ft.layer_norm(x, w, b, residual=r, dropout_p=P)
        return (y, *torch.autograd.grad((y * y).sum(), (x, r, w, b)))
    return run


def _attention():
    q, k, v = (torch.randn(2, 2, 24, 16, device=DEVICE, requires_grad=True) for _ in range(3))

    def run():
        o = ft.attention(q, k, v, is_causal=True, dropout_p=P)
        return (o, *torch.autograd.grad((o * o).sum(), (q, k, v)))
    return run


def _feed_forward():
    x = torch.randn(10, 16, device=DEVICE, requires_grad=True)
    w1, w2 = torch.randn(32, 16, device=DEVICE, requires_grad=True), torch.randn(16, 32, device=DEVICE,
                                                                                 requires_grad=True)
    b1, b2 = torch.randn(32, device=DEVICE), torch.randn(16, device=DEVICE)

    def run():
        y = ft.feed_forward(x, w1, b1, w2, b2, dropout_p=P)
        return (y, *torch.autograd.grad((y * y).sum(), (x, w1, w2)))
    return run


OPS = {"layer_norm": _layer_norm, "attention": _attention, "feed_forward": _feed_forward}


BACKENDS = ["triton"] + (["cpu"] if backend.cpu_unavailable_reason() is None and DEVICE == "cpu" else [])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_host_seed_drops_what_the_same_seed_drawn_on_the_device_drops(op, name, monkeypatch):
    """One compiled kernel for both: ``*SEED + host_seed``, with SEED at a zero for a host draw, or host_seed 0. The
    C++ kernels take a host draw as a tensor."""
    run = OPS[op]()
    drawn_on_host = []

    def recorded(generator):
        drawn_on_host.append(host_seed(generator))
        return drawn_on_host[-1]
    host_seed = contract.host_seed
    monkeypatch.setattr(contract, "host_seed", recorded)
    with ft.use_backend(name), cpu_draws_as_on_a_gpu(99):
        host = run()
    seed = drawn_on_host[0]
    for drawn, same in ((seed, True), (seed + 1, False)):  # the seed decides: another drops other elements
        monkeypatch.setattr(autograd, "draw_dropout_seed", lambda device: torch.tensor([drawn], device=device))
        with ft.use_backend(name):
            device = run()
        assert all(torch.equal(got, expected) for got, expected in zip(host, device)) == same
    assert torch.equal(dropout_keep_mask(seed, 5, 33, P, DEVICE), dropout_keep_mask(torch.tensor([seed]), 5, 33, P,
                                                                                     DEVICE))


@pytest.mark.parametrize("op", sorted(OPS))
def test_no_op_launches_a_seed_kernel(op):
    """Forward + backward with dropout, our kernels' launches: layer_norm 3 (its forward, its backward kernel, one
    reduction of the weight and bias partials), attention 3 (forward, dq, dk/dv), feed_forward 4 (the activation pass
    forward and backward, the two bias gradients' sums; the products are torch's); no random draw beside them."""
    run = OPS[op]()
    with ft.use_backend("triton"), cpu_draws_as_on_a_gpu():
        run()  # the first host draw makes its zero SEED on the device
        counts = launches(run, torch.device(DEVICE))
    assert "randint" not in counts and "random_" not in counts, counts
    assert counts["triton"] == {"layer_norm": 3, "attention": 3, "feed_forward": 4}[op], counts
    with ft.use_backend("triton"):
        assert launches(run, torch.device(DEVICE)).get("randint") == (1 if DEVICE == "cpu" else None)


def test_torch_manual_seed_reproduces_host_draws():
    run = _layer_norm()
    with ft.use_backend("triton"):
        with cpu_draws_as_on_a_gpu(5):
            torch.manual_seed(5)  # on a GPU, the CUDA generator's
            first = run()
        with cpu_draws_as_on_a_gpu(5):
            torch.manual_seed(5)
            again = run()
    assert all(torch.equal(a, b) for a, b in zip(first, again))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA generator needs a GPU")


@needs_gpu
def test_on_a_gpu_eager_dropout_draws_on_the_host_and_checkpointing_recomputes_it():
    """The real CUDA generator: no seed kernel, torch.manual_seed reproduces, and activation checkpointing's
    recompute (which restores the generator's state) drops the same elements as the forward did."""
    layer = ft.TransformerEncoderLayer(64, 4, 128, dropout=0.3, batch_first=True).cuda()
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = generator.get_offset()
    contract.draw_dropout_seed(x.device)
    assert generator.get_offset() == offset + 4
    x_ln = torch.randn(8, 64, device="cuda", requires_grad=True)
    w = torch.ones(64, device="cuda", requires_grad=True)
    with ft.use_backend("triton"):
        ft.layer_norm(x_ln, w, None, residual=x_ln, dropout_p=0.1).sum().backward()  # the zero SEED made once
        counts = launches(lambda: ft.layer_norm(x_ln, w, None, residual=x_ln, dropout_p=0.1).sum().backward(),
                          x.device)
    assert "randint" not in counts and counts["triton"] == 3, counts
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(11)
        x.grad = None
        with ft.use_backend("triton"):
            y = (torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x))
            F.mse_loss(y, torch.zeros_like(y)).backward()
        grads.append((y.detach(), x.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.allclose(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)
