"""``python -m fused_transformer bench``: runs end to end on CPU, writes the promised CSV columns and the plots,
counts the work it promises to count, and refuses bad options."""
import csv
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from fused_transformer import backend, ops
from fused_transformer.ops.attention import cases as attention_cases
from fused_transformer.tools import bench, bench_cases, bench_llama, bench_plots, bench_summary, provenance

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# The llama suite's model at a size a test can afford.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny run of every suite on CPU: length 32, short timings, the llama suite's model tiny."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(bench_llama.MODELS, "cpu", TINY_LLAMA)
        code = bench.main(["--quick", "--device", "cpu", "--lengths", "32", "--min-time", "0.01",
                           "--threads", "1", "--out", str(out)])
    with open(out / "bench_cpu.csv", newline="") as f:
        reader = csv.DictReader(f)
        return code, out, reader.fieldnames, list(reader)


def test_cli_runs_end_to_end(bench_run):
    code, _, _, rows = bench_run
    assert code == 0
    assert {row["suite"] for row in rows} == set(bench_cases.SUITES)


def test_csv_has_the_promised_columns(bench_run):
    _, _, fieldnames, rows = bench_run
    assert tuple(fieldnames) == bench.COLUMNS == (
        "suite", "case", "mode", "impl", "device", "dtype", "batch", "heads", "seq_len", "head_dim", "d_model",
        "d_ff", "causal", "padding", "ms", "tflops", "tokens_per_s", "gb_per_s", "bw_of_peak", "peak_mem_mb",
        "mem_measure", "baseline", "speedup", "launches", "note",
    )
    assert rows and all(row["device"] == "cpu" and row["dtype"] == "float32" for row in rows)


def test_csv_has_ours_and_every_baseline(bench_run):
    _, _, _, rows = bench_run
    impls = {suite: {row["impl"] for row in rows if row["suite"] == suite and row["ms"]}
             for suite in bench_cases.SUITES}
    assert {"ours", "sdpa", "sdpa:math", "sdpa:flash_attention"} <= impls["attention"]
    assert impls["layer_norm"] == impls["rms_norm"] == impls["feed_forward"] == impls["gated_feed_forward"] == {
        "ours", "torch"}
    assert impls["apply_rotary_pos_emb"] == {"ours", "torch"}
    assert impls["encoder_layer"] == impls["decoder_layer"] == impls["decode_step"] == {"ours", "torch.nn"}
    assert impls["module_call"] == {"ours", "torch.nn"}
    assert impls["llama"] == {"ours", "transformers"}
    llama = {(row["case"], row["mode"], row["seq_len"], row["d_model"]) for row in rows if row["suite"] == "llama"}
    assert llama == {("decoder layer", "train", "32", "64"), ("LM step", "train", "32", "64")}
    assert impls["decode"] == {"ours", "sdpa"}
    decode = [row for row in rows if row["suite"] == "decode" and row["ms"]]
    assert {row["case"] for row in decode} == {f"B{b} H{h}/8" for b in (1, 8, 32) for h in (8, 32)}
    assert all(math.isclose(float(r["gb_per_s"]), 2 * int(r["batch"]) * int(r["seq_len"]) * 8 * 64 * 4 / float(r["ms"])
                            / 1e6, rel_tol=1e-3) for r in decode)  # the cache's keys and values, read once
    calls = {(row["case"], row["mode"]) for row in rows if row["suite"] == "module_call"}
    assert calls == {(c, m) for c in bench_cases.MODULE_CALL_MODULES for m in ("eval", "train")}
    masks = {(row["case"], row["mode"]) for row in rows if row["suite"] == "attention"}
    assert masks == {(m, p) for m in ("none", "causal", "pad50%", "B1H1 causal", "causal+alibi")
                     for p in ("fwd", "fwd+bwd")}
    assert {row["batch"] for row in rows if row["case"] == "B1H1 causal"} == {"1"}
    encoder = {(row["case"], row["mode"]) for row in rows if row["suite"] == "encoder_layer"}
    assert encoder == {(c, m) for c in ("no padding", "pad25%", "pad50%", "pad75%", "seq-first") for m in ("train", "eval")}
    steps = [row for row in rows if row["suite"] == "decode_step" and row["ms"]]
    assert steps and all(math.isclose(float(r["tokens_per_s"]), 32 / float(r["ms"]) * 1e3, rel_tol=1e-3)
                         for r in steps)  # one token per sequence a step
    expected = "backend cpu" if backend.cpu_unavailable_reason() is None else "backend reference"
    ours = [row for row in rows if row["impl"] == "ours"]
    assert all(row["note"].split("; route: ")[0] == expected for row in ours)
    # the route's decisions of each case's calls, with why: torch's ATen ops where there is no dropout to fuse
    plain = [row["note"] for row in ours if row["suite"] == "module_call" and row["case"] == "LayerNorm"]
    assert plain and all("layer_norm -> torch (no dropout: nothing to fuse" in note or
                         "layer_norm -> torch (ours" in note for note in plain), plain
    assert all("; route: " in row["note"] for row in ours if row["suite"] in ("attention", "layer_norm"))


