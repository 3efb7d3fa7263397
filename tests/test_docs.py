"""The documentation holds: every figure in docs/ comes from a command, and its page says which, when, where and from
which commit (the pages are refreshed on purpose, not held to today's sources); every relative link leads somewhere;
README keeps the two commands CI runs."""
import datetime
import pathlib
import re
import subprocess
import sys

import pytest

from fused_transformer.tools import provenance

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Generated page -> how the command that wrote it starts. tests/test_report.py and tests/test_bench.py run each
# command on a small case and read the header it writes.
GENERATED = {
    "docs/report.md": "report --markdown docs/report.md",
    "docs/bench/bench_cpu.md": "bench --out docs/bench",
    "docs/bench/bench_cuda.md": "bench --device cuda",
}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("page", list(GENERATED))
def test_generated_pages_name_their_command_date_machine_versions_and_commit(page):
    header = provenance.parse_header((ROOT / page).read_text().splitlines()[2])
    assert header is not None, f"{page}'s third line is not a header provenance.header writes"
    assert header["command"].startswith(GENERATED[page]), header["command"]
    assert datetime.date.fromisoformat(header["date"]) <= datetime.date.today()
    assert header["machine"] and header["torch"] and header["triton"] and header["python"]
    if "cuda" in header["command"]:
        assert header["machine"].startswith("NVIDIA "), "a GPU page names its GPU"
    assert header["commit"] != "unknown", "a page in the checkout names the commit it measured"
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "false":
        assert _git("merge-base", "--is-ancestor", header["commit"], "HEAD").returncode == 0, (
            f"{page} names commit {header['commit']}, which is not in this branch's history")


def _markdown_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{page.name} links {target}: no such heading"


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert commands[:2] == [
        'pip install torch==2.13.0 setuptools wheel ninja && pip install --no-build-isolation -e ".[test]" && '
        "python -m fused_transformer",
        'pip install torch==2.13.0 setuptools wheel ninja && pip install --no-build-isolation -e ".[test]" && '
        "python -m pytest tests -q -n auto --dist loadfile",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci
    assert "python -m pytest tests -q --quick -n auto --dist loadfile" in commands[2:], "the development quick check"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", (ROOT / "README.md").read_text()))))
def test_readme_python_snippets_run_as_pasted(index, tmp_path):
    """Each README snippet runs on its own in a fresh interpreter (outside the checkout, as a user's script)."""
    snippet = re.findall(r"```python\n(.+?)```", (ROOT / "README.md").read_text(), re.S)[index]
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README snippet {index + 1}:\n{snippet}\n{proc.stderr[-3000:]}"
