"""Seals of memory-tier steps: what lets a restore from this host's memory skip hashing again bytes that were
hashed when they arrived.

Every byte of a memory-tier file is hashed once on its way in: by the worker that copies it out of the staging
buffer (its checksum goes into the manifest) or by the worker that receives it from a peer (checked against the
manifest's checksum, which the transport authenticates). Hashing it again on every restore costs ~21 ms per
256 MiB of one core on the CI VM, more than mapping the pages (~7 ms): with it, recovery from memory was 5.6x
faster than a cold read from storage; without it, the same restore is mostly page-table work.

So when a memory-tier step is committed (by `persisting.commit`, or by `transfer` once a peer's copy is
verified), each file is made read-only (0444) and its stamp (inode, size, mtime_ns, ctime_ns) is recorded in the
step's `seal.json`. A restore that finds the open file's `fstat` equal to its stamp and the file still not
writable trusts the arrival hash (`DCSConfig.memory.restore_verify = "seal"`, the default); any other file, or
`memory_restore_verify = "hash"`, is hashed in full as before.

What a seal catches: any write, truncation, chmod or replacement of the file after it was sealed, because each
of these moves the file's ctime, which user space cannot set back, or changes its inode. What it does not catch:
a change within the same kernel clock tick as the seal (a few ms; it needs write permission on a 0444 file in the
0700 memory directory, so root or the worker's own user), and memory corruption in RAM after arrival (ECC's
job, as for every byte a trainer keeps in memory). Storage reads never use seals: disks and object stores are
hashed on every restore.

`seal.json` is untrusted input like every file on disk: bounded in size, parsed strictly; a bad or missing seal
only means the step is hashed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dcs_tasks.checkpoint.store.writes.durable import write_bytes_durably

log = logging.getLogger(__name__)

SEAL_NAME = "seal.json"
SEAL_FORMAT = 1
MAX_SEAL_BYTES = 1 << 20  # far above what a step's files need (~100 bytes each, at most a few thousand files)
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
_INT64 = (1 << 63) - 1


@dataclass(frozen=True)
class Stamp:
    """What `fstat` says of a sealed file; any change to the file changes at least one field."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Stamp:
        return cls(info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def holds(self, info: os.stat_result) -> bool:
        """`info` (an fstat of the open file) is the sealed file, unchanged and still not writable."""
        return stat.S_ISREG(info.st_mode) and not info.st_mode & _WRITE_BITS and Stamp.of(info) == self


def seal_fd(fd: int) -> Stamp:
    """Make the open file read-only (when it is not) and return its stamp."""
    info = os.fstat(fd)
    if info.st_mode & _WRITE_BITS:
        os.fchmod(fd, 0o444)
        info = os.fstat(fd)
    return Stamp.of(info)


def seal_bytes(stamps: Mapping[str, Stamp], peer: bool = False) -> bytes:
    """The `seal.json` record of `stamps` (file name -> stamp); `peer`: the step is a copy received from another
    host (`is_peer_copy`)."""
    files = {name: [s.ino, s.size, s.mtime_ns, s.ctime_ns] for name, s in stamps.items()}
    record: dict[str, object] = {"format": SEAL_FORMAT, "files": files}
    if peer:
        record["peer"] = True
    return json.dumps(record, separators=(",", ":")).encode()


def seal_step(step_dir: Path, names: Iterable[str]) -> dict[str, Stamp]:
    """Seal each named file of `step_dir` (`seal_fd`) and record the stamps in `seal.json` (written last,
    replacing an older one). Call once every file holds its verified bytes, before the step's manifest makes it
    visible."""
    stamps: dict[str, Stamp] = {}
    for name in names:
        fd = os.open(step_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            stamps[name] = seal_fd(fd)
        finally:
            os.close(fd)
    write_bytes_durably(step_dir / SEAL_NAME, seal_bytes(stamps), "seal")
    return stamps


def is_peer_copy(step_dir: Path) -> bool:
    """Whether the memory step at `step_dir` is a copy received from another host (its seal says so): such a step
    is evicted before this host's own. A step without a readable seal counts as this host's own."""
    body = _seal_body(step_dir)
    return isinstance(body, dict) and body.get("peer") is True


def _seal_body(step_dir: Path) -> object:
    path = step_dir / SEAL_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SEAL_BYTES:
            return None
        raw = os.read(fd, MAX_SEAL_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def read_seals(step_dir: Path) -> dict[str, Stamp]:
    """The stamps `seal_step` recorded for `step_dir`; empty when there are none or the record is unreadable,
    oversized or malformed (those files are then hashed: a bad seal costs time, never correctness)."""
    path = step_dir / SEAL_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SEAL_BYTES:
            log.warning("ignoring %s: not a regular file of at most %d bytes", path, MAX_SEAL_BYTES)
            return {}
        raw = os.read(fd, MAX_SEAL_BYTES + 1)
    except OSError:
        return {}
    finally:
        os.close(fd)
    try:
        return _parse(json.loads(raw))
    except (ValueError, TypeError, RecursionError) as exc:
        log.warning("ignoring %s: %s", path, str(exc)[:200])
        return {}


def _parse(body: object) -> dict[str, Stamp]:
    if not isinstance(body, dict) or body.get("format") != SEAL_FORMAT or not isinstance(body.get("files"), dict):
        raise ValueError(f"not a format-{SEAL_FORMAT} seal record")
    stamps = {}
    for name, fields in body["files"].items():
        if not (
            isinstance(fields, list)
            and len(fields) == 4
            and all(type(v) is int and 0 <= v <= _INT64 for v in fields)  # bool is not an int here
        ):
            raise ValueError(f"the stamp of {str(name)[:100]!r} is not four integers")
        stamps[name] = Stamp(*fields)
    return stamps