def test_speedup_is_baseline_time_over_time(bench_run):
    _, _, _, rows = bench_run
    key = ("suite", "case", "mode", "seq_len", "head_dim", "d_model")
    baseline_ms = {tuple(r[k] for k in key): float(r["ms"]) for r in rows if r["impl"] == r["baseline"]}
    measured = [row for row in rows if row["ms"]]
    assert len(measured) > len(baseline_ms)
    for row in measured:
        expected = baseline_ms[tuple(row[k] for k in key)] / float(row["ms"])
        assert math.isclose(float(row["speedup"]), expected, rel_tol=1e-4), row
        if row["impl"] == row["baseline"]:
            assert float(row["speedup"]) == 1.0


def test_throughput_and_memory_columns(bench_run):
    _, _, _, rows = bench_run
    counted = {"flops": set(), "nbytes": set()}  # the suites whose op counts FLOPs, or bytes (``Op.work``)
    for op in ops.registered():
        if op.bench is not None:
            work = op.work(op.bench(False, (128,))[0], 4, False)
            for kind in counted:
                if getattr(work, kind) is not None:
                    counted[kind].add(op.bench_suite)
    for row in (r for r in rows if r["ms"]):
        assert float(row["ms"]) > 0 and float(row["tokens_per_s"]) > 0
        assert float(row["peak_mem_mb"]) >= 0 and row["mem_measure"] == "cpu_profiler_alloc"
        assert bool(row["tflops"]) == (row["suite"] in counted["flops"])
        assert bool(row["gb_per_s"]) == (row["suite"] in counted["nbytes"])
        assert row["bw_of_peak"] == ""  # no peak bandwidth on CPU
    # The math backend materialises the [L, L] scores: it allocates more than ours.
    fwd = {row["impl"]: float(row["peak_mem_mb"]) for row in rows
           if row["suite"] == "attention" and row["case"] == "none" and row["mode"] == "fwd+bwd"}
    assert fwd["sdpa:math"] > fwd["ours"] > 0


def test_plots_are_written(bench_run):
    _, out, _, _ = bench_run
    for suite in bench_cases.SUITES:
        for kind in ("throughput", "memory"):
            data = (out / f"{suite}_cpu_{kind}.png").read_bytes()
            assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_summary_says_where_its_figures_come_from(bench_run):
    _, out, _, rows = bench_run
    text = (out / "bench_cpu.md").read_text()
    assert text.startswith("# Benchmark on cpu, float32\n")
    header = provenance.parse_header(text.splitlines()[2])
    assert header["command"].startswith("bench --quick --device cpu") and header["torch"] == torch.__version__
    assert header["commit"] == provenance.commit() != "unknown"
    assert bool(header["uncommitted"]) == provenance.sources_changed()
    for suite in bench_cases.SUITES:
        assert f"\n## {suite}\n" in text and f"![{suite}_cpu_throughput.png]({suite}_cpu_throughput.png)" in text
    ours = [row for row in rows if row["impl"] == "ours" and row["speedup"]]
    assert text.count("x |") == len(ours)


def test_a_suite_measured_at_one_length_is_drawn_as_bars(bench_run):
    from matplotlib.container import BarContainer

    _, _, _, rows = bench_run
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32, "auto")
    def parsed(value):
        try:
            return float(value)
        except ValueError:
            return value or None

    measured = [{key: parsed(value) if key != "seq_len" else int(value) for key, value in row.items()} for row in rows]
    for kind, fig in bench_plots.suite_figures(measured, "module_call", setup):
        for ax in fig.axes:
            assert ax.containers and all(isinstance(c, BarContainer) for c in ax.containers), kind
            assert not ax.get_lines(), kind


def test_recap_lists_each_suite_with_ours_median_speedup():
    rows = [dict(suite="layer_norm", impl=impl, speedup=speedup, baseline="torch")
            for impl, speedup in (("ours", 1.5), ("torch", 1.0), ("ours", 0.5), ("ours", 2.0))]
    assert bench_summary.recap(rows) == ["layer_norm: ours / torch 1.50x median (0.50x - 2.00x) over 3 cases"]


