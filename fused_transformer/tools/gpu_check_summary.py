"""The verdict of ``python -m fused_transformer gpu-check``: ``DIR/summary.json`` and ``DIR/summary.md``, rebuilt by
every invocation from all the part records in DIR (``DIR/<part>.json``), whichever invocation wrote them, so that
parts run one at a time (``--only tests``, later ``--only bench``) merge into one summary."""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Mapping, Optional

from fused_transformer.tools import bench_cases
from fused_transformer.tools.gpu_check_parts import (
    FAILED, NOT_RUN, PARTS, PASSED, TIMED_OUT, read_record, record_path,
)

TAIL_LINES = 25  # of a part's output, shown in summary.md when it did not pass


def load_records(out: str) -> Dict[str, dict]:
    """The part records in ``out`` (part -> record), whichever invocation wrote them; an unreadable one fails."""
    records = {}
    for part in PARTS:
        path = record_path(out, part)
        if os.path.exists(path):
            records[part] = read_record(path) or {"part": part, "status": FAILED, "figures": {},
                                                  "reason": f"{path} is not a part record"}
    return records


def build_summary(records: Mapping[str, dict], environment: dict, missing_reason: Callable[[str], str],
                  run: Optional[dict] = None) -> dict:
    """Every part, from its record or as not run for ``missing_reason(part)``, the overall verdict, and ``run``:
    this invocation's budget, its split and its wall time (``gpu_check.run_parts``), None when nothing ran."""
    parts = {}
    for part in PARTS:
        parts[part] = dict(records[part]) if part in records else {"part": part, "status": NOT_RUN,
                                                                   "reason": missing_reason(part), "figures": {}}
        parts[part]["key_figures"] = key_figures(part, parts[part])
    return {"generated": environment.get("date"), "environment": environment, "verdict": verdict(parts, environment),
            "run": run, "parts": parts}


def verdict(parts: Mapping[str, dict], environment: Mapping[str, object]) -> str:
    """One line: PASSED (every part passed), FAILED (naming the parts that failed or timed out), INCOMPLETE (none
    failed, some not run), or NO CUDA DEVICE."""
    by_status: Dict[str, List[str]] = {}
    for part, record in parts.items():
        by_status.setdefault(record["status"], []).append(part)
    rest = "; ".join(f"{status}: {', '.join(names)}" for status, names in by_status.items())
    if not environment.get("cuda_available"):
        kept = [p for p, r in parts.items() if r["status"] != NOT_RUN]
        return "NO CUDA DEVICE: nothing ran here" + (f" (kept from earlier runs: {rest})" if kept else "")
    bad = [f"{part} {record['status']}" for part, record in parts.items() if record["status"] in (FAILED, TIMED_OUT)]
    if bad:
        return f"FAILED: {', '.join(bad)} ({rest})"
    if len(by_status.get(PASSED, [])) == len(parts):
        return f"PASSED: all {len(parts)} parts passed on {_device_name(environment)}"
    return f"INCOMPLETE: {rest}"


def _device_name(environment: Mapping[str, object]) -> str:
    device = environment.get("device")
    return device["name"] if isinstance(device, dict) else "no CUDA device"


def describe_environment(environment: Mapping[str, object]) -> str:
    device = environment.get("device")
    which = (f"{device['torch_device']}, the parts' only GPU through CUDA_VISIBLE_DEVICES="
             f"{device['cuda_visible_devices']}; " if isinstance(device, dict) and device.get("torch_device") else "")
    where = (f"{device['name']} ({which}capability {device['capability']}, {device['sm_count']} SMs, "
             f"{device['memory_gib']:.1f} GiB)" if isinstance(device, dict) else "a machine with no CUDA device")
    return (f"{where}; torch {environment.get('torch')}, CUDA {environment.get('cuda')}, triton "
            f"{environment.get('triton')}, fused_transformer {environment.get('fused_transformer')}, python "
            f"{environment.get('python')}")


# ---------------------------------------------------------------------------------------------- key figures


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rate(shape: Mapping[str, object]) -> str:
    if shape.get("tflops") is not None:
        return f"{shape['tflops']:.3g} TFLOP/s"
    if shape.get("tokens_per_s") is not None:
        return f"{shape['tokens_per_s'] / 1e6:.3g}M tok/s"
    return "-"


