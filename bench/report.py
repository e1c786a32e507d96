"""The benchmark tables of docs/benchmarks.md and README.md, built from the result files in bench/results/.

Every bench script writes one file per run (bench/harness.py `Run`): bench/results/<benchmark>/<UTC start>.json
with the command, the dates, the machine's load average, the figures and `summary` rows (what was measured,
DCS's figure, the contender's in the same run, the ratio, the target and whether it was met). This script takes,
per benchmark, the newest run that has summary rows (or the one `--pick BENCHMARK=FILE` names) and writes
  docs/benchmarks.md   between the `bench-report` markers: every row, with its run (date, load, command)
  README.md            between the `bench-readme` markers: one short line per benchmark
Runs without summary rows (older scripts, or a run that printed only figures) are listed by `--list`.

    python bench/report.py             # rewrite both tables
    python bench/report.py --check     # exit 1 if either table differs from what the result files give
    python bench/report.py --list      # every run, newest first
Only result files git tracks count (commit a run's file to table it), unless --untracked.

A new benchmark needs nothing here: a script that records rows with `Run(...).record(figures, rows)` appears.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
MARKERS = {"doc": "bench-report", "readme": "bench-readme"}
# the order of the tables; benchmarks not named here follow in alphabetical order
ORDER = (
    "save", "dcp_writer", "storage", "weight_sync", "http_roundtrip", "reshard", "incremental", "replica",
    "compression", "coordinator_load", "fleet_heartbeats", "task_latency",
)  # fmt: skip


@dataclass
class Result:
    path: Path
    doc: dict[str, Any]

    @property
    def benchmark(self) -> str:
        return str(self.doc.get("benchmark") or self.path.parent.name)

    @property
    def started(self) -> str:
        return str(self.doc.get("started", ""))

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self.doc.get("summary") or [])

    def when(self) -> str:
        """'2026-12-02 01:58 UTC, load 1.3 -> 2.9'."""
        start = self.started.replace("T", " ")[:16]
        machine = self.doc.get("machine") or {}
        before, after = machine.get("load_before"), machine.get("load_after")
        load = ""
        if before and after:
            load = f", load {before[0]:.1f} -> {after[0]:.1f}"
        elif machine.get("load"):
            load = f", load {machine['load']}"
        return f"{start} UTC{load}"

    def link(self, base: Path) -> str:
        """A markdown link to the result file from the document `base`."""
        return f"[{self.path.stem}]({Path(os.path.relpath(self.path, base.parent)).as_posix()})"


def tracked(results: Path) -> set[Path] | None:
    """The result files git tracks under `results` (None: not in a git work tree, every file counts)."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--", "."], cwd=results, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {(results / name).resolve() for name in listing.stdout.split("\0") if name}


def load(results: Path, untracked: bool = False) -> list[Result]:
    """Result files of format 1 under `results`; in a git work tree only those git tracks unless `untracked`
    (the tables cite committed runs)."""
    found = []
    known = None if untracked else tracked(results)
    for path in sorted(results.glob("*/*.json")):
        if known is not None and path.resolve() not in known:
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"skipped {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(doc, dict) and doc.get("format") == 1:
            found.append(Result(path, doc))
    return found


def chosen(results: list[Result], picks: dict[str, str]) -> list[Result]:
    """Per benchmark the picked run, else the newest with summary rows; in ORDER."""
    best: dict[str, Result] = {}
    for result in results:
        name = result.benchmark
        if name in picks:
            if result.path.name == picks[name] or result.path.stem == picks[name]:
                best[name] = result
            continue
        if result.rows and (name not in best or result.started > best[name].started):
            best[name] = result
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(best.values(), key=lambda r: (rank.get(r.benchmark, len(ORDER)), r.benchmark))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _met(row: dict[str, Any]) -> str:
    met = row.get("met")
    target = row.get("target") or ""
    if not target:
        return "reported"
    return f"{target}: {'met' if met else 'not met' if met is not None else 'not judged'}"


def doc_table(picked: list[Result], base: Path = DOC) -> str:
    lines = [
        "| benchmark | measured | DCS | compared in the same run | ratio | target | run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in picked:
        run = f"{result.when()}; `{_cell(result.doc.get('command', ''))}`; {result.link(base)}"
        for row in result.rows:
            ratio = row.get("ratio_text") or (f"{row['ratio']:.2f}" if row.get("ratio") is not None else "")
            cells = [result.benchmark, row.get("what", ""), row.get("ours", ""), row.get("compared", ""), ratio]
            lines.append("| " + " | ".join(_cell(c) for c in [*cells, _met(row), run]) + " |")
    return "\n".join(lines)


def readme_table(picked: list[Result]) -> str:
    """One short line per benchmark: the run's headline (else its first row's ratio) and how many targets it met."""
    lines = ["| benchmark | result, against a contender in the same run | targets met | run |"]
    lines.append("| --- | --- | --- | --- |")
    for result in picked:
        headline = result.doc.get("headline") or result.rows[0].get("ratio_text") or result.rows[0].get("ours", "")
        judged = [row for row in result.rows if row.get("target") and row.get("met") is not None]
        targets = [row for row in result.rows if row.get("target")]
        met = (
            f"{sum(bool(row['met']) for row in judged)} of {len(judged)}"
            if judged
            else "not judged"
            if targets
            else "reported"
        )
        cells = [f"`{result.benchmark}`", headline, met, result.when().replace(" UTC", "")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def replaced(text: str, marker: str, table: str) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"markers {begin} / {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--pick", action="append", default=[], help="BENCHMARK=FILE: that run instead of the newest")
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is not what the result files give")
    parser.add_argument("--list", action="store_true", help="every run, newest first")
    parser.add_argument("--untracked", action="store_true", help="also result files git does not track (yet)")
    args = parser.parse_args()
    results = load(args.results, args.untracked)
    if args.list:
        for result in sorted(results, key=lambda r: r.started, reverse=True):
            rows = len(result.rows)
            print(f"{result.benchmark:18s} {result.when():40s} {rows} rows  {os.path.relpath(result.path)}")
        return 0
    picks = dict(pick.split("=", 1) for pick in args.pick)
    picked = chosen(results, picks)
    stale = []
    for path, marker, table in (
        (args.doc, MARKERS["doc"], doc_table(picked, args.doc)),
        (args.readme, MARKERS["readme"], readme_table(picked)),
    ):
        text = path.read_text()
        new = replaced(text, marker, table)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("not what bench/results/ gives (run python bench/report.py): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
