"""The thin path (docs/layout.md, "The route of a call"): an eager call launches its Triton kernel without going
through a custom op, a traced call goes through one; a call that needs no gradient records no autograd node, one
that does records the op's one Function, whichever backend runs it."""
import ast
from types import SimpleNamespace

import pytest
import torch
import triton
from torch.fx.experimental.proxy_tensor import make_fx
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.tools.tensor_descriptor import TensorDescriptor

import fused_transformer as ft
from fused_transformer import backend, functional
from fused_transformer.ops.attention import function as attention_function
from fused_transformer.kernels import _common
from fused_transformer.kernels.attention import configs, launch
from fused_transformer.kernels.attention.fwd import attention_fwd_kernel
from tests.numerics import DEVICE
from fused_transformer.ops.attention import contract as attention_contract

CALLS = {
    "attention_fwd": lambda q, x, w: ft.attention(q, q, q, is_causal=True),
    # with dropout: without it, ATen runs the op (layer_norm_composed, feed_forward_composed)
    "layer_norm_fwd": lambda q, x, w: functional.layer_norm(x, w, w, dropout_p=0.1),
    "feed_forward_fwd": lambda q, x, w: functional.feed_forward(x, w[:, None].expand(32, 32), None,
                                                                w[None, :].expand(32, 32), None, dropout_p=0.1),
}


def _inputs(device: str = DEVICE):
    generator = torch.Generator().manual_seed(0)
    return tuple(t.to(device) for t in (torch.randn(1, 2, 8, 16, generator=generator),
                                        torch.randn(4, 32, generator=generator), torch.randn(32, generator=generator)))


def _profiled_ops(fn) -> set:
    with torch.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("op", list(CALLS))
def test_eager_calls_skip_the_custom_op_and_traced_calls_go_through_it(op):
    inputs = _inputs()
    with backend.use_backend("triton"):
        eager = _profiled_ops(lambda: CALLS[op](*inputs))
        graph = make_fx(CALLS[op])(*inputs).graph
    assert f"fused_transformer::{op}" not in eager
    assert any(f"fused_transformer.{op}" in str(node.target) for node in graph.nodes), graph


@pytest.mark.parametrize("name", ["triton", "cpu"])
def test_one_function_per_op_records_autograd_only_when_a_gradient_is_needed(name):
    if name == "cpu" and backend.cpu_unavailable_reason() is not None:
        pytest.skip(backend.cpu_unavailable_reason())
    q, x, w = _inputs("cpu" if name == "cpu" else DEVICE)
    with backend.use_backend(name):
        assert ft.attention(q, q, q).grad_fn is None
        with torch.no_grad():
            assert functional.layer_norm(x.requires_grad_(), w, w).grad_fn is None
        leaf = q.clone().requires_grad_()
        out = ft.attention(leaf, q, q)
        y = functional.layer_norm(x, w, w, dropout_p=0.1)  # with dropout: no backend has a composed form
    assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
    assert type(y.grad_fn).__name__ == "NormFunctionBackward"  # contiguous rows: no view before or after
    assert attention_function.AttentionFunction.__module__ == "fused_transformer.ops.attention.function"


def _node_names(node, depth: int = 2) -> set:
    """The autograd nodes from ``node`` back ``depth`` steps."""
    if node is None or depth == 0:
        return set()
    return {type(node).__name__}.union(*(_node_names(n, depth - 1) for n, _ in node.next_functions))


def test_launch_options_are_made_once_per_kind_of_launch(monkeypatch):
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    q, _, _ = _inputs()
    with backend.use_backend("triton"):
        ft.attention(q, q, q)
        planned = dict(launch._LAUNCHES)
        ft.attention(q, q, q)
        ft.attention(q * 2, q, q)
        assert len(planned) == 1 and launch._LAUNCHES == planned
        ft.attention(q, q, q, is_causal=True)
    assert len(launch._LAUNCHES) == 2
    (found,) = planned.values()
    # the constexprs, positional: the kernel's last parameters, in its order
    names = attention_fwd_kernel.arg_names[-len(found.constexprs):]
    constexprs = dict(zip(names, found.constexprs))
    assert constexprs == {**constexprs, **found.plan.constexprs(), "IS_CAUSAL": False, "HEAD_DIM": 16}
    assert found.num_warps == found.plan.tile.num_warps