def key_figures(part: str, record: Mapping[str, object]) -> str:
    """The part's figures in one line, for the overview table."""
    figures = record.get("figures") or {}
    if part == "tests" and "tests" in figures:
        workers = f", {figures['xdist_workers']} xdist workers" if figures.get("xdist_workers") else ""
        partial = (", counted from its progress: it stopped before its junit XML" if figures.get("partial") else
                   ", stopped at its limit: the tests it had not reached are not counted" if figures.get("stopped")
                   else "")
        return (f"{figures['passed']} passed, {figures['failed']} failed, {figures['errors']} errors, "
                f"{figures['skipped']} skipped ({len(figures.get('files', []))} files{workers}{partial})")
    if part == "check" and "checks" in figures:
        done = "checks" if figures.get("summary") else "rows before it stopped"
        return f"{figures['checks']} {done}: {figures['passed']} passed, {figures['failed']} failed"
    if part == "bench" and "shapes" in figures:
        medians = [f"{m['suite']} vs {m['impl']} {_ratio(m['median'])}" for m in figures["medians"]
                   if m["impl"] in ("sdpa", "torch", "torch.nn", "flash_attn", "xformers")]
        partial = " (partial)" if figures.get("partial") else ""
        lengths = f" at L {', '.join(map(str, figures['lengths']))}" if figures.get("lengths") else ""
        return (f"{len(figures['shapes'])} shapes{lengths}{partial}; median speed-up: "
                + (", ".join(medians) or "-"))
    if part == "variants" and figures.get("rows"):
        won = [row for row in figures["rows"] if row["vs_default"] < 1.0]
        return (f"{len(figures['rows'])} verdicts, {len(won)} won by another variant than the default; rows in "
                f"{figures.get('rows_copy') or figures.get('rows_file')}")
    if part == "tune" and figures.get("priors"):
        return f"{figures['rows']} rows in {figures['rows_file']}; {figures['priors']['line']}"
    if part == "tune" and figures.get("rows_file"):
        return f"{figures['rows']} rows in {figures['rows_file']}"
    if part == "graphs" and figures:
        found = []
        graph = figures.get("cuda_graph")
        if graph:
            found.append(f"CUDA graph: {graph['error']}" if "error" in graph else
                         f"CUDA graph replay vs eager max rel. error {graph['max_rel_error']:.2g}"
                         f" ({'ok' if graph['ok'] else 'NOT OK'})")
        determinism = figures.get("determinism")
        if determinism:
            equal = sum(case["equal"] for case in determinism.get("cases", []))
            found.append(determinism.get("error") or
                         f"backward bitwise deterministic in {equal}/{len(determinism['cases'])} cases")
        sdpa = figures.get("sdpa_determinism")
        if sdpa:
            found.append(sdpa.get("error") or "SDPA backward bitwise deterministic: " + _per_backend(sdpa["cases"]))
        memory = figures.get("memory")
        if memory:
            found.append(memory.get("error") or f"memory {memory['verdict']}")
        return "; ".join(found)
    return "-"


def _per_backend(cases: List[dict]) -> str:
    """``cudnn_attention 8/8, flash_attention 8/8``: the cases each SDPA backend ran with equal gradients, of those it
    could run (``n/a`` where it could run none)."""
    counts: Dict[str, List[int]] = {}
    for case in cases:
        ran = counts.setdefault(case["backend"], [0, 0])
        if case["equal"] is not None:
            ran[0] += bool(case["equal"])
            ran[1] += 1
    return ", ".join(f"{name} {equal}/{ran}" if ran else f"{name} n/a" for name, (equal, ran) in counts.items())


# ------------------------------------------------------------------------------------------------- markdown


