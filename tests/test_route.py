"""The route (fused_transformer/route.py): the rule on every measured row and on the default, the backends'
features as data, the table's text form, tuned rows read from the user's cache ahead of the measured ones, and the
ops running where the route says."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import autograd, backend, contract, ops, reference, route
from fused_transformer.ops import feed_forward as feed_forward_op
from fused_transformer.route import Call, decide
from fused_transformer.ops.attention import contract as attention_contract
from fused_transformer.ops.attention import facts as attention_facts
from fused_transformer.ops.attention import function as attention_function

ROWS = route.table()
MEASURED = route.parse_rows(attention_facts.MEASURED)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "*": torch.float32}


def _matching_call(row: route.Row, needs_grad: bool) -> Call:
    """A call the row matches (its first value of every list, a size inside its range)."""
    lo, hi = row.sizes
    return Call(row.op, "cpu" if row.device == "*" else row.device, DTYPES[row.dtypes[0]],
                door="functional" if row.doors == ("*",) else row.doors[0],
                head_dim=64 if row.head_dims == ("*",) else int(row.head_dims[0]),
                mask="none" if row.masks == ("*",) else row.masks[0], dropout=row.dropout == "yes",
                size=lo if hi is not None or lo else 4096, needs_grad=needs_grad)


@pytest.mark.parametrize("row", MEASURED, ids=lambda row: f"{row.op}-{row.passes}-{row.device}-{row.sizes}")
def test_every_measured_row_decides_the_calls_it_matches(row):
    passes = {"forward": [False], "training": [True], "*": [False, True]}[row.passes]
    ours = "cpu" if row.device.startswith("cpu") else "triton"
    for grad in passes:
        call = _matching_call(row, grad)
        assert row.matches(call)
        got = decide(call, "auto", ours, [row])
        assert got.backend == ("torch" if row.speedup[1] < 1.0 else ours), (call, got)
        assert row.source in got.reason
        if grad and got.backend == "torch":
            strict = decide(call._replace(deterministic=True), "auto", ours, [row])
            assert strict.backend == ("torch" if row.torch_deterministic == "yes" else ours), strict


def test_without_a_row_the_default_decides():
    for op in ("attention", "attention_varlen", "attention_with_kvcache"):
        assert decide(Call(op, "sm75", torch.float16, size=512), "auto", "triton", ROWS).backend == "triton"
    for op in ("layer_norm", "rms_norm", "feed_forward"):
        record = ops.get(op)
        example = record.route_examples[0]

        def call(dropout_p):
            with_p = dataclasses.replace(example, options={**example.options, "dropout_p": dropout_p})
            return record.route_call(with_p, torch.device("cpu"), torch.float32)._replace(device="sm75", size=512)

        assert decide(call(0.0), "auto", "triton", ROWS).backend == "torch"  # nothing to fuse: the op's own default
        assert decide(call(0.1), "auto", "triton", ROWS).backend == "triton"
    # The gated feed-forward fuses the gating on a GPU with or without dropout; on the CPU, without dropout, ours
    # would be ATen's own ops and a recompute.
    record = ops.get("gated_feed_forward")
    for device, dropout_p, want in (("sm75", 0.0, "triton"), ("sm75", 0.1, "triton"), ("cpu", 0.0, "torch"),
                                    ("cpu", 0.1, "cpu")):
        example = dataclasses.replace(record.route_examples[0],
                                      options={**record.route_examples[0].options, "dropout_p": dropout_p})
        target = torch.device("cpu" if device == "cpu" else "meta")  # meta: a device other than the CPU
        call = record.call_of(example.draw(lambda *shape, scale=1.0: torch.empty(shape, device="meta")),
                              example.options, target, True)
        ours = "cpu" if device == "cpu" else "triton"
        assert decide(call._replace(device=device, size=512), "auto", ours, ROWS).backend == want, (device, dropout_p)
    rotary = ops.get("apply_rotary_pos_emb")  # q and k in one pass: ours where no row says otherwise
    call = rotary.route_call(rotary.route_examples[0], torch.device("cpu"), torch.float32)
    assert decide(call._replace(device="sm75"), "auto", "triton", ROWS).backend == "triton"
    assert decide(call._replace(device="cpu-unmeasured-t1"), "auto", "cpu", ROWS).backend == "cpu"


def test_a_named_backend_runs_ours_and_falls_back_for_what_it_lacks():
    call = Call("attention", "H200", torch.bfloat16, head_dim=64, size=4096)
    assert decide(call, "auto", "triton", ROWS).backend == "torch"
    assert decide(call, "triton", "triton", ROWS).backend == "triton"  # forced: ours, even where torch is faster
    assert decide(call, "reference", "reference", ROWS).backend == "reference"
    recompute = Call("feed_forward", "cpu", torch.float32, size=64, dropout=True, needs=frozenset({"recompute"}))
    assert decide(recompute, "cpu", "cpu", ROWS) == ("reference", "backend 'cpu' does not compute recompute")
    assert decide(recompute, "auto", "cpu", ROWS).backend == "reference"
    assert decide(recompute, "auto", "triton", ROWS).backend == "triton"
    assert decide(Call("attention", "cpu", torch.float64), "auto", "reference", ROWS).backend == "reference"


@pytest.mark.parametrize("change, why", [
    (dict(mask="other"), "masks"), (dict(needs_lse=True), "LSE"),
    (dict(needs=frozenset({"softcap"})), "softcap"), (dict(torch_cannot="empty dims"), "empty dims"),
])
def test_calls_torchs_path_does_not_compute_run_ours(change, why):
    call = Call("attention", "H200", torch.bfloat16, head_dim=64, size=4096)._replace(**change)
    got = decide(call, "auto", "triton", ROWS)
    assert got.backend == "triton" and why in got.reason


def test_attentions_facts_say_what_sdpa_does_not_serve():
    """Dropout (SDPA's random mask is not our seed's), empty dims, packed sequences and KV caches: the op's own facts
    (``Call.torch_cannot``), which the route reads without naming the op."""
    q = torch.empty(2, 4, 256, 64, device="meta", dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    for spec, why in ((attention_contract.attention_spec(64, False, "top_left", None, 0.1, None), "dropout"),
                      (attention_contract.attention_spec(64, False, "top_left", None, 0.0, None), "")):
        call = attention_facts.call(q, q, q, contract.AttentionMasks(), spec, contract.NO_SCORE_MODS, None, False,
                                    needs_grad=False, device=cpu)
        assert why in call.torch_cannot and (why or call.torch_cannot == "")
    empty = attention_facts.call(q[:, :, :0], q, q, None, spec, contract.NO_SCORE_MODS, None, False, device=cpu)
    assert empty.torch_cannot == "empty dims"
    packed = torch.randn(16, 4, 64)
    with backend.use_backend("reference"):
        assert attention_facts.decide_packed("attention_varlen", packed, 16, contract.NO_SCORE_MODS,
                                             None).backend == "reference"
    got = decide(Call("attention_varlen", "cpu", torch.float32, torch_cannot=attention_facts._PACKED), "auto", "cpu",
                 ROWS)
    assert got.backend == "cpu" and "packed sequences" in got.reason


def test_layer_norm_rows_split_by_size_and_cpu_keeps_16_bits_on_ours():
    call = Call("layer_norm", "H200", torch.bfloat16, dropout=True, size=8 * 1024 * 1024)
    assert decide(call, "auto", "triton", ROWS).backend == "torch"
    assert decide(call._replace(size=32 * 1024 * 1024), "auto", "triton", ROWS).backend == "triton"
    assert decide(call._replace(needs_grad=True, size=1 << 30), "auto", "triton", ROWS).backend == "torch"
    norm = ops.get("layer_norm")
    plain = norm.route_examples[0]
    cpu = torch.device("cpu")
    assert decide(norm.route_call(plain, cpu, torch.bfloat16), "auto", "cpu", ROWS).backend == "cpu"
    assert decide(norm.route_call(plain, cpu, torch.float32), "auto", "cpu", ROWS).backend == "torch"


def test_the_table_reads_back_what_it_writes_and_names_a_bad_line():
    text = route.HEADER + "\n" + "\n".join(row.line() for row in MEASURED)
    assert route.parse_rows(text) == MEASURED
    with pytest.raises(ValueError, match="line 2"):
        route.parse_rows(route.HEADER + "\nattention forward cpu * * none no * * 0.9")
    with pytest.raises(ValueError, match="line 1: a cell"):
        route.parse_rows("attention sideways cpu * * none no * * 0.9 - x")


@pytest.fixture
def tuned_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSED_TRANSFORMER_CACHE", str(tmp_path))
    route.forget_tuned()
    yield tmp_path
    route.forget_tuned()


def _write_rows(device: torch.device, *lines: str) -> None:
    import os

    path = route.tuned_path(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(route.HEADER + "\n" + "\n".join(lines) + "\n")


@pytest.mark.skipif(backend.cpu_unavailable_reason() is not None, reason="needs the C++ kernels")
def test_tuned_rows_come_first_and_change_the_route(tuned_cache, monkeypatch):
    """Rows in the user's cache for this CPU decide ahead of the built-in ones and the priors: SDPA where they
    measured it faster, ours where they measured ours faster; a named backend still runs ours."""
    cpu = torch.device("cpu")
    ran = []
    def sdpa(q, k, v, spec, alibi_slopes=None):
        ran.append("torch")
        return F.scaled_dot_product_attention(q, k, v, is_causal=spec.is_causal, scale=spec.scale)
    monkeypatch.setattr(attention_function, "sdpa", sdpa)
    q = torch.randn(1, 2, 64, 16)
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert route.table(cpu) == route.with_priors(route.device_facts(cpu), route._measured())
    for speedup, runs in (("0.80", ["torch"]), ("1.30", [])):
        _write_rows(cpu, f"attention  *  cpu  float32  16  causal  no  functional  32..128  {speedup}  -  a test's row")
        route.forget_tuned()
        assert route.table(cpu)[0].source == "a test's row"
        ran.clear()
        with route.explain() as calls:
            torch.testing.assert_close(ft.attention(q, q, q, is_causal=True), expected)
        assert ran == runs and "a test's row" in calls[0].reason
    with ft.use_backend("cpu"):
        ft.attention(q, q, q, is_causal=True)
    assert ran == []


def test_a_gpu_row_sends_the_functional_call_to_sdpa(monkeypatch):
    """The H200's rows, as an H200 would read them: a dense bfloat16 call runs SDPA (bit for bit what SDPA gives),
    forward and backward; one with a padding mask runs ours."""
    monkeypatch.setattr(route, "device_tag", lambda device: "H200")
    monkeypatch.setattr(route, "device_facts", lambda device: route.MEASURED_DEVICES["H200"])
    monkeypatch.setattr(backend, "current", lambda device, dtype=None: "cpu")
    monkeypatch.setattr(route, "_DECISIONS", {})
    monkeypatch.setattr(route, "_TABLES", {})
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 33, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    out = ft.attention(q, k, v, is_causal=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    assert torch.equal(out, expected)
    assert attention_facts.decide(q, k, v, contract.AttentionMasks(), attention_contract.attention_spec(64, True, "top_left", None,
                           0.0, None), contract.NO_SCORE_MODS, None, False).backend == "torch"
    dout = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(expected, leaves, dout)):
        assert torch.equal(mine, theirs)
    padding = torch.zeros(2, 33, dtype=torch.bool)
    padding[:, -5:] = True
    masks = contract.AttentionMasks(None, padding)
    spec = attention_contract.attention_spec(64, False, "top_left", None, 0.0, None)
    assert attention_facts.decide(q, k, v, masks, spec, contract.NO_SCORE_MODS, None, False).backend == "cpu"


def test_traced_attention_runs_ours(monkeypatch):
    q = torch.empty(2, 4, 256, 64, device="meta", dtype=torch.bfloat16)
    spec = attention_contract.attention_spec(64, False, "top_left", None, 0.0, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    call = attention_facts.call(q, q, q, None, spec, contract.NO_SCORE_MODS, None, False, needs_grad=True,
                                device=torch.device("cpu"))._replace(device="H200")
    monkeypatch.undo()
    assert call.size is None and "traced" in call.torch_cannot
    assert decide(call, "auto", "triton", ROWS).backend == "triton"
    layer_norm = Call("layer_norm", "H200", torch.bfloat16, size=None, torch_default="no dropout: nothing to fuse")
    assert decide(layer_norm, "auto", "triton", ROWS).backend == "torch"


def test_autograd_runs_torchs_paths_as_torch_nn():
    g = torch.Generator().manual_seed(5)
    x, w1, w2 = torch.randn(3, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g)
    spec = feed_forward_op.check(x, w1, None, w2, None, "gelu", 0.0)
    assert torch.equal(feed_forward_op.run("torch", x, w1, None, w2, None, spec),
                       F.linear(F.gelu(F.linear(x, w1)), w2))
    torch.manual_seed(0)
    dropped = feed_forward_op.run("torch", x, w1, None, w2, None, spec._replace(dropout_p=0.5))
    torch.manual_seed(0)
    assert torch.equal(dropped, F.linear(F.dropout(F.gelu(F.linear(x, w1)), 0.5), w2))


def test_tune_writes_rows_the_route_reads(tuned_cache):
    """``tune --quick`` on the CPU: one small size per group, written to the user's cache under this device's key;
    the route then reads them first, and their verdicts decide the calls they match."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fused_transformer", "tune", "--quick", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "FUSED_TRANSFORMER_CACHE": str(tuned_cache)})
    assert done.returncode == 0, done.stderr
    path = route.tuned_path(torch.device("cpu"))
    assert f"rows written to {path}" in done.stdout
    rows = route.parse_rows(open(path).read(), path)
    route.forget_tuned()
    table = route.table(torch.device("cpu"))
    assert table[:len(rows)] == tuple(rows) and len(rows) >= 8
    assert {(row.op, row.passes, row.dropout) for row in rows} >= {
        ("attention", "forward", "no"), ("layer_norm", "training", "yes"), ("feed_forward", "forward", "no")}
    for row in rows:
        call = _matching_call(row, row.passes == "training")
        got = route.decide_for(call, torch.device("cpu"), "auto", "cpu")
        assert got.backend == ("torch" if row.speedup[1] < 1.0 and not route.torch_refuses(call) else "cpu"), (row, got)
        assert row.source in got.reason


