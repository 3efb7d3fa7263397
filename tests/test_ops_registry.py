"""The house of the ops (``fused_transformer.ops``): every registered op reaches every tool, its call path from the
public function to a Triton launch stays short, ``ft.explain()`` says who ran each call, and an op's name stays in a
handful of code files."""
import ast
import inspect
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

import fused_transformer as ft
from fused_transformer import ops, route
from fused_transformer.tools import bench_cases, bench_overhead, check_cases, tune
from tests.numerics import DEVICE

MAX_FRAMES = 5
REGISTERED = ops.names()


# Checked through another entry (the weights from attention's LSE): its function and oracle run the pair.
THROUGH_ANOTHER = {"attention_weights"}


def test_every_op_module_registers_and_every_tool_lists_it():
    """Each tool lists every registered op that gives it something to run (``check``: ``Op.check``; bench: its suite;
    the overhead suite: ``Op.overhead``, the first call named as the op, its targets; ``tune``: ``Op.tune``), and no
    other; every op reaches at least one tool."""
    assert {"attention", "attention_weights", "attention_varlen", "attention_with_kvcache", "layer_norm", "rms_norm",
            "feed_forward", "gated_feed_forward", "apply_rotary_pos_emb"} <= set(REGISTERED)
    for name in REGISTERED:
        op = ops.get(name)
        assert name in route.op_names()
        assert getattr(ft, name) is getattr(ft.functional, name)
        if name not in THROUGH_ANOTHER:
            assert getattr(ft, name) is op.function
            assert op.reference is None or ft.reference.__getattr__(name) is op.reference
        assert op.check or op.bench or op.overhead or op.tune("cpu", torch.float32, True), name
        assert (name in check_cases.CHECKS) == bool(op.check), name
        assert not op.check or any(example.quick for example in op.check), name
        assert op.bench_suite is None or op.bench_suite in bench_cases.SUITES, name
        overhead = [case for case, (case_op, _) in bench_overhead.OP_CASES.items() if case_op is op]
        assert overhead == [name, *(f"{name} ({example.label})" for example in op.overhead[1:])][:len(op.overhead)]
        assert all(bench_overhead.OPS[case] == tuple(op.overhead_target) for case in overhead), name
        assert {mode for key, mode in bench_overhead.TARGETS if key == name} == (
            {mode for mode, target in op.overhead_target.items() if target is not None} if op.overhead else set())
        groups = [g for g in tune._groups(torch.device("cpu"), quick=True) if g.op == name]
        assert bool(groups) == bool(op.tune("cpu", torch.float32, True)), name
        assert all(size > 0 for g in groups for size, _ in g.examples), name
    with pytest.raises(ValueError, match="is not an op"):
        ops.get("no_such_op")


