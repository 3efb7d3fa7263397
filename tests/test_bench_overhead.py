"""``python -m fused_transformer bench --suite overhead``: times every public op (torch, thin, ours) and module
(torch.nn, ours) on CPU with the Triton launches skipped, puts the host microseconds and ratios in its rows, leaves
the launches as they were, and runs only when named."""
import csv
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fused_transformer as ft
from fused_transformer import ops
from fused_transformer.tools import bench, bench_cases, bench_overhead


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run
    out = tmp_path_factory.mktemp("overhead")
    code = bench.main(["--suite", "overhead", "--device", "cpu", "--min-time", "0.005", "--out", str(out),
                       "--no-progress", "--profile"])
    with open(out / "bench_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return code, out, rows, launch


def test_every_op_is_timed_against_thin_and_torch_and_every_module_against_torch_nn(overhead_run):
    code, _, rows, _ = overhead_run
    assert code == 0
    assert {row["suite"] for row in rows} == {"overhead"}
    impls = {}
    for row in rows:
        impls.setdefault((row["case"], row["mode"]), set()).add(row["impl"])
    expected = {(op, mode): {"torch", "thin", "ours"} for op, modes in bench_overhead.OPS.items() for mode in modes}
    expected.update({(name, mode): {"torch.nn", "ours"}
                     for name in bench_overhead.MODULES for mode in ("eval", "train")})
    assert impls == expected
    assert {("attention", "fwd+bwd"), ("attention (key padding)", "fwd+bwd"), ("attention_varlen", "fwd"),
            ("attention_with_kvcache", "fwd"),
            ("layer_norm", "fwd+bwd"), ("feed_forward", "fwd+bwd"), ("apply_rotary_pos_emb", "fwd+bwd"),
            ("TransformerDecoderLayer", "train")} <= set(impls)


def test_times_are_positive_and_the_notes_give_microseconds_and_ratios(overhead_run):
    _, _, rows, _ = overhead_run
    ms = {(row["case"], row["mode"], row["impl"]): float(row["ms"]) for row in rows}
    for row in rows:
        assert math.isfinite(float(row["ms"])) and float(row["ms"]) > 0, row
        host_us = float(re.search(r"host ([\d.]+) us/call", row["note"]).group(1))
        assert host_us == pytest.approx(float(row["ms"]) * 1e3, abs=0.06)
        baseline = ms[(row["case"], row["mode"], row["baseline"])]
        assert float(row["speedup"]) == pytest.approx(baseline / float(row["ms"]), rel=1e-4)
        if row["impl"] != "ours":
            continue
        assert row["note"].startswith("backend triton (interpreter, launches skipped)")
        ratio = float(re.search(rf"ours/{re.escape(row['baseline'])} ([\d.]+)x", row["note"]).group(1))
        assert ratio == pytest.approx(float(row["ms"]) / baseline, abs=0.006)
        thin = re.search(r"ours/thin ([\d.]+)x", row["note"])
        assert (thin is not None) == (row["case"] in bench_overhead.OPS)
        if thin:
            assert float(thin.group(1)) == pytest.approx(float(row["ms"]) / ms[(row["case"], row["mode"], "thin")],
                                                         abs=0.006)


def test_every_row_counts_its_launches(overhead_run):
    """The ``launches`` column (tools/launches.py): the device launches of one call, for ours, thin and torch.
    Ours: the attention forward is one kernel, its backward two more (dq, dk/dv); the LayerNorm backward is its
    kernel and one reduction of the weight and bias partials; thin launches nothing but what its backward's
    allocations need (none)."""
    _, out, rows, _ = overhead_run
    launches = {(row["case"], row["mode"], row["impl"]): int(row["launches"]) for row in rows}
    assert all(n >= 0 for n in launches.values()) and launches[("attention", "fwd", "torch")] >= 1
    assert launches[("attention", "fwd", "ours")] == 1 and launches[("attention", "fwd+bwd", "ours")] == 3
    # The dropout seed drawn on the host, as from a CUDA generator: no launch of its own.
    assert launches[("layer_norm", "fwd", "ours")] == 1 and launches[("layer_norm", "fwd+bwd", "ours")] == 3
    assert launches[("attention", "fwd", "thin")] == 0
    assert "launches ours / torch" in (out / "bench_cpu.md").read_text()


def test_the_summary_has_the_table_of_microseconds_and_no_plots_are_drawn(overhead_run):
    _, out, rows, _ = overhead_run
    text = (out / "bench_cpu.md").read_text()
    assert "\n## overhead\n" in text and "| op / module | mode | ours us | thin us | torch us |" in text
    assert "| attention | fwd+bwd |" in text and "<= 2.5x" in text
    assert not list(out.glob("*.png"))


def test_the_profiles_say_where_each_cases_host_time_goes(overhead_run):
    """--profile: per case, ours and (for the ops) thin, cProfile's functions in microseconds per call, then the torch
    profiler's operators; ours' rows name our own launchers."""
    _, out, rows, _ = overhead_run
    text = (out / "overhead_profile_cpu.txt").read_text()
    sections = re.split(r"\n=== ", text)[1:]
    expected = [f"{case} {mode}: {impl}" for case, mode in dict.fromkeys((r["case"], r["mode"]) for r in rows)
                for impl in (("ours", "thin") if case in bench_overhead.OPS else ("ours",))]
    assert [section.splitlines()[0] for section in sections] == expected
    for section in sections:
        lines = section.splitlines()
        assert lines[1].split() == ["own", "us", "cum", "us", "calls", "function"]
        functions = [line.split(None, 3) for line in lines[2:lines.index("")]]
        assert 0 < len(functions) <= bench_overhead.PROFILE_ROWS
        assert all(float(own) >= 0 and float(cum) >= float(own) for own, cum, _, _ in functions)
        assert "Self CPU time total" in section
    attention = sections[expected.index("attention fwd+bwd: ours")]
    assert "attention_bwd (kernels/attention/bwd.py" in attention and "aten::" in attention


class _Prepared(ops.Rivals):
    def calls(self, example, tensors, names, backward):
        return ops.RivalCalls({"prepared": lambda: tensors["x"] * 3, "other": lambda: None})


@pytest.mark.parametrize("rivals", [ops.Rivals(), _Prepared()])
@pytest.mark.parametrize("backward", [False, True])
def test_an_ops_calls_are_its_records(rivals, backward):
    """torch: the baseline its rivals prepare, else its torch path; ours: its function; thin and the backward over the
    tensors it differentiates (not its constants), which alone require a gradient."""
    example = ops.Example("tiny", lambda draw: {"x": draw(2, 3), "bias": draw(3), "lengths": torch.tensor([1, 2])})
    op = ops.Op("probe", lambda x, bias, lengths: x + bias, lambda x, bias, lengths: x * 2, "", ("out",),
                constants=("bias",), baseline="prepared", rivals=rivals)
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32, "triton")
    inputs, calls = bench_overhead._op_calls(op, example, setup, backward)
    [x] = inputs
    assert x.shape == (2, 3) and x.requires_grad == backward and set(calls) == {"torch", "ours"}
    torch.testing.assert_close(calls["torch"](), x * (3 if isinstance(rivals, _Prepared) else 2))


