"""gpu-check's tune part without a GPU: the priors against what ``tune`` measured (``tools/priors.py``) on made-up rows
and on rows as ``tune --device cpu`` writes them, the part's command line, its record and the summary's line, and the
budget with the part in it."""
import os

import pytest

from fused_transformer import route
from fused_transformer.tools import gpu_check, gpu_check_parts, gpu_check_summary, priors

T4 = route.DeviceFacts("cpu-avx512-t4", "cpu", isa="avx512", threads=4)  # nobody measured it: cpu-avx512-t2's priors
BUILT_IN = route.parse_rows("""
attention     forward   cpu-avx512-t2  float32           64        causal       no       functional  0..1024         1.40       -          built-in A
layer_norm    forward   cpu-avx512-t2  float32           *         *            no       functional  *               1.30       -          built-in B
layer_norm    forward   cpu-avx2-t2    float32           *         *            yes      functional  *               0.50       -          built-in C
""")
# As ``tune --device cpu`` writes them on T4 (route.HEADER, then the rows; its source "tune <date>").
TUNED = f"""# cpu-x: python -m fused_transformer tune, 9 s
{route.HEADER}
attention     forward   cpu-avx512-t4  float32           64        causal       no       functional  0..1024         0.60       -          tune 2026-12-07
layer_norm    forward   cpu-avx512-t4  float32           *         *            no       functional  *               1.20       -          tune 2026-12-07
layer_norm    forward   cpu-avx512-t4  float32           *         *            yes      functional  *               0.70       -          tune 2026-12-07
"""


def _verdicts(before=None):
    measured = route.parse_rows(TUNED)
    table = route.with_priors(T4, BUILT_IN) if before is None else before
    return priors.compare(measured, table, "cpu")


def test_a_prior_where_ours_won_and_a_measurement_where_torch_wins_is_wrong_and_agreement_holds():
    wrong, held, without = _verdicts()
    assert (wrong.call.op, wrong.call.mask, wrong.call.needs_grad) == ("attention", "causal", False)
    assert wrong.row.matches(wrong.call) and 0 <= wrong.call.size < 1024
    assert wrong.before.backend == "cpu" and "prior from cpu-avx512-t2: built-in A" in wrong.before.reason
    assert wrong.measured.backend == "torch" and "tune 2026-12-07" in wrong.measured.reason
    assert (wrong.prior, wrong.verdict) == ("prior from cpu-avx512-t2", "prior wrong")
    assert held.before.backend == held.measured.backend == "cpu" and held.verdict == "prior held"
    # LayerNorm with dropout: the AVX2 row is not T4's nearest, so no row decided it before: the plain default
    assert without.call.dropout and without.prior == "default" and without.verdict == "no prior"
    assert without.before.reason == "no measured row: ours (the default)" and without.measured.backend == "torch"


def test_a_default_that_names_itself_a_prior_counts_as_one():
    # Without the built-in attention row, causal attention falls to DENSE_PRIOR (torch): the tuned row (torch) holds it
    attention, _, _ = _verdicts(route.with_priors(T4, BUILT_IN[1:]))
    assert attention.call.torch_default.startswith("prior: ") and attention.before.backend == "torch"
    assert (attention.prior, attention.verdict) == ("prior (default)", "prior held")


def test_the_counts_line_and_priors_md(tmp_path):
    verdicts = _verdicts()
    line = priors.counts_line(verdicts, T4.tag, "cpu-avx512-t2")
    assert line == "priors: 1 held, 1 wrong, 1 without a prior (from cpu-avx512-t4's nearest: cpu-avx512-t2)"
    text = priors.markdown(verdicts, T4.tag, "cpu-avx512-t2", "tune 2026-12-07")
    table = [row for row in text.splitlines() if row.startswith("| attention ")]
    assert len(table) == 1 and table[0].endswith("| torch | ours 0.60x torch (tune 2026-12-07) | prior wrong |")
    assert "| cpu | prior from cpu-avx512-t2 | ours 1.40x torch (prior from cpu-avx512-t2: built-in A) |" in table[0]


def test_the_report_reads_the_rows_tune_wrote_for_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(route, "_measured", lambda: tuple(BUILT_IN))
    rows = tmp_path / "tuned_rows.txt"
    rows.write_text(TUNED)
    figures = priors.write_report(str(rows), T4, "cpu", str(tmp_path / "priors.md"))
    assert (figures["held"], figures["wrong"], figures["without"], figures["nearest"]) == (1, 1, 1, "cpu-avx512-t2")
    assert figures["line"].startswith("priors: 1 held, 1 wrong, 1 without a prior")
    assert "| prior wrong |" in (tmp_path / "priors.md").read_text()


def test_a_training_row_is_decided_with_gradients_and_a_star_pass_both_ways():
    row = route.parse_rows("layer_norm    *         cpu-avx512-t4  float32           *         *            no       "
                           "functional  *               1.20       -          tune x")
    verdicts = priors.compare(row, route.with_priors(T4, BUILT_IN), "cpu")
    assert [v.call.needs_grad for v in verdicts] == [False, True]


# ---------------------------------------------------------------------------------------------------- the part


