"""``ft.gated_feed_forward`` and ``ft.GatedFeedForward``: forward and every gradient against the float64 reference
(the 2x rule) on the Triton kernels (a GPU, or the interpreter), the CPU backend and the route's choice, separate and
packed (Phi-3), with biases and dropout (replayed masks); what the backward keeps; Hugging Face's LlamaMLP, GemmaMLP
and Phi3MLP state_dicts; torch.compile without a graph break; the custom ops; bad input."""
import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import backend, contract, cpu_ops
from fused_transformer.kernels import gated_feed_forward as kernels
from fused_transformer.ops import gated_feed_forward as op
from tests.kernel_checks import DTYPES, check_against_reference, replayed_keep_mask
from tests.numerics import DEVICE

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

CASES = {  # name: (activation, biases, packed, dropout_p)
    "silu": ("silu", False, False, 0.0),
    "gelu_bias": ("gelu", True, False, 0.0),
    "gelu_tanh_packed_bias": ("gelu_tanh", True, True, 0.0),
    "silu_bias_dropout": ("silu", True, False, 0.3),
    "silu_packed_dropout": ("silu", False, True, 0.3),
    "gelu_tanh_dropout": ("gelu_tanh", False, False, 0.2),
}


def _backends():
    found = ["auto"]
    if backend.triton_unavailable_reason() is None:
        found.append("triton")
    if DEVICE == "cpu" and backend.cpu_unavailable_reason() is None:
        found.append("cpu")
    return found


def _inputs(lead, d_model, d_ff, d_out, dtype, *, biases, packed):
    """Random tensors scaled as nn.Linear's init (activations O(1)); packed: gate and up in one weight."""
    rows = 2 * d_ff if packed else d_ff

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)

    return {"x": draw(*lead, d_model), "gate_weight": draw(rows, d_model, scale=d_model ** -0.5),
            "up_weight": None if packed else draw(d_ff, d_model, scale=d_model ** -0.5),
            "down_weight": draw(d_out, d_ff, scale=d_ff ** -0.5),
            "gate_bias": draw(rows, scale=0.5) if biases else None,
            "up_bias": draw(d_ff, scale=0.5) if biases and not packed else None,
            "down_bias": draw(d_out, scale=0.5) if biases else None}


def _ran_on(name, inputs, activation, dropout_p):
    """The backend a call runs on under backend ``name``."""
    with ft.use_backend(name), ft.explain() as calls:
        with torch.no_grad():
            ft.gated_feed_forward(**inputs, activation=activation, dropout_p=dropout_p)
    return calls[-1].backend


def _keep_mask(ran, x, d_ff, dropout_p):
    """The keep-mask ``[..., d_ff]`` the op draws for its dropout after ``torch.manual_seed(7)`` on backend ``ran``."""
    rows = x.numel() // x.shape[-1]
    if ran == "triton":
        keep = replayed_keep_mask(7, rows, d_ff, dropout_p, x.device, quads=True)
    else:
        assert ran == "cpu", ran
        torch.manual_seed(7)
        keep = cpu_ops.dropout_keep_mask(contract.draw_dropout_seed(x.device), (rows, d_ff), dropout_p)
    return keep.reshape(*x.shape[:-1], d_ff)


def _check(name, inputs, activation, dropout_p, d_ff):
    ran = _ran_on(name, inputs, activation, dropout_p)
    if name != "auto":
        assert ran == name
    keep = _keep_mask(ran, inputs["x"], d_ff, dropout_p) if dropout_p > 0 else None
    tensors = {k: v for k, v in inputs.items() if v is not None}
    absent = {k: None for k, v in inputs.items() if v is None}
    out_grads = [torch.randn(*inputs["x"].shape[:-1], inputs["down_weight"].shape[0], device=DEVICE)]

    def ours(**leaves):
        torch.manual_seed(7)
        with ft.use_backend(name):
            return ft.gated_feed_forward(**leaves, **absent, activation=activation, dropout_p=dropout_p)

    def oracle(**leaves):
        return ft.reference.gated_feed_forward(**leaves, **absent, activation=activation, dropout_p=dropout_p,
                                               keep_mask=keep)

    check_against_reference(ours, oracle, tensors, out_grads)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _backends())
def test_gated_feed_forward_matches_reference(name, dtype, case):
    activation, biases, packed, dropout_p = CASES[case]
    torch.manual_seed(len(case))
    d_ff = 37  # not a multiple of 4: rows start Philox groups of their own
    inputs = _inputs((2, 9), 24, d_ff, 20, dtype, biases=biases, packed=packed)
    _check(name, inputs, activation, dropout_p, d_ff)


