"""Checkpoint files on disk are untrusted input. An in-process committer (the worker's persist and commit) writes
good steps 1 and 2 (once per module); each test copies them, tampers with step 2 the way an outside tester did,
and checks that restore (plain, `into=`, multi-rank) warns and falls back to step 1, that
`dcs ckpt list|inspect|verify` print a per-step error and no traceback, and that no file outside the checkpoint
is read or described.

The property test feeds random manifest, header, byte and symlink mutations to restore and verify: only
CorruptCheckpoint (turned into a fallback) or success may come out; every path opened or stat'ed lies in
the run directory (a spy on `os.open`/`os.stat`/`os.lstat`); every allocation on the read side
(`fileread.anonymous`, `torch.empty`) is bounded by the bytes on disk, checked before it happens."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import new_hasher
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.checkpoint.restore.reader import load_manifest, verify_step
from dcs_tasks.checkpoint.store.ledger.retention import apply_retention, newest_intact
from dcs_tasks.checkpoint.store.payloads import RetentionPolicy
from dcs_tasks.checkpoint.store.reads import fileread, zread
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CorruptCheckpoint, UntrustedPath
from tests.checkpoint_support import assert_same_state, ckpt_config, dcs_ckpt, training_state
from tests.helpers.redis_server import RedisServer
from tests.helpers.shm import shm_dir

pytestmark = pytest.mark.integration

RUN, MULTI = "plain", "multi"
SECRET_BYTES = 12347  # a size that would show up in a message that describes the outside file


_PLAIN: dict[int, dict[str, Any]] = {}


def plain_state(step: int) -> dict[str, Any]:
    """The state saved as `step` (a copy of the one computed first in this process: the golden files hold those
    bits, and a state computed again after other tests ran in this process has differed from them in low bits)."""
    if step not in _PLAIN:
        state = training_state(seed=step)
        state["step"] = step
        _PLAIN[step] = state
    return copy.deepcopy(_PLAIN[step])


def rank_state(step: int, rank: int) -> dict[str, Any]:
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4) * step
    return {"model": {"w": torch.tensor_split(full, 2, 0)[rank].clone()}, "rank": rank, "step": step}


@dataclass(frozen=True)
class Golden:
    ckpt_dir: Path


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Golden]:
    """Steps 1 and 2 of a single-rank run and of a 2-rank sharded run, written by an in-process committer."""
    root = tmp_path_factory.mktemp("golden")
    server = RedisServer(root / "redis")
    server.start()
    base = DCSConfig(redis_url=server.url, checkpoint_dir=root / "ckpt", node_name="testhost", enable_metrics=False)
    config = ckpt_config(base, root)
    committer = InlineCommitter(config)  # the worker's persist and commit, in this process
    try:
        with Checkpointer(RUN, config, celery_app=committer) as ckpt:
            for step in (1, 2):
                ckpt.save(plain_state(step), step=step).wait(timeout=60)
        ranks = [Checkpointer(MULTI, config, rank=r, world_size=2, celery_app=committer) for r in range(2)]
        try:
            for step in (1, 2):
                for c in [c.save(rank_state(step, c.rank), step, sharding={"model/w": 0}) for c in ranks]:
                    c.wait(timeout=60)
        finally:
            for c in ranks:
                c.close()
    finally:
        committer.close()
        server.stop()
        shutil.rmtree(shm_dir(root), ignore_errors=True)
    yield Golden(root / "ckpt")


@pytest.fixture
def config(golden: Golden, tmp_path: Path) -> DCSConfig:
    """A private copy of the golden checkpoints (restore never talks to Redis; the URL is the golden one)."""
    shutil.copytree(golden.ckpt_dir, tmp_path / "ckpt", symlinks=True)
    base = DCSConfig(checkpoint_dir=tmp_path / "ckpt", node_name="testhost", enable_metrics=False)
    return ckpt_config(base, tmp_path)


def step_dir(config: DCSConfig, step: int, run: str = RUN, rank: int | None = None) -> Path:
    run_dir = Path(config.checkpoint.dir) / run
    if rank is not None:
        run_dir = run_dir / f"rank-{rank:05d}"
    return run_dir / f"step-{step:09d}"


def edit_manifest(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def digest(path: Path) -> str:
    hasher = new_hasher()
    hasher.update(path.read_bytes())
    return str(hasher.hexdigest())


def resign(directory: Path, name: str, target: Path | None = None) -> None:
    """Record `name`'s (or `target`'s) current size and checksum in the manifest, as an attacker would."""
    data = target or directory / name

    def edit(m: dict[str, Any]) -> None:
        for f in m["files"]:
            if f["name"] == name:
                f["size"], f["checksum"] = data.stat().st_size, digest(data)

    edit_manifest(directory, edit)


def first_tensor(m: dict[str, Any]) -> dict[str, Any]:
    return m["tensors"][sorted(m["tensors"])[0]]


def restore_falls_back(config: DCSConfig, run: str = RUN, **kwargs: Any) -> tuple[Any, str]:
    """restore() as a trainer calls it; returns (restored, warning text) and checks it fell back to step 1."""
    with Checkpointer(run, config) as ckpt, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = ckpt.restore(**kwargs)
    text = " | ".join(str(w.message) for w in seen if issubclass(w.category, RuntimeWarning))
    assert restored.step == 1, text
    assert "checkpoint step 2 is corrupt" in text, text
    return restored, text


def write_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.bin"  # outside the checkpoint directory
    secret.write_bytes(bytes(range(256)) * (SECRET_BYTES // 256) + b"s" * (SECRET_BYTES % 256))
    return secret


# --- finding: a manifest can point restore at any file -------------------------------------------------


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink", "manifest-symlink"])
def test_manifest_cannot_reach_files_outside_the_step(config: DCSConfig, tmp_path: Path, how: str) -> None:
    secret = write_secret(tmp_path)
    step2 = step_dir(config, 2)
    name = {"relative": os.path.relpath(secret, step2), "absolute": str(secret)}.get(how, "leak.safetensors")
    if how == "symlink":
        (step2 / name).symlink_to(secret)

    def leak(m: dict[str, Any]) -> None:  # a manifest re-signed for the outside file, its bytes as a tensor
        m["files"] = [{"name": name, "size": SECRET_BYTES, "checksum": digest(secret), "algorithm": "xxh3_128"}]
        m["tensors"] = {"leak": {"file": name, "dtype": "U8", "shape": [SECRET_BYTES], "offsets": [0, SECRET_BYTES]}}
        m["structure"] = {"k": "dict", "keys": [{"k": "v", "v": "leak"}], "values": [{"k": "tensor", "name": "leak"}]}

    if how == "manifest-symlink":
        outside = tmp_path / "outside-manifest.json"
        shutil.copy(step2 / "manifest.json", outside)
        (step2 / "manifest.json").unlink()
        (step2 / "manifest.json").symlink_to(outside)
    else:
        edit_manifest(step2, leak)
    restored, text = restore_falls_back(config)
    assert_same_state(plain_state(1), restored.state)
    assert str(SECRET_BYTES) not in text, text  # the manifest's own claims may be echoed, never facts on disk
    reason = "is a symlink (never followed)" if "symlink" in how else "is not a plain safetensors file name"
    assert reason in text, text
    done = dcs_ckpt(config, "verify", "--run", RUN)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 1: ok" in done.stdout and "step 2: BAD" in done.stderr, done.stdout + done.stderr
    assert str(SECRET_BYTES) not in done.stderr, done.stderr


@pytest.mark.parametrize("how", ["huge-length", "not-json", "renamed-tensor", "offsets-outside"])
def test_safetensors_header_is_checked_by_verify_and_restore(config: DCSConfig, how: str) -> None:
    step2 = step_dir(config, 2)
    data_file = sorted(step2.glob("*.safetensors"))[0]
    raw = bytearray(data_file.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    if how == "huge-length":
        raw[:8] = b"\xff" * 8
    elif how == "not-json":
        raw[8 : 8 + length] = b"x" * length
    else:
        header = json.loads(raw[8 : 8 + length])
        name = sorted(k for k in header if k != "__metadata__")[0]
        if how == "renamed-tensor":
            header[name[:-1] + "#"] = header.pop(name)
        else:
            header[name]["data_offsets"] = [len(raw), len(raw) + 4 * (header[name]["data_offsets"][1] // 4)]
        text = json.dumps(header, separators=(",", ":")).encode()
        raw[8 : 8 + length] = text + b" " * (length - len(text))
    data_file.write_bytes(bytes(raw))
    resign(step2, data_file.name)
    done = dcs_ckpt(config, "verify", "--run", RUN, "--step", "2")
    assert done.returncode == 1 and "step 2: BAD" in done.stderr, done.stdout + done.stderr
    assert data_file.name in done.stderr
    restored, _ = restore_falls_back(config)
    assert_same_state(plain_state(1), restored.state)


@pytest.mark.parametrize("value", [{"k": "dtype", "v": "save"}, {"k": "dtype", "v": "serialization"}])
def test_structure_naming_a_torch_attribute_is_refused(config: DCSConfig, value: dict[str, Any]) -> None:
    def inject(m: dict[str, Any]) -> None:
        root = m["structure"]
        keys = [k["v"] for k in root["keys"]]
        root["values"][keys.index("step")] = value

    edit_manifest(step_dir(config, 2), inject)
    restored, text = restore_falls_back(config)
    assert restored.state["step"] == 1 and "not a torch dtype" in text


# --- finding: a malformed newest step blocks resume --------------------------------------------------

MALFORMED: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown-dtype": lambda m: first_tensor(m).update(dtype="Q9"),
    "shape-not-bytes": lambda m: first_tensor(m).update(shape=[*first_tensor(m)["shape"], 3]),
    "missing-file-entry": lambda m: first_tensor(m).update(file="model-00009-of-00009.safetensors"),
    "overflowing-offset": lambda m: first_tensor(m).update(offsets=[2**64, 2**64 + 4]),
    "missing-tensor": lambda m: m["tensors"].pop(sorted(m["tensors"])[0]),
}


@pytest.mark.parametrize("how", ["plain", "into", "ranks"])
@pytest.mark.parametrize("malformed", sorted(MALFORMED))
def test_malformed_newest_step_falls_back_to_the_last_good_one(config: DCSConfig, malformed: str, how: str) -> None:
    if how == "ranks":
        edit_manifest(step_dir(config, 2, MULTI, rank=1), MALFORMED[malformed])
        restored, _ = restore_falls_back(config, MULTI)  # world 1 reads both ranks' parts
        assert torch.equal(restored.state["model"]["w"], torch.arange(40, dtype=torch.float32).reshape(10, 4))
        return
    edit_manifest(step_dir(config, 2), MALFORMED[malformed])
    if how == "plain":
        restored, _ = restore_falls_back(config)
        assert_same_state(plain_state(1), restored.state)
        return
    target = plain_state(9)
    weight = target["model"]["0.weight"]
    restored, _ = restore_falls_back(config, into=target)
    assert restored.state["model"]["0.weight"] is weight
    assert_same_state(plain_state(1), restored.state)


def test_explicit_malformed_step_raises_corrupt_checkpoint(config: DCSConfig) -> None:
    edit_manifest(step_dir(config, 2), MALFORMED["unknown-dtype"])
    edit_manifest(step_dir(config, 2, MULTI, rank=0), MALFORMED["overflowing-offset"])
    with Checkpointer(RUN, config) as ckpt, pytest.raises(CorruptCheckpoint, match=r"'Q9'.*not a safetensors dtype"):
        ckpt.restore(step=2)
    with Checkpointer(MULTI, config) as ckpt, pytest.raises(CorruptCheckpoint, match="outside its file"):
        ckpt.restore(step=2)


def test_cli_reports_bad_steps_without_a_traceback(config: DCSConfig) -> None:
    edit_manifest(step_dir(config, 2), MALFORMED["unknown-dtype"])
    edit_manifest(step_dir(config, 2, MULTI, rank=1), MALFORMED["shape-not-bytes"])
    listing = dcs_ckpt(config, "list", "--run", RUN)
    lines = listing.stdout.splitlines()
    assert listing.returncode == 0 and lines[0].split()[0] == "1", listing.stdout
    assert lines[1].split()[:2] == ["2", "BAD"] and "'Q9'" in lines[1], listing.stdout
    newest = dcs_ckpt(config, "inspect", "--run", RUN)
    assert newest.returncode == 1 and newest.stderr.startswith("step 2: BAD:") and "'Q9'" in newest.stderr
    older = dcs_ckpt(config, "inspect", "--run", RUN, "--step", "1")
    assert older.returncode == 0 and json.loads(older.stdout)["step"] == 1
    verified = dcs_ckpt(config, "verify", "--run", RUN)
    assert verified.returncode == 1 and "step 1: ok" in verified.stdout and "step 2: BAD" in verified.stderr
    ranks = dcs_ckpt(config, "list", "--run", MULTI)
    lines = ranks.stdout.splitlines()
    assert ranks.returncode == 0 and lines[0].split()[0] == "1" and lines[0].endswith("2 ranks"), ranks.stdout
    assert lines[1].split()[:2] == ["2", "BAD"] and "rank-00001" in lines[1], ranks.stdout
    assert len(lines) == 2, ranks.stdout
    rank1 = dcs_ckpt(config, "inspect", "--run", MULTI, "--rank", "1")
    assert rank1.returncode == 1 and "step 2: BAD" in rank1.stderr


@pytest.mark.parametrize("created_at", [1e300, float("nan"), float("inf"), -1.0])
def test_list_reports_an_impossible_created_at_as_a_bad_step(config: DCSConfig, created_at: float) -> None:
    """Issue 20, finding 9: `dcs ckpt list` printed a traceback for a `created_at` of 1e300 or NaN. Now the
    manifest model bounds it (finite, 0 to year 2200): the step is BAD, restore falls back."""
    edit_manifest(step_dir(config, 2), lambda m: m.__setitem__("created_at", created_at))
    listing = dcs_ckpt(config, "list", "--run", RUN)  # asserts no traceback
    lines = listing.stdout.splitlines()
    assert listing.returncode == 0 and lines[0].split()[0] == "1", listing.stdout + listing.stderr
    assert lines[1].split()[:2] == ["2", "BAD"] and "created_at" in listing.stdout, listing.stdout
    restore_falls_back(config)


def test_retention_spares_the_last_restorable_step_past_a_symlinked_file(config: DCSConfig, tmp_path: Path) -> None:
    """A step whose data file is a symlink (to a copy of the same size outside, so sizes match) is not intact:
    restore refuses it, so retention keeps the last step restore can use instead of deleting it."""
    directory = step_dir(config, 2)
    name = next(p.name for p in directory.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(directory / name, outside)
    (directory / name).unlink()
    (directory / name).symlink_to(outside)
    assert newest_intact(directory.parent) == 1
    assert apply_retention(directory.parent, RetentionPolicy(keep_last=1), set()) == []
    restore_falls_back(config)


def test_cli_turns_an_os_error_into_one_line(config: DCSConfig) -> None:
    old = step_dir(config, 1)
    shutil.rmtree(old)
    (old / "manifest.json").mkdir(parents=True)  # a "manifest" gc cannot unlink
    done = dcs_ckpt(config, "gc", "--run", RUN, "--keep-last", "1")  # asserts no traceback
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"dcs ckpt: IsADirectoryError: [Errno 21] Is a directory: '{old / 'manifest.json'}'" in done.stderr


@pytest.mark.parametrize("rank", [None, 1])
def test_gc_does_not_follow_a_symlinked_run_directory(config: DCSConfig, tmp_path: Path, rank: int | None) -> None:
    """Issue 20, finding 7: `<root>/<run>` a link to a run outside the root; gc (with `--rank` too) refuses
    it in one line and deletes nothing there, as the worker's retention does."""
    run = MULTI if rank is not None else RUN
    outside = tmp_path / "outside-run"
    shutil.move(Path(config.checkpoint.dir) / run, outside)
    (Path(config.checkpoint.dir) / run).symlink_to(outside)
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    extra = ("--rank", str(rank)) if rank is not None else ()
    done = dcs_ckpt(config, "gc", "--run", run, "--keep-last", "1", *extra)
    assert done.returncode == 2 and "is a symlink: not followed" in done.stderr, done.stdout + done.stderr
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    with pytest.raises(UntrustedPath, match="is a symlink"):
        apply_retention(Path(config.checkpoint.dir) / run, RetentionPolicy(keep_last=1), set())
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before


