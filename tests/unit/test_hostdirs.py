"""`dcs_tasks.hostdirs`: what a private host-local directory is, and what DCS does with one that is not (refuses
it, naming the path, the problem and the fix; never changes it). `nobody` owns the foreign ones."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from dcs_tasks import hostdirs
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import UnsafeHostDirectory
from tests.helpers.localuser import NOBODY


def test_a_missing_directory_is_made_0700_with_its_parents(tmp_path: Path) -> None:
    made = hostdirs.ensure_private_dir(tmp_path / "a" / "b")
    for path in (tmp_path / "a", made):
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


@pytest.mark.parametrize(
    ("prepare", "problem"),
    [
        (lambda p: (p.mkdir(), os.chmod(p, 0o777)), "has mode 0777"),
        (lambda p: (p.mkdir(), os.chmod(p, 0o750)), "has mode 0750"),
        (lambda p: (p.mkdir(0o700), os.chown(p, NOBODY, -1)), f"is owned by uid {NOBODY}"),
        (lambda p: p.symlink_to(p.parent), "is a symlink"),
        (lambda p: p.write_bytes(b""), "is not a directory"),
    ],
    ids=["world-writable", "group-readable", "foreign-owner", "symlink", "file"],
)
def test_an_unsafe_directory_is_refused_and_left_as_it_is(tmp_path: Path, prepare: object, problem: str) -> None:
    path = tmp_path / "dir"
    prepare(path)  # type: ignore[operator]
    before = os.lstat(path)
    with pytest.raises(UnsafeHostDirectory, match=problem) as caught:
        hostdirs.ensure_private_dir(path)
    message = str(caught.value)
    assert str(path) in message and "Remove it" in message and "DCS_RUNTIME_DIR" in message
    after = os.lstat(path)
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)  # never chmod-ed or adopted


def test_a_trusted_uid_may_own_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    path.mkdir(0o700)
    os.chown(path, NOBODY, -1)
    config = DCSConfig(runtime_dir=path, host_trusted_uid=NOBODY)
    assert hostdirs.private_root(config) == path
    with pytest.raises(UnsafeHostDirectory):
        hostdirs.private_root(DCSConfig(runtime_dir=path))


def test_defaults_follow_the_runtime_dir_and_are_checked(tmp_path: Path) -> None:
    root = tmp_path / "run"
    config = DCSConfig(runtime_dir=root)
    assert (config.host.staging_dir, config.host.memory_dir) == (root / "staging", root / "memory")
    assert DCSConfig().host.runtime_dir == Path(f"/dev/shm/dcs-{os.geteuid()}")
    assert hostdirs.staging_dir(config) == root / "staging" and not root.exists()  # not made unless asked
    assert hostdirs.memory_dir(config, create=True) == root / "memory"
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    os.chmod(root, 0o777)  # the runtime directory itself opened up: what lies under it is refused too
    with pytest.raises(UnsafeHostDirectory, match=f"{root} has mode 0777"):
        hostdirs.staging_dir(config, create=True)
    explicit = config.model_copy(update={"staging_dir": tmp_path / "elsewhere"})
    assert hostdirs.staging_dir(explicit, create=True) == tmp_path / "elsewhere"


def test_check_socket_tells_ours_from_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    assert hostdirs.check_socket(path) is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
    assert hostdirs.check_socket(path) is True
    os.chown(path, NOBODY, -1)
    with pytest.raises(UnsafeHostDirectory, match=f"socket owned by uid {NOBODY}"):
        hostdirs.check_socket(path)
    path.unlink()
    path.symlink_to(tmp_path)
    with pytest.raises(UnsafeHostDirectory, match="symlink"):
        hostdirs.check_socket(path)


def test_try_lock_is_exclusive_and_survives_a_removed_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    held = hostdirs.try_lock(path)
    assert held is not None and hostdirs.try_lock(path) is None  # flock is per open file: a second open waits
    path.unlink()  # the holder removes the file before it lets go
    again = hostdirs.try_lock(path)  # a new file: a new lock
    assert again is not None
    os.close(held)
    os.close(again)
