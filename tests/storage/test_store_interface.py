"""The storage interface (`dcs_tasks/storage/store.py`) behaves the same through every store: the file store (a
POSIX directory), the S3 store (a real S3 server, tests/storage/conftest.py) and the memory tier's store (a
private directory in /dev/shm). Each test runs once per store: a write by regions is invisible until published
and whole after, an aborted one leaves nothing (no temp file, no open upload), ranges land in the caller's
buffers, and stat, names, folders_with, files, delete and delete_tree agree; the verified reader a location's
store picks (`checkpoint/store/reads/verified.py`) lands and checks every byte the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
from dcs_tasks.checkpoint.store.reads import verified
from dcs_tasks.errors import CorruptCheckpoint, StorageFull
from dcs_tasks.storage import ObjectPath, S3Settings, S3Store, Store, store_of
from dcs_tasks.storage.factory import FILES, copy, is_object, named, relative, within
from dcs_tasks.storage.memtier import MemoryTierStore
from dcs_tasks.storage.store import NoLock, Refused
from dcs_tasks.storage_url import ObjectURL
from tests.storage.conftest import S3Bucket
from tests.storage.s3_support import open_uploads

MiB = 1024 * 1024
STORES = ("file", "s3", "memory")


@dataclass
class Place:
    """A store and an empty folder of it to work in."""

    store: Store[Any]
    root: Any
    kind: str
    bucket: S3Bucket | None = None

    def leftovers(self) -> list[str]:
        """What an unpublished write could have left: temp files in the folder, or open multipart uploads."""
        if self.bucket is not None:
            return open_uploads(self.bucket)
        return [name for _, _, names in os.walk(self.root) for name in names]


@pytest.fixture(params=STORES)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    if request.param == "file":
        yield Place(FILES, tmp_path / "root", "file")
    elif request.param == "memory":
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        memory = Path(tempfile.mkdtemp(prefix="dcs-test-memtier-", dir=shm))  # mode 0700, this user's own
        try:
            yield Place(MemoryTierStore(memory), memory / "root", "memory")
        finally:
            shutil.rmtree(memory, ignore_errors=True)
    else:
        bucket: S3Bucket = request.getfixturevalue("aws_env")
        settings = S3Settings(endpoint_url=bucket.endpoint_url, addressing_style="path", part_bytes=5 * MiB)
        s3 = S3Store(ObjectURL(bucket.bucket, "root"), settings)
        loc = ObjectPath(s3, "root")
        yield Place(store_of(loc), loc, "s3", bucket)


def pattern(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]  # period 251: no two aligned blocks alike


def test_a_write_by_regions_is_invisible_until_published_then_whole(place: Place) -> None:
    store, target = place.store, place.root / "step-000000001" / "rank-0.safetensors"
    data = pattern(12 * MiB + 4097)  # more than two S3 parts, not a multiple of the O_DIRECT alignment
    view = memoryview(data)
    with store.open_writer(target, "t1") as writer:
        for begin in range(0, len(data), 3 * MiB):
            writer.write(view[begin : begin + 3 * MiB])
        assert store.stat(target) is None and not store.exists(target)
        assert store.names(target.parent) == [] and store.files(place.root, 10) == {}
        writer.publish()
    assert store.stat(target) == len(data) and store.exists(target) and store.exists(target.parent)
    got = bytearray(len(data))
    store.read_into(target, 0, [memoryview(got)])
    assert got == data
    assert place.leftovers() == ([] if place.bucket else ["rank-0.safetensors"])


def test_an_aborted_or_failed_write_leaves_nothing_and_the_old_bytes_stay(place: Place) -> None:
    store, target = place.store, place.root / "manifest.json"
    store.write_small(target, b"old", "t0")
    with store.open_writer(target, "t1") as writer:
        writer.write(memoryview(pattern(6 * MiB)))  # an S3 part is already uploaded
        writer.abort()
    with pytest.raises(RuntimeError), store.open_writer(target, "t2") as writer:
        writer.write(memoryview(pattern(6 * MiB)))
        raise RuntimeError("the writer's caller failed")
    assert store.read_small(target, 100) == b"old"
    assert place.leftovers() == ([] if place.bucket else ["manifest.json"])


def test_what_a_writer_that_died_left_is_swept_and_never_listed(place: Place) -> None:
    store, folder = place.store, place.root / "step-000000002"
    store.write_small(folder / "kept", b"published", "t")
    dead = store.open_writer(folder / "lost.safetensors", "t1")  # its process "dies": no publish, no abort
    dead.write(memoryview(pattern(6 * MiB)))
    assert place.leftovers() != ([] if place.bucket else ["kept"])
    assert store.names(folder) == ["kept"] and store.files(folder, 10) == {"kept": 9}
    store.sweep(folder)
    assert (
        place.leftovers() == ([] if place.bucket else ["kept"]) and store.read_small(folder / "kept", 9) == b"published"
    )
    dead.abort()  # its descriptor closed; nothing left to drop


def test_ranges_land_in_the_callers_buffers(place: Place) -> None:
    store, target = place.store, place.root / "f"
    data = pattern(1 * MiB + 13)
    store.write_small(target, data, "t")
    first, second = bytearray(100), bytearray(5000)
    store.read_into(target, 4093, [memoryview(first), memoryview(second)])
    assert bytes(first + second) == data[4093 : 4093 + 5100]
    with pytest.raises(CorruptCheckpoint, match="ended early"):
        store.read_into(target, len(data) - 10, [memoryview(bytearray(11))])
    with pytest.raises(CorruptCheckpoint, match="missing"):
        store.read_into(place.root / "absent", 0, [memoryview(bytearray(1))])


def _stored_file(place: Place, name: str, data: bytes, checksum: str | None = None) -> tuple[Any, FileEntry]:
    """`data` written as `name` in the folder `step` of the place, with the manifest entry a reader checks it by."""
    hasher = new_hasher()
    hasher.update(data)
    loc = place.root / "step" / name
    place.store.write_small(loc, data, "t")
    return loc, FileEntry(name=name, size=len(data), checksum=checksum or hasher.hexdigest())


def test_verified_reads_land_every_byte_and_check_it_through_every_store(place: Place) -> None:
    """`verified.read_scatter` / `read_many`: the reader the files' store picks lands each range in the caller's
    buffers (ranges across S3 parts and O_DIRECT blocks, gaps skipped) or each file in fresh memory, bit-exact."""
    big, small = pattern(6 * MiB + 4097), pattern(9000)[::-1]
    (big_loc, big_entry), (small_loc, small_entry) = _stored_file(place, "a", big), _stored_file(place, "b", small)
    head, middle, tail = bytearray(4099), bytearray(2 * MiB), bytearray(10)
    verified.read_scatter(
        [
            (big_loc, big_entry, [(1, 4100, memoryview(head)), (5 * MiB - MiB, 5 * MiB + MiB, memoryview(middle))]),
            (small_loc, small_entry, [(len(small) - 10, len(small), memoryview(tail))]),
        ],
        verify=True,
    )
    assert bytes(head) == big[1:4100] and bytes(middle) == big[4 * MiB : 6 * MiB] and bytes(tail) == small[-10:]
    many = verified.read_many([(small_loc, small_entry), (big_loc, big_entry)], verify=True)
    assert [bytes(m[: len(d)]) for m, d in zip(many, (small, big), strict=True)] == [small, big]


def test_verified_reads_name_the_file_that_fails_through_every_store(place: Place) -> None:
    """A checksum that does not match, a size that is not the entry's and a missing file are CorruptCheckpoint
    naming the file, whichever store holds it; with `verify` off the checksum is not asked."""
    data = pattern(MiB + 3)
    loc, entry = _stored_file(place, "c", data, checksum="0" * 32)
    with pytest.raises(CorruptCheckpoint, match="fails its xxh3_128 checksum") as failed:
        verified.read_scatter([(loc, entry, [])], verify=True)
    assert failed.value.path == str(loc)
    assert bytes(verified.read_many([(loc, entry)], verify=False)[0][: len(data)]) == data
    with pytest.raises(CorruptCheckpoint, match="has 1048579 bytes, manifest says 1048580"):
        verified.read_many([(loc, entry.model_copy(update={"size": len(data) + 1}))], verify=False)
    with pytest.raises(CorruptCheckpoint, match="missing"):
        verified.read_scatter([(place.root / "step" / "absent", entry.model_copy(update={"name": "absent"}), [])], True)


def test_read_small_refuses_a_missing_or_larger_file(place: Place) -> None:
    store = place.store
    store.write_small(place.root / "latest", b"step-000000007", "t")
    assert store.read_small(place.root / "latest", 64) == b"step-000000007"
    with pytest.raises(CorruptCheckpoint):
        store.read_small(place.root / "latest", 4)
    with pytest.raises(CorruptCheckpoint, match="missing"):
        store.read_small(place.root / "absent", 64)


def test_stat_list_files_and_deletes_agree(place: Place) -> None:
    store, root = place.store, place.root
    for name, size in (("a/x", 3), ("a/y", 0), ("a/sub/z", 5), ("b/w", 2), ("top", 1)):
        store.write_small(root / name, pattern(size), "t")
    assert store.names(root) == ["a", "b", "top"] and store.names(root / "a") == ["sub", "x", "y"]
    assert store.files(root / "a", 10) == {"x": 3, "y": 0, "sub/z": 5}
    assert store.stat(root / "a" / "y") == 0 and store.stat(root / "a") is None and store.stat(root / "no") is None
    assert store.names(root / "missing") == [] and store.files(root / "missing", 10) == {}
    store.delete([root / "a" / "x", root / "a" / "never-there"])
    assert store.stat(root / "a" / "x") is None and store.files(root / "a", 10) == {"y": 0, "sub/z": 5}
    store.delete_tree(root / "a")
    store.delete_tree(root / "never-there")
    assert not store.exists(root / "a") and store.names(root) == ["b", "top"]


def test_folders_holding_an_entry_and_a_delete_that_keeps_named_entries(place: Place) -> None:
    store, run = place.store, place.root / "run"
    for name in ("step-1/manifest.json", "step-1/a", "step-2/a", "step-3/manifest.json", "manifest.json"):
        store.write_small(run / name, b"x", "t")
    store.write_small(run / "step-4" / "deep" / "manifest.json", b"x", "t")  # not directly in step-4
    assert store.folders_with(run, "manifest.json") == ["step-1", "step-3"]
    assert store.folders_with(run / "missing", "manifest.json") == []
    store.delete_tree(run / "step-1", keep=frozenset({"a"}))  # a retired step keeps what later steps use
    assert store.files(run / "step-1", 10) == {"a": 1}
    assert store.folders_with(run, "a") == ["step-1", "step-2"]


def test_the_factory_names_what_a_location_is(place: Place) -> None:
    root = place.root
    assert within(root / "x" / "y", root) and not within(root.parent / "other", root)
    assert relative(root / "run" / "step-000000001", root) == "run/step-000000001"
    with pytest.raises(ValueError):
        relative(root, root)
    with pytest.raises(ValueError):
        relative(root.parent / "other", root)
    assert is_object(root) is (place.kind == "s3")
    assert (place.store.local_path(root) is None) is (place.kind == "s3")
    step = root / "run" / "step-000000001"  # a location as a task payload names it: parsed back to the same one
    assert named(str(step), root) == step and store_of(named(str(step), root) or root) is store_of(root)
    other_kind = "/elsewhere/run" if place.kind == "s3" else "s3://bucket/run"
    assert named(other_kind, root) is None
    if place.kind == "s3":
        assert named("s3://another-bucket/root/run", root) is None
    if place.kind == "memory":
        assert isinstance(place.store, MemoryTierStore) and place.store.holds(root / "x")
        assert not place.store.holds(Path("/elsewhere"))


def test_copy_between_stores_is_whole_or_nothing(place: Place, tmp_path: Path) -> None:
    data = pattern(7 * MiB + 5)
    local = tmp_path / "local" / "f"
    FILES.write_small(local, data, "t")
    copy(local, place.root / "copied", "c", len(data))
    assert place.store.stat(place.root / "copied") == len(data)
    back = tmp_path / "back" / "f"
    copy(place.root / "copied", back, "c", len(data))
    assert back.read_bytes() == data
    with pytest.raises(CorruptCheckpoint):  # the source is shorter than said: nothing published
        copy(local, place.root / "short", "c", len(data) + 1)
    assert place.store.stat(place.root / "short") is None
    assert not within(local, place.root) or place.kind != "s3"


def test_put_stores_a_buffer_whole_hashed_in_order_and_paced(place: Place) -> None:
    store, target = place.store, place.root / "step-000000003" / "rank-0.safetensors"
    data = pattern(11 * MiB + 4097)  # three S3 parts (5 MiB), not a multiple of the O_DIRECT alignment
    hasher, paced = hashlib.sha256(), list[int]()
    store.put(target, memoryview(data), "p", hasher=hasher, on_bytes=paced.append)
    assert hasher.digest() == hashlib.sha256(data).digest() and sum(paced) == len(data)
    got = bytearray(len(data))
    store.read_into(target, 0, [memoryview(got)])
    assert got == data and store.stat(target) == len(data)
    store.put(place.root / "empty", memoryview(b""), "p")
    assert store.stat(place.root / "empty") == 0
    assert place.leftovers() == ([] if place.bucket else ["empty", "rank-0.safetensors"])


def test_a_put_its_publish_check_refuses_leaves_the_old_bytes(place: Place) -> None:
    store, target = place.store, place.root / "rank-1.safetensors"
    store.write_small(target, b"old", "t0")
    asked = list[int]()

    def refuse() -> bool:
        asked.append(1)
        return False

    for size in (100, 11 * MiB):  # one PUT / one file write; a multipart upload
        with pytest.raises(Refused):
            store.put(target, memoryview(pattern(size)), "p", publish=refuse)
    assert asked == [1, 1] and store.read_small(target, 100) == b"old"
    assert place.leftovers() == ([] if place.bucket else ["rank-1.safetensors"])


def test_a_folder_lock_is_the_stores_own_or_the_fence_given(place: Place) -> None:
    store, run = place.store, place.root / "run"
    store.write_small(run / "latest", b"step-000000001", "t")
    fenced: list[tuple[Any, str]] = []

    @contextlib.contextmanager
    def fence(folder: Any, name: str) -> Iterator[None]:
        fenced.append((folder, name))
        yield

    if place.bucket is not None:  # no locks of its own: the fence (Redis, in DCS) is the lock
        with pytest.raises(NoLock):
            store.lock(run, "latest").__enter__()
        with store.lock(run, "latest", fence=fence):
            assert fenced == [(run, "latest")]
        return
    entered = threading.Event()

    def other() -> None:
        with store.lock(run, "latest"):
            entered.set()

    with store.lock(run, "latest", fence=fence):  # a file store holds its own flock; the fence is not taken
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.5), "a second exclusive holder got in"
    assert entered.wait(10) and fenced == []
    thread.join(10)
    with store.lock(run, "refs", shared=True), store.lock(run, "refs", shared=True):
        pass  # shared holders share
    assert sorted(os.listdir(run)) == [".latest.lock", ".refs.lock", "latest"]


def _s3_place(bucket: S3Bucket, concurrency: int) -> tuple[ObjectPath, Store[Any]]:
    settings = S3Settings(
        endpoint_url=bucket.endpoint_url, addressing_style="path", part_bytes=5 * MiB, concurrency=concurrency
    )
    loc = ObjectPath(S3Store(ObjectURL(bucket.bucket, "root"), settings), "root")
    return loc, store_of(loc)


def test_a_writers_parts_travel_side_by_side_never_more_than_the_concurrency(
    aws_env: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, store = _s3_place(aws_env, concurrency=3)
    travelling, most, lock = 0, 0, threading.Lock()
    put_part = root.store.put_part

    def slow_part(*args: Any) -> dict[str, Any]:
        nonlocal travelling, most
        with lock:
            travelling += 1
            most = max(most, travelling)
        time.sleep(0.2)  # every part long enough in flight that the writer must have sent the next ones
        try:
            return put_part(*args)
        finally:
            with lock:
                travelling -= 1

    monkeypatch.setattr(root.store, "put_part", slow_part)
    data = pattern(31 * MiB + 3)  # seven parts
    with store.open_writer(root / "big", "w") as writer:
        for begin in range(0, len(data), MiB):
            writer.write(memoryview(data)[begin : begin + MiB])
        assert store.stat(root / "big") is None
        writer.publish()
    assert most == 3, f"{most} parts travelled at once, with 3 allowed"
    got = bytearray(len(data))
    store.read_into(root / "big", 0, [memoryview(got)])
    assert got == data and open_uploads(aws_env) == []


def test_a_part_the_store_refuses_fails_the_writer_and_aborts_its_upload(aws_env: S3Bucket) -> None:
    root, store = _s3_place(aws_env, concurrency=2)
    aws_env.set_quota(12 * MiB)  # the third 5 MiB part passes the bucket's quota
    with pytest.raises(StorageFull), store.open_writer(root / "big", "w") as writer:
        for _ in range(8):
            writer.write(memoryview(pattern(5 * MiB)))
        writer.publish()
    assert store.stat(root / "big") is None and open_uploads(aws_env) == []


def test_a_fresh_process_places_its_first_memory_path_in_the_memory_tier(tmp_path: Path) -> None:
    """A worker's first question, before anything else told the factory of the memory directory: its commit
    seals a memory step and its writes reuse recycled pages only when this says yes (a pool process that
    committed first once answered no, and its steps went unsealed)."""
    code = (
        "import sys; from pathlib import Path\n"
        "from dcs_tasks.checkpoint.store.tiers import memdir\n"
        "from dcs_tasks.config import DCSConfig\n"
        "config = DCSConfig(memory_tier_bytes=1 << 20, memory_dir=sys.argv[1])\n"
        "print(memdir.in_memory_tier(config, Path(sys.argv[1]).resolve() / 'run' / 'step-000000001'))\n"
    )
    (tmp_path / "memory").mkdir(mode=0o700)
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "memory")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_paths_under_a_memory_directory_go_to_the_memory_tiers_store(tmp_path: Path) -> None:
    """`memdir.memory_root` tells the factory of the memory directory; from then on its paths are the memory
    tier's (no O_DIRECT, `in_memory`), every other path stays the file store's, and the two remain one family:
    `within`, `relative` and copies work between them as between any two directories."""
    from dcs_tasks.checkpoint.store.tiers import memdir
    from dcs_tasks.config import DCSConfig

    config = DCSConfig(memory_tier_bytes=MiB, memory_dir=str(tmp_path / "memory"), checkpoint_dir=tmp_path / "disk")
    assert not memdir.in_memory_tier(config.model_copy(update={"memory_tier_bytes": 0}), tmp_path / "memory" / "x")
    root = memdir.memory_root(config, create=True)
    step = root / "run" / "step-000000001"
    store = store_of(step)
    assert isinstance(store, MemoryTierStore) and store is memdir.memory_store(config) and store.in_memory
    assert store.name == "memory" and not store.direct and memdir.in_memory_tier(config, step)
    disk = tmp_path / "disk" / "run" / "step-000000001"
    assert store_of(disk) is FILES and not FILES.in_memory and not memdir.in_memory_tier(config, disk)
    assert within(step, root) and not within(disk, root) and relative(step, root) == "run/step-000000001"
    data = pattern(3 * MiB + 1)
    store.write_small(step / "f", data, "t")
    copy(step / "f", disk / "f", "c", len(data))  # memory -> disk, as a flush copies
    assert (disk / "f").read_bytes() == data and store.stat(step / "f") == len(data)