def test_table_is_printed_as_it_goes(tmp_path, capsys):
    argv = ["--suite", "layer_norm", "--lengths", "16", "--min-time", "0.01", "--threads", "1", "--out", str(tmp_path),
            "--no-plots"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("d256 ") or line.startswith("d1024 ")]
    assert len(rows) == 8 and all(row[-1].endswith("x") for row in rows)
    assert not list(tmp_path.glob("*.png"))


def test_the_suites_are_the_ops_with_a_bench_then_the_modules():
    """Registering an op with a bench puts its suite in bench (in registry order), with its lengths and words; those
    timed in inference only come after decode_step."""
    op_suites = [op.bench_suite for op in ops.registered() if op.bench_suite is not None]
    assert {"attention", "decode", "layer_norm", "rms_norm", "feed_forward"} <= set(op_suites)
    assert [suite for suite in bench_cases.SUITES if suite in op_suites] == sorted(
        op_suites, key=lambda suite: "fwd+bwd" not in bench_cases.OP_SUITES[suite].bench_modes)
    assert bench_cases.SUITES.index("decode") > bench_cases.SUITES.index("decode_step")
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32)
    for suite in op_suites:
        op = bench_cases.OP_SUITES[suite]
        assert bench_cases.default_lengths(suite, setup.device, True) == op.lengths["cpu"][1]
        assert bench_cases.describe(suite, setup) == op.describe(False)


def test_case_ids_name_the_head_dim_where_a_suite_has_several():
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32)
    attention = bench_cases.cases("attention", setup, [128])
    assert attention[0].id == "attention-none-fwd-L128-D64" and attention[0].impls[:2] == ("sdpa", "ours")
    assert bench_cases.cases("decode", setup, [512])[0].id == "decode-B1_H8/8-eval-L512"  # one head dim a device
    assert len({case.id for case in attention}) == len(attention)
    cuda = bench_cases.cases("attention", bench_cases.Setup(torch.device("cuda"), torch.bfloat16), [1024])
    assert {case.id[-4:] for case in cuda} == {"-D64", "D128"} and len({case.id for case in cuda}) == len(cuda)
    assert all(case.impls[1:3] == ("ours", "ours:triton") for case in cuda)
    assert bench_cases.is_competitor("sdpa:math") and not bench_cases.is_competitor("torch")
    assert bench_cases.is_competitor("flash_attn", "decode") and not bench_cases.is_competitor("xformers", "decode")
    assert bench_cases.competitor_notes(setup.device, ["layer_norm"]) == []
    assert any("sdpa backends" in note for note in bench_cases.competitor_notes(setup.device, ["attention"]))


def test_attention_flops_count_the_attended_pairs():
    full = attention_cases.attention_flops(2, 3, 128, 64)
    assert full == 4 * 64 * 3 * 2 * 128 * 128
    causal = attention_cases.attention_flops(2, 3, 128, 64, causal=True)
    assert causal / full == pytest.approx(0.5, abs=0.01) and causal == 4 * 64 * 3 * 2 * 128 * 129 // 2
    padded = attention_cases.attention_flops(2, 3, 128, 64, kept=[32, 96])
    assert padded / full == 0.5
    # causal and padding: query i sees min(i + 1, kept) keys
    both = attention_cases.attention_flops(1, 1, 4, 1, causal=True, kept=[2])
    assert both == 4 * (1 + 2 + 2 + 2)
    assert attention_cases.attention_flops(2, 3, 128, 64, backward=True) == 3.5 * full
    with pytest.raises(ValueError):
        attention_cases.attention_flops(2, 3, 128, 64, kept=[128])


def test_padding_ratio_and_other_counts():
    kept = attention_cases.kept_lengths(8, 128, 0.5)
    assert kept[:2] == [32, 96] and attention_cases.padding_ratio(kept, 128) == 0.5
    assert attention_cases.kept_lengths(3, 10, 0.0) == [10, 10, 10]
    from fused_transformer.ops import feed_forward, layer_norm

    assert feed_forward.flops(10, 4, 8) == 2 * 2 * 10 * 4 * 8
    assert feed_forward.flops(10, 4, 8, backward=True) == 3 * 2 * 2 * 10 * 4 * 8
    assert layer_norm.bytes_moved(10, 4, 2) == 2 * (3 * 10 * 4 + 2 * 4)


