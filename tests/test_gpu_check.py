"""``python -m fused_transformer gpu-check`` without a GPU: the no-CUDA verdict end to end, the device option (on a
faked torch.cuda), the budget and its split, the parts that time nothing run side by side and bench alone after
them, a part past its limit stopped (children included) while the others run, parts run in separate invocations
merging into one summary, the tests part's pytest command (pytest-xdist or not), and the rules its parts are judged
by (junit counts, check output, bench ratios, CUDA-graph errors, bitwise determinism, linear memory), on made-up
inputs."""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

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
        part: ("not run", reason) for part in gpu_check_parts.PARTS}
    markdown = (out / "summary.md").read_text()
    assert "**NO CUDA DEVICE: nothing ran here**" in markdown
    assert markdown.count(f"| not run: {reason} |") == len(gpu_check_parts.PARTS)
    assert summary["run"] is None and "This run:" not in markdown
    assert not list(out.glob("*.log")), "nothing ran, so no part left a log"


@pytest.mark.parametrize("argv, message", [
    (["--only", "bnech"], "invalid choice: 'bnech'"),
    (["--budget", "0"], "must be a positive number of seconds"),
    (["--budget", "soon"], "is not a number"),
    (["--budget", "59"], "--budget 59: at least 60 seconds"),
    (["--time-limit", "300"], "unrecognized arguments: --time-limit"),  # replaced by --budget
    (["--device", "cuda"], "device 'cuda': no CUDA device is available here"),
    (["--device", "tpu"], "is not a torch device"),
])
def test_bad_options_are_argparse_errors(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv + ["--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_out_that_is_a_file_is_an_argparse_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "file" / "sub")])
    assert "is a file, not a folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- the device


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a machine with 3 GPUs whose current one is cuda:2; no GPU is touched."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        name=f"Fake GPU {torch.device(device).index}", major=9, minor=0, multi_processor_count=132,
        total_memory=int(79.6 * 2**30)))


@pytest.mark.parametrize("given, device", [
    ([], "cuda:2"),  # the current device
    (["--device", "auto"], "cuda:2"),
    (["--device", "cuda"], "cuda:2"),
    (["--device", "cuda:0"], "cuda:0"),
])
def test_the_device_is_resolved_by_the_projects_rule(given, device, fake_cuda, tmp_path):
    args = gpu_check.parse_args(given + ["--out", str(tmp_path)])
    assert args.device == torch.device(device)