@pytest.fixture
def small_tiles(monkeypatch):
    """16-column tiles: several programs a row, the last one partial."""
    monkeypatch.setattr(kernels, "plan", lambda n_cols: kernels.GatedPlan(16, 1))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("d_ff", [50, 48])
def test_many_column_tiles(small_tiles, d_ff, packed):
    torch.manual_seed(d_ff)
    inputs = _inputs((13,), 16, d_ff, 16, torch.bfloat16, biases=True, packed=packed)
    _check("triton", inputs, "silu", 0.25, d_ff)


@pytest.mark.parametrize("name", [n for n in _backends() if n != "auto"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_backward_keeps_x_and_the_products_only(name, packed):
    """Saved between forward and backward, beside the inputs: the gate and up products (or the packed one), never
    act(g) nor the gated product, which torch's own ops keep too."""
    torch.manual_seed(0)
    tokens, d_ff = 10, 24
    inputs = _inputs((tokens,), 16, d_ff, 16, torch.float32, biases=False, packed=packed)
    leaves = {k: v.requires_grad_() if v is not None else None for k, v in inputs.items()}

    def hidden_sized(run):
        found = []

        def pack(t):
            if t.data_ptr() not in {p.data_ptr() for p in leaves.values() if p is not None}:
                found.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sorted(n for n in found if n >= tokens * d_ff)

    with ft.use_backend(name):
        ours = hidden_sized(lambda: ft.gated_feed_forward(**leaves, dropout_p=0.2))
    theirs = hidden_sized(lambda: op.torch_path(**leaves, dropout_p=0.2))
    assert ours == ([2 * tokens * d_ff] if packed else [tokens * d_ff] * 2), ours
    assert len(theirs) >= 4 and sum(theirs) > sum(ours)


def test_dropout_is_reproducible_from_torch_seed_and_differs_between_seeds():
    inputs = _inputs((37,), 16, 64, 16, torch.float32, biases=False, packed=False)
    for name in [n for n in _backends() if n != "auto"]:
        def run(seed):
            torch.manual_seed(seed)
            with ft.use_backend(name):
                return ft.gated_feed_forward(**inputs, dropout_p=0.5)

        assert torch.equal(run(1), run(1))
        assert not torch.equal(run(1), run(2))


def test_no_grad_gives_the_training_forward():
    torch.manual_seed(1)
    inputs = _inputs((3, 5), 16, 40, 12, torch.float32, biases=True, packed=True)
    for name in [n for n in _backends() if n != "auto"]:
        with ft.use_backend(name):
            torch.manual_seed(4)
            with torch.no_grad():
                bare = ft.gated_feed_forward(**inputs, dropout_p=0.1)
            leaves = {k: v.clone().requires_grad_() if v is not None else None for k, v in inputs.items()}
            torch.manual_seed(4)
            assert torch.equal(bare, ft.gated_feed_forward(**leaves, dropout_p=0.1).detach())


def test_autocast_runs_in_the_matmul_dtype():
    torch.manual_seed(2)
    inputs = _inputs((4, 3), 16, 24, 16, torch.float32, biases=True, packed=False)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = ft.gated_feed_forward(**inputs, activation="gelu")
    assert out.dtype == torch.bfloat16
    want = ft.gated_feed_forward(**{k: v.bfloat16() if v is not None else None for k, v in inputs.items()},
                                 activation="gelu")
    torch.testing.assert_close(out, want)


def test_routes_calls_without_dropout_on_the_cpu_to_torch():
    inputs = _inputs((4,), 8, 16, 8, torch.float32, biases=False, packed=False)
    if DEVICE == "cpu":
        assert _ran_on("auto", inputs, "silu", 0.0) == "torch"
        assert _ran_on("auto", inputs, "silu", 0.1) in ("cpu", "triton")


# ------------------------------------------------------------------------------------------ the module


def _hf_mlp(kind, bias):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, mlp_bias=bias, hidden_act="silu")
        from transformers.models.llama.modeling_llama import LlamaMLP
        return LlamaMLP(config), dict(activation="silu", bias=bias)
    if kind == "gemma":
        config = transformers.GemmaConfig(hidden_size=32, intermediate_size=48, hidden_activation="gelu_pytorch_tanh")
        from transformers.models.gemma.modeling_gemma import GemmaMLP
        return GemmaMLP(config), dict(activation="gelu_tanh")
    config = transformers.Phi3Config(hidden_size=32, intermediate_size=48, hidden_act="silu")
    from transformers.models.phi3.modeling_phi3 import Phi3MLP
    return Phi3MLP(config), dict(activation="silu", packed=True)


@pytest.mark.parametrize("kind, bias", [("llama", False), ("llama", True), ("gemma", False), ("phi3", False)])
def test_module_has_hugging_faces_state_dict_and_output(kind, bias):
    torch.manual_seed(0)
    theirs, options = _hf_mlp(kind, bias)
    ours = ft.GatedFeedForward(32, 48, **options)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 7, 32, requires_grad=True)
    want = theirs(x)
    for name in [n for n in _backends()]:
        with ft.use_backend(name):
            got = ours(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grad_ours = torch.autograd.grad(got.square().sum(), [x, *ours.parameters()])
        grad_theirs = torch.autograd.grad(want.square().sum(), [x, *theirs.parameters()], retain_graph=True)
        for a, b in zip(grad_ours, grad_theirs):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_module_drops_only_in_training():
    torch.manual_seed(0)
    module = ft.GatedFeedForward(16, 24, 8, dropout=0.5, bias=True)
    x = torch.randn(3, 16)
    module.eval()
    torch.testing.assert_close(module(x), op.torch_path(x, module.gate_proj.weight, module.up_proj.weight,
                                                          module.down_proj.weight, module.gate_proj.bias,
                                                          module.up_proj.bias, module.down_proj.bias))
    module.train()
    torch.manual_seed(1)
    first = module(x)
    torch.manual_seed(2)
    assert not torch.equal(first, module(x))
    assert module.down_proj.out_features == 8 and "dropout=0.5" in repr(module)


# ------------------------------------------------------------------------------------------ compile


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("packed, dropout_p", [(False, 0.0), (False, 0.2), (True, 0.2)])
def test_compiles_fullgraph_without_a_graph_break(name, packed, dropout_p):
    """Forward and loss, then the AOT backward, on the backend the route picks or the one named."""
    torch.manual_seed(0)
    inputs = _inputs((2, 5), 16, 24, 16, torch.float32, biases=True, packed=packed)
    leaves = [v.requires_grad_() for v in inputs.values() if v is not None]

    def loss(x, gate_weight, down_weight, gate_bias, down_bias, up_weight=None, up_bias=None):
        y = ft.gated_feed_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                  dropout_p=dropout_p)
        return y.sin().mean()

    args = {k: v for k, v in inputs.items() if v is not None}
    torch._dynamo.reset()
    with ft.use_backend(name):
        explanation = torch._dynamo.explain(loss)(**args)
        assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        torch.manual_seed(3)
        got = compiled(**args)
        grads = torch.autograd.grad(got, leaves)
        torch.manual_seed(3)
        want = loss(**args)
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(g, w)