def test_no_tool_names_an_op():
    """The tools read the registry: none of their strings starts with an op's name."""
    from fused_transformer.tools import bench_llama, check

    for module in (check, check_cases, tune, bench_overhead, bench_llama):
        strings = [node.value for node in ast.walk(ast.parse(inspect.getsource(module)))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        named = [s for s in strings if re.match(r"\w+", s) and re.match(r"\w+", s).group(0) in REGISTERED]
        assert not named, (module.__name__, named)


def test_a_backend_without_an_ops_launchers_does_not_compute_it():
    """The route sends a call whose op the backend does not define to torch's path (or the reference), no stub."""
    call = route.Call("rms_norm", "cpu", torch.float32, dropout=True, needs_grad=True, backends=frozenset({"triton"}))
    decision = route.decide(call, "auto", "cpu", rows=())
    assert decision.backend == "torch" and "does not compute rms_norm" in decision.reason
    refused = call._replace(torch_cannot="a reason")
    assert route.decide(refused, "auto", "cpu", rows=()).backend == "reference"
    assert route.decide(call, "cpu", "cpu", rows=()).backend == "reference"


# --------------------------------------------------------------------------------------------- frames


def _package_roots():
    import fused_transformer.kernels as kernels

    return (os.path.dirname(ft.__file__) + os.sep, os.path.dirname(kernels.__file__) + os.sep)


@pytest.fixture
def launches_seen(monkeypatch):
    """Every Triton launch's project frames (the package's and the kernels' own files on the stack when Triton's
    runtime is entered), by kernel; launches still run."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    roots, seen = _package_roots(), []

    def spy(original):
        def run(self, *args, **kwargs):
            frames = [f for f in inspect.stack(0)[1:] if f.filename.startswith(roots)]
            seen.append((getattr(self, "__name__", str(self)), [f"{os.path.basename(f.filename)}:{f.function}"
                                                                for f in frames]))
            return original(self, *args, **kwargs)
        return run

    monkeypatch.setattr(InterpretedFunction, "run", spy(InterpretedFunction.run))
    monkeypatch.setattr(JITFunction, "run", spy(JITFunction.run))
    return seen


@pytest.mark.skipif(ft.backend.triton_unavailable_reason() is not None, reason="triton is not installed")
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "feed_forward", "gated_feed_forward"])
@pytest.mark.parametrize("autocast", [False, True])
def test_at_most_five_project_frames_at_every_launch(launches_seen, name, autocast):
    """From the public call to Triton's runtime: the public function, the op's run, its Function's forward or
    backward, the launcher and the one launch helper (forward, backward, no-grad forward; under autocast too)."""
    op = ops.get(name)
    example = next(e for e in op.check if e.quick)
    torch.manual_seed(0)
    tensors = example.draw(lambda *shape, scale=1.0: torch.randn(*shape, device=DEVICE) * scale)
    options = {**example.options, "dropout_p": 0.1}
    with ft.use_backend("triton"), torch.autocast(DEVICE, enabled=autocast):
        with torch.no_grad():
            op.function(**tensors, **options)
        for t in tensors.values():
            if t is not None:
                t.requires_grad_(True)
        out = op.function(**tensors, **options)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert launches_seen
    assert all(len(frames) <= MAX_FRAMES for _, frames in launches_seen), \
        [(kernel, frames) for kernel, frames in launches_seen if len(frames) > MAX_FRAMES]


@pytest.mark.skipif(ft.backend.triton_unavailable_reason() is not None, reason="triton is not installed")
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_at_most_five_project_frames_at_every_attention_launch(launches_seen, varlen, autocast):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 16, device=DEVICE) for _ in range(3))
    padding = torch.arange(9, device=DEVICE) >= torch.tensor([9, 5], device=DEVICE)[:, None]
    cu_seqlens = torch.tensor([0, 9, 14], dtype=torch.int32, device=DEVICE)
    packed = [t.transpose(1, 2).reshape(18, 2, 16)[:14].contiguous() for t in (q, k, v)]

    def call(q, k, v):
        if varlen:
            return ft.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 9, 9, is_causal=True, dropout_p=0.1)
        return ft.attention(q, k, v, key_padding_mask=padding, dropout_p=0.1)

    inputs = packed if varlen else (q, k, v)
    with ft.use_backend("triton"), torch.autocast(DEVICE, enabled=autocast):
        with torch.no_grad():
            call(*inputs)
        leaves = [t.detach().requires_grad_() for t in inputs]
        call(*leaves).float().sum().backward()
    assert len(launches_seen) >= 3
    assert all(len(frames) <= MAX_FRAMES for _, frames in launches_seen), \
        [(kernel, frames) for kernel, frames in launches_seen if len(frames) > MAX_FRAMES]


# -------------------------------------------------------------------------------------------- explain


def test_explain_records_every_call_of_a_models_forward_with_what_ran():
    torch.manual_seed(0)
    model = ft.fuse(nn.Sequential(nn.Linear(32, 32), nn.RMSNorm(32), nn.LayerNorm(32))).to(DEVICE)
    layer = ft.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True).to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE)
    with ft.explain() as calls:
        layer(model(x)).sum().backward()
    ops_seen = [record.op for record in calls]
    assert ops_seen[:2] == ["rms_norm", "layer_norm"] and "attention" in ops_seen and "feed_forward" in ops_seen
    assert all(r.door == "functional" and r.backend in ("triton", "cpu", "torch", "reference") and r.reason
               for r in calls)
    assert str(calls[0]) == f"rms_norm (functional) -> {calls[0].backend}: {calls[0].reason}"
    with ft.use_backend("reference"), ft.explain() as forced:
        model(x)
    assert [(r.op, r.backend) for r in forced] == [("rms_norm", "reference"), ("layer_norm", "reference")]
    with ft.explain() as outside:
        pass
    model(x)
    assert outside == []
    nested = torch.nested.nested_tensor([torch.randn(3, 32), torch.randn(2, 32)])
    with ft.explain() as fallback:
        ft.fuse(nn.LayerNorm(32))(nested)
    assert [(r.op, r.door, r.backend) for r in fallback] == [("LayerNorm", "module", "torch")]


def test_explains_backend_is_the_one_that_ran(monkeypatch):
    """A call the route sends to torch's path runs torch's ops, and one it sends to ours runs our launcher."""
    from fused_transformer.ops import layer_norm as norm

    ran = []
    forward = norm.LAUNCHERS(ft.current(DEVICE, torch.float32))[0]
    monkeypatch.setattr(norm.LAUNCHERS, "_found", {
        name: (lambda *args, _name=name: ran.append(_name) or forward(*args), found[1])
        for name, found in norm.LAUNCHERS._found.items()})
    x, w, b = torch.randn(4, 32, device=DEVICE), torch.randn(32, device=DEVICE), torch.randn(32, device=DEVICE)
    with ft.explain() as calls:
        ft.layer_norm(x, w, b)
        ft.layer_norm(x, w, b, dropout_p=0.1)
    assert [r.backend for r in calls][0] == "torch"
    assert ran == [calls[1].backend]


# ---------------------------------------------------------------------------------------- one op, few files

LEFT_OUT = (":!tests", ":!docs", ":!benchmarks", ":!fused_transformer/modules", ":!fused_transformer/models",
            ":!fused_transformer/integrations")


@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(
    os.path.dirname(os.path.dirname(ft.__file__)), ".git")), reason="not a git checkout")
# Attention's name is the kernels' package and every backend's interface (``contract``): the issue that made one
# module per op counted the norms and the feed-forward, whose names were in 22 to 25 files.
@pytest.mark.parametrize("name", [name for name in REGISTERED if not name.startswith("attention")])
def test_an_ops_name_appears_in_at_most_six_code_files(name):
    root = os.path.dirname(os.path.dirname(ft.__file__))
    found = subprocess.run(["git", "grep", "-l", "--untracked", name, "--", "*.py", "*.cpp", "*.h", *LEFT_OUT],
                           cwd=root, capture_output=True, text=True, check=False).stdout.split()
    assert 0 < len(found) <= 6, found