@pytest.mark.parametrize("argv", [
    ["--suite", "nope"],
    ["--lengths", "abc"],
    ["--lengths", "0,128"],
    ["--dtype", "fp8"],
    ["--dtype", "fp32"],  # check's spelling, float32, is the one
    ["--device", "tpu"],
    ["--device", "not a device"],
    ["--min-time", "-1"],
    ["--threads", "0"],
    ["--backend", "cuda"],
    ["--frobnicate"],
])
def test_bad_options_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
def test_cuda_without_a_gpu_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("under", ["", "inner"])
def test_out_at_or_under_a_regular_file_is_an_argparse_error(tmp_path, capsys, under):
    blocking = tmp_path / "results"
    blocking.write_text("not a folder")
    out = str(blocking / under) if under else str(blocking)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", out, "--suite", "layer_norm"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out!r}: {blocking} is a file, not a folder" in err
    assert blocking.read_text() == "not a folder"


def test_the_pytest_benchmark_suite_collects_every_case_of_a_suite():
    """``pytest benchmarks/`` loads its conftest and parametrizes one test per (case, implementation) of
    ``bench_cases`` (without pytest-benchmark installed, as here, collecting still works)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--bench-suite", "module_call", "--bench-lengths", "4"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line for line in result.stdout.splitlines() if line.startswith("benchmarks/")]
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32)
    expected = sum(len(case.impls) for case in bench_cases.cases("module_call", setup, [4]))
    assert len(collected) == expected == 16


def test_the_llama_suite_compares_transformers_with_its_fused_copy():
    """Both twins compute the same model (logits, loss, every gradient); ours is the fused copy."""
    pytest.importorskip("transformers")
    setup = bench_cases.Setup(torch.device("cpu"), torch.float32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(bench_llama.MODELS, "cpu", TINY_LLAMA)
        models, fused = bench_llama.twins(setup)
        assert [case.id for case in bench_cases.cases("llama", setup, [16, 24])] == [
            "llama-decoder_layer-train-L16", "llama-decoder_layer-train-L24", "llama-LM_step-train-L16",
            "llama-LM_step-train-L24"]
        assert bench_cases.default_lengths("llama", setup.device, True) == (128,)
        assert bench_cases.default_lengths("llama", setup.device, False) == (512,)
    theirs, ours = models["transformers"], models["ours"]
    assert theirs.config._attn_implementation == "sdpa" and not theirs.use_kernels
    assert ours.config._attn_implementation == "fused_transformer" and fused.startswith("ft.fuse: ")
    assert theirs.training and ours.training and not theirs.config.tie_word_embeddings
    ids = torch.randint(256, (2, 19))
    outputs = [model(input_ids=ids, labels=ids) for model in (theirs, ours)]
    assert outputs[1].logits is None  # the fused loss never makes them in training
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in (theirs, ours)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, rtol=1e-5, atol=1e-6)
    for output in outputs:
        output.loss.backward()
    for (name, mine), theirs_param in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(mine.grad, theirs_param.grad, rtol=1e-4, atol=1e-5, msg=name)
    # the decoder layer case's call: no mask, causal attention
    x = torch.randn(2, 19, TINY_LLAMA["hidden_size"])
    positions = torch.arange(19).expand(2, 19)
    cos_sin = theirs.model.rotary_emb(x, positions)
    layers = [model.model.layers[0](x, position_ids=positions, position_embeddings=cos_sin) for model in (theirs, ours)]
    torch.testing.assert_close(layers[1], layers[0], rtol=1e-5, atol=1e-5)
    future = x.clone()
    future[:, -1] += 1.0  # the last token changes no earlier output
    changed = ours.model.layers[0](future, position_ids=positions, position_embeddings=cos_sin)
    torch.testing.assert_close(changed[:, :-1], layers[1][:, :-1])


def test_the_llama_suite_is_skipped_loudly_without_transformers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_llama, "unavailable_reason", lambda: "transformers is not installed (test)")
    assert list(bench_llama.cases(bench_cases.Setup(torch.device("cpu"), torch.float32), [16])) == []
    argv = ["--suite", "llama", "--suite", "rms_norm", "--lengths", "16", "--min-time", "0.01", "--threads", "1",
            "--out", str(tmp_path), "--no-plots"]
    assert bench.main(argv) == 0
    assert "SKIPPED suite llama: transformers is not installed (test)" in capsys.readouterr().out
    with open(tmp_path / "bench_cpu.csv", newline="") as f:
        assert {row["suite"] for row in csv.DictReader(f)} == {"rms_norm"}
