"""``python -m fused_transformer gpu-check`` without a GPU: the no-CUDA verdict end to end, parts run in separate
invocations merging into one summary, a part past its limit stopped (children included) while the others run, and
the rules its parts are judged by (junit counts, check output, bench ratios, CUDA-graph errors, bitwise
determinism, linear memory), on made-up inputs."""
import csv
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from fused_transformer.tools import bench, gpu_check, gpu_check_graphs, gpu_check_parts, gpu_check_summary

# ------------------------------------------------------------------------------------------- no CUDA device


def test_without_cuda_it_writes_the_summary_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "made" / "by" / "gpu-check"  # missing folders are made
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no CUDA device, also on a machine with one
    proc = subprocess.run([sys.executable, "-m", "fused_transformer", "gpu-check", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert "no CUDA device" in line and str(out / "summary.md") in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"].startswith("NO CUDA DEVICE")
    assert summary["environment"]["device"] is None and summary["environment"]["cuda_available"] is False
    reason = (f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
              "torch.cuda.is_available() False)")
    assert {part: (r["status"], r["reason"]) for part, r in summary["parts"].items()} == {
        part: ("not run", reason) for part in ("tests", "check", "bench", "graphs")}
    markdown = (out / "summary.md").read_text()
    assert "**NO CUDA DEVICE: nothing ran here**" in markdown
    assert markdown.count(f"| not run: {reason} |") == 4
    assert not list(out.glob("*.log")), "nothing ran, so no part left a log"


@pytest.mark.parametrize("argv, message", [
    (["--only", "bnech"], "invalid choice: 'bnech'"),
    (["--time-limit", "0"], "must be a positive number of seconds"),
    (["--time-limit", "soon"], "is not a number"),
])
def test_bad_options_are_argparse_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv + ["--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_out_that_is_a_file_is_an_argparse_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "file" / "sub")])
    assert "is a file, not a folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- running the parts

FAKE_ENVIRONMENT = {"date": "2030-01-01T00:00:00+00:00", "python": "3.x", "torch": "9.9", "cuda": "12.9",
                    "triton": "9.9", "fused_transformer": "0.1.0", "cuda_available": True,
                    "device": {"name": "Fake GPU", "capability": "9.0", "sm_count": 132, "memory_gib": 79.6},
                    "triton_interpret": None}
WRITE_RECORD = ("import json, sys; out, part, status, figures = sys.argv[1:]; "
                "json.dump({'part': part, 'status': status, 'reason': None if status == 'passed' else 'it broke', "
                "'figures': json.loads(figures), 'output_tail': ''}, open(f'{out}/{part}.json', 'w'))")
TEST_FIGURES = {"tests": 10, "passed": 8, "failed": 0, "errors": 0, "skipped": 2, "files": ["tests/test_a.py"]}
CHECK_FIGURES = {"checks": 40, "passed": 38, "failed": 2, "summary": "summary: 40 checks, 2 failed"}


def fake_part(status, figures=None):
    """A part's process that writes its record with ``status`` and ``figures``, as the real ones do."""
    return lambda part, out, limit_s: [sys.executable, "-c", WRITE_RECORD, out, part, status, json.dumps(figures or {})]


def test_parts_from_separate_invocations_merge_in_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_ENVIRONMENT))
    out = str(tmp_path)

    monkeypatch.setattr(gpu_check, "part_command", lambda part, out, limit_s, all_tests: fake_part(
        "passed", TEST_FIGURES)(part, out, limit_s))
    assert gpu_check.main(["--out", out, "--only", "tests"]) == 0
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["parts"]["tests"]["status"] == "passed"
    assert first["parts"]["bench"] == {"part": "bench", "status": "not run", "figures": {}, "key_figures": "-",
                                       "reason": "not asked for yet (gpu-check --only bench)"}
    assert first["verdict"].startswith("INCOMPLETE: passed: tests; not run: check, bench, graphs")

    monkeypatch.setattr(gpu_check, "part_command", lambda part, out, limit_s, all_tests: fake_part(
        "failed", CHECK_FIGURES)(part, out, limit_s))
    assert gpu_check.main(["--out", out, "--only", "check"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = summary["parts"]
    assert parts["tests"]["status"] == "passed" and parts["tests"]["started"] == first["parts"]["tests"]["started"]
    assert parts["check"]["status"] == "failed" and parts["check"]["reason"] == "it broke"
    assert parts["check"]["environment"]["device"]["name"] == "Fake GPU"
    assert summary["verdict"] == "FAILED: check failed (passed: tests; failed: check; not run: bench, graphs)"
    markdown = (tmp_path / "summary.md").read_text()
    assert "| tests | passed |" in markdown and "8 passed, 0 failed, 0 errors, 2 skipped (1 files)" in markdown
    assert "| check | failed: it broke |" in markdown and "40 checks: 38 passed, 2 failed" in markdown
    assert "Fake GPU (capability 9.0, 132 SMs, 79.6 GiB)" in markdown
    assert "FAILED: check failed" in capsys.readouterr().out


def test_a_part_past_its_limit_is_stopped_with_its_children_and_the_others_still_run(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '120']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(120)")
    commands = {
        "check": lambda part, out, limit_s: [sys.executable, "-c", hang],
        "graphs": fake_part("passed"),
        "bench": lambda part, out, limit_s: [sys.executable, "-c", "import sys; sys.exit(3)"],
        "tests": fake_part("passed", TEST_FIGURES),
    }
    limits = {"check": 2.0, "graphs": 30.0, "bench": 30.0, "tests": 30.0}
    started = time.monotonic()
    records = gpu_check.run_parts(["check", "graphs", "bench", "tests"], str(tmp_path), limits,
                                  lambda part, out, limit_s: commands[part](part, out, limit_s), say=lambda line: None)
    assert time.monotonic() - started < 60
    assert records["check"]["status"] == "timed out" and records["check"]["reason"] == "stopped at its 2 s limit"
    assert 2.0 <= records["check"]["duration_s"] < 20
    assert records["graphs"]["status"] == records["tests"]["status"] == "passed"
    assert records["bench"]["status"] == "failed" and "exit status 3" in records["bench"]["reason"]
    for part, record in records.items():  # the records on disk are the ones returned
        assert gpu_check_parts.read_record(str(tmp_path / f"{part}.json"))["status"] == record["status"]
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the timed-out part's own child was left running"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_record_left_by_an_earlier_run_does_not_pass_for_this_one(tmp_path):
    gpu_check_parts.write_record(str(tmp_path), gpu_check_parts.part_record("graphs", "passed"))
    record = gpu_check.run_part("graphs", [sys.executable, "-c", "print('dying'); raise SystemExit(1)"],
                                str(tmp_path), 30)
    assert record["status"] == "failed" and "exit status 1" in record["reason"]
    assert "dying" in record["output_tail"] and (tmp_path / "graphs.log").read_text() == "dying\n"


def test_ctrl_c_stops_the_running_part_and_says_so_in_its_record(tmp_path, ctrl_c_raises):
    pid_file = tmp_path / "part.pid"
    interrupt_me = ("import os, signal, time; "
                    f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                    "os.kill(os.getppid(), signal.SIGINT); time.sleep(120)")
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_part("tests", [sys.executable, "-c", interrupt_me], str(tmp_path), 300)
    assert time.monotonic() - started < 60
    record = gpu_check_parts.read_record(str(tmp_path / "tests.json"))
    assert record["status"] == "not run" and record["reason"] == "interrupted (Ctrl-C) while it ran"
    assert not _alive(int(pid_file.read_text()))


def test_the_whole_run_limit_cuts_the_last_parts():
    limits = gpu_check.TIME_LIMITS_S
    assert sum(limits.values()) > gpu_check.TOTAL_LIMIT_S >= max(limits.values())
    assert all(limit <= 600 for limit in limits.values())  # each part at most 10 minutes
    assert gpu_check.limit_for("bench", limits, 1200, 100) == (540, None)
    limit, note = gpu_check.limit_for("bench", limits, 1200, 1000)
    assert limit == 200 and "cut from 540 s to 200 s" in note
    assert gpu_check.limit_for("bench", limits, 1200, 1150)[0] is None
    assert gpu_check.limit_for("bench", limits, None, 5000) == (540, None)


def test_the_tests_part_says_why_without_a_tests_folder(tmp_path):
    record = gpu_check_parts.tests_part(str(tmp_path), 100, root=str(tmp_path))
    assert record["status"] == "not run" and "no tests folder beside the package" in record["reason"]


# ----------------------------------------------------------------------------------------- reading the parts


def test_junit_counts_and_names_the_failures(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    xml = tmp_path / "junit.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
 <testcase classname="tests.test_x" name="test_ok" time="0.1"/>
 <testcase classname="tests.test_x.TestGroup" name="test_ok_too[bfloat16]" time="0.1"/>
 <testcase classname="tests.test_x" name="test_wrong[float16]" time="0.1">
  <failure message="AssertionError: dq: max error 3e-2 &gt; 2 x baseline&#10;second line">trace</failure></testcase>
 <testcase classname="tests.test_x" name="test_broken" time="0.1">
  <error message="failed on setup with &quot;RuntimeError: CUDA error&quot;">trace</error></testcase>
 <testcase classname="tests.test_x" name="test_cpu_only" time="0"><skipped message="needs no GPU"/></testcase>
 <testcase classname="tests.test_x" name="test_cpu_only_too" time="0"><skipped message="needs no GPU"/></testcase>
</testsuite></testsuites>""")
    figures = gpu_check_parts.parse_junit(str(xml), str(tmp_path))
    assert {k: figures[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 6, "passed": 2, "failed": 1, "errors": 1, "skipped": 2}
    assert figures["failures"] == [
        {"name": "tests/test_x.py::test_wrong[float16]", "kind": "failed",
         "message": "AssertionError: dq: max error 3e-2 > 2 x baseline"},
        {"name": "tests/test_x.py::test_broken", "kind": "error",
         "message": 'failed on setup with "RuntimeError: CUDA error"'},
    ]
    assert figures["skip_reasons"] == [{"reason": "needs no GPU", "count": 2}]
    outside = gpu_check_parts.parse_junit(str(xml), str(tmp_path / "elsewhere"))
    assert outside["failures"][0]["name"] == "tests.test_x::test_wrong[float16]"


def test_pytest_progress_lines_count_a_run_stopped_before_its_junit_xml():
    output = "\n".join([
        "tests/test_a.py ignored header", "..F.s [ 10%]", "Es.xX", "some warning line with . and F", ".. [ 20%]",
    ])
    assert gpu_check_parts.pytest_progress(output) == {
        "tests": 12, "passed": 7, "failed": 1, "errors": 1, "skipped": 3, "failures": [], "skip_reasons": []}


def test_check_output_gives_counts_and_failing_rows():
    text = "\n".join([
        "fused_transformer 0.1.0 check (quick grid): torch 2.13, device cuda",
        "backends: triton (Triton kernels on Fake GPU); reference (plain PyTorch, the baseline)",
        "op         backend    dtype     case   max err  torch err   ratio  result  worst",
        "attention  triton     float32   B2 L7  1.00e-06   1.00e-06    0.50  pass    dq",
        "attention  triton     bfloat16  B2 L7  1.00e-01   1.00e-03   50.00  FAIL    dq, dk",
        "layer_norm triton     bfloat16  d33         nan        nan     inf  ERROR   see [1]",
        "[1] layer_norm triton bfloat16 d33: RuntimeError: CUDA error: an illegal memory access",
        "summary: 3 checks, 2 failed; worst ratio float32 0.50 (attention on triton, dq); 4.0 s",
    ])
    figures = gpu_check_parts.parse_check_output(text)
    assert (figures["checks"], figures["passed"], figures["failed"]) == (3, 1, 2)
    assert [line.split()[-1] for line in figures["failing"]] == ["dk", "[1]"]
    assert figures["notes"] == [text.splitlines()[6]] and figures["backends"].startswith("backends: triton")
    stopped = gpu_check_parts.parse_check_output("\n".join(text.splitlines()[:5]))  # no summary line yet
    assert (stopped["checks"], stopped["passed"], stopped["failed"], stopped["summary"]) == (2, 1, 1, None)


def _bench_row(suite, case, impl, ms, **extra):
    row = {column: "" for column in bench.COLUMNS}
    row.update(suite=suite, case=case, mode="fwd+bwd", impl=impl, device="cuda", dtype="bfloat16", batch="4",
               heads="32", seq_len="4096", head_dim="64", ms="" if ms is None else str(ms),
               baseline="sdpa" if suite == "attention" else "torch")
    row.update(extra)
    return row


def test_bench_csv_gives_our_rate_and_speed_up_over_each_implementation(tmp_path):
    rows = [
        _bench_row("attention", "causal", "sdpa", 2.0, note="dispatch flash_attention"),
        _bench_row("attention", "causal", "ours", 1.0, tflops="312.4"),
        _bench_row("attention", "causal", "sdpa:flash_attention", 1.5),
        _bench_row("attention", "causal", "sdpa:cudnn_attention", None, note="refused, left out: no kernel"),
        _bench_row("attention", "causal", "sdpa:math", 10.0),
        _bench_row("attention", "causal", "flash_attn", 0.8),
        _bench_row("layer_norm", "d1024", "torch", 1.0, head_dim="", heads=""),
        _bench_row("layer_norm", "d1024", "ours", 0.5, head_dim="", heads="", tokens_per_s="2.5e+07"),
    ]
    path = tmp_path / "bench_cuda.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    figures = gpu_check_parts.bench_figures(gpu_check_parts.read_bench_csv(str(path)),
                                            {"flash_attn": True, "xformers": False})
    attention, layer_norm = figures["shapes"]
    assert (attention["ours_ms"], attention["tflops"], attention["seq_len"], attention["head_dim"]) == (1.0, 312.4,
                                                                                                        4096, 64)
    assert attention["ratios"] == pytest.approx({"sdpa": 2.0, "sdpa:flash_attention": 1.5, "sdpa:math": 10.0,
                                                 "flash_attn": 0.8})
    assert attention["left_out"] == {"sdpa:cudnn_attention": "refused, left out: no kernel"}
    assert layer_norm["ratios"] == {"torch": 2.0} and layer_norm["tflops"] is None
    assert layer_norm["tokens_per_s"] == 2.5e7
    assert figures["competitors"] == {"flash_attn": "measured on 1 shapes",
                                      "xformers": "not installed here, not measured (gpu-check installs nothing)"}
    record = gpu_check_parts.part_record("bench", "passed", figures=dict(figures, csv=str(path)))
    assert gpu_check_summary.key_figures("bench", record) == (
        "2 shapes; median speed-up: attention vs sdpa 2.00x, attention vs flash_attn 0.80x, layer_norm vs torch 2.00x")
    markdown = "\n".join(gpu_check_summary._bench_details(record["figures"]))
    assert ("| causal | fwd+bwd | 4096 | 64 | 1.000 | 312 TFLOP/s | 2.00x | 1.50x | refused | 10.00x | 0.80x |"
            in markdown)
    assert "| d1024 | fwd+bwd | 4096 | 0.500 | 25M tok/s | 2.00x |" in markdown


# ---------------------------------------------------------------------------------------------- graphs' rules


def test_memory_rule_allows_up_to_2_2x_per_doubling():
    linear = gpu_check_graphs.memory_growth({1024: 100, 2048: 200, 4096: 420, 8192: 900})
    assert linear["linear"] is True and linear["verdict"].startswith("linear: at most x2.14")
    quadratic = gpu_check_graphs.memory_growth({1024: 100, 2048: 400, 4096: 1600, 8192: 6400})
    assert quadratic["linear"] is False and "x4.00" in quadratic["verdict"]
    one_bad_step = gpu_check_graphs.memory_growth({1024: 100, 2048: 200, 4096: 460})
    assert one_bad_step["linear"] is False and [s["ok"] for s in one_bad_step["steps"]] == [True, False]
    assert "L 2048 -> 4096" in one_bad_step["verdict"]
    quadrupled = gpu_check_graphs.memory_growth({1024: 100, 4096: 400})  # x4 over two doublings: x2 each
    assert quadrupled["linear"] is True and quadrupled["steps"][0]["growth_per_doubling"] == pytest.approx(2.0)
    assert gpu_check_graphs.memory_growth({1024: 0, 2048: 10})["linear"] is None
    assert gpu_check_graphs.memory_growth({1024: 10})["linear"] is None


def test_determinism_comparator_wants_bitwise_equality():
    grads = {name: torch.randn(2, 3, 5, 8, dtype=torch.bfloat16) for name in ("out", "dq", "dk", "dv")}
    same = {name: t.clone() for name, t in grads.items()}
    assert gpu_check_graphs.differing(grads, same) == []
    one_ulp = dict(same, dk=same["dk"].clone())
    one_ulp["dk"].view(torch.int16).view(-1)[7] += 1
    [found] = gpu_check_graphs.differing(grads, one_ulp)
    assert found.startswith("dk (max difference ")
    missing = {name: t for name, t in same.items() if name != "dv"}
    assert gpu_check_graphs.differing(grads, missing) == ["dv (missing in one run)"]


def test_graph_replay_errors_are_relative_to_each_tensor():
    expected = {"loss": torch.tensor(2.0), "dw": torch.tensor([100.0, -200.0])}
    errors = gpu_check_graphs.relative_errors({"loss": torch.tensor(2.0), "dw": torch.tensor([100.0, -198.0])},
                                              expected)
    assert errors["loss"] == (0.0, 0.0) and errors["dw"] == pytest.approx((2.0, 0.01))
    assert gpu_check_graphs.relative_errors({"loss": torch.tensor(float("nan"))}, expected) == {
        "loss": (math.inf, math.inf), "dw": (math.inf, math.inf)}
    assert gpu_check_graphs.relative_errors({"loss": torch.tensor(0.5)}, {"loss": torch.tensor(0.0)}) == {
        "loss": (0.5, math.inf)}


def test_graphs_problems_name_what_failed():
    figures = {
        "cuda_graph": {"ok": False, "worst": "d(linear1.weight)", "max_rel_error": 0.5, "tolerance": 0.016},
        "determinism": {"ok": False, "cases": [{"equal": True}, {"equal": False}, {"equal": False}]},
        "memory": {"ok": True, "verdict": "linear: at most x2.00 per doubling of L"},
    }
    assert gpu_check_graphs.problems_of(figures) == [
        "CUDA graph replay differs from eager: d(linear1.weight) max relative error 0.5 > 0.016",
        "backward not deterministic in 2 of 3 cases",
    ]
    assert gpu_check_graphs.problems_of({"memory": {"ok": False, "error": "RuntimeError: CUDA error"}}) == [
        "memory: RuntimeError: CUDA error"]


def test_graphs_figures_read_in_the_summary():
    growth = gpu_check_graphs.memory_growth({1024: 40.0, 2048: 80.0})
    figures = {
        "cuda_graph": {"ok": True, "what": "TransformerEncoderLayer(...)", "optimizer": "AdamW(capturable=True) step "
                       "captured too", "compared": 26, "worst": "loss", "max_abs_error": 0.0, "max_rel_error": 0.0,
                       "tolerance": 0.016, "bitwise_equal": True},
        "determinism": {"ok": False, "cases": [
            {"dtype": "bfloat16", "mask": "causal", "shape": [2, 8, 1000, 64], "equal": True, "differing": []},
            {"dtype": "float16", "mask": "padded", "shape": [3, 4, 777, 64], "equal": False,
             "differing": ["dk (max difference 0.00781)"]}]},
        "memory": {"ok": True, "what": "attention fwd+bwd", "verdict": growth["verdict"], "rows": [
            {"seq_len": 1024, "inputs_mib": 16.0, "extra_mib": 40.0, "growth_per_doubling": None},
            {"seq_len": 2048, "inputs_mib": 32.0, "extra_mib": 80.0, "growth_per_doubling": 2.0}]},
    }
    record = gpu_check_parts.part_record("graphs", "failed", "backward not deterministic in 1 of 2 cases", figures)
    summary = gpu_check_summary.build_summary({"graphs": record}, FAKE_ENVIRONMENT, lambda part: "not asked for")
    assert summary["parts"]["graphs"]["key_figures"] == (
        "CUDA graph replay vs eager max rel. error 0 (ok); backward bitwise deterministic in 1/2 cases; "
        "memory linear: at most x2.00 per doubling of L (L 1024 -> 2048; limit x2.2)")
    markdown = gpu_check_summary.render_markdown(summary)
    assert "Replay: bitwise equal to eager over 26 tensors: ok." in markdown
    assert "| float16 | padded | 3, 4, 777, 64 | NO | dk (max difference 0.00781) |" in markdown
    assert "| 2048 | 32.0 | 80.0 | x2.00 |" in markdown and "| 1024 | 16.0 | 40.0 | - |" in markdown
    assert summary["verdict"] == "FAILED: graphs failed (not run: tests, check, bench; failed: graphs)"


def test_the_commands_run_where_tqdm_is_not_installed():
    """A GPU machine may hold only torch and triton: check, bench and demo draw no bar there instead of failing."""
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "from fused_transformer._progress import tqdm\n"
            "bar = tqdm(total=3, file=sys.stderr, disable=None)\n"
            "bar.update(); bar.update(2); bar.set_description('x'); bar.set_postfix_str('y'); bar.close()\n"
            "tqdm.write('written')\n"
            "assert bar.n == 3 and bar.total == 3 and list(tqdm([1, 2])) == [1, 2]\n"
            "import fused_transformer.tools.check, fused_transformer.tools.bench, fused_transformer.models.synthetic\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "written\n"
