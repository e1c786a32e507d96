"""The user docs (README.md and docs/*.md) describe the product as it is, not the project's history: no issue
numbers, no dated runs, no "measured here" or "run here" lines. Dated measurements belong in docs/benchmarks.md
(and the README's benchmark table, which bench/report.py generates from bench/results/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NARRATION = re.compile(
    r"\bissue \d+|\bissue #\d+|\b20\d\d-\d\d-\d\d\b|\bmeasured here\b|\b[Nn]ot run here\b|\bRun here\b|"
    r"\bwhat was run here\b|\bthe earlier run\b|\bstop \d+\b"
)
GENERATED = re.compile(r"<!-- bench-readme:begin -->.*?<!-- bench-readme:end -->", re.S)


def test_user_docs_hold_no_issue_numbers_dates_or_run_here_lines() -> None:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name == "benchmarks.md":
            continue
        text = GENERATED.sub("", path.read_text())
        for number, line in enumerate(text.splitlines(), 1):
            if NARRATION.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    assert found == [], "project-log lines in the user docs (move measurements to docs/benchmarks.md):\n" + "\n".join(
        found
    )