def test_custom_ops_pass_opcheck():
    torch.manual_seed(0)
    seed = torch.tensor([123], device=DEVICE)
    for packed in (False, True):
        x, wg, wu, wd, bg, bu, bd = _inputs((5,), 8, 12, 8, torch.float32, biases=True, packed=packed).values()
        args = (x, wg, wu, wd, bg, bu, bd, "silu", 0.1, seed)
        torch.library.opcheck(torch.ops.fused_transformer.gated_feed_forward_fwd, args)
        y, first, second = torch.ops.fused_transformer.gated_feed_forward_fwd(*args)
        second = None if packed else second
        bwd = torch.ops.fused_transformer.gated_feed_forward_bwd
        torch.library.opcheck(bwd, (torch.randn_like(y), x, wg, wu, wd, first, second, True, not packed, True,
                                    "silu", 0.1, seed))
        torch.library.opcheck(bwd, (torch.randn_like(y), x, wg, wu, wd, first, second, False, False, False,
                                    "gelu_tanh", 0.0, None))
    if DEVICE == "cpu":
        torch.library.opcheck(torch.ops.fused_transformer.gated_cpu_keep_mask, (seed, 3, 7, 0.4))


# ------------------------------------------------------------------------------------------ bad input


def _good(**changes):
    torch.manual_seed(0)
    found = {"x": torch.randn(3, 8), "gate_weight": torch.randn(12, 8), "up_weight": torch.randn(12, 8),
             "down_weight": torch.randn(8, 12)}
    found.update(changes)
    return found