# --- property: random mutations never escape as anything but CorruptCheckpoint ---------------------------

SPECIAL = st.sampled_from(
    ["..", ".", "", "/etc/passwd", "../../secret.bin", "F32", "Q9", "U8", "save", "load", "cuda:0", "0x1p9999"]
)
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-2, 300),
    SPECIAL,
    st.text(max_size=5),
    st.lists(st.integers(-2, 2**40), max_size=3),
)
JSON = st.recursive(
    LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += json_paths(v, (*prefix, i))
    return out


def apply_edit(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> None:
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


@st.composite
def mutations(draw: st.DrawFn, manifest: dict[str, Any], header: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A few edits: ('manifest', path, value, delete) / ('replace', json) / ('header', path, value, delete) /
    ('length', n) / ('byte', pos, xor) / ('truncate', n) / ('symlink',), each header-side edit maybe re-signed."""
    edits: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(["manifest", "manifest", "replace", "header", "length", "byte", "truncate", "symlink"])
        )
        if kind in ("manifest", "header"):
            path = draw(st.sampled_from(json_paths(manifest if kind == "manifest" else header)))
            edits.append((kind, path, draw(JSON), draw(st.booleans())))
        elif kind == "replace":
            edits.append((kind, draw(JSON)))
        elif kind == "length":
            edits.append((kind, draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096)))))
        elif kind == "byte":
            edits.append((kind, draw(st.integers(0, 4096)), draw(st.integers(1, 255))))
        elif kind == "truncate":
            edits.append((kind, draw(st.integers(0, 4096))))
        else:
            edits.append((kind,))
    return [*edits, ("resign", draw(st.booleans()))]


def mutate(step2: Path, secret: Path, edits: list[tuple[Any, ...]]) -> None:
    data_file = sorted(step2.glob("*.safetensors"))[0]
    manifest = json.loads((step2 / "manifest.json").read_text())
    replaced: Any = None
    for edit in edits[:-1]:
        kind = edit[0]
        with contextlib.suppress(KeyError, IndexError, TypeError, ValueError):  # an earlier edit broke the path
            if kind == "manifest":
                apply_edit(manifest, edit[1], edit[2], edit[3])
            elif kind == "replace":
                replaced = edit[1]
            elif kind == "symlink":
                data_file.unlink()
                data_file.symlink_to(secret)
            elif data_file.is_file() and not data_file.is_symlink():
                data_file.write_bytes(mutate_bytes(data_file.read_bytes(), edit))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if edits[-1][1] and isinstance(files, list):  # re-signed: checksum and size no longer give the tampering away
        for f in files:
            with contextlib.suppress(TypeError, KeyError, OSError):
                if f["name"] == data_file.name:
                    f["size"], f["checksum"] = data_file.stat().st_size, digest(data_file)
    (step2 / "manifest.json").write_text(json.dumps(replaced if replaced is not None else manifest))


def mutate_bytes(raw: bytes, edit: tuple[Any, ...]) -> bytes:
    data = bytearray(raw)
    kind = edit[0]
    if kind == "length":
        data[:8] = edit[1].to_bytes(8, "little")
    elif kind == "byte":
        if data:
            data[edit[1] % len(data)] ^= edit[2]
    elif kind == "truncate":
        del data[edit[1] :]
    else:  # a header edit, the file rewritten with the new header (and its length)
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        apply_edit(header, edit[1], edit[2], edit[3])
        text = json.dumps(header).encode()
        data = bytearray(len(text).to_bytes(8, "little") + text + data[8 + length :])
    return bytes(data)


class Spy:
    """Records every path the read side opens or stats and checks every allocation before it happens."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = os.path.abspath(run_dir)
        files = [p.lstat().st_size for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
        self.max_file, self.total = max(files), sum(files)
        self.outside: list[str] = []
        self.seen = {"paths": 0, "allocations": 0}  # proof that the spies were live

    def path(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
            # warnings.warn primes linecache with the warning's source file, looked up along sys.path: not
            # checkpoint data, so calls from linecache are not counted
            caller = sys._getframe(1).f_globals.get("__name__")
            if isinstance(path, str | bytes | os.PathLike) and caller != "linecache":
                self.seen["paths"] += 1
                where = os.path.abspath(os.fsdecode(path))
                if where != self.run_dir and not where.startswith(self.run_dir + os.sep):
                    self.outside.append(where)
            return real(path, *args, **kwargs)

        return spy

    def anonymous(self, real: Callable[[int], Any]) -> Callable[[int], Any]:
        def spy(nbytes: int) -> Any:
            self.seen["allocations"] += 1
            limit = fileread.WINDOW * (self.max_file + fileread.DIRECT_ALIGN)
            assert nbytes <= limit, f"allocation of {nbytes} bytes, the largest file has {self.max_file}"
            return real(nbytes)

        return spy

    def empty(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def spy(*size: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
            dims = size[0] if len(size) == 1 and isinstance(size[0], list | tuple | torch.Size) else size
            if all(isinstance(d, int) and d >= 0 for d in dims):
                nbytes = (dtype or torch.float32).itemsize
                for d in dims:
                    nbytes *= d
                assert nbytes <= self.total, f"torch.empty of {nbytes} bytes, {self.total} on disk"
            return real(*size, dtype=dtype, **kwargs)

        return spy

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with pytest.MonkeyPatch.context() as mp:
            for name in ("open", "stat", "lstat"):
                mp.setattr(os, name, self.path(getattr(os, name)))
            mp.setattr(fileread, "anonymous", self.anonymous(fileread.anonymous))
            mp.setattr(zread, "anonymous", self.anonymous(zread.anonymous))
            mp.setattr(torch, "empty", self.empty(torch.empty))
            yield


@pytest.mark.parametrize("run", [RUN, MULTI])
def test_random_mutations_only_ever_fall_back(golden: Golden, tmp_path: Path, run: str) -> None:
    golden_run = golden.ckpt_dir / run
    part = Path("rank-00001") / "step-000000002" if run == MULTI else Path("step-000000002")
    step2 = golden_run / part
    manifest = json.loads((step2 / "manifest.json").read_text())
    raw = sorted(step2.glob("*.safetensors"))[0].read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    secret = write_secret(tmp_path)
    config = ckpt_config(
        DCSConfig(checkpoint_dir=tmp_path / "ckpt", node_name="testhost", enable_metrics=False), tmp_path
    )
    run_dir = tmp_path / "ckpt" / run
    expected_1 = plain_state(1)
    seen: dict[str, int] = {"fell back": 0, "restored 2": 0}

    with Checkpointer(run, config) as ckpt:  # world size 1: a multi-rank run is read from both ranks
        # no explain phase: its tracer resolves source paths while the spy is on (hypothesis's own reads)
        phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]

        @settings(
            max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None, phases=phases
        )
        # rank 1 of step 2 naming another rank or world size: a contradiction, reported (it was skipped quietly)
        @example(edits=[("manifest", ("rank",), 0, False), ("resign", False)])
        @example(edits=[("manifest", ("world_size",), 3, False), ("resign", False)])
        @given(edits=mutations(manifest, header))
        def check(edits: list[tuple[Any, ...]]) -> None:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(golden_run, run_dir, symlinks=True)
            mutate(run_dir / part, secret, edits)
            spy = Spy(run_dir)
            with spy.watching(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                restored = ckpt.restore()  # anything but CorruptCheckpoint propagates and fails the test
                with contextlib.suppress(CorruptCheckpoint):
                    verify_step(run_dir / part, load_manifest(run_dir / part))
            assert spy.outside == [], spy.outside
            assert spy.seen["paths"] > 0 and (restored.step == 1 or spy.seen["allocations"] > 0), spy.seen
            assert restored.step in (1, 2)
            if restored.step == 1:
                assert any("checkpoint step 2 is corrupt" in str(w.message) for w in caught)
                if run == RUN:
                    assert_same_state(expected_1, restored.state)
                else:
                    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
                    assert torch.equal(restored.state["model"]["w"], full) and restored.state["step"] == 1
                seen["fell back"] += 1
            else:
                seen["restored 2"] += 1

        check()
    assert seen["fell back"] > 40, seen  # the mutations mostly did break step 2, and restore got past it