def test_rows_of_merges_neighbours_with_the_same_winner():
    from fused_transformer.tools.tune import Group, rows_of

    group = Group("attention", "forward", torch.float32, "64", "causal", "no", ())
    rows = rows_of(group, "cpu", [(128, 0.8, "-"), (512, 1.2, "-"), (2048, 1.5, "-")], "t")
    assert [(r.sizes, r.speedup) for r in rows] == [((0, 256), (0.8, 0.8)), ((256, None), (1.2, 1.5))]
    assert [decide(Call("attention", "cpu", torch.float32, head_dim=64, mask="causal", size=n), "auto", "cpu",
                   rows).backend for n in (100, 300, 5000)] == ["torch", "cpu", "cpu"]


def test_a_first_call_under_torch_compile_reads_the_table_without_a_graph_break(tmp_path):
    """In a fresh process whose first calls are compiled (fullgraph), the route reads the tuned rows and the built-in
    ones at trace time (``constant_for_compile``): no graph break, and the tuned row still decides."""
    import os
    import subprocess
    import sys

    code = f"""
import torch, fused_transformer as ft
from fused_transformer import route
path = route.tuned_path(torch.device("cpu"))
import os; os.makedirs(os.path.dirname(path), exist_ok=True)
open(path, "w").write(route.HEADER + "\\nlayer_norm  *  cpu  float32  *  *  yes  functional  *  0.5  yes  a test's row\\n")
x = torch.randn(4, 8, 32, requires_grad=True)
w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
with route.explain() as seen:
    y = torch.compile(lambda x: ft.layer_norm(x, w, b, dropout_p=0.1), fullgraph=True, backend="eager")(x)
    y.sum().backward()
    q = torch.randn(2, 2, 16, 8)
    torch.compile(lambda q: ft.attention(q, q, q, is_causal=True), fullgraph=True, backend="eager")(q)
print(route.describe(seen))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FUSED_TRANSFORMER_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer_norm -> torch (ours 0.50x torch (a test's row))" in done.stdout
    assert "attention -> cpu (torch's path does not serve a traced call" in done.stdout


def test_a_feature_the_cpu_backend_lacks_falls_back_to_the_reference_which_computes_it():
    """A feed-forward that recomputes its pre-activation (the Triton entry's option) on the C++ backend, which has
    no such option: the route sends it to the reference, which computes the op, forward and backward, instead of
    raising."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 24, generator=g, dtype=torch.float64, requires_grad=True)
    w1, w2 = torch.randn(32, 24, generator=g, dtype=torch.float64), torch.randn(8, 32, generator=g, dtype=torch.float64)
    spec = feed_forward_op.check(x, w1, None, w2, None, "gelu", 0.0)._replace(recompute=True)
    with ft.use_backend("cpu"):
        decision = feed_forward_op.decide(x, w1, None, w2, None, spec)
        y = feed_forward_op.run(decision.backend, x, w1, None, w2, None, spec)
    assert decision == ("reference", "backend 'cpu' does not compute recompute")
    expected = F.linear(F.gelu(F.linear(x, w1)), w2)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])