# ------------------------------------------------------------------------------ launches (kernels/_common.py)


def _launch_samples() -> list:
    x = torch.randn(64, 64)
    b = x.to(torch.bfloat16)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 16, 2**40, 2**63 - 16,
            2**63, 2**64 - 16]
    return [*ints, 0.0, 0.5, 1.0, True, False, None, x, x[:, 1:], x[4:], b, b[:, 1:], b[:, 8:],
            torch.nn.Parameter(x), TensorDescriptor(b, [64, 64], [64, 1], [16, 64]),
            TensorDescriptor(b[:, 8:], [64, 56], [64, 1], [16, 64]), TensorDescriptor(b, [64, 64], [64, 1], [32, 64]),
            TensorDescriptor(x, [64, 64], [64, 1], [16, 64]),
            # tuples, as the attention kernels take their score modifiers (jit.score_mod_args)
            (1.0, None, 0, 0), (0.5, x, 0, 1), (0.5, x, 16, 1), (0.5, x[:, 1:], 0, 1), (0.5, x, 17, 1), (0.5, b, 0, 1),
            (0.5, (x, 1)), (0.5, (x, 2))]


def test_launch_keys_are_as_fine_as_tritons_specialization():
    """Two arguments with one launch key are alike to Triton's own specialization (on an sm_90 target), so a kernel
    compiled for one is the kernel Triton launches for the other."""
    backend_class = type(make_backend(GPUTarget("cuda", 90, 32)))
    samples = _launch_samples()
    keys = [_common._runtime_key(a) for a in samples]
    tritons = [native_specialize_impl(backend_class, a, False, True, True) for a in samples]
    assert len(set(map(str, tritons))) > 10  # the samples span what Triton tells apart
    for a, key_a, triton_a in zip(samples, keys, tritons):
        for b, key_b, triton_b in zip(samples, keys, tritons):
            if key_a == key_b:
                assert triton_a == triton_b, (a, b)


class _Compiled:
    """A compiled kernel's parts that launch_kernel reads; records its launches."""
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, *launch_args):
        self.launches.append(launch_args)


class _Kernel:
    """A JITFunction's parts that launch_kernel reads: (X, n, scale, BLOCK: constexpr)."""
    arg_names = ["X", "n", "scale", "BLOCK"]
    params = [SimpleNamespace(is_constexpr=name == "BLOCK") for name in arg_names]

    def __init__(self):
        self.compiled = []

    def run(self, *args, grid, warmup, **options):
        assert not warmup
        self.compiled.append((args, grid, options, _Compiled()))
        return self.compiled[-1][-1]


def test_launches_reuse_the_compiled_kernel_of_a_key_seen_before(monkeypatch):
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "current_stream", lambda device: 7)
    monkeypatch.setattr(_common, "_COMPILED", {})
    kernel, x = _Kernel(), torch.randn(64)
    _common.launch_kernel(kernel, (3,), (x, 16, 0.5), 4, BLOCK=64)
    assert [(args, grid, options) for args, grid, options, _ in kernel.compiled] == [
        ((x, 16, 0.5, 64), (3,), dict(num_warps=4, num_ctas=1))]
    y = x * 2
    _common.launch_kernel(kernel, (5, 2), (y, 32, 0.25, 64), 4)  # other values, the kernel Triton would launch
    hooks = triton.knobs.runtime
    (first,) = kernel.compiled
    no_hook = hooks.launch_enter_hook  # None up to Triton 3.6, an empty HookChain since: no launch metadata
    assert first[-1].launches == [(5, 2, 1, 7, "function", "packed", None, no_hook, hooks.launch_exit_hook, y, 32,
                                   0.25, 64)]
    hooked = [print]
    if hasattr(triton.knobs, "HookChain"):
        hooked.append(triton.knobs.HookChain())
        hooked[-1].add(print)
    for hook in hooked:  # a profiler's hook: the metadata it reads
        monkeypatch.setattr(hooks, "launch_enter_hook", hook)
        _common.launch_kernel(kernel, (5, 2), (y, 32, 0.25, 64), 4)
        assert first[-1].launches[-1][6:8] == (("metadata", (5, 2), 7), hook)
    monkeypatch.setattr(hooks, "launch_enter_hook", no_hook)
    for args, options in [((x, 17, 0.5), {}), ((x[1:], 16, 0.5), {}), ((x, 1, 0.5), {}), ((x, 2**31, 0.5), {}),
                          ((x.double(), 16, 0.5), {}), ((x, 16, None), {}), ((x, 16, 0.5), dict(num_warps=8)),
                          ((x, 16, 0.5), dict(num_stages=2))]:
        compiles = len(kernel.compiled)
        _common.launch_kernel(kernel, (1,), args, **{"num_warps": 4, **options}, BLOCK=64)
        assert len(kernel.compiled) == compiles + 1, (args, options)
    compiles = len(kernel.compiled)
    _common.launch_kernel(kernel, (1,), (x, 16, 0.5), 4, BLOCK=128)  # a constexpr: its value
    for _ in range(2):
        _common.launch_kernel(kernel, (1,), (x, 16, 0.5), 4)  # not every parameter given: through run
    monkeypatch.setattr(_common, "interpreting", lambda: True)  # the interpreter: every launch through run
    _common.launch_kernel(kernel, (1,), (x, 16, 0.5), 4, BLOCK=64)
    assert len(kernel.compiled) == compiles + 4


