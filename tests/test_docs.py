"""The docs that can drift from the code: the generated flag reference, the README's test command
(the same line as .ci/run's) and the links between the pages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gen_server_args_doc as gen

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_server_args_doc.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_flag_reference_is_what_the_parser_defines_now() -> None:
    assert (ROOT / "docs" / "server_args.md").read_text() == gen.render(), (
        "docs/server_args.md is stale: run `python scripts/gen_server_args_doc.py`"
    )


def test_flag_reference_names_every_flag_with_its_default() -> None:
    page = gen.render()
    assert "| `--tp-size`, `--tp` | `1` | integer |" in page
    assert "| `--schedule-policy` | `fcfs` | `fcfs`, `lpm` |" in page
    assert "| `--cpu-kvcache-space` | none, or `VLLM_CPU_KVCACHE_SPACE` | number |" in page
    assert "| `--enable-metrics` | off | switch | serve Prometheus metrics on GET /metrics |" in page


def test_check_exits_1_on_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "server_args.md"
    page.write_text(gen.render().replace("`--tp-size`", "`--tp-sise`"))

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--check", "--out", str(page)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    stale = check()
    assert stale.returncode == 1 and "stale" in stale.stderr
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(page)], check=True, timeout=120)
    assert check().returncode == 0


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if line.endswith("python -m pytest -q"))
    assert f"\n{command}\n" in (ROOT / "README.md").read_text()


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {gen.anchor(title) for title in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_point_at_pages_and_headings_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists() or (fragment and fragment not in _anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{fragment}")
    assert not broken, broken


# docs/performance.md is one table per machine, one row per figure, replaced when it is measured
# again (issue 59); the history is git's and docs/performance-log.md's.
PERFORMANCE = ROOT / "docs" / "performance.md"
PERFORMANCE_MAX_LINES = 200
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_DATE = re.compile(rf"\b(?:19|20)\d\d\b|\b\d{{1,2}}-\d{{1,2}}\b|\b(?:{_MONTHS})\b", re.I)


def _headings(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [line for line in text.splitlines() if line.startswith("#")]


def _dated_headings(text: str) -> list[str]:
    return [line for line in _headings(text) if _DATE.search(line)]


def _rows_without_a_script(text: str) -> list[str]:
    """The table rows (header and separator rows aside) whose last cell names no file of scripts/."""
    scripts = {path.name for path in (ROOT / "scripts").iterdir() if path.is_file()}
    bare = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        separator = re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip())
        header = i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
        if separator or header:
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not any(re.search(rf"(?<![\w.-]){re.escape(name)}\b", cells[-1]) for name in scripts):
            bare.append(line)
    return bare


def test_performance_page_fits_on_a_few_screens() -> None:
    lines = len(PERFORMANCE.read_text().splitlines())
    assert lines <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {lines} lines (at most {PERFORMANCE_MAX_LINES}): replace a figure "
        "in its machine's table; history goes to git and docs/performance-log.md"
    )


def test_performance_page_has_no_dated_heading() -> None:
    dated = _dated_headings(PERFORMANCE.read_text())
    assert not dated, f"a date belongs in a table cell, not a heading of docs/performance.md: {dated}"


def test_every_performance_row_names_its_script() -> None:
    bare = _rows_without_a_script(PERFORMANCE.read_text())
    assert not bare, f"rows of docs/performance.md whose last cell names no file of scripts/: {bare}"


def test_the_checks_catch_a_dated_section_and_a_row_without_a_script() -> None:
    page = "# Performance\n\n## Mixtures of experts (AMD Zen 4, 2026-12-04)\n\n### Later (12-05)\n\n"
    page += "| figure | value | script |\n|---|---|---|\n| decode | 9.76 ms | `bench_one_batch.py` |\n"
    page += "| prefill | 1504 tok/s | by hand |\n| served | 423.6 | `scripts/compare_peers.py --rounds 3` |\n"
    assert len(_dated_headings(page)) == 2
    assert _rows_without_a_script(page) == ["| prefill | 1504 tok/s | by hand |"]
    assert not _dated_headings("# Performance\n## AMD Zen 4\n## GPU: one H200\n")
