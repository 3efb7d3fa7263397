"""``ft.apply_rotary_pos_emb``: q and k and their gradients against the float64 reference (the 2x rule) on the
Triton kernel (a GPU, or the interpreter) and the CPU path, halves and interleaved pairs, partial rotary, grouped
heads, both head layouts, strided inputs and a batch-1 cos; equal to transformers' own ``apply_rotary_pos_emb``
(modeling_llama, modeling_phi3) on cos / sin from the models' rotary modules (default, llama3 and yarn scaling);
one launch forward and one backward; torch.compile without a graph break; bad input."""
import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend
from tests.kernel_checks import DTYPES, check_against_reference
from tests.numerics import DEVICE
from tests.test_ops_registry import MAX_FRAMES, launches_seen  # noqa: F401 (a fixture)

# Not on the torch.compile test: dynamo does not trace the NaN-filling torch.empty_like the fixture puts in place.
numerics = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

# name: (heads, kv_heads, head_dim, rotary_dim, unsqueeze_dim, interleaved, cos batch, strided, cos float32)
CASES = {
    "halves": (4, 2, 32, 32, 1, False, 2, False, False),
    "pairs": (2, 2, 32, 32, 1, True, 2, False, False),
    "partial_heads_last": (3, 1, 48, 16, 2, False, 2, True, False),
    "partial_pairs_strided": (2, 1, 40, 24, 1, True, 1, True, False),
    "strided_cos_batch1_float32": (4, 1, 32, 32, 1, False, 1, True, True),
}
BATCH, SEQ = 2, 7


def _backends():
    found = ["cpu"] if DEVICE == "cpu" else []
    if backend.triton_unavailable_reason() is None:
        found.append("triton")
    return found


def _projected(heads, head_dim, heads_last, dtype, seq=SEQ):
    """q or k as Hugging Face makes them: a projection ``[B, S, H * D]`` viewed ``[B, S, H, D]`` and transposed."""
    x = torch.randn(BATCH, seq, heads * head_dim, device=DEVICE, dtype=dtype).view(BATCH, seq, heads, head_dim)
    return x if heads_last else x.transpose(1, 2)


def _tables(batch, rotary_dim, interleaved, dtype, seq=SEQ):
    """cos / sin ``[batch, S, rotary_dim]`` of random positions, each frequency twice (halves: concatenated;
    pairs: repeat_interleave'd), as the models build them."""
    positions = torch.rand(batch, seq, 1, device=DEVICE) * 500
    freqs = positions * 10000.0 ** (-torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim)
    angles = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@numerics
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _backends())
def test_matches_reference(name, dtype, case):
    heads, kv_heads, head_dim, rotary_dim, unsqueeze_dim, interleaved, table_batch, strided, cos32 = CASES[case]
    torch.manual_seed(len(case))
    heads_last = unsqueeze_dim == 2
    q, k = _projected(heads, head_dim, heads_last, dtype), _projected(kv_heads, head_dim, heads_last, dtype)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    cos, sin = _tables(table_batch, rotary_dim, interleaved, torch.float32 if cos32 else dtype)
    out_grads = [torch.randn(t.shape, device=DEVICE, dtype=dtype) for t in (q, k)]

    def ours(q, k):
        with ft.use_backend(name):
            return ft.apply_rotary_pos_emb(q, k, cos, sin, None, unsqueeze_dim, interleaved=interleaved)

    def oracle(q, k):
        return ft.reference.apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype), None, unsqueeze_dim,
                                                 interleaved=interleaved)

    check_against_reference(ours, oracle, {"q": q, "k": k}, out_grads)


def _llama_tables(rope_parameters, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    extra = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         **extra)
    hidden = torch.randn(BATCH, SEQ, 128, device=DEVICE, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [40, 41, 90, 91, 200, 201, 255]], device=DEVICE)
    return LlamaRotaryEmbedding(config).to(DEVICE)(hidden, positions)


