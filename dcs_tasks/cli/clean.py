"""`dcs clean`: remove what DCS left on this host (dcs_tasks/local/leftovers.py), printing each path and its bytes.

Refuses (exit 1, `HostBusy`, naming the processes) while a `dcs worker`, `dcs up` or `dcs demo` of this user runs
on the directories it would clean; a running trainer's staging files and anything a process holds open or maps
are kept and listed. `--dry-run` lists without removing. Only this user's files are looked at.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from dcs_tasks import hostdirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import HostBusy, UnsafeHostDirectory
from dcs_tasks.local import leftovers


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "clean", help="remove DCS's leftovers on this host (staging, memory tier, sockets, metrics directories)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    parser.add_argument(
        "--memory-steps",
        action="store_true",
        help="also remove the memory tier's committed steps (restorable ones: a trainer restarted here reads them)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = DCSConfig()
    legacy = leftovers.LEGACY_SHM if hostdirs.runtime_path(config) == config.default_runtime_dir() else None
    try:
        busy = leftovers.services_using(config, legacy is not None)
        if busy:
            raise HostBusy(
                "DCS processes of this user run on these directories: "
                + "; ".join(f"pid {pid}: {command}" for pid, command in busy)
                + ". Stop them first (Ctrl-C in `dcs up`, SIGTERM to `dcs worker`), then run `dcs clean` again"
            )
        found = leftovers.survey(
            config, memory_steps=args.memory_steps, legacy_shm=legacy, temp_dir=Path(tempfile.gettempdir())
        )
    except (HostBusy, UnsafeHostDirectory) as exc:
        print(f"dcs clean: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return _report(found, dry_run=args.dry_run)


def _report(found: leftovers.Survey, dry_run: bool) -> int:
    for path, why in found.kept:
        print(f"kept     {path}  ({why})")
    done = found.found if dry_run else leftovers.remove(found.found)
    verb = "would remove" if dry_run else "removed"
    for item in done:
        print(f"{verb:<8} {item.path}  {_size(item.nbytes)}  ({item.what})")
    failed = [item for item in found.found if item not in done]
    for item in failed:
        print(f"failed   {item.path}  (could not be removed)", file=sys.stderr)
    total = sum(item.nbytes for item in done)
    print(f"dcs clean: {verb} {len(done)} leftovers, {total} bytes ({_size(total)}); kept {len(found.kept)}")
    return 1 if failed else 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
