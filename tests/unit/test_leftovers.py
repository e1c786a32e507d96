"""`dcs clean`'s survey of the older layout (everything directly in /dev/shm), on a directory standing in for it:
this user's leftovers of gone processes are found, a live process's and another user's never are."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import UnsafeHostDirectory
from dcs_tasks.local import leftovers

NOBODY = 65534


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_the_older_layouts_leftovers_are_found_and_only_this_users(tmp_path: Path) -> None:
    shm, runtime = tmp_path / "shm", tmp_path / "runtime"
    shm.mkdir()
    runtime.mkdir(mode=0o700)
    dead, alive = _dead_pid(), os.getpid()
    gone = shm / f"dcs-dcs-exp1-{dead}-0123abcd-0.stage"
    gone.write_bytes(b"x" * 8192)
    live = shm / f"dcs-dcs-exp1-{alive}-0123abcd-1.stage"
    live.write_bytes(b"x")
    others = shm / f"dcs-dcs-exp1-{dead}-0123abcd-2.stage"
    others.write_bytes(b"x")
    if os.geteuid() == 0:
        os.chown(others, NOBODY, NOBODY)
    stale_socket = shm / "dcs-agent-0123456789abcdef.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale_socket))
    sock.close()  # nobody listens on it any more
    (shm / "dcs-memory" / ".recycle").mkdir(parents=True)
    (shm / "dcs-memory" / ".recycle" / "f").write_bytes(b"y" * 4096)
    config = DCSConfig(runtime_dir=runtime)

    found = leftovers.survey(config, legacy_shm=shm, temp_dir=tmp_path)

    paths = {item.path for item in found.found}
    assert paths == {gone, stale_socket, shm / "dcs-memory"}
    assert (live, f"its trainer, pid {alive}, is running") in found.kept
    assert found.nbytes >= 8192 + 4096
    assert {item.path for item in leftovers.remove(found.found)} == paths
    assert not gone.exists() and not stale_socket.exists() and not (shm / "dcs-memory").exists()
    assert live.exists() and others.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user's")
def test_another_users_runtime_directory_is_refused_not_cleaned(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, NOBODY, NOBODY)
    with pytest.raises(UnsafeHostDirectory):
        leftovers.survey(DCSConfig(runtime_dir=runtime), temp_dir=tmp_path)
