"""A test's private directory in /dev/shm (staging buffers, the memory tier), removed after it by the autouse
fixture in tests/conftest.py.

Named after the test's `tmp_path`, whole: pytest truncates a test's name to 30 characters and numbers it per
xdist worker, so two parametrizations of one test running at once on two workers share `tmp_path.name`; a
name built from that alone let one test write into, and its cleanup remove, the other's buffers."""

from __future__ import annotations

import hashlib
from pathlib import Path

SHM = Path("/dev/shm")


def shm_dir(tmp_path: Path) -> Path:
    """`/dev/shm/dcs-test-<name>-<hash of the whole path>` for the test whose temporary directory is `tmp_path`."""
    digest = hashlib.sha1(str(tmp_path.resolve()).encode()).hexdigest()[:8]
    return SHM / f"dcs-test-{tmp_path.name}-{digest}"
