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