@pytest.mark.parametrize("dtype, head_dim, need", [(torch.float32, 256, "float32 head dims above 128"),
                                                    (torch.bfloat16, 320, "head dims above 256")])
def test_heads_wider_than_the_triton_kernels_go_where_they_are_computed(dtype, head_dim, need):
    """Gemma's head dim 256 in float32 (and any head over 256): torch's path where it serves the call, else the
    reference on a GPU (the Triton kernels stop short of them) and ours on the CPU, whose kernels take any width."""
    q = torch.empty(1, 4, 16, head_dim, device="meta", dtype=dtype)
    k = torch.empty(1, 2, 16, head_dim, device="meta", dtype=dtype)
    spec = attention_contract.attention_spec(head_dim, True, "top_left", None, 0.0, None)
    call = attention_facts.call(q, q, q, contract.AttentionMasks(), spec, contract.NO_SCORE_MODS, None, False,
                                needs_grad=True, device=torch.device("cpu"))._replace(device="H200")
    assert need in call.needs
    assert decide(call, "auto", "triton", ROWS).backend == "torch"
    grouped = attention_facts.call(q, k, k, contract.AttentionMasks(), spec, contract.NO_SCORE_MODS, None, True,
                                   needs_grad=True, device=torch.device("cpu"))  # the LSE: torch's path refuses
    assert decide(grouped._replace(device="H200"), "auto", "triton", ROWS).backend == "reference"
    assert decide(grouped, "auto", "cpu", ROWS).backend == "cpu"
    assert decide(grouped._replace(device="H200"), "triton", "triton", ROWS).backend == "reference"