def _status(record: Mapping[str, object]) -> str:
    return f"{record['status']}: {record['reason']}" if record.get("reason") else str(record["status"])


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _tests_details(figures: Mapping[str, object]) -> List[str]:
    lines = [f"Files: {', '.join(figures.get('files', []))}."]
    if figures.get("missing_files"):
        lines.append(f"Missing from the checkout (not run): {', '.join(figures['missing_files'])}.")
    if figures.get("failures"):
        lines += ["", "Failures and errors:", ""]
        lines += [f"- `{f['name']}` ({f['kind']}): {_cell(f['message'])}" for f in figures["failures"][:40]]
    if figures.get("skip_reasons"):
        lines += ["", "Skipped, by reason:", ""]
        lines += [f"- {s['count']} x {_cell(s['reason']) or '(no reason given)'}" for s in figures["skip_reasons"]]
    return lines


def _check_details(figures: Mapping[str, object]) -> List[str]:
    lines = [f"`{figures['summary']}`" if figures.get("summary") else "No summary line (the check did not finish)."]
    if figures.get("backends"):
        lines += ["", figures["backends"]]
    if figures.get("failing") or figures.get("notes"):
        lines += ["", "```", *figures.get("failing", []), *figures.get("notes", []), "```"]
    return lines


def _bench_details(figures: Mapping[str, object]) -> List[str]:
    lines = ["No CSV was written."] if "csv" not in figures else [
        f"From `{figures['csv']}`{' (partial: the run stopped early)' if figures.get('partial') else ''}. Speed-up = "
        "their ms / our ms (> 1: ours is faster); `refused`: that implementation does not take the shape."]
    tuned = figures.get("tune")
    if tuned:
        lines += ["", f"Route rows (`{tuned['command']}`, {tuned['seconds']:.0f} s, exit status "
                  f"{tuned['exit_status']}): {tuned['rows']} written to `{tuned['path']}`; bench's ours follows them."]
    if figures.get("lengths_left_out"):
        lines += ["", f"Lengths: {', '.join(map(str, figures['lengths']))} only; "
                  f"{', '.join(map(str, figures['lengths_left_out']))} left out, as its time limit would not fit them "
                  "(a larger --budget, or gpu-check --only bench, measures them)."]
    for name, status in figures.get("competitors", {}).items():
        lines.append(f"- {name}: {status}")
    if figures.get("failures"):
        lines += ["", "Failures:", "", *[f"- {_cell(line)}" for line in figures["failures"]]]
    if figures.get("medians"):
        lines += ["", "| suite | against | median | lowest | highest | shapes |", "| --- " * 6 + "|"]
        lines += [f"| {m['suite']} | {m['impl']} | {_ratio(m['median'])} | {_ratio(m['low'])} | {_ratio(m['high'])} "
                  f"| {m['shapes']} |" for m in figures["medians"]]
    suites: Dict[str, List[dict]] = {}
    for shape in figures.get("shapes", []):
        suites.setdefault(shape["suite"], []).append(shape)
    for suite, shapes in suites.items():
        impls = list(dict.fromkeys(impl for shape in shapes for impl in shape["impls"]))
        head_dim = bench_cases.keyed_by_head_dim(suite)  # a column of its own where the cases differ by it
        lines += ["", f"### {suite} ({shapes[0]['dtype']})", "",
                  "| case | mode | L |" + (" D |" if head_dim else "") + " ours ms | ours throughput |"
                  + "".join(f" vs {impl} |" for impl in impls),
                  "| --- " * (5 + head_dim + len(impls)) + "|"]
        for s in shapes:
            ms = f"{s['ours_ms']:.3f}" if s["ours_ms"] is not None else f"FAILED ({_cell(s.get('ours_note', ''))})"
            cells = [_ratio(s["ratios"][impl]) if impl in s["ratios"] else
                     ("FAILED" if "FAILED" in s["left_out"].get(impl, "") else "refused")
                     if impl in s["left_out"] else "-" for impl in impls]
            lines.append(f"| {s['case']} | {s['mode']} | {s['seq_len']} |" + (f" {s['head_dim']} |" if head_dim else "")
                         + f" {ms} | {_rate(s)} |" + "".join(f" {cell} |" for cell in cells))
    return lines


def _measured(title: List[str], figures: Mapping[str, object], render: Callable[[dict], List[str]]) -> List[str]:
    """``title`` and the lines ``render`` makes of a measurement, or why it could not run; nothing when absent."""
    if not figures:
        return []
    return title + ([f"Could not run: {_cell(figures['error'])}"] if "error" in figures else render(figures))


