"""docs/troubleshooting.md names every error DCS raises on purpose, with what to do: each `DCSError` subclass of
dcs_tasks/errors.py (and the few defined beside the code that raises them) has a row there."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from dcs_tasks import errors
from dcs_tasks.checkpoint.state.dtensor_meta import UnsupportedPlacement
from dcs_tasks.interop.foreign import ForeignCheckpointError
from dcs_tasks.local.procs import LocalStackError

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
ELSEWHERE = (UnsupportedPlacement, ForeignCheckpointError, LocalStackError)


def _rows() -> dict[str, list[str]]:
    """Error name -> the row's cells after the name (what it means, what to do)."""
    rows: dict[str, list[str]] = {}
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        named = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 3 else None
        if named:
            rows[named.group(1)] = cells[1:]
    return rows


def test_every_named_error_has_a_row_saying_what_it_means_and_what_to_do() -> None:
    defined = [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.DCSError) and cls.__module__ == errors.__name__
    ]
    rows = _rows()
    missing = sorted(cls.__name__ for cls in (*defined, *ELSEWHERE) if cls.__name__ not in rows)
    assert missing == [], f"errors not on docs/troubleshooting.md: {missing}"
    empty = sorted(name for name, cells in rows.items() if not all(len(cell) > 10 for cell in cells))
    assert empty == [], f"rows without a meaning or a fix: {empty}"