# ----------------------------------------------------------------------------------- devices nobody measured

# Vendors' figures: name, capability, memory bandwidth (GB/s); torch reports the clock (kHz) and the bus (bits).
SIMULATED_GPUS = {"Tesla T4": ((7, 5), 320.0), "NVIDIA L4": ((8, 9), 300.0), "NVIDIA B200": ((10, 0), 8000.0),
                  "NVIDIA GeForce RTX 5090": ((12, 0), 1792.0), "NVIDIA H100 80GB HBM3": ((9, 0), 3350.0)}


def _props(name, capability, bandwidth):
    """Device properties as torch.cuda.get_device_properties gives them (a 2 GHz memory clock, the bus to match)."""
    clock_khz = 2_000_000
    return SimpleNamespace(name=name, major=capability[0], minor=capability[1], memory_clock_rate=clock_khz,
                           memory_bus_width=round(bandwidth * 1e9 * 8 / (2 * clock_khz * 1e3)))


def test_gpu_facts_read_the_model_capability_and_bandwidth():
    facts = route.gpu_facts(_props("NVIDIA GeForce RTX 5090", (12, 0), 1792.0))
    assert facts.tag == "RTX5090" and facts.capability == (12, 0) and abs(facts.bandwidth - 1792.0) < 2
    assert route.gpu_tag("Tesla T4") == "T4" and route.gpu_tag("NVIDIA H100 80GB HBM3") == "H10080GBHBM3"
    assert route.gpu_facts(SimpleNamespace(name="NVIDIA H200", major=9, minor=0)).bandwidth == 0.0