def _graph_lines(graph: dict) -> List[str]:
    same = "bitwise equal to eager" if graph["bitwise_equal"] else (
        f"max relative error {graph['max_rel_error']:.3g} (abs {graph['max_abs_error']:.3g}) in "
        f"`{graph['worst']}`, tolerance {graph['tolerance']:g}")
    return [f"{graph['what']}; optimizer: {graph['optimizer']}.", "",
            f"Replay: {same} over {graph['compared']} tensors: {'ok' if graph['ok'] else 'NOT OK'}."]


def _determinism_lines(determinism: dict) -> List[str]:
    lines = ["| dtype | mask | B, H, L, D | bitwise equal | differing |", "| --- | --- | --- | --- | --- |"]
    return lines + [f"| {c['dtype']} | {c['mask']} | {', '.join(map(str, c['shape']))} | "
                    f"{'yes' if c['equal'] else 'NO'} | {_cell(c.get('error') or ', '.join(c['differing']) or '-')} |"
                    for c in determinism["cases"]]


def _sdpa_determinism_lines(determinism: dict) -> List[str]:
    lines = [f"{determinism['what']}.", "", "| SDPA backend | dtype | mask | B, H, L, D | bitwise equal | differing |",
             "| --- | --- | --- | --- | --- | --- |"]
    return lines + [f"| {c['backend']} | {c['dtype']} | {c['mask']} | {', '.join(map(str, c['shape']))} | "
                    f"{'n/a' if c['equal'] is None else 'yes' if c['equal'] else 'NO'} | "
                    f"{_cell(c.get('error') or ', '.join(c['differing']) or '-')} |" for c in determinism["cases"]]


def _memory_lines(memory: dict) -> List[str]:
    lines = [f"{memory['what']}; extra = peak allocated during the call minus what was allocated before "
             "it (the inputs).", "", "| L | inputs MiB | extra MiB | growth per doubling |",
             "| --- | --- | --- | --- |"]
    for row in memory["rows"]:
        growth = row["growth_per_doubling"]
        lines.append(f"| {row['seq_len']} | {row['inputs_mib']:.1f} | {row['extra_mib']:.1f} | "
                     f"{'-' if growth is None else f'x{growth:.2f}'} |")
    return lines + ["", f"Verdict: {memory['verdict']}."]


def _graphs_details(figures: Mapping[str, object]) -> List[str]:
    return (_measured(["### CUDA graph of a training step", ""], figures.get("cuda_graph"), _graph_lines)
            + _measured(["", "### Determinism of the attention backward", ""], figures.get("determinism"),
                        _determinism_lines)
            + _measured(["", "### Determinism of SDPA's backward (for the attention route)", ""],
                        figures.get("sdpa_determinism"), _sdpa_determinism_lines)
            + _measured(["", "### Peak memory against L", ""], figures.get("memory"), _memory_lines))


def _variants_details(figures: Mapping[str, object]) -> List[str]:
    rows = figures.get("rows") or []
    if not rows:
        return []
    lines = ["", "| op | shape | winner | its time / the default's | vendor's time / its time | vendor |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['op']} | {row['shape']} | {row['variant']} | {row['vs_default']:.3f} | {row['vs_vendor']:.3f} "
              f"| {row['vendor']} |" for row in rows]
    return lines + ["", f"Provenance: {rows[0]['provenance']}."]


def _tune_details(figures: Mapping[str, object]) -> List[str]:
    if not figures.get("rows_file"):
        return ["`tune` wrote no rows."]
    lines = [f"{figures['rows']} route rows measured on this GPU in `{figures['rows_file']}` (not the user's cache: "
             "`python -m fused_transformer tune` keeps them there)."]
    found = figures.get("priors")
    if found:
        lines += ["", f"{found['line']}: each row against the table {found['device']} ran under before, call by call, "
                  f"in `{found['priors_md']}`."]
    return lines