def _assert_same_as_theirs(theirs, cos, sin, q, k, name, unsqueeze_dim=1):
    """Ours on ``name`` against ``theirs(q, k, cos, sin)``, forward and the gradients of q and k."""
    leaves = [t.detach().requires_grad_() for t in (q, k, q, k)]
    with ft.use_backend(name):
        got = ft.apply_rotary_pos_emb(leaves[0], leaves[1], cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = theirs(leaves[2], leaves[3], cos, sin, unsqueeze_dim=unsqueeze_dim)
    grads = [torch.randn_like(t) for t in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w)
    for ours_leaf, their_leaf in zip(leaves[:2], leaves[2:]):
        torch.testing.assert_close(ours_leaf.grad, their_leaf.grad)


ROPE_PARAMETERS = {
    "default": None,
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
}


@numerics
@pytest.mark.parametrize("rope", list(ROPE_PARAMETERS))
@pytest.mark.parametrize("name", _backends() + ["auto"])
def test_equals_transformers_llama(name, rope):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as theirs

    torch.manual_seed(1)
    cos, sin = _llama_tables(ROPE_PARAMETERS[rope], torch.float32)
    q, k = _projected(4, 32, False, torch.float32), _projected(2, 32, False, torch.float32)
    _assert_same_as_theirs(theirs, cos, sin, q, k, name)
    # [B, S, H, D] with unsqueeze_dim=2
    _assert_same_as_theirs(theirs, cos, sin, q.transpose(1, 2), k.transpose(1, 2), name, unsqueeze_dim=2)


@numerics
@pytest.mark.parametrize("name", _backends() + ["auto"])
def test_equals_transformers_phi3_partial_rotary(name):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb as theirs

    torch.manual_seed(2)
    config = Phi3Config(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5,
                        max_position_embeddings=64)
    positions = torch.arange(SEQ, device=DEVICE)[None].expand(BATCH, SEQ)
    cos, sin = Phi3RotaryEmbedding(config).to(DEVICE)(torch.randn(BATCH, SEQ, 192, device=DEVICE), positions)
    assert cos.shape[-1] == 48  # 96-dim heads, half of them rotated
    _assert_same_as_theirs(theirs, cos, sin, _projected(2, 96, False, torch.float32),
                           _projected(1, 96, False, torch.float32), name)


@numerics
@pytest.mark.parametrize("name", _backends())
def test_bfloat16_as_transformers_runs_it(name):
    """bfloat16 q / k / cos / sin from Llama's rotary module: within the 2x rule of Hugging Face's own bfloat16
    result, measured against float64."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as theirs

    torch.manual_seed(3)
    cos, sin = _llama_tables(ROPE_PARAMETERS["llama3"], torch.bfloat16)
    q, k = _projected(4, 32, False, torch.bfloat16), _projected(2, 32, False, torch.bfloat16)

    def ours(q, k):
        with ft.use_backend(name):
            return ft.apply_rotary_pos_emb(q, k, cos, sin)

    def hf(q, k):
        return theirs(q, k, cos.to(q.dtype), sin.to(q.dtype))

    check_against_reference(ours, hf, {"q": q, "k": k}, [torch.randn_like(q), torch.randn_like(k)])


@pytest.mark.skipif(backend.triton_unavailable_reason() is not None, reason="triton is not installed")
@pytest.mark.parametrize("autocast", [False, True])
def test_one_launch_forward_one_backward_few_frames(launches_seen, autocast):
    """q and k in one launch, their gradients in one; from the public call at most five of the package's frames."""
    torch.manual_seed(4)
    q, k = _projected(4, 32, False, torch.float32), _projected(2, 32, False, torch.float32)
    cos, sin = _tables(1, 32, False, torch.float32)
    with ft.use_backend("triton"), torch.autocast(DEVICE, enabled=autocast, dtype=torch.bfloat16):
        q_embed, k_embed = ft.apply_rotary_pos_emb(q.requires_grad_(), k.requires_grad_(), cos, sin)
        assert q_embed.dtype == k_embed.dtype == torch.float32  # q's dtype, as Hugging Face's elementwise code
        assert len(launches_seen) == 1
        (q_embed.sum() + k_embed.sum()).backward()
    assert [kernel for kernel, _ in launches_seen] == ["_rotary_kernel"] * 2
    assert all(len(frames) <= MAX_FRAMES for _, frames in launches_seen), launches_seen


@numerics
@pytest.mark.parametrize("name", _backends())
def test_outputs_keep_qs_layout(name):
    q, k = _projected(4, 32, False, torch.float32), _projected(2, 32, False, torch.float32)
    cos, sin = _tables(2, 32, False, torch.float32)
    with ft.use_backend(name):
        q_embed, k_embed = ft.apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    if name == "triton":
        assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()


@pytest.mark.parametrize("name", _backends())
def test_empty_sequence(name):
    q, k = torch.randn(2, 4, 0, 32, device=DEVICE), torch.randn(2, 2, 0, 32, device=DEVICE)
    cos = torch.randn(2, 0, 32, device=DEVICE)
    with ft.use_backend(name):
        q_embed, k_embed = ft.apply_rotary_pos_emb(q, k, cos, cos.sin())
    assert q_embed.shape == q.shape and k_embed.shape == k.shape


@numerics
@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_sin_requiring_grad_run_on_torchs_path_with_their_gradients(interleaved):
    torch.manual_seed(5)
    q, k = _projected(2, 16, False, torch.float32), _projected(1, 16, False, torch.float32)
    angles = torch.randn(2, SEQ, 16, device=DEVICE)
    leaves = [t.detach().requires_grad_() for t in (q, k, angles.cos(), angles.sin())]
    with ft.explain() as calls:
        got = ft.apply_rotary_pos_emb(*leaves, interleaved=interleaved)
    assert [r.backend for r in calls] == ["torch"] and "cos or sin requires grad" in calls[0].reason
    twins = [t.detach().requires_grad_() for t in leaves]
    want = ft.reference.apply_rotary_pos_emb(*twins, interleaved=interleaved)
    grads = [torch.randn_like(t) for t in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    for a, b in zip(leaves, twins):
        torch.testing.assert_close(a.grad, b.grad)


def test_default_route_is_ours():
    q, k = torch.randn(1, 4, 8, 32, device=DEVICE), torch.randn(1, 2, 8, 32, device=DEVICE)
    cos = torch.randn(1, 8, 32, device=DEVICE)
    with ft.explain() as calls:
        ft.apply_rotary_pos_emb(q, k, cos, cos.sin())
    assert calls[0].backend in ("triton", "cpu"), calls[0]


_Q, _K, _COS = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32), torch.randn(2, 5, 32)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(k=torch.randn(2, 2, 5, 16)), ValueError, "k must have q's rank and head dim"),
    (dict(k=torch.randn(2, 2, 5, 32, dtype=torch.float64)), TypeError, "k has dtype torch.float64"),
    (dict(q=torch.randint(0, 3, (2, 4, 5, 32))), TypeError, "q must be float16"),
    (dict(cos=torch.randint(0, 3, (2, 5, 32))), TypeError, "cos must be float16"),
    (dict(sin=torch.randn(2, 5, 16)), ValueError, "sin must have cos's shape"),
    (dict(sin=_COS.double()), TypeError, "sin has dtype torch.float64 but cos has torch.float32"),
    (dict(cos=torch.randn(2, 5, 31), sin=torch.randn(2, 5, 31)), ValueError, "rotary_dim even"),
    (dict(cos=torch.randn(2, 5, 64), sin=torch.randn(2, 5, 64)), ValueError, "in (0, head_dim=32]"),
    (dict(cos=torch.randn(2, 6, 32), sin=torch.randn(2, 6, 32)), ValueError, "does not broadcast to q's"),
    (dict(cos=torch.randn(3, 5, 32), sin=torch.randn(3, 5, 32)), ValueError, "does not broadcast to q's"),
    (dict(unsqueeze_dim=7), ValueError, "unsqueeze_dim=7 must be an int"),
    (dict(position_ids=2), TypeError, "pass unsqueeze_dim by keyword"),
    (dict(q=torch.randn(1, 2, 2, 4, 5, 32)), ValueError, "q must be [B, H, S, D]"),
    (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
])
def test_rejects_bad_input(kwargs, error, words):
    call = dict(q=_Q, k=_K, cos=_COS, sin=_COS.sin(), position_ids=None, unsqueeze_dim=1, interleaved=False)
    call.update(kwargs)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        ft.apply_rotary_pos_emb(**call)