def test_nearest_is_the_same_architecture_then_capability_then_bandwidth():
    """Two synthetic measured GPUs: "Fast90" (sm_90, 3000 GB/s), where ours won, and "Slow80" (sm_80, 2000 GB/s),
    where torch won; each unmeasured GPU follows the nearest by the documented rule and its reason names it."""
    fast = route.DeviceFacts("Fast90", "cuda", (9, 0), 3000.0)
    slow = route.DeviceFacts("Slow80", "cuda", (8, 0), 2000.0)
    rows = route.parse_rows(
        "attention forward Fast90 bfloat16 64 none,causal no * * 1.40 - synthetic: ours won\n"
        "attention forward Slow80 bfloat16 64 none,causal no * * 0.60 - synthetic: torch won\n")
    monkey = {"Fast90": fast, "Slow80": slow}
    expected = {"H100": "Fast90", "B200": "Fast90", "A100": "Slow80", "L4": "Slow80", "RTX5090": "Fast90",
                "T4": "Slow80", "A10": "Slow80"}
    gpus = {"H100": ((9, 0), 3350.0), "B200": ((10, 0), 8000.0), "A100": ((8, 0), 2039.0), "L4": ((8, 9), 300.0),
            "RTX5090": ((12, 0), 1792.0), "T4": ((7, 5), 320.0), "A10": ((8, 6), 600.0)}
    for tag, (capability, bandwidth) in gpus.items():
        facts = route.DeviceFacts(tag, "cuda", capability, bandwidth)
        assert route.nearest(facts, monkey.values()).tag == expected[tag], tag
    # Same architecture beats a closer capability across architectures; bandwidth breaks a capability tie.
    twin = route.DeviceFacts("Twin90", "cuda", (9, 0), 4800.0)
    h100 = route.DeviceFacts("H100", "cuda", (9, 0), 3350.0)
    assert route.nearest(h100, [fast, twin]).tag == "Fast90"
    assert route.nearest(route.DeviceFacts("H20", "cuda", (9, 0), 4000.0), [fast, twin]).tag == "Twin90"
    assert route.nearest(route.DeviceFacts("sm87", "cuda", (8, 7), 200.0), [fast, slow]).tag == "Slow80"
    for tag, won in (("H100", "triton"), ("T4", "torch")):
        facts = route.DeviceFacts(tag, "cuda", *gpus[tag])
        table = _with_devices(monkeypatch_devices=monkey, facts=facts, rows=rows)
        got = decide(Call("attention", tag, torch.bfloat16, head_dim=64, size=512), "auto", "triton", table)
        assert got.backend == won and f"prior from {expected[tag]}" in got.reason, got


