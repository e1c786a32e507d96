"""Names of the Prometheus multiprocess directories `dcs worker` makes, and finding those of gone workers.

Each worker process tree writes its samples to a directory of its own under the system temp dir (made by
`workers/prometheus.py`): `dcs-prometheus-<namespace>-<host>-<pid>-<8 random characters>`, mode 0700. A worker
removes its own at exit; one killed leaves it, and the next worker's start or `dcs clean` removes it. The
directory of an older release, `dcs-prometheus-<namespace>-<host>` (shared by every worker of the host), has no
pid: only `dcs clean` removes it. Imports nothing of prometheus_client (a worker names its directory before that
import).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from dcs_tasks.process import pid_alive

PREFIX = "dcs-prometheus-"
OWN_NAME = re.compile(r"dcs-prometheus-.+-(\d+)-[A-Za-z0-9_]{8}")  # ...-<pid>-<mkdtemp's 8 characters>
MAX_LISTED = 4096  # entries of the temp dir looked at, at most


def gone_workers_dirs(base: Path, legacy: bool = False) -> list[Path]:
    """The worker directories under `base` whose worker is gone: this user's own real directories named like
    `workers/prometheus.py` names them, of a pid that no longer exists; with `legacy`, also those of the older
    shared form (whose worker cannot be told: the caller knows that none runs)."""
    found: list[Path] = []
    for index, path in enumerate(base.glob(f"{PREFIX}*")):
        if index >= MAX_LISTED:
            break
        own = OWN_NAME.fullmatch(path.name)
        if own is not None and pid_alive(int(own.group(1))):
            continue
        if own is None and not legacy:
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            found.append(path)
    return found