def test_a_known_part_of_the_launch_key_tells_apart_what_the_whole_key_does(monkeypatch):
    """A launcher's kept key of some arguments (``cached_key``) reuses a compiled kernel exactly where the key of every
    argument would."""
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "current_stream", lambda device: 7)
    monkeypatch.setattr(_common, "_COMPILED", {})
    kernel, x = _Kernel(), torch.randn(64)
    calls = [(x, 16, 0.5), (x * 2, 32, 0.25), (x, 17, 0.5), (x, 1, 0.5), (x, 16, None), (x[1:], 16, 0.5),
             (x, 2**31, 0.5)]
    options = (0, 4, None, 1)
    for a in calls:
        for b in calls:
            known_a, known_b = ((1, 3, _common.runtime_keys(args[1:3])) for args in (a, b))
            same = _common.launch_key(kernel, (*a, 64), options) == _common.launch_key(kernel, (*b, 64), options)
            assert (_common.launch_key(kernel, (*a, 64), options, known_a)
                    == _common.launch_key(kernel, (*b, 64), options, known_b)) == same, (a, b)
    for args in calls:
        _common.launch_kernel(kernel, (1,), args, 4, cached_key=(1, 3, _common.runtime_keys(args[1:3])), BLOCK=64)
    compiles = len(kernel.compiled)
    assert compiles == len(calls) - 1  # (x * 2, 32, 0.25) and (x, 16, 0.5) are alike
    y = x * 3
    _common.launch_kernel(kernel, (2,), (y, 48, 0.75), 4, cached_key=(1, 3, _common.runtime_keys((48, 0.75))), BLOCK=64)
    assert len(kernel.compiled) == compiles and kernel.compiled[0][-1].launches[-1][-4:] == (y, 48, 0.75, 64)
    assert _common.runtime_keys((16, object())) is None  # no key: launch_kernel keys every argument itself


def test_the_launchers_key_the_shared_arguments_where_the_kernels_take_them():
    """``cached_key_of``' start in each launcher is the kernel's first shared parameter (``launch.shared_args``)."""
    import inspect

    from fused_transformer.kernels.attention import bwd, fwd

    for kernel, start in ((fwd.attention_fwd_kernel, 5), (bwd.attention_dq_kernel, 12),
                          (bwd.attention_dkdv_kernel, 11)):
        names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        assert names[start:start + 2] == ["MASK", "PAD"], names


def test_small_launches_read_through_pointers_on_a_gpu(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "target_of", lambda device: SimpleNamespace(tma=True))
    q = torch.randn(2, 4, 64, 64, dtype=torch.bfloat16)
    small = launch.Layout.dense(q, q, q)
    large = small._replace(n_queries=4096, n_keys=4096)  # 2**27 scores
    assert not launch.tma_can_load((q, q, q), small)
    assert launch.tma_can_load((q, q, q), large)
    assert not launch.tma_can_load((q, q[..., 1:], q), large)  # a base TMA cannot address
    monkeypatch.setattr(configs, "TMA_MIN_SCORES", 0)
    assert launch.tma_can_load((q, q, q), small)