def _with_devices(monkeypatch_devices, facts, rows):
    saved = dict(route.MEASURED_DEVICES)
    route.MEASURED_DEVICES.update(monkeypatch_devices)
    try:
        return route.with_priors(facts, rows)
    finally:
        route.MEASURED_DEVICES.clear()
        route.MEASURED_DEVICES.update(saved)


@pytest.mark.parametrize("name", sorted(SIMULATED_GPUS))
@pytest.mark.parametrize("needs_grad", [False, True])
def test_unmeasured_gpus_send_dense_bfloat16_attention_to_torch(monkeypatch, name, needs_grad):
    """A simulated GPU (its properties, no GPU): dense and causal bfloat16 attention, eval and training, at the
    functional door and SDPA's, goes to torch with a prior's reason: the H200's rows, or the dense prior where none
    matches (another head dim)."""
    facts = route.gpu_facts(_props(name, *SIMULATED_GPUS[name]))
    monkeypatch.setattr(route, "device_tag", lambda device: facts.tag)
    monkeypatch.setattr(route, "device_facts", lambda device: facts)
    monkeypatch.setattr(backend, "current", lambda device, dtype=None: "triton")
    monkeypatch.setattr(route, "_DECISIONS", {})
    monkeypatch.setattr(route, "_TABLES", {})
    spec = attention_contract.attention_spec
    for head_dim, reason in ((64, "prior from H200"), (128, "prior from H200"), (96, "prior: torch"),
                             (256, "prior: torch")):
        q = torch.empty(2, 8, 1024, head_dim, dtype=torch.bfloat16, device="meta", requires_grad=needs_grad)
        for causal in (False, True):
            with route.explain() as calls:
                got = attention_facts.decide(q, q, q, contract.AttentionMasks(),
                                             spec(head_dim, causal, "top_left", None, 0.0, None),
                                             contract.NO_SCORE_MODS, None, False)
                door = attention_facts.sdpa_door(q, 1024, causal, "triton")
            assert got.backend == door.backend == "torch", (got, door)
            assert reason in got.reason and reason in door.reason, (got, door)
            assert [record.backend for record in calls] == ["torch", "torch"]
    padding = contract.AttentionMasks(None, torch.zeros(2, 1024, dtype=torch.bool, device="meta"))
    q = torch.empty(2, 8, 1024, 64, dtype=torch.bfloat16, device="meta")
    got = attention_facts.decide(q, q, q, padding, spec(64, False, "top_left", None, 0.0, None),
                                 contract.NO_SCORE_MODS, None, False)
    assert got.backend == "triton"  # a mask torch's path does not compute as ours: ours, measured or not