def test_the_tune_part_runs_tune_on_the_gpu_into_out_within_its_limit(tmp_path):
    command = gpu_check_parts.tune_command(str(tmp_path), 63)
    assert command[1:6] == ["-m", "fused_transformer", "tune", "--device", gpu_check_parts.PART_DEVICE]
    assert command[command.index("--out") + 1] == os.path.join(str(tmp_path), "tuned_rows.txt")
    budget = float(command[command.index("--budget") + 1])
    assert budget == 63 - gpu_check_parts.INNER_MARGIN_S - gpu_check_parts.TUNE_START_S and budget <= 63
    assert gpu_check.part_command("tune", str(tmp_path), 63)[-6:] == ["--part", "tune", "--out", str(tmp_path),
                                                                      "--time-limit", "63"]


def test_the_tune_part_compares_its_rows_and_the_summary_says_so(tmp_path, monkeypatch):
    ran = []

    def fake_run(command, limit_s, log, **kwargs):  # tune --device cpu, as it writes its rows
        ran.append((command, limit_s, os.path.basename(log)))
        (tmp_path / "tuned_rows.txt").write_text(TUNED)
        return gpu_check_parts.Finished(0, False, 9.0, f"3 rows written to {tmp_path / 'tuned_rows.txt'}\n")

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", fake_run)
    monkeypatch.setattr(route, "_measured", lambda: tuple(BUILT_IN))
    monkeypatch.setattr(route, "device_facts", lambda device: T4)
    (tmp_path / "tuned_rows.txt").write_text("stale")
    record = gpu_check_parts.tune_part(str(tmp_path), 63, device="cpu")
    (command, limit, log), = ran
    assert limit == 63 - gpu_check_parts.INNER_MARGIN_S and log == "tune.log"
    assert record["status"] == "passed" and record["figures"]["rows"] == 3
    line = "priors: 1 held, 1 wrong, 1 without a prior (from cpu-avx512-t4's nearest: cpu-avx512-t2)"
    assert record["figures"]["priors"]["line"] == line
    gpu_check_parts.write_record(str(tmp_path), record)
    summary = gpu_check_summary.build_summary(gpu_check_summary.load_records(str(tmp_path)),
                                              {"cuda_available": True}, lambda part: "not asked")
    markdown = gpu_check_summary.render_markdown(summary)
    assert f"{line}; per call in `{tmp_path / 'priors.md'}`." in markdown
    assert f"| tune | passed | - | 3 rows in {tmp_path / 'tuned_rows.txt'}; {line} |" in markdown


def test_the_tune_part_without_rows_fails_and_compares_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_parts, "run_with_limit",
                        lambda command, limit_s, log, **kwargs: gpu_check_parts.Finished(1, False, 5.0, "boom\n"))
    (tmp_path / "tuned_rows.txt").write_text(TUNED)  # an earlier run's: removed, not compared
    record = gpu_check_parts.tune_part(str(tmp_path), 63, device="cpu")
    assert record["status"] == "failed" and "priors" not in record["figures"]
    assert not (tmp_path / "priors.md").exists()


# -------------------------------------------------------------------------------------------------- the budget


@pytest.mark.parametrize("budget", [60, 120, 240, 420, 540, 1200, 3600])
def test_with_the_tune_part_the_split_stays_within_the_budget(budget):
    variants = gpu_check.variants_limit(budget, gpu_check_parts.PARTS)
    side, bench, tune = gpu_check.split_budget(budget - variants, gpu_check_parts.PARTS)
    assert tune == min(gpu_check.TUNE_SHARE_MAX_S, (budget - variants) * gpu_check.TUNE_SHARE)
    assert variants + side + bench + tune == pytest.approx(max(budget, variants))
    assert side >= 0 or budget < 2 * gpu_check.MIN_PART_S  # only a budget too small for variants and the rest


def test_the_default_budget_leaves_tune_a_minute_and_the_tests_three():
    budget = gpu_check.DEFAULT_BUDGET_S
    variants = gpu_check.variants_limit(budget, gpu_check_parts.PARTS)
    side, bench, tune = gpu_check.split_budget(budget - variants, gpu_check_parts.PARTS)
    assert (variants, side, bench, tune) == (120, 199.5, 157.5, 63)
    assert tune >= gpu_check.MIN_PART_S and side - gpu_check_parts.INNER_MARGIN_S >= 175


@pytest.mark.parametrize("asked, split", [
    (("tune",), (None, None, 300)),
    (("bench", "tune"), (None, 255, 45)),
    (("check", "tune"), (255, None, 45)),
    (("check", "bench", "tune"), (142.5, 112.5, 45)),
])
def test_tune_takes_its_share_from_the_parts_before_it(asked, split):
    side, bench, tune = gpu_check.split_budget(300, asked)
    assert (side, bench, tune) == split
    assert sum(x or 0 for x in (side, bench, tune)) == 300


def test_tune_gets_what_bench_left_and_bench_keeps_tunes_share():
    assert gpu_check.bench_limit(540, 300, 150, 60) == (180, "its 150 s share of the budget and the 30 s the parts "
                                                        "before it left")
    assert gpu_check.tune_limit(540, 460, 63) == (80, "its 63 s share of the budget and the 17 s the parts before it "
                                                  "left")
    limit, note = gpu_check.tune_limit(540, 500, 63)
    assert limit is None and "gpu-check --only tune" in note