def test_a_launch_with_an_unhashable_constexpr_goes_through_run(monkeypatch):
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "_COMPILED", {})
    kernel = _Kernel()
    for _ in range(2):
        _common.launch_kernel(kernel, (1,), (torch.randn(4), 16, 0.5), 4, BLOCK=[64])
    assert len(kernel.compiled) == 2 and _common._COMPILED == {}


def test_the_lse_is_an_output_of_the_function_only_when_asked_for():
    """Without ``return_lse`` the Function has one output (one less for autograd to track); the gradients do not
    depend on it, and an asked-for LSE still carries its own."""
    q, _, _ = _inputs()
    leaves = [q.clone().requires_grad_() for _ in range(3)]
    grad = torch.randn_like(q)
    with backend.use_backend("triton"):
        out = ft.attention(*leaves, is_causal=True)
        alone = torch.autograd.grad(out, leaves, grad)
        out_lse, lse = ft.attention(*leaves, is_causal=True, return_lse=True)
        with_lse = torch.autograd.grad(out_lse, leaves, grad, retain_graph=True)
        lse_grads = torch.autograd.grad(lse.sum(), leaves)
    assert out_lse.grad_fn is lse.grad_fn  # one node, two outputs
    for a, b in zip(alone, with_lse):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(g.abs().sum() > 0 for g in lse_grads[:2])


def test_a_plain_dense_call_reuses_its_launch_form(monkeypatch):
    """The layout, kernel-form masks and shared arguments of a dense call without masks are made once per shapes,
    strides and spec; the seed of each call takes its place among the cached arguments."""
    from fused_transformer.contract import NO_SCORE_MODS, AttentionMasks
    from fused_transformer.ops.attention.contract import attention_spec
    from fused_transformer.kernels.attention import call

    monkeypatch.setattr(call, "_CACHED_LAUNCH_ARGS", {})
    q, _, _ = _inputs()
    spec = attention_spec(q.shape[-1], True, "top_left", None, 0.1, None)
    masks = AttentionMasks(None, None, None, None)
    seeds = [torch.tensor([n]) for n in (7, 8)]
    made = [call.launch_args_of(q, q, q, spec, NO_SCORE_MODS, None, masks, None, seed) for seed in seeds]
    assert len(call._CACHED_LAUNCH_ARGS) == 1
    monkeypatch.setattr(call, "_CACHED_LAUNCH_ARGS", {})
    fresh = call.launch_args_of(q, q, q, spec, NO_SCORE_MODS, None, masks, None, seeds[1])
    assert made[1][:2] == fresh[:2] and len(made[1].args) == len(fresh.args)
    assert all(a is b or a == b for a, b in zip(made[1].args, fresh.args))
    held = [[t for t in form.args if isinstance(t, torch.Tensor)] for form in made]
    assert len(held[0]) == len(held[1]) == 1 and held[0][0] is seeds[0] and held[1][0] is seeds[1]
    # The launch key of the arguments before the seed, made with them; an uncached form has none.
    at = next(i for i, arg in enumerate(made[1].args) if arg is seeds[1])
    assert made[0].args_key is made[1].args_key and fresh.args_key == _common.runtime_keys(fresh.args[:at])
    padding = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)
    padded = call.launch_args_of(q, q, q, spec, NO_SCORE_MODS, None, AttentionMasks(None, padding, None, None), None,
                              seeds[0])
    assert len(call._CACHED_LAUNCH_ARGS) == 1 and padded.args_key is None  # a call with a mask tensor is never cached


def test_the_backend_is_resolved_once_per_choice_device_and_dtype(monkeypatch):
    monkeypatch.setattr(backend, "_RESOLVED", {})
    with backend.use_backend("reference"):
        assert backend.current("cpu", torch.float32) == "reference"
    with backend.use_backend("triton"):
        assert backend.current(DEVICE, torch.float32) == "triton"
    assert set(backend._RESOLVED) == {("reference", "cpu", torch.float32), ("triton", torch.device(DEVICE).type,
                                                                             torch.float32)}