def test_cpu_rows_route_only_the_same_instruction_set_and_threads_near_theirs(monkeypatch):
    rows = route.table()
    sdpa = Call("attention", "", torch.float32, door="sdpa", head_dim=64, mask="causal", size=512,
                torch_default=attention_facts.DENSE_PRIOR)
    for threads, isa, want in ((2, "avx512", "cpu"), (1, "avx512", "cpu"), (4, "avx512", "cpu"),
                               (64, "avx512", "torch"), (8, "avx512", "torch"), (2, "sve256", "torch")):
        facts = route.cpu_facts(threads, isa)
        table = route.with_priors(facts, rows)
        got = decide(sdpa._replace(device=facts.tag), "auto", "cpu", table)
        assert got.backend == want, (facts, got)
        if want == "torch":
            assert got.reason == attention_facts.DENSE_PRIOR
        elif threads != 2:
            assert "prior from cpu-avx512-t2" in got.reason
        assert all(row.device == facts.tag for row in table if row.device != "*")
    assert route.cpu_facts().tag == "cpu-unmeasured-t1"  # tests/conftest.py names it
    monkeypatch.delenv("FUSED_TRANSFORMER_ROUTE_CPU")
    assert route.cpu_facts().tag == f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}-t{torch.get_num_threads()}"
    monkeypatch.setenv("FUSED_TRANSFORMER_ROUTE_CPU", "avx512")
    with pytest.raises(ValueError, match="FUSED_TRANSFORMER_ROUTE_CPU"):
        route.cpu_facts()
    assert route.facts_of_tag("cpu-avx2-t16") == route.cpu_facts(16, "avx2")
    assert route.facts_of_tag("sm90") is None


def test_alibi_is_torchs_to_run_as_a_float_bias_where_a_row_says_so():
    """ALiBi (``causal+alibi``) is a mask kind of its own: torch's path computes it (SDPA with the float bias, equal to
    the reference in float64), dense rows do not match it, and without a row ours runs it (ours won it wherever
    measured); a row saying torch won sends it to SDPA."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.rand(2, 4, generator=g, dtype=torch.float64)
    spec = attention_contract.attention_spec(16, True, "top_left", None, 0.0, None)
    expected = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(attention_function.sdpa(q, k, v, spec, slopes), expected, rtol=1e-12, atol=1e-12)
    mods = contract.ScoreMods(None, slopes.float())
    call = attention_facts.call(q.float(), k.float(), v.float(), contract.AttentionMasks(), spec, mods, None, False)
    assert call.mask == "causal+alibi" and route.torch_refuses(call) is None and call.torch_default == ""
    h200 = route.with_priors(route.MEASURED_DEVICES["H200"], ROWS)
    gpu = call._replace(device="H200", dtype=torch.bfloat16, head_dim=64, size=1024)
    got = decide(gpu, "auto", "triton", h200)
    assert got.backend == "triton" and "1.78-2.21" in got.reason
    assert decide(gpu._replace(mask="causal"), "auto", "triton", h200).backend == "torch"
    unmeasured = call._replace(device="cpu-unmeasured-t1")
    assert decide(unmeasured, "auto", "cpu", ROWS).backend == "cpu"
    slower = route.parse_rows("attention * cpu-unmeasured-t1 float32 16 causal+alibi no * * 0.70 - a test's row")
    got = decide(unmeasured, "auto", "cpu", slower)
    assert got.backend == "torch" and "a test's row" in got.reason