DETAILS: Dict[str, Callable[[Mapping[str, object]], List[str]]] = {
    "variants": _variants_details, "tests": _tests_details, "check": _check_details, "bench": _bench_details,
    "graphs": _graphs_details, "tune": _tune_details}


def describe_run(run: Optional[Mapping[str, object]]) -> Optional[str]:
    """This invocation's parts, its budget and its wall time, in one sentence; None when nothing ran."""
    if not run or not (run.get("side_by_side") or run.get("alone")):
        return None
    side, alone = run["side_by_side"], [part for part in run["alone"] if part != "variants"]
    phases = []
    if run.get("variants_limit_s"):
        phases.append(f"variants first, alone on the GPU, within {run['variants_limit_s']:.0f} s")
    if side:
        each = " side by side, each" if len(side) > 1 else ""
        phases.append(f"{', '.join(side)}{each} within {run['side_by_side_limit_s']:.0f} s")
    for i, part in enumerate(alone):
        share = run.get(f"{part}_share_s")
        share = f" (its share {share:.0f} s, and what they left)" if share and (side or i) else ""
        phases.append(f"{'then ' if side or i else ''}{part} alone on the GPU{share}")
    return (f"This run: {'; '.join(phases)}. Wall time {run['wall_s']:.0f} s of its {run['budget_s']:.0f} s "
            "budget.")


def _wall_time(record: Mapping[str, object]) -> str:
    if record.get("duration_s") is None or record.get("limit_s") is None:
        return "-"
    return f"{record['duration_s']:.0f} s of {record['limit_s']:.0f} s"


def priors_line(parts: Mapping[str, dict]) -> Optional[str]:
    """The tune part's verdict on the priors (``priors.counts_line``), None where it made none."""
    found = ((parts.get("tune") or {}).get("figures") or {}).get("priors")
    return f"{found['line']}; per call in `{found['priors_md']}`." if found else None


def render_markdown(summary: Mapping[str, object]) -> str:
    environment = summary["environment"]
    parts: Mapping[str, dict] = summary["parts"]
    run = describe_run(summary.get("run"))
    lines = ["# gpu-check summary", "", f"**{summary['verdict']}**", "",
             f"Written {summary['generated']} by `python -m fused_transformer gpu-check` on "
             f"{describe_environment(environment)}.", *(["", run] if run else []),
             *(["", priors_line(parts)] if priors_line(parts) else []), "",
             "| part | status | wall time | key figures |", "| --- | --- | --- | --- |"]
    for part, record in parts.items():
        lines.append(f"| {part} | {_cell(_status(record))} | {_wall_time(record)} | {_cell(record['key_figures'])} |")
    for part, record in parts.items():
        if record["status"] == NOT_RUN and not record.get("figures"):
            continue
        section = [f"## {part}: {record['status']}", ""]
        ran = record.get("environment") or {}
        if record.get("started"):
            elsewhere = ran.get("device") != environment.get("device")
            section += [f"Started {record['started']}" + (f" on {describe_environment(ran)}" if elsewhere else "")
                        + (f", {record['phase']}" if record.get("phase") else "")
                        + (f"; wall time {_wall_time(record)}" if record.get("duration_s") is not None else "")
                        + (f"; command `{record['command']}`" if record.get("command") else "") + ".", ""]
        if record.get("limit_note"):
            section += [f"Time limit: {record['limit_note']}.", ""]
        if record.get("figures"):
            section += [*DETAILS[part](record["figures"]), ""]
        if record["status"] != PASSED and record.get("output_tail"):
            tail = record["output_tail"].rstrip().splitlines()[-TAIL_LINES:]
            section += [f"Last lines of its output (all of it in `{part}.log`):", "", "```", *tail, "```"]
        while section[-1] == "":
            section.pop()
        lines += ["", *section]
    return "\n".join(lines) + "\n"


def write_summary(out: str, environment: dict, missing_reason: Callable[[str], str],
                  run: Optional[dict] = None) -> dict:
    """Rebuild ``summary.json`` and ``summary.md`` in ``out`` from every part record there (``run``: this
    invocation's, as ``build_summary`` takes it); return the summary."""
    summary = build_summary(load_records(out), environment, missing_reason, run)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(render_markdown(summary))
    return summary
