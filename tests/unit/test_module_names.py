"""No two product modules share a name, except the kinds docs/architecture.md (Module names) keeps on purpose."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dcs_tasks", "coordinator", "workers", "plugins/vllm-dcs/vllm_dcs")


def _kept(path: Path) -> bool:
    """A module whose name may repeat another's: a service's `cli.py`, a module of `dcs_tasks/cli/` or
    `coordinator/routes/` (named by the command or URL it serves), the vLLM plugin's own copies."""
    rel = path.relative_to(ROOT).as_posix()
    return path.name in ("__init__.py", "cli.py") or rel.startswith(
        ("dcs_tasks/cli/", "coordinator/routes/", "plugins/")
    )


def test_product_module_names_do_not_collide() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts or "build" in path.relative_to(ROOT / package).parts:
                continue
            if not _kept(path):
                seen[path.name].append(path.relative_to(ROOT).as_posix())
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"module names used twice (rename one, or see docs/architecture.md, Module names): {clashes}"


def test_the_scan_sees_the_product() -> None:
    """The check above looks at every package (a wrong root would pass it vacuously)."""
    counts = {package: sum(1 for _ in (ROOT / package).rglob("*.py")) for package in PACKAGES}
    assert counts["dcs_tasks"] > 100 and all(counts.values()), counts