_DIRECT_LAUNCHES = """
import collections
from types import SimpleNamespace

import torch
from triton.runtime.jit import JITFunction

from fused_transformer import contract
from fused_transformer.kernels import _common, feed_forward, layer_norm
from fused_transformer.kernels.attention import decode, launch, ops
from fused_transformer.kernels.targets import BY_CAPABILITY
from fused_transformer.ops.attention import contract as attention_contract

through_run, direct = collections.Counter(), collections.Counter()

class Compiled:
    function, packed_metadata = "function", "packed"
    def __init__(self, name):
        self.name = name
    def run(self, *launch_args):
        direct[self.name] += 1

def run(kernel, *args, grid, warmup, **options):  # JITFunction.run: a compiled kernel that records its launches
    through_run[kernel.fn.__name__] += 1
    return Compiled(kernel.fn.__name__)

JITFunction.run = run
_common.current_device, _common.current_stream = (lambda: 0), (lambda device: 0)
launch.target_of = lambda device: BY_CAPABILITY[90]
decode.sm_count_of = lambda device: 132

g = torch.Generator().manual_seed(0)
def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g).to(dtype)
seed = torch.tensor([7, 0], dtype=torch.int64)
q = randn(2, 4, 24, 64)
padded = contract.AttentionMasks(key_padding_mask=torch.arange(24).expand(2, 24) >= torch.tensor([[20], [9]]))
no_mods, capped = contract.NO_SCORE_MODS, contract.ScoreMods(softcap=5.0)
dense = [(contract.AttentionMasks(), attention_contract.attention_spec(64, True, "top_left", None, 0.0, None), no_mods, None),
         (padded, attention_contract.attention_spec(64, False, "top_left", (8, 0), 0.1, None), capped, seed)]
packed_q = randn(30, 4, 64)
offsets = torch.tensor([0, 10, 30], dtype=torch.int32)
seqs = contract.PackedSequences(offsets, offsets, 20, 20)
k_cache, v_cache = randn(2, 512, 2, 64), randn(2, 512, 2, 64)
kv_spec = attention_contract.kvcache_spec(64, True, None, None, None)
x, w = randn(16, 96), randn(96)
w1, b1, w2, b2 = randn(384, 96), randn(384), randn(96, 384), randn(96)

def calls():
    for masks, spec, mods, s in dense:
        o, lse = ops.attention_fwd(q, q, q, masks, spec, mods, None, s, False)
        ops.attention_bwd(q, None, q, q, q, o, lse, masks, spec, mods, s)
    spec = dense[0][1]
    o, lse = ops.attention_varlen_fwd(packed_q, packed_q, packed_q, seqs, spec, no_mods, None, None, False)
    ops.attention_varlen_bwd(packed_q, None, packed_q, packed_q, packed_q, o, lse, seqs, spec, no_mods, None)
    cache = contract.KVCache(k_cache, v_cache, torch.tensor([5, 400], dtype=torch.int32), None)
    new_keys = randn(2, 1, 2, 64), randn(2, 1, 2, 64)
    decode.attention_with_kvcache(randn(2, 1, 8, 64), cache, capped, None, kv_spec, *new_keys)
    y, z, mean, rstd = layer_norm.layer_norm_fwd(x, w, w, x, 1e-5, 0.1, seed, False, True)
    layer_norm.layer_norm_bwd(x, x, z, w, w, mean, rstd, 0.1, seed, False, True)
    y, saved = feed_forward.feed_forward_fwd(x, w1, b1, w2, b2, "gelu", 0.1, seed, True, False)
    feed_forward.feed_forward_bwd(y, x, w1, b1, w2, saved, True, "gelu", 0.1, seed, False)

calls()
first = dict(through_run)
through_run.clear(), direct.clear()
calls()
print((sorted(first), dict(through_run), dict(direct)))
"""


def test_every_launcher_reuses_its_compiled_kernel_on_a_gpu():
    """A second call of each op launches every kernel straight to the kernel compiled for the first (on a GPU,
    ``JITFunction.run`` binds and specializes about 45 arguments a launch): run outside the interpreter, Triton's run
    replaced by one that hands back a stand-in compiled kernel, CPU tensors standing in for a GPU's."""
    from tests.test_backend import run_python

    done = run_python(_DIRECT_LAUNCHES, TRITON_INTERPRET=None)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second_through_run, second_direct = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert {"attention_fwd_kernel", "attention_dq_kernel", "attention_dkdv_kernel", "_attention_decode_kernel",
            "_attention_append_kernel", "_attention_decode_merge_kernel", "_layer_norm_fwd_kernel",
            "_layer_norm_bwd_kernel", "_sum_rows_kernel", "_activation_kernel",
            "_padding_lengths_kernel"} <= set(first), first
    assert second_through_run == {}, second_through_run
    assert set(second_direct) == set(first)