@pytest.mark.parametrize("name", _backends())
def test_compiles_fullgraph_without_a_graph_break(name):
    """Forward and loss, then the AOT backward: the Triton launches through the custom op, the CPU path's ops."""
    torch.manual_seed(6)
    q = _projected(4, 32, False, torch.float32).detach().requires_grad_()
    k = _projected(2, 32, False, torch.float32).detach().requires_grad_()
    cos, sin = _tables(2, 32, False, torch.float32)

    def loss(q, k):
        q_embed, k_embed = ft.apply_rotary_pos_emb(q, k, cos, sin)
        return (q_embed.sin() * 2 + k_embed.mean()).mean()

    with ft.use_backend(name):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(loss)(q, k)
        assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        got = compiled(q, k)
        grads = torch.autograd.grad(got, (q, k))
        want = loss(q, k)
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, (q, k))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("name", _backends())
def test_stands_in_for_transformers_in_llama_attention(monkeypatch, name):
    """LlamaAttention with modeling_llama's apply_rotary_pos_emb replaced by ours: the same output and gradients."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    torch.manual_seed(7)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    attention = modeling_llama.LlamaAttention(config, layer_idx=0).to(DEVICE)
    hidden = torch.randn(BATCH, SEQ, 64, device=DEVICE)
    positions = torch.arange(SEQ, device=DEVICE)[None].expand(BATCH, SEQ)
    cos_sin = modeling_llama.LlamaRotaryEmbedding(config).to(DEVICE)(hidden, positions)

    def run():
        leaf = hidden.detach().requires_grad_()
        out = attention(leaf, cos_sin, None)[0]
        out.square().sum().backward()
        return out.detach(), leaf.grad

    want = run()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", ft.apply_rotary_pos_emb)
    with ft.use_backend(name), ft.explain() as calls:
        got = run()
    assert [r.op for r in calls] == ["apply_rotary_pos_emb"] and calls[0].backend == name
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.skipif(backend.triton_unavailable_reason() is not None, reason="triton is not installed")
def test_every_plan_tiles_rows_by_a_power_of_two():
    """tl.arange takes powers of two only: a partial rotary's tile (head dim 96, 32 rotated: 96 features wide) once
    asked for 42 rows."""
    from fused_transformer.kernels import rotary as kernel

    for head_dim in range(2, 257, 2):
        for rotary_dim in range(2, head_dim + 1, 2):
            rows = kernel.plan_of(head_dim, rotary_dim).block_rows
            assert rows & (rows - 1) == 0, (head_dim, rotary_dim, rows)
    q, k = torch.randn(2, 3, 13, 96, device=DEVICE), torch.randn(2, 1, 13, 96, device=DEVICE)
    angles = torch.randn(2, 13, 32, device=DEVICE)
    with ft.use_backend("triton"):
        got = ft.apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
    want = ft.reference.apply_rotary_pos_emb(q.double(), k.double(), angles.cos().double(), angles.sin().double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