def test_a_failing_profile_is_said_in_the_file_and_raises_nothing(tmp_path):
    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("no profiler here")

    case = bench_overhead.cases(bench_cases.Setup(torch.device("cpu"), torch.float32, "triton"))[0]
    path = str(tmp_path / "profile.txt")
    bench_overhead.profile(case, {"ours": failing}, torch.device("cpu"), path)
    text = (tmp_path / "profile.txt").read_text()
    assert f"=== {case.case} {case.mode}: ours\nprofile failed: RuntimeError: no profiler here" in text
    assert calls == [1]


def test_profile_is_an_argparse_error_without_the_overhead_suite(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--suite", "attention", "--profile", "--out", str(tmp_path)])
    assert "--profile profiles the overhead suite" in capsys.readouterr().err


def test_triton_launches_run_again_after_the_suite(overhead_run):
    from triton.runtime.interpreter import InterpretedFunction

    _, _, _, launch = overhead_run
    assert InterpretedFunction.run is launch
    x, weight, bias = torch.randn(3, 32), torch.randn(32), torch.randn(32)
    with ft.use_backend("triton"):
        y = ft.layer_norm(x, weight, bias)
    torch.testing.assert_close(y, F.layer_norm(x, (32,), weight, bias))


def test_launches_are_restored_when_the_block_raises():
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run
    with pytest.raises(KeyError), bench_overhead.launches_skipped():
        assert InterpretedFunction.run is not launch
        raise KeyError
    assert InterpretedFunction.run is launch


def test_the_default_run_leaves_the_overhead_suite_out():
    assert "overhead" not in bench_cases.SUITES and "overhead" in bench.SUITE_CHOICES
    assert bench.parse_args(["--no-plots"]).suite is None  # run() then takes bench_cases.SUITES


def test_without_the_interpreter_the_overhead_suite_is_an_argparse_error(interpreter_off, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--suite", "overhead", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--suite overhead: " in err and "needs the Triton interpreter" in err


def test_python_m_fused_transformer_bench_switches_the_interpreter_on(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[1]  # the package tested here, not another install
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "fused_transformer", "bench", "--suite", "overhead", "--device", "cpu", "--min-time",
         "0.001", "--no-progress", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| attention | fwd |" in proc.stdout and "every kernel launch skipped" in proc.stdout


def test_ours_launching_no_kernel_while_launches_are_skipped_is_an_error():
    """Else an op's path that bypasses the Triton kernels (or launches them some other way) would be timed as theirs.
    A module (no thin twin) may run ATen alone, as ft.LayerNorm without dropout does on a GPU."""
    with bench_overhead.launches_skipped():
        with pytest.raises(RuntimeError, match="launched no Triton kernel"):
            bench_overhead.host_ms({"thin": lambda: None, "ours": lambda: None}, [], torch.device("cpu"), 0.001)
        assert set(bench_overhead.host_ms({"ours": lambda: None}, [], torch.device("cpu"), 0.001)) == {"ours"}
