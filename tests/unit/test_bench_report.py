"""bench/harness.py's result file and bench/report.py's tables, run as the scripts are (`python ...` from the
repository root, in processes of their own), on result files written into a temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RECORD = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from bench.harness import Row, Run
run = Run({name!r})
run.started = run.started.replace(day={day})
rows = [Row(what="thing", ours="1.0 s", compared="limit 0.9 s", ratio={ratio}, ratio_text="{ratio}x the limit",
            target=">= 0.95x", met={ratio} >= 0.95)] if {rows} else []
run.record({{"seconds": 1.0}}, rows, out=Path({out!r}), headline="{ratio}x the limit")
"""


def _record(results: Path, name: str, day: int, ratio: float, rows: bool = True) -> Path:
    out = results / name / f"202612{day:02d}T000000Z.json"
    code = RECORD.format(repo=str(REPO), name=name, day=day, ratio=ratio, rows=rows, out=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60, capture_output=True)
    return out


def _report(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "bench/report.py", "--results", str(tmp / "results"), "--doc", str(tmp / "docs" / "b.md")]
    cmd += ["--readme", str(tmp / "README.md"), *args]
    return subprocess.run(cmd, cwd=REPO, timeout=60, capture_output=True, text=True)


def test_a_run_writes_its_command_load_and_rows_and_the_report_tables_the_newest(tmp_path: Path) -> None:
    results = tmp_path / "results"
    first = _record(results, "alpha", 1, 0.9)
    _record(results, "alpha", 2, 0.97)
    _record(results, "alpha", 3, 0.5, rows=False)  # newest, but no summary: not tabled
    _record(results, "beta", 1, 1.2)
    doc = json.loads(first.read_text())
    assert doc["format"] == 1 and doc["benchmark"] == "alpha" and doc["command"].startswith("python -c")
    assert len(doc["machine"]["load_before"]) == 3 and len(doc["machine"]["load_after"]) == 3
    assert doc["started"].startswith("2026-12-01") and doc["summary"][0]["met"] is False
    assert doc["figures"] == {"seconds": 1.0} and "head" in doc["commit"]
    (tmp_path / "docs").mkdir()
    doc = "# B\n\n<!-- bench-report:begin -->\nold\n<!-- bench-report:end -->\ntail\n"
    (tmp_path / "docs" / "b.md").write_text(doc)
    (tmp_path / "README.md").write_text("x\n<!-- bench-readme:begin -->\n<!-- bench-readme:end -->\ny\n")

    assert _report(tmp_path, "--check").returncode == 1  # stale before the first build
    built = _report(tmp_path)
    assert built.returncode == 0, built.stderr
    table = (tmp_path / "docs" / "b.md").read_text()
    assert "old" not in table and table.endswith("tail\n")
    alpha = [line for line in table.splitlines() if line.startswith("| alpha")]
    assert len(alpha) == 1 and "0.97x the limit" in alpha[0] and ">= 0.95x: met" in alpha[0]
    assert "(../results/alpha/20261202T000000Z.json)" in alpha[0]  # the run's file, linked from the doc
    readme = (tmp_path / "README.md").read_text()
    assert "| `alpha` | 0.97x the limit | 1 of 1 | 2026-12-02 " in readme  # the run's date, time and load follow
    assert "| `beta` | 1.2x the limit | 1 of 1 | 2026-12-01 " in readme and ", load " in readme
    assert _report(tmp_path, "--check").returncode == 0

    picked = _report(tmp_path, "--pick", "alpha=20261201T000000Z")
    assert picked.returncode == 0
    assert "| `alpha` | 0.9x the limit | 0 of 1 | 2026-12-01 " in (tmp_path / "README.md").read_text()
