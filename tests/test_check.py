"""``python -m fused_transformer check``: runs end to end, covers every op, module and usable backend, fails
(exit 1) when an op is broken, and its options and the rule behave as documented."""
import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from fused_transformer import __main__ as cli
from fused_transformer import ops
from fused_transformer.tools import check, check_cases, numerics, resolve_device

DEVICE = resolve_device()  # what `check` picks by default
ROW = re.compile(r"^(?P<op>\w+)\s+(?P<backend>triton|cpu|reference)\s+(?P<dtype>float32|float16|bfloat16)\s+.*?"
                 r"\s(?P<result>pass|FAIL|ERROR)(\s|$)")


def rows(text):
    """(op, backend, dtype, result, line) of every table row in ``text``."""
    found = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            found.append((m["op"], m["backend"], m["dtype"], m["result"], line))
    return found


def run_check(capsys, *args):
    code = cli.main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_quick_check_covers_every_op_module_and_usable_backend(capsys):
    code = cli.main(["check", "--quick"])
    out, err = capsys.readouterr()
    assert code == 0, out
    usable = check.usable_backends(DEVICE)
    assert "triton" in usable and "reference" in usable  # conftest switched the interpreter on without a GPU
    found = rows(out)
    assert {(op, b, d) for op, b, d, _, _ in found} == {
        (op, b, d) for op in check_cases.CHECKS for b in usable for d in check_cases.QUICK_DTYPES
    }
    assert all(result == "pass" for *_, result, _ in found)
    assert re.search(rf"^summary: {len(found)} checks, 0 failed; worst ratio float32 [\d.]+ .*bfloat16 [\d.]+ .*\d s$",
                     out, re.M)
    assert "backends: triton (" in out and "auto picks: float32 -> " in out
    # stderr is not a terminal here: at most a sparse progress line, never escape codes or carriage returns
    assert "\r" not in out + err and "\x1b" not in out + err
    assert all(line.startswith("check: ") for line in err.splitlines())


def test_hook_breaks_only_the_named_op_and_backend(capsys, monkeypatch):
    args = ["--quick", "--op", "layer_norm", "--op", "feed_forward"]
    code, out, _ = run_check(capsys, *args)
    assert code == 0 and rows(out) and all(result == "pass" for *_, result, _ in rows(out))

    kernels = "triton" if DEVICE.type == "cuda" else "cpu"  # a kernel backend that runs on the device check picks
    monkeypatch.setattr(check, "CORRUPT", {("layer_norm", kernels)})
    code, out, _ = run_check(capsys, *args)
    assert code == 1
    assert f"TEST HOOK: outputs perturbed before comparison for layer_norm on {kernels}" in out
    found = rows(out)
    assert {b for op, b, *_ in found} == set(check.usable_backends(DEVICE))
    for op, backend, dtype, result, line in found:
        broken = (op, backend) == ("layer_norm", kernels)
        assert result == ("FAIL" if broken else "pass"), line
        if broken:  # only the perturbed output fails, flagged as the hook's doing
            assert re.search(r"FAIL\s+y \(test hook\)$", line), line
    assert re.search(rf"^summary: {len(found)} checks, {len(check_cases.QUICK_DTYPES)} failed;", out, re.M)


def test_hook_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv(check.CORRUPT_ENV, "MultiheadAttention:reference")
    code, out, _ = run_check(capsys, "--quick", "--op", "MultiheadAttention", "--backend", "reference",
                             "--dtype", "bfloat16")
    assert code == 1
    [(op, backend, dtype, result, line)] = rows(out)
    assert (op, backend, dtype, result) == ("MultiheadAttention", "reference", "bfloat16", "FAIL")


def test_hook_perturbs_the_real_output():
    case = check_cases.build_cases(DEVICE, ["layer_norm"], quick=True)[0]
    results = case.run(torch.float32, False)
    before = {n: t.clone() for n, t in results.items()}
    check._corrupt(results)
    changed = {n: int((results[n] != before[n]).sum()) for n in results}
    assert changed == {n: (1 if n == "y" else 0) for n in results}


def test_bad_hook_value_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv(check.CORRUPT_ENV, "layernorm:cpu")
    with pytest.raises(SystemExit) as exc:
        cli.main(["check"])
    assert exc.value.code == 2
    assert "expected op:backend" in capsys.readouterr().err


