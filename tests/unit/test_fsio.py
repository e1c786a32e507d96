"""Durable writes (`dcs_tasks.checkpoint.store.writes.durable`): a final name only ever shows complete bytes, even
when two writers with the same tag overlap (a redelivered Celery task keeps its task id, which is the tag)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks.checkpoint.store.writes.durable import TEMP_GLOB, durable_file, write_all, write_bytes_durably

DATA = bytes(range(256)) * 1024  # 256 KiB
CHUNK = 64 * 1024


def test_overlapping_writers_with_one_tag_never_publish_a_short_file(tmp_path: Path) -> None:
    final = tmp_path / "model-00001-of-00001.safetensors"
    first, second = durable_file(final, "task-1"), durable_file(final, "task-1")
    fd = first.__enter__()
    write_all(fd, memoryview(DATA))  # the first delivery has written everything...
    late = second.__enter__()  # ...when a redelivery of the same task starts and writes one chunk
    write_all(late, memoryview(DATA[:CHUNK]))
    assert len(list(tmp_path.glob(TEMP_GLOB))) == 2  # each writer has a temp file of its own
    first.__exit__(None, None, None)  # the first delivery renames its file: it must be whole
    assert final.read_bytes() == DATA
    write_all(late, memoryview(DATA[CHUNK:]))
    second.__exit__(None, None, None)  # the redelivery replaces it with identical bytes, atomically
    assert final.read_bytes() == DATA
    assert list(tmp_path.glob(TEMP_GLOB)) == []


def test_a_failed_write_removes_only_its_own_temp_and_leaves_the_final_name_alone(tmp_path: Path) -> None:
    final = tmp_path / "manifest.json"
    write_bytes_durably(final, b"committed", "task-1")
    other = durable_file(final, "task-2")
    other_fd = other.__enter__()
    with pytest.raises(OSError), durable_file(final, "task-2") as fd:
        write_all(fd, memoryview(b"partial"))
        raise OSError("disk full")
    assert final.read_bytes() == b"committed"
    assert len(list(tmp_path.glob(TEMP_GLOB))) == 1  # the other writer's temp file is still there
    write_all(other_fd, memoryview(b"rewritten"))
    other.__exit__(None, None, None)
    assert final.read_bytes() == b"rewritten"
    assert list(tmp_path.glob(TEMP_GLOB)) == []


def test_a_file_system_that_refuses_o_direct_after_creating_the_file_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux creates the file, then answers EINVAL, when a file system has no direct I/O (FUSE, older tmpfs):
    the temp name (opened O_EXCL) already exists when the writer falls back to buffered mode."""
    from dcs_tasks.checkpoint.store.writes import durable

    real_open = os.open

    def open_like_a_file_system_without_direct_io(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & durable.O_DIRECT:
            os.close(real_open(path, flags & ~durable.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(durable, "O_DIRECT", os.O_DIRECT)
    monkeypatch.setattr(durable.os, "open", open_like_a_file_system_without_direct_io)
    final = tmp_path / "model-00001-of-00001.safetensors"
    with durable_file(final, "task-1", direct=True) as fd:
        write_all(fd, memoryview(DATA))
    assert final.read_bytes() == DATA
    assert list(tmp_path.glob(TEMP_GLOB)) == []