@pytest.mark.parametrize("kwargs, error, words", [
    (_good(x=torch.randint(0, 3, (3, 8))), TypeError, "x must be float16"),
    (_good(x=torch.randn(())), ValueError, "at least 1 dim"),
    (_good(gate_weight=torch.randn(12, 9)), ValueError, "gate_weight must be [d_ff, d_model=8]"),
    (_good(up_weight=torch.randn(10, 8)), ValueError, "up_weight must be gate_weight's shape (12, 8)"),
    (_good(down_weight=torch.randn(8, 10)), ValueError, "down_weight must be [d_out, d_ff=12]"),
    (_good(up_weight=None, down_weight=torch.randn(8, 12)), ValueError, "down_weight must be [d_out, d_ff=6]"),
    (_good(up_weight=None, gate_weight=torch.randn(13, 8), down_weight=torch.randn(8, 6)), ValueError,
     "rows must be even"),
    (_good(up_weight=None, down_weight=torch.randn(8, 6), up_bias=torch.randn(6)), ValueError,
     "up_bias must be None when up_weight is None"),
    (_good(gate_bias=torch.randn(11)), ValueError, "gate_bias must be [12]"),
    (_good(down_bias=torch.randn(12)), ValueError, "down_bias must be [8]"),
    (_good(up_weight=torch.randn(12, 8, dtype=torch.float64)), TypeError, "up_weight has dtype torch.float64"),
    (_good(down_weight=torch.randn(8, 12, device="meta")), ValueError, "down_weight is on meta"),
    (_good(gate_weight=torch.randn(12)), ValueError, "gate_weight must have 2 dims"),
    (_good(activation="relu"), ValueError, "activation='relu' must be one of"),
    (_good(dropout_p=1.0), ValueError, "dropout_p"),
])
def test_rejects_bad_input(kwargs, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        ft.gated_feed_forward(**kwargs)


def test_the_triton_entry_rejects_float64_and_the_module_a_bad_activation():
    inputs = _inputs((4,), 8, 8, 8, torch.float64, biases=False, packed=False)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        kernels.gated_feed_forward_fwd(*inputs.values(), "silu", 0.0, None)
    with pytest.raises(ValueError, match="activation='relu'"):
        ft.GatedFeedForward(8, 16, activation="relu")


@pytest.mark.parametrize("name", [n for n in _backends() if n != "auto"])
@pytest.mark.parametrize("packed", [False, True])
def test_no_rows_and_rows_with_strides(name, packed):
    """x of no rows gives no rows and zero weight gradients; x whose last dim is not contiguous gives what its
    contiguous copy gives."""
    torch.manual_seed(5)
    inputs = _inputs((0, 3), 16, 24, 8, torch.float32, biases=True, packed=packed)
    leaves = {k: v.requires_grad_() if v is not None else None for k, v in inputs.items()}
    with ft.use_backend(name):
        out = ft.gated_feed_forward(**leaves, dropout_p=0.1)
        out.sum().backward()
    assert out.shape == (0, 3, 8) and leaves["x"].grad.shape == (0, 3, 16)
    assert not leaves["gate_weight"].grad.any() and not leaves["gate_bias"].grad.any()
    weights = {k: v.detach() if v is not None else None for k, v in inputs.items() if k != "x"}
    strided = torch.randn(16, 7, device=DEVICE).t()
    with ft.use_backend(name):
        torch.testing.assert_close(ft.gated_feed_forward(strided, **weights),
                                   ft.gated_feed_forward(strided.contiguous(), **weights))


@pytest.mark.parametrize("name", [n for n in _backends() if n != "auto"])
def test_activation_checkpointing_replays_the_dropout_mask(name):
    """torch.utils.checkpoint runs the forward again in the backward with torch's RNG state restored: the same seed,
    so the same mask, and the gradients of the plain call."""
    torch.manual_seed(6)
    inputs = _inputs((3, 4), 16, 20, 16, torch.float32, biases=True, packed=True)
    leaves = [v.requires_grad_() for v in inputs.values() if v is not None]

    def call(x, gate_weight, down_weight, gate_bias, down_bias):
        with ft.use_backend(name):
            return ft.gated_feed_forward(x, gate_weight, None, down_weight, gate_bias, None, down_bias,
                                         dropout_p=0.4)

    torch.manual_seed(9)
    plain = torch.autograd.grad(call(*leaves).sin().sum(), leaves)
    torch.manual_seed(9)
    out = torch.utils.checkpoint.checkpoint(call, *leaves, use_reentrant=False)
    for got, want in zip(torch.autograd.grad(out.sin().sum(), leaves), plain):
        torch.testing.assert_close(got, want)