def test_filters_select_a_slice(capsys):
    code, out, _ = run_check(capsys, "--quick", "--op", "attention", "--backend", "reference", "--dtype", "float32")
    assert code == 0
    quick_attention = check_cases.build_cases(DEVICE, ["attention"], quick=True)
    assert [(op, b, d) for op, b, d, *_ in rows(out)] == [("attention", "reference", "float32")] * len(quick_attention)
    for case, (*_, line) in zip(quick_attention, rows(out)):
        assert case.label in line
    # the full grid has more cases and all three dtypes
    full = check_cases.build_cases(DEVICE, ["attention"])
    assert len(full) > len(quick_attention) and {c.label for c in quick_attention} <= {c.label for c in full}


def test_the_ops_come_from_the_registry_with_their_labels():
    assert check_cases.OPS == tuple(op.name for op in ops.registered() if op.check)
    labels = [(case.op, case.label) for case in check_cases.build_cases(DEVICE, ["attention", "attention_weights"])]
    assert labels[0] == ("attention", "B2 H2/1 L33x47 D64 causal-br+padding")
    assert ("attention_weights", "B2 H2/1 L33x47 D64 causal-br+padding (with its lse)") in labels


def _probe_op(**fields):
    """An op over every kind of argument: ``x`` and ``sinks`` differentiated (``sinks`` float32), a bool mask, a float
    bias, float32 slopes and integer lengths as constants. Its function records what it was given."""
    seen = {}

    def probe(x, mask, bias, slopes, lengths, sinks, scale):
        seen.update({n: (t.dtype, t.requires_grad) for n, t in
                     dict(x=x, mask=mask, bias=bias, slopes=slopes, lengths=lengths, sinks=sinks).items()})
        return x * scale + sinks.sum().to(x.dtype), x + bias

    example = ops.Example("probe", lambda draw: {
        "x": draw(3, 4), "mask": draw(3, 4) > 0, "bias": draw(4), "slopes": draw(2),
        "lengths": torch.tensor([3, 1], dtype=torch.int32), "sinks": draw(2)}, {"scale": 2.0}, quick=True)
    op = ops.Op("probe", probe, None, "", ("out", "shifted"), check=(example,), reference=probe,
                constants=("mask", "bias", "slopes", "lengths"), float32=("slopes", "sinks"), **fields)
    return op, seen


def test_an_ops_cases_cast_and_differentiate_its_arguments_as_its_record_says():
    op, seen = _probe_op()
    [case] = check_cases._op_cases(op, DEVICE)
    results = case.run(torch.bfloat16, False)
    assert list(results) == ["out", "shifted", "dx", "dsinks"]  # the constants get no gradient
    assert seen == {"x": (torch.bfloat16, True), "mask": (torch.bool, False), "bias": (torch.bfloat16, False),
                    "slopes": (torch.float32, False), "lengths": (torch.int32, False), "sinks": (torch.float32, True)}
    case.run(torch.bfloat16, True)  # the oracle: float64 after the rounding, the float32 ones too
    assert {n: dtype for n, (dtype, _) in seen.items()} == {
        "x": torch.float64, "mask": torch.bool, "bias": torch.float64, "slopes": torch.float64,
        "lengths": torch.int32, "sinks": torch.float64}

    op, seen = _probe_op(differentiable=False)
    [case] = check_cases._op_cases(op, DEVICE)
    assert list(case.run(torch.float32, False)) == ["out", "shifted"]  # outputs only
    assert not any(grad for _, grad in seen.values())