@pytest.mark.parametrize("given, message", [
    ("cuda:3", "there are 3 CUDA devices here (cuda:0 to cuda:2)"),
    ("cpu", "gpu-check runs on a CUDA device"),
])
def test_a_device_gpu_check_cannot_use_is_an_argparse_error(given, message, fake_cuda, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--device", given, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("index, parent, visible", [
    (2, None, "2"),  # no list of its own: CUDA's numbering is torch's
    (2, "", "2"),
    (1, "4,6,7", "6"),  # torch's cuda:1 is the second GPU of the parent's list
    (0, "GPU-8d1c, GPU-77aa", "GPU-8d1c"),
    (1, "MIG-1,MIG-2", "MIG-2"),
])
def test_a_part_sees_only_the_chosen_gpu(index, parent, visible, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_check.visible_devices(index, parent) == visible
    if parent is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
        assert gpu_check.visible_devices(index) == visible
    assert gpu_check_parts.gpu_environment(visible)["CUDA_VISIBLE_DEVICES"] == visible
    with pytest.raises(ValueError, match="cuda:5 is not in CUDA_VISIBLE_DEVICES=4,6,7"):
        gpu_check.visible_devices(5, "4,6,7")


# ---------------------------------------------------------------------------------------------- the budget


def test_the_default_budget_fits_the_gpu_machines_and_splits_for_the_tests_and_bench():
    budget = gpu_check.DEFAULT_BUDGET_S
    assert budget == 540 and budget + gpu_check.KILL_GRACE_S <= 600  # 10 minutes a command, 15 a machine
    variants = gpu_check.variants_limit(budget, gpu_check_parts.PARTS)
    assert variants == 120  # bench --suite variants --quick, first and alone
    side, share, tune = gpu_check.split_budget(budget - variants, gpu_check_parts.PARTS)
    assert (side, share, tune) == (199.5, 157.5, 63) and variants + side + share + tune == budget
    assert side - gpu_check_parts.INNER_MARGIN_S >= 175  # pytest -n 8 took about 180 s alone on the H200
    assert tune >= gpu_check.MIN_PART_S  # the tune part, last and alone: tune and the priors it checks
    assert gpu_check_parts.bench_lengths(share) == (4096,)  # bench --quick's longer length fits its share
    # tune takes what one length of bench leaves of the share: the route's rows, then bench at L 4096
    assert gpu_check_parts.tune_seconds(share) == 32.5 and gpu_check_parts.bench_lengths(share - 32.5) == (4096,)
    # alone, the variants part takes the whole budget
    assert gpu_check.variants_limit(300, ("variants",)) == 300


@pytest.mark.parametrize("budget, asked, split", [
    (240, ("tests", "check", "bench", "graphs"), (150, 90, None)),  # 3/8 for bench
    (1200, ("tests", "check", "bench", "graphs"), (1020, 180, None)),  # at most 180 s: the rest goes to the tests
    (1200, ("tests", "check", "bench", "graphs", "tune"), (930, 180, 90)),  # tune: 15%, at most 90 s
    (400, ("tests", "check", "bench", "graphs", "tune"), (190, 150, 60)),
    (480, ("tests", "graphs"), (480, None, None)),
    (480, ("check",), (480, None, None)),
    (300, ("bench",), (None, 300, None)),
])
def test_the_budget_splits_between_the_parts_side_by_side_and_bench(budget, asked, split):
    assert gpu_check.split_budget(budget, asked) == split
    assert sum(limit or 0.0 for limit in split) == budget  # the phases within the budget, none left idle


def test_bench_gets_what_is_left_of_the_budget_and_is_cut_or_not_run_when_little_is():
    assert gpu_check.bench_limit(480, 300, 180) == (180, None)
    limit, note = gpu_check.bench_limit(480, 200, 180)
    assert limit == 280 and note == "its 180 s share of the budget and the 100 s the parts before it left"
    limit, note = gpu_check.bench_limit(480, 315, 180)  # a part stopped at its limit took its kill grace
    assert limit == 165 and note == "cut from its 180 s share to the 165 s left of the 480 s budget"
    limit, note = gpu_check.bench_limit(480, 430, 180)
    assert limit is None and "only 50 s of the 480 s budget were left" in note and "--only bench" in note


def test_the_bench_part_tunes_the_route_first_with_what_one_length_leaves(tmp_path, monkeypatch):
    assert gpu_check_parts.tune_seconds(124) == gpu_check_parts.tune_seconds(150) == 0  # under TUNE_MIN_S left
    assert gpu_check_parts.tune_seconds(160) == 35 and gpu_check_parts.tune_seconds(600) == gpu_check_parts.TUNE_MAX_S
    ran = []

    def fake_run(command, limit_s, log, **kwargs):
        ran.append((command, limit_s, os.path.basename(log)))
        output = "28 rows written to /cache/routes/cuda-x.txt\n" if "tune" in command else ""
        return gpu_check_parts.Finished(0, False, 1.0, output)

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", fake_run)
    record = gpu_check_parts.bench_part(str(tmp_path), 180)
    (tune, tune_limit, tune_log), (bench, bench_limit, _) = ran
    assert tune[1:] == ["-m", "fused_transformer", "tune", "--device", "cuda:0", "--budget", "35"]
    assert tune_limit == 55 and tune_log == "bench_tune.log"  # tune.log is the tune part's
    margin = gpu_check_parts.INNER_MARGIN_S
    assert "bench" in bench and 180 - 55 - margin - 1 < bench_limit <= 180 - margin
    assert record["figures"]["tune"]["rows"] == 28 and record["figures"]["tune"]["path"] == "/cache/routes/cuda-x.txt"
    assert "28 written to `/cache/routes/cuda-x.txt`" in "\n".join(gpu_check_summary._bench_details(record["figures"]))


def test_bench_measures_fewer_lengths_when_its_limit_would_not_fit_both(tmp_path, monkeypatch):
    assert gpu_check_parts.bench_lengths(170) == (1024, 4096)
    assert gpu_check_parts.bench_lengths(169) == gpu_check_parts.bench_lengths(90) == (4096,)
    assert gpu_check_parts.bench_lengths(10) == (4096,)  # at least one
    ran = {}

    def fake_run(command, limit_s, log, **kwargs):
        ran.update(command=command, limit_s=limit_s)
        return gpu_check_parts.Finished(0, False, 1.0, "")

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", fake_run)
    record = gpu_check_parts.bench_part(str(tmp_path), 120)
    command = " ".join(ran["command"])
    assert "bench --device cuda:0 --quick" in command and "--lengths 4096 --out" in command
    assert ran["command"].count("--suite") == len(gpu_check_parts.BENCH_SUITES) and "--profile" in ran["command"]
    assert ran["limit_s"] == 120 - gpu_check_parts.INNER_MARGIN_S
    assert record["figures"]["lengths"] == [4096] and record["figures"]["lengths_left_out"] == [1024]
    assert "Lengths: 4096 only; 1024 left out" in "\n".join(gpu_check_summary._bench_details(record["figures"]))


# ---------------------------------------------------------------------------------------- running the parts

FAKE_ENVIRONMENT = {"date": "2030-01-01T00:00:00+00:00", "python": "3.x", "torch": "9.9", "cuda": "12.9",
                    "triton": "9.9", "fused_transformer": "0.1.0", "cuda_available": True,
                    "device": {"name": "Fake GPU", "capability": "9.0", "sm_count": 132, "memory_gib": 79.6},
                    "triton_interpret": None}
# A part's process as the real ones end: its record in DIR/<part>.json, here with when it started and ended, and
# the GPUs it was given, after sleeping as long as asked.
WRITE_RECORD = ("import json, os, sys, time; out, part, status, figures, sleep = sys.argv[1:]; begun = time.time(); "
                "time.sleep(float(sleep)); figures = dict(json.loads(figures), begun=begun, ended=time.time(), "
                "visible=os.environ.get('CUDA_VISIBLE_DEVICES')); "
                "json.dump({'part': part, 'status': status, 'reason': None if status == 'passed' else 'it broke', "
                "'figures': figures, 'output_tail': ''}, open(f'{out}/{part}.json', 'w'))")
TEST_FIGURES = {"tests": 10, "passed": 8, "failed": 0, "errors": 0, "skipped": 2, "files": ["tests/test_a.py"]}
CHECK_FIGURES = {"checks": 40, "passed": 38, "failed": 2, "summary": "summary: 40 checks, 2 failed"}


def fake_part(status, figures=None, sleep=0.0):
    """A part's process that writes its record with ``status`` and ``figures``, as the real ones do."""
    return lambda part, out, limit_s: [sys.executable, "-c", WRITE_RECORD, out, part, status, json.dumps(figures or {}),
                                       str(sleep)]


def test_parts_from_separate_invocations_merge_in_the_summary(tmp_path, monkeypatch, capsys, fake_cuda):
    out = str(tmp_path)
    monkeypatch.setattr(gpu_check, "part_command", lambda part, out, limit_s, all_tests: fake_part(
        "passed", TEST_FIGURES)(part, out, limit_s))
    assert gpu_check.main(["--out", out, "--only", "tests"]) == 0
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["parts"]["tests"]["status"] == "passed"
    assert first["parts"]["bench"] == {"part": "bench", "status": "not run", "figures": {}, "key_figures": "-",
                                       "reason": "not asked for yet (gpu-check --only bench)"}
    assert first["verdict"].startswith("INCOMPLETE: not run: variants, check, bench, graphs, tune; passed: tests")

    monkeypatch.setattr(gpu_check, "part_command", lambda part, out, limit_s, all_tests: fake_part(
        "failed", CHECK_FIGURES)(part, out, limit_s))
    assert gpu_check.main(["--out", out, "--only", "check"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = summary["parts"]
    assert parts["tests"]["status"] == "passed" and parts["tests"]["started"] == first["parts"]["tests"]["started"]
    assert parts["check"]["status"] == "failed" and parts["check"]["reason"] == "it broke"
    assert parts["check"]["environment"]["device"]["name"] == "Fake GPU 2"
    assert summary["verdict"] == ("FAILED: check failed (not run: variants, bench, graphs, tune; passed: tests; failed: "
                                  "check)")
    assert summary["run"]["side_by_side"] == ["check"] and summary["run"]["alone"] == []
    markdown = (tmp_path / "summary.md").read_text()
    assert "| tests | passed |" in markdown and "8 passed, 0 failed, 0 errors, 2 skipped (1 files)" in markdown
    assert "| check | failed: it broke |" in markdown and "40 checks: 38 passed, 2 failed" in markdown
    assert "Fake GPU 2 (cuda:2, the parts' only GPU through CUDA_VISIBLE_DEVICES=2; capability 9.0, 132 SMs, " \
           "79.6 GiB)" in markdown
    assert "FAILED: check failed" in capsys.readouterr().out


def test_every_part_runs_on_the_gpu_asked_for_and_the_summary_names_it(tmp_path, monkeypatch, capsys, fake_cuda):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    monkeypatch.setattr(gpu_check, "part_command", lambda part, out, limit_s, all_tests: fake_part("passed")(
        part, out, limit_s))
    assert gpu_check.main(["--out", str(tmp_path), "--device", "cuda:1", "--budget", "120"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {part: r["figures"]["visible"] for part, r in summary["parts"].items()} == dict.fromkeys(
        gpu_check_parts.PARTS, "6")
    assert summary["environment"]["device"]["name"] == "Fake GPU 1"
    assert summary["environment"]["device"]["torch_device"] == "cuda:1"
    assert summary["verdict"] == "PASSED: all 6 parts passed on Fake GPU 1"
    run = summary["run"]
    assert (run["budget_s"], run["variants_limit_s"], run["side_by_side_limit_s"], run["bench_share_s"],
            run["tune_share_s"]) == (120, 60, 28.5, 22.5, 9)
    assert 0 < run["wall_s"] < run["budget_s"]
    assert all(r["duration_s"] < r["limit_s"] for r in summary["parts"].values())
    markdown = (tmp_path / "summary.md").read_text()
    assert ("This run: variants first, alone on the GPU, within 60 s; tests, check, graphs side by side, each within "
            "28 s; then bench alone on the GPU (its share 22 s, and what they left); then tune alone on the GPU (its "
            "share 9 s, and what they left). Wall time "
            f"{run['wall_s']:.0f} s of its 120 s budget.") in markdown
    assert f"| tests | passed | {summary['parts']['tests']['duration_s']:.0f} s of 28 s |" in markdown
    printed = capsys.readouterr().out
    assert "Fake GPU 1 (cuda:1, CUDA_VISIBLE_DEVICES=6 for the parts)" in printed
    assert "variants: first, alone on the GPU, at most 60 s" in printed
    assert "tests, check, graphs: side by side, each at most 28 s (the budget less bench's 22 s and tune's 9 s shares)" in printed
    assert f"the whole run: {run['wall_s']:.0f} s of its 120 s budget" in printed
    for part in gpu_check_parts.PARTS:
        assert f"] {part}: passed in " in printed


# A part's process that marks its start in DIR/<part>.begun and ends (writing its record as WRITE_RECORD does) once
# every part named on its command line has marked its own, or after a minute: parts run one after the other never all
# meet, and parts run side by side meet however slowly a busy machine starts them.
MEET_THE_OTHERS = textwrap.dedent("""
    import json, os, sys, time
    out, part, others = sys.argv[1], sys.argv[2], sys.argv[3:]
    begun = time.time()
    open(os.path.join(out, part + ".begun"), "w").close()
    give_up = time.monotonic() + 60
    met = False
    while not met and time.monotonic() < give_up:
        met = all(os.path.exists(os.path.join(out, other + ".begun")) for other in others)
        time.sleep(0.05)
    figures = {"begun": begun, "ended": time.time(), "met": met}
    json.dump({"part": part, "status": "passed", "reason": None, "figures": figures, "output_tail": ""},
              open(os.path.join(out, part + ".json"), "w"))
""")


def test_tests_check_and_graphs_run_side_by_side_and_bench_alone_after_them(tmp_path):
    def command_for(part, out, limit_s):
        if part in gpu_check.SIDE_BY_SIDE:
            return [sys.executable, "-c", MEET_THE_OTHERS, out, part, *gpu_check.SIDE_BY_SIDE]
        return fake_part("passed")(part, out, limit_s)

    records, run = gpu_check.run_parts(gpu_check_parts.PARTS, str(tmp_path), 120, command_for, say=lambda line: None)
    side = [records[part]["figures"] for part in gpu_check.SIDE_BY_SIDE]
    assert all(f["met"] for f in side), "the three did not run at the same time"
    assert max(f["begun"] for f in side) < min(f["ended"] for f in side), "the three did not overlap"
    assert records["bench"]["figures"]["begun"] >= max(f["ended"] for f in side), "bench shared the GPU"
    assert {part: r["phase"] for part, r in records.items()} == {
        "tests": "side by side with check, graphs", "check": "side by side with tests, graphs",
        "graphs": "side by side with tests, check", "bench": "alone, after the others", "variants": "alone",
        "tune": "alone, after the others"}
    assert records["variants"]["figures"]["ended"] <= min(f["begun"] for f in side), "variants shared the GPU"
    assert records["bench"]["limit_s"] > 45 and "the parts before it left" in records["bench"]["limit_note"]
    assert records["tune"]["figures"]["begun"] >= records["bench"]["figures"]["ended"], "tune shared the GPU"


def test_a_part_past_its_limit_is_stopped_with_its_children_while_the_others_finish(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '600']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)")
    commands = {
        "check": lambda part, out, limit_s: [sys.executable, "-c", hang],
        "graphs": fake_part("passed", sleep=1.0),
        "bench": lambda part, out, limit_s: [sys.executable, "-c", "import sys; sys.exit(3)"],
        "tests": fake_part("passed", TEST_FIGURES),
    }
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 1.0)
    parts = [part for part in gpu_check_parts.PARTS if part not in ("variants", "tune")]
    # Side by side at most 10 s each, as long as graphs and tests need several times over on a busy machine; bench
    # gets what is left of its 6 s share once check has been stopped.
    budget = 16.0
    records, run = gpu_check.run_parts(parts, str(tmp_path), budget,
                                       lambda part, out, limit_s: commands[part](part, out, limit_s),
                                       say=lambda line: None)
    assert run["wall_s"] < budget, "the run went past its budget"
    assert records["check"]["status"] == "timed out" and records["check"]["reason"] == "stopped at its 10 s limit"
    # Ended by its stop signal, not by the SIGKILL its grace would have brought.
    assert 10.0 <= records["check"]["duration_s"] < 10.0 + gpu_check.KILL_GRACE_S
    assert records["graphs"]["status"] == records["tests"]["status"] == "passed"
    assert records["bench"]["status"] == "failed" and "exit status 3" in records["bench"]["reason"]
    assert records["bench"]["limit_s"] <= budget - 10.0  # what the side by side phase left
    for part, record in records.items():  # the records on disk are the ones returned
        assert gpu_check_parts.read_record(str(tmp_path / f"{part}.json"))["status"] == record["status"]
    grandchild = int(pid_file.read_text())
    give_up = time.monotonic() + 60
    while _alive(grandchild) and time.monotonic() < give_up:
        time.sleep(0.1)
    assert not _alive(grandchild), "the timed-out part's own child was left running"


def test_bench_is_not_started_with_less_than_a_minute_of_the_budget_left(tmp_path):
    records, run = gpu_check.run_parts(["check", "bench"], str(tmp_path), 61, fake_part("passed", sleep=1.5),
                                       say=lambda line: None)
    assert records["check"]["status"] == "passed"
    assert records["bench"]["status"] == "not run" and "run it alone (gpu-check --only bench)" in \
        records["bench"]["reason"]
    assert not (tmp_path / "bench.log").exists(), "bench was started"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_record_left_by_an_earlier_run_does_not_pass_for_this_one(tmp_path):
    gpu_check_parts.write_record(str(tmp_path), gpu_check_parts.part_record("graphs", "passed"))
    dying = [sys.executable, "-c", "print('dying'); raise SystemExit(1)"]
    record = gpu_check.run_side_by_side({"graphs": dying}, str(tmp_path), 30)["graphs"]
    assert record["status"] == "failed" and "exit status 1" in record["reason"]
    assert "dying" in record["output_tail"] and (tmp_path / "graphs.log").read_text() == "dying\n"


def test_ctrl_c_stops_every_running_part_and_says_so_in_their_records(tmp_path, ctrl_c_raises):
    pid_files = [tmp_path / "tests.pid", tmp_path / "check.pid"]
    # Its pid file appears whole (renamed into place): it may be stopped right after.
    wait = (f"import os, time; open({str(pid_files[1])!r} + '.tmp', 'w').write(str(os.getpid())); "
            f"os.replace({str(pid_files[1])!r} + '.tmp', {str(pid_files[1])!r}); time.sleep(600)")
    # Ctrl-C once check is running too, however long a busy machine takes to start it.
    interrupt_me = ("import os, signal, time; "
                    f"open({str(pid_files[0])!r}, 'w').write(str(os.getpid()))\n"
                    f"while not os.path.exists({str(pid_files[1])!r}): time.sleep(0.05)\n"
                    "os.kill(os.getppid(), signal.SIGINT); time.sleep(600)")
    limit_s = 300
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_side_by_side({"tests": [sys.executable, "-c", interrupt_me],
                                    "check": [sys.executable, "-c", wait]}, str(tmp_path), limit_s)
    assert time.monotonic() - started < limit_s, "the parts were left to run to their limit"
    for part, pid_file in zip(("tests", "check"), pid_files):
        record = gpu_check_parts.read_record(str(tmp_path / f"{part}.json"))
        assert record["status"] == "not run" and record["reason"] == "interrupted (Ctrl-C) while it ran"
        assert not _alive(int(pid_file.read_text()))


# --------------------------------------------------------------------------------------------- the tests part


def test_the_tests_part_says_why_without_a_tests_folder(tmp_path):
    record = gpu_check_parts.tests_part(str(tmp_path), 100, root=str(tmp_path))
    assert record["status"] == "not run" and "no tests folder beside the package" in record["reason"]


@pytest.mark.parametrize("cpus, installed, workers", [
    (16, True, 8),  # the H200 machine: 8 workers, as its first run had, and 8 cores for check, graphs, compiles
    (64, True, 8),
    (8, True, 4),
    (5, True, None),  # one worker is no better than none
    (2, True, None),
    (16, False, None),  # no pytest-xdist: serially
])
def test_the_tests_run_over_xdist_workers_when_it_is_installed(cpus, installed, workers):
    assert gpu_check_parts.xdist_workers(cpus, installed) == workers
    command = gpu_check_parts.tests_command(["tests/test_a.py"], "out/tests.xml", workers)
    assert command[1:] == ["-m", "pytest", "tests/test_a.py", "-q", "-p", "no:cacheprovider", "--junitxml",
                           "out/tests.xml"] + (["-n", str(workers)] if workers else [])


def test_the_tests_part_runs_pytest_with_the_workers_it_chose(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("")
    (tmp_path / "tests" / "test_attention_triton.py").write_text("")
    ran = {}

    def fake_run(command, limit_s, log, **kwargs):
        ran.update(command=command, **kwargs)
        return gpu_check_parts.Finished(5, False, 1.0, "")

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", fake_run)
    monkeypatch.setattr(gpu_check_parts, "xdist_workers", lambda: 6)
    record = gpu_check_parts.tests_part(str(tmp_path), 100, root=str(tmp_path))
    assert ran["command"][-2:] == ["-n", "6"] and "tests/test_attention_triton.py" in ran["command"]
    assert ran["stop_signal"] == gpu_check_parts.signal.SIGINT  # pytest then writes the junit XML of what ran
    assert record["figures"]["xdist_workers"] == 6 and record["figures"]["missing_files"]
    gpu_check_parts.tests_part(str(tmp_path), 100, root=str(tmp_path), workers=0)
    assert "-n" not in ran["command"]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.skipif(
    gpu_check_parts.xdist_workers(16) is None, reason="pytest-xdist is not installed"))])
def test_pytest_stopped_at_its_limit_still_gives_the_counts_of_what_it_ran(workers, tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("")
    slow_began = tmp_path / "test_slow.began"
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time, pytest\n"
        "def test_quick(): pass\n"
        "def test_wrong(): assert False, 'wrong'\n"
        f"def test_slow(): open({str(slow_began)!r}, 'w').close(); time.sleep(600)\n")
    monkeypatch.setattr(gpu_check_parts, "GPU_TEST_FILES", ("tests/test_slow.py",))

    def limit_reached_in_test_slow(command, limit_s, log, **options):
        """pytest under its limit brought forward to the moment test_slow runs and the other two are reported (their
        progress marks in the log), so that however long a busy machine takes to start pytest, its limit falls
        there; the limit given stays the bound when test_slow is never reached."""
        run = gpu_check_parts.LimitedRun(command, limit_s, log, **options)
        while run.poll() is None and not (slow_began.exists() and _reported(log) >= 2):
            time.sleep(0.05)
        run.limit_s = time.monotonic() - run.started
        return run.wait()

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", limit_reached_in_test_slow)
    record = gpu_check_parts.tests_part(str(tmp_path), gpu_check_parts.INNER_MARGIN_S + 300, root=str(tmp_path),
                                        workers=workers)
    figures = record["figures"]
    assert record["status"] == "timed out" and figures["stopped"] is True and not figures.get("partial")
    assert (figures["tests"], figures["passed"], figures["failed"]) == (2, 1, 1), record["output_tail"]
    assert figures["failures"][0]["name"] == "tests/test_slow.py::test_wrong"
    assert "stopped at its limit: the tests it had not reached are not counted" in gpu_check_summary.key_figures(
        "tests", record)


def test_a_run_started_with_its_stop_signal_ignored_still_stops_on_it(tmp_path):
    """``cmd &`` from a shell without job control starts everything below it with SIGINT ignored; the run must still
    end on its stop signal, well before the SIGKILL its grace would bring."""
    child = "import signal, sys, time; print(signal.getsignal(signal.SIGINT), flush=True); time.sleep(600)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run = gpu_check_parts.LimitedRun([sys.executable, "-c", child], 600, str(tmp_path / "log"), grace_s=120,
                                         stop_signal=signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    give_up = time.monotonic() + 60
    while "default_int_handler" not in (tmp_path / "log").read_text() and time.monotonic() < give_up:
        time.sleep(0.05)
    run.stop()
    finished = run.wait()
    assert "default_int_handler" in finished.output, finished.output
    assert finished.returncode not in (None, -signal.SIGKILL) and finished.seconds < 120, finished


def _reported(log):
    """How many tests pytest's progress marks in the file ``log`` show as ended."""
    with open(log) as f:
        return gpu_check_parts.pytest_progress(f.read())["tests"]


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


def test_junit_of_pytest_xdist_counts_each_test_once(tmp_path):
    """As pytest-xdist 3.8 wrote it (pytest -n 2): entries in the order the workers ended them, a crashed worker's
    test as an error, and (as serially) a second entry for a test that failed and then errored in its teardown, and
    an empty one for a test stopped by SIGINT."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    xml = tmp_path / "junit.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="4" failures="2" skipped="2" tests="12">
<testcase classname="tests.test_x" name="test_ok" time="0.000" />
<testcase classname="tests.test_x" name="test_p[fp16]" time="0.001">
 <failure message="AssertionError: wrong dtype&#10;assert 'fp16' == 'bf16'">trace</failure></testcase>
<testcase classname="tests.test_x" name="test_p[bf16]" time="0.001" />
<testcase classname="tests.test_x" name="test_teardown_err" time="0.000">
 <error message="failed on teardown with &quot;RuntimeError: teardown broke&quot;">trace</error></testcase>
<testcase classname="tests.test_x" name="test_setup_err" time="0.000">
 <error message="failed on setup with &quot;RuntimeError: setup broke&quot;">trace</error></testcase>
<testcase classname="tests.test_x" name="test_fail_and_teardown_err" time="0.000">
 <failure message="AssertionError: both&#10;assert False">trace</failure></testcase>
<testcase classname="tests.test_x" name="test_fail_and_teardown_err" time="0.000">
 <error message="failed on teardown with &quot;RuntimeError: teardown broke&quot;">trace</error></testcase>
<testcase classname="tests.test_x" name="test_skip" time="0.000">
 <skipped type="pytest.skip" message="needs no GPU">/tmp/tests/test_x.py:18: needs no GPU</skipped></testcase>
<testcase classname="tests.test_x" name="test_xfail" time="0.000">
 <skipped type="pytest.xfail" message="known" /></testcase>
<testcase classname="tests.test_x" name="test_xpass" time="0.000" />
<testcase classname="tests.test_x.TestGroup" name="test_in_class" time="0.000" />
<testcase time="0.000" />
<testcase classname="tests.test_x" name="test_crash" time="0.000">
 <error message="failed on setup with &quot;worker 'gw0' crashed while running 'tests/test_x.py::test_crash'&quot;">
  worker 'gw0' crashed while running 'tests/test_x.py::test_crash'</error></testcase>
</testsuite></testsuites>""")
    figures = gpu_check_parts.parse_junit(str(xml), str(tmp_path))
    # 11 tests; the XML's own 12 counts test_teardown_err twice, as passed and as an error.
    assert {k: figures[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 11, "passed": 4, "failed": 2, "errors": 3, "skipped": 2}
    assert [(f["name"].split("::")[-1], f["kind"]) for f in figures["failures"]] == [
        ("test_p[fp16]", "failed"), ("test_teardown_err", "error"), ("test_setup_err", "error"),
        ("test_fail_and_teardown_err", "failed"), ("test_fail_and_teardown_err", "error"), ("test_crash", "error")]
    assert figures["failures"][-1]["message"] == ("failed on setup with \"worker 'gw0' crashed while running "
                                                  "'tests/test_x.py::test_crash'\"")
    assert figures["skip_reasons"] == [{"reason": "needs no GPU", "count": 1}, {"reason": "known", "count": 1}]


def test_pytest_progress_lines_of_xdist_count_past_a_crashed_worker():
    output = "\n".join(["bringing up nodes...", "bringing up nodes...", "",
                        "...FEEFEsxX.[gw0] node down: Not properly terminated", "F   [100%]"])
    counts = gpu_check_parts.pytest_progress(output)
    assert (counts["tests"], counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (
        13, 5, 3, 3, 2)


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
    assert summary["verdict"] == "FAILED: graphs failed (not run: variants, tests, check, bench, tune; failed: graphs)"


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


def test_sdpa_determinism_is_measured_per_backend_and_read_in_the_summary():
    """The route's question (is SDPA's backward deterministic?) answered per backend; a backend that cannot run a
    case is said so, not counted, and fails nothing. Runs here on CPU tensors: the math backend runs, cuDNN cannot."""
    result = gpu_check_graphs.sdpa_determinism_check(torch.device("cpu"), ("MATH", "CUDNN_ATTENTION"),
                                                     ((1, 2, 16, 8),))
    assert result["ok"]
    by_backend = {}
    for case in result["cases"]:
        by_backend.setdefault(case["backend"], []).append(case)
    assert [c["equal"] for c in by_backend["math"]] == [True] * 4  # 2 dtypes x no mask / causal
    assert all(c["equal"] is None and c["error"] for c in by_backend["cudnn_attention"])
    flipped = dict(result, cases=[dict(result["cases"][0], equal=False, differing=["dq (max difference 0.0156)"]),
                                  *result["cases"][1:]])
    record = gpu_check_parts.part_record("graphs", "passed", "", {"sdpa_determinism": flipped})
    summary = gpu_check_summary.build_summary({"graphs": record}, FAKE_ENVIRONMENT, lambda part: "not asked for")
    assert summary["parts"]["graphs"]["key_figures"] == (
        "SDPA backward bitwise deterministic: math 3/4, cudnn_attention n/a")
    markdown = gpu_check_summary.render_markdown(summary)
    assert "| math | bfloat16 | none | 1, 2, 16, 8 | NO | dq (max difference 0.0156) |" in markdown
    assert "| cudnn_attention | float16 | causal | 1, 2, 16, 8 | n/a | " in markdown


def test_variants_figures_read_in_the_summary():
    rows = [{"op": "attention.fwd", "gpu": "H200", "shape": "bf16/D128/causal/L4096", "variant": "persistent",
             "vs_default": 0.87, "vs_vendor": 0.93, "vendor": "sdpa:cudnn_attention", "provenance": "NVIDIA H200, x"},
            {"op": "decode.split", "gpu": "H200", "shape": "P8/L8192", "variant": "fill_sms", "vs_default": 1.0,
             "vs_vendor": 1.2, "vendor": "sdpa", "provenance": "NVIDIA H200, x"}]
    record = gpu_check_parts.part_record("variants", "passed", None, {"rows": rows, "rows_copy": "out/v.json"})
    summary = gpu_check_summary.build_summary({"variants": record}, FAKE_ENVIRONMENT, lambda part: "not asked for")
    assert summary["parts"]["variants"]["key_figures"] == (
        "2 verdicts, 1 won by another variant than the default; rows in out/v.json")
    markdown = gpu_check_summary.render_markdown(summary)
    assert "| attention.fwd | bf16/D128/causal/L4096 | persistent | 0.870 | 0.930 | sdpa:cudnn_attention |" in markdown