@pytest.mark.parametrize("args, choices", [
    (["--op", "attn"], check_cases.CHECKS),
    (["--backend", "gpu"], check.BACKENDS),
    (["--dtype", "float64"], list(check_cases.DTYPES)),
])
def test_bad_arguments_are_rejected_with_the_choices(capsys, args, choices):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", *args])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument {args[0]}: invalid choice: '{args[1]}' (choose from " in err
    listed = err.split("(choose from ", 1)[1].rsplit(")", 1)[0]
    assert [c.strip(" '") for c in listed.split(",")] == list(choices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a CUDA device where there is none")
def test_device_without_cuda_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--device", "cuda"])
    assert exc.value.code == 2
    assert "argument --device: device 'cuda': no CUDA device is available here" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU triton is usable without the interpreter")
def test_requested_backend_that_cannot_run_fails_loudly(capsys, interpreter_off):
    code, out, _ = run_check(capsys, "--quick", "--op", "layer_norm", "--backend", "triton", "--backend", "reference")
    assert code == 1
    assert "not usable here (requested): backend 'triton' on CPU tensors needs the Triton interpreter" in out
    assert {b for _, b, *_ in rows(out)} == {"reference"}
    assert "(requested backend triton not usable here)" in out


def test_main_switches_the_interpreter_on_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", check.CORRUPT_ENV)}
    proc = subprocess.run(
        [sys.executable, "-m", "fused_transformer", "check", "--quick", "--op", "layer_norm"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = rows(proc.stdout)
    assert {op for op, *_ in found} == {"layer_norm"} and all(result == "pass" for *_, result, _ in found)
    assert {b for _, b, *_ in found} == set(check.usable_backends(DEVICE))
    if not torch.cuda.is_available():
        assert "Triton interpreter on CPU tensors, TRITON_INTERPRET=1" in proc.stdout


# ------------------------------------------------------------------------------------------- the rule


def test_ratio_is_two_exactly_at_the_limit():
    ref = torch.zeros(4, dtype=torch.float64) + 0.5
    floor = numerics.ATOL_FLOOR[torch.bfloat16]
    baseline = (ref + 0.01).to(torch.bfloat16)
    base_err = numerics.max_error(baseline, ref)
    at_limit = ref.clone()
    at_limit[0] += numerics.FACTOR * base_err + floor
    verdict = numerics.judge("out", at_limit.to(torch.bfloat16), ref, baseline)
    err = numerics.max_error(at_limit.to(torch.bfloat16), ref)
    assert verdict.ratio == pytest.approx(err / (base_err + floor / 2))
    assert verdict.ok == (err <= 2 * base_err + floor) == (verdict.ratio <= 2)
    same = numerics.judge("out", baseline, ref, baseline)
    assert same.ok and same.ratio < 1  # PyTorch against itself: below 1 by construction


def test_non_finite_results_fail_but_matching_infinities_agree():
    ref = torch.tensor([0.5, -math.inf, 1.0], dtype=torch.float64)
    good = ref.to(torch.float32)
    assert numerics.judge("lse", good, ref, good).ok
    for bad_value in (math.nan, math.inf):
        bad = good.clone()
        bad[2] = bad_value
        verdict = numerics.judge("lse", bad, ref, good)
        assert not verdict.ok and verdict.note == "1 non-finite" and verdict.ratio == math.inf
    assert not numerics.judge("dq", None, ref, good).ok


def test_progress_bar_goes_to_a_terminal_only_and_never_into_the_table(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for progress, stderr, shown in ((True, Terminal(), True), (True, io.StringIO(), False), (False, Terminal(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        table = io.StringIO()
        assert check.check(DEVICE, True, ops=["layer_norm"], backends=["reference"], progress=progress, out=table) == 0
        assert ("layer_norm reference" in stderr.getvalue()) == shown, stderr.getvalue()
        assert "\r" not in table.getvalue() and "it/s" not in table.getvalue() and "check/s" not in table.getvalue()
        assert re.search(r"^summary: 2 checks, 0 failed;", table.getvalue(), re.M)


def test_main_job_runs_check_then_bench_with_the_shared_options(monkeypatch, capsys):
    from fused_transformer import __main__ as cli
    from fused_transformer.tools import bench

    calls = []

    def fake(name, status):
        def run(argv, recap):
            calls.append((name, argv))
            recap.append(f"{name} said")
            return status
        return run

    monkeypatch.setattr(check, "main", fake("check", 1))
    monkeypatch.setattr(bench, "main", fake("bench", 0))
    assert cli.main(["--quick", "--out", "somewhere"]) == 1  # a failed check fails the job, after the bench
    assert capsys.readouterr().out.endswith("recap:\n  check said\n  bench said\n")
    device = str(resolve_device())  # "cpu", or the current CUDA device with its index
    assert calls == [("check", ["--device", device, "--quick"]),
                     ("bench", ["--device", device, "--quick", "--out", "somewhere"])]
    calls.clear()
    monkeypatch.setattr(check, "main", fake("check", 0))
    assert cli.main(["all"]) == 0
    assert [name for name, _ in calls] == ["check", "bench"]
    with pytest.raises(SystemExit):
        cli.main(["--suite", "attention"])  # bench-only options go to `bench`, not to the main job
