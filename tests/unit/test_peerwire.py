"""The memory tier's peer transport (dcs_tasks.checkpoint.store.peers.transfer) over real sockets: real server threads,
a server and hostile peers in other processes. Steps are built the way the writer lays them out (safetensors
headers, xxh3_128 checksums, a checked manifest) without torch, as a worker holds them."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcs_tasks.checkpoint.format.layout import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    file_name,
    manifest_bytes,
    new_hasher,
)
from dcs_tasks.checkpoint.store.peers import channel as pc
from dcs_tasks.checkpoint.store.peers import stepfiles as ps
from dcs_tasks.checkpoint.store.peers import transfer as pw
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files, read_manifest
from dcs_tasks.checkpoint.store.tiers.seal import SEAL_NAME, read_seals
from dcs_tasks.errors import (
    CorruptCheckpoint,
    PeerAuthFailed,
    PeerCorrupt,
    PeerError,
    PeerNotFound,
    PeerRefused,
    PeerUnavailable,
)
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def any_step(rel: ps.StepRel, raw: bytes) -> None:
    """The transport alone: any step may be put (the memory tier's ownership check is `tiers.PutCheck`)."""


TOKEN = "peer-token-1"
TIMEOUT = 5.0
SIZES = (1000, 1 << 20, 3 * (1 << 20) + 7)


def safetensors_bytes(name: str, payload: bytes) -> bytes:
    """One U8 tensor as a safetensors file the way DCS lays it out (header padded so data starts 64-aligned)."""
    header = {
        "__metadata__": {"format": "pt"},
        name: {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(raw)) // 64) * 64 - 8
    return struct.pack("<Q", padded) + raw + b" " * (padded - len(raw)) + payload


def make_step(
    root: Path, run: str, step: int, sizes: tuple[int, ...] = SIZES, rank: int | None = None
) -> tuple[Path, str]:
    """A committed step directory under `root` (a file of one U8 tensor of random bytes per size), and its rel;
    built without torch (layout.plan_layout would import it to spell dtypes)."""
    rel = ps.StepRel(run, step, rank)
    step_dir = root.joinpath(*rel.parts)
    step_dir.mkdir(parents=True)
    files, tensors = [], {}
    for i, size in enumerate(sizes):
        name = file_name(i, len(sizes))
        data = safetensors_bytes(f"t{i}", os.urandom(size))
        (step_dir / name).write_bytes(data)
        hasher = new_hasher()
        hasher.update(data)
        files.append(FileEntry(name=name, size=len(data), checksum=hasher.hexdigest()))
        tensors[f"t{i}"] = TensorEntry(file=name, dtype="U8", shape=[size], offsets=(len(data) - size, len(data)))
    structure = {
        "k": "dict",
        "keys": [{"k": "v", "v": t} for t in tensors],
        "values": [{"k": "tensor", "name": t} for t in tensors],
    }
    manifest = Manifest(
        run=run,
        step=step,
        tensors=tensors,
        structure=structure,
        created_at=time.time(),
        rank=rank or 0,
        world_size=(rank or 0) + 1,
        files=files,
    )
    (step_dir / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    return step_dir, str(rel)


def contents(step_dir: Path) -> dict[str, bytes]:
    """The step's files; its seal apart (a receiver's own record of its own inodes: `sealed`)."""
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir()) if p.name != SEAL_NAME}


def sealed(step_dir: Path) -> bool:
    """Every file the manifest lists is sealed by the receiver: read-only, its stamp in `seal.json` holding."""
    stamps = read_seals(step_dir)
    names = [entry.name for entry in read_manifest(step_dir).files]
    return sorted(stamps) == sorted(names) and all(stamps[n].holds((step_dir / n).stat()) for n in names)


def leftovers(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(ps.INCOMING_PREFIX + "*")) if root.exists() else []


def verifies(step_dir: Path) -> bool:
    """Full check of an installed step: manifest, headers and every file's checksum."""
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    for entry in manifest.files:
        hasher = new_hasher()
        hasher.update((step_dir / entry.name).read_bytes())
        if hasher.hexdigest() != entry.checksum:
            return False
    return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[pw.PeerServer]:
    srv = pw.PeerServer(tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=64 << 20, timeout=TIMEOUT)
    srv.start()
    yield srv
    srv.stop()


def hostile_put(server: pw.PeerServer, rel: str, raw: bytes) -> pc.Channel:
    """An authenticated client that offered a step (its manifest `raw`) and was told to send its files."""
    ch = pc.client_session(server.address, TOKEN, TIMEOUT)
    ch.send({"op": "put", "rel": rel})
    ch.send_blob(raw)
    assert ch.reply("offering", "send", "have")["status"] == "send"
    return ch


def failure_of(server: pw.PeerServer, kind: type[PeerError]) -> PeerError:
    """The server's latest failure, once it has recorded one of `kind` (bounded wait)."""
    wait_until(lambda: any(isinstance(e, kind) for e in server.errors), 10, f"the server to record a {kind.__name__}")
    return next(e for e in reversed(server.errors) if isinstance(e, kind))


# --- round trips --------------------------------------------------------------------------------------------


def test_put_list_get_round_trip_is_bit_exact(server: pw.PeerServer, tmp_path: Path) -> None:
    plain, plain_rel = make_step(tmp_path / "src", "exp", 5)
    ranked, ranked_rel = make_step(tmp_path / "src", "exp", 7, (4096, 70000), rank=1)
    total = sum(e.size for e in read_manifest(plain).files)
    assert pw.push_step(server.address, TOKEN, plain, plain_rel, timeout=TIMEOUT) == total
    assert pw.push_step(server.address, TOKEN, ranked, ranked_rel, timeout=TIMEOUT) > 0
    assert contents(server.root / plain_rel) == contents(plain)
    assert contents(server.root / ranked_rel) == contents(ranked)
    assert sealed(server.root / plain_rel) and sealed(server.root / ranked_rel)
    assert pw.list_steps(server.address, TOKEN, "exp", timeout=TIMEOUT) == [plain_rel, ranked_rel]
    assert pw.list_steps(server.address, TOKEN, "other", timeout=TIMEOUT) == []
    # the step is there: a second push sends nothing and replaces nothing
    before = {p.name: p.stat().st_ino for p in (server.root / plain_rel).iterdir()}
    assert pw.push_step(server.address, TOKEN, plain, plain_rel, timeout=TIMEOUT) == 0
    assert {p.name: p.stat().st_ino for p in (server.root / plain_rel).iterdir()} == before
    dest = tmp_path / "dest"
    for rel, source in ((plain_rel, plain), (ranked_rel, ranked)):
        got = pw.pull_step(server.address, TOKEN, rel, dest, timeout=TIMEOUT, max_bytes=1 << 30)
        assert got == dest / rel and contents(got) == contents(source) and verifies(got) and sealed(got)
    assert leftovers(server.root) == [] and leftovers(dest) == []
    with pytest.raises(PeerNotFound, match="no step exp/step-000000006"):
        pw.pull_step(server.address, TOKEN, "exp/step-000000006", dest, timeout=TIMEOUT, max_bytes=1 << 30)
    assert not (dest / "exp" / "step-000000006").exists()


def test_a_step_committed_at_the_destination_is_kept_without_asking(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "dest", "exp", 3)
    before = contents(step_dir)
    server.stop()  # nobody answers: the pull must not need the peer
    assert pw.pull_step(server.address, TOKEN, rel, tmp_path / "dest", timeout=1, max_bytes=1 << 30) == step_dir
    assert contents(step_dir) == before
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        pw.list_steps(server.address, TOKEN, "exp", timeout=1)


# --- names --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    [
        "../x/step-000000001",
        "/abs/step-000000001",
        "exp/../step-000000001",
        "exp//step-000000001",
        "exp/step-1",
        "exp/step-000000001/",
        "exp/step-000000001\n",
        "exp/step-" + "\u0660" * 8 + "\u0661",  # Arabic-Indic digits: int() reads them, DCS never writes them
        "exp/rank-1/step-000000001",
        "exp/rank-00001\n/step-000000001",
        "exp/rank-00001/x/step-000000001",
        ".hidden/step-000000001",
        "-x/step-000000001",
        "exp",
        "",
        "x" * 400 + "/step-000000001",
        5,
        None,
    ],
)
def test_a_bad_rel_is_refused(rel: object) -> None:
    with pytest.raises(PeerRefused):
        ps.parse_rel(rel)


def test_good_rels_parse_and_spell_back() -> None:
    assert ps.parse_rel("exp.1/step-000000005") == ps.StepRel("exp.1", 5)
    assert ps.parse_rel("exp/rank-00003/step-1234567890") == ps.StepRel("exp", 1234567890, 3)
    assert ps.rel_of("exp", 5, 2) == "exp/rank-00002/step-000000005"
    with pytest.raises(PeerRefused):
        ps.rel_of("exp", -1)


def test_the_server_checks_the_rel_itself(server: pw.PeerServer, tmp_path: Path) -> None:
    """A client that skips its own checks still cannot make the server build a path from a bad name."""
    step_dir, _ = make_step(tmp_path / "src", "exp", 1)
    raw = (step_dir / MANIFEST_NAME).read_bytes()
    for op in ("put", "get"):
        ch = pc.client_session(server.address, TOKEN, TIMEOUT)
        ch.send({"op": op, "rel": "../outside/step-000000001", "max_bytes": 1 << 20})
        if op == "put":
            ch.send_blob(raw)
        with pytest.raises(PeerRefused, match=r"not <run>/step-N|run name"):
            ch.reply("offering", "send")
        ch.sock.close()
    assert not (tmp_path / "outside").exists() and sorted(server.root.iterdir()) == []


def test_symlinks_are_never_followed(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (server.root / "exp").symlink_to(outside)
    with pytest.raises(PeerRefused, match="symlink"):
        pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT)
    assert list(outside.iterdir()) == []
    # a symlinked step directory is not listed, and cannot be pushed from
    (server.root / "exp").unlink()
    (server.root / "exp").mkdir()
    (server.root / "exp" / "step-000000001").symlink_to(step_dir)
    assert pw.list_steps(server.address, TOKEN, "exp", timeout=TIMEOUT) == []
    with pytest.raises(PeerRefused, match="symlink"):
        pw.pull_step(server.address, TOKEN, rel, tmp_path / "dest", timeout=TIMEOUT, max_bytes=1 << 30)
    link = tmp_path / "link"
    link.symlink_to(step_dir)
    with pytest.raises(PeerRefused, match="symlink"):
        pw.push_step(server.address, TOKEN, link, rel, timeout=TIMEOUT)


# --- authentication ------------------------------------------------------------------------------------------


def test_a_client_with_the_wrong_token_is_refused_and_nothing_is_written(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    with pytest.raises(PeerAuthFailed, match="does not know the token"):
        pw.push_step(server.address, "wrong", step_dir, rel, timeout=TIMEOUT)
    with pytest.raises(PeerAuthFailed):
        pw.list_steps(server.address, "wrong", "exp", timeout=TIMEOUT)
    assert sorted(server.root.iterdir()) == []
    assert isinstance(failure_of(server, PeerAuthFailed), PeerAuthFailed)


def test_a_server_that_does_not_know_the_token_is_sent_nothing(tmp_path: Path) -> None:
    """The server proves it knows the token before the client says anything about a step."""
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    seen: dict[str, Any] = {}

    def impostor() -> None:
        sock, _ = listener.accept()
        sock.settimeout(10)
        ch = pc.Channel(sock, "client", 10, server=True)
        ch.send({"proto": pc.PROTOCOL, "nonce": os.urandom(pc.NONCE_BYTES).hex()})
        seen["auth"] = ch.recv()
        ch.send({"mac": os.urandom(pc.TAG_BYTES).hex()})  # it cannot compute the right one
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
        seen["after"] = rest
        sock.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(PeerAuthFailed, match="does not know the token"):
        pw.push_step(listener.getsockname(), TOKEN, step_dir, rel, timeout=TIMEOUT)
    thread.join(10)
    listener.close()
    assert not thread.is_alive() and set(seen["auth"]) == {"nonce", "mac"} and seen["after"] == b""


def test_frames_failing_their_mac_are_refused(server: pw.PeerServer) -> None:
    ch = pc.client_session(server.address, TOKEN, TIMEOUT)
    ch.key = bytes(32)  # not the session key
    ch.send({"op": "list", "run": "exp"})
    assert "fails its MAC" in str(failure_of(server, PeerCorrupt))
    ch.sock.close()


# --- hostile clients -----------------------------------------------------------------------------------------


def test_more_bytes_than_announced_are_refused(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    ch = hostile_put(server, rel, (step_dir / MANIFEST_NAME).read_bytes())
    for entry in read_manifest(step_dir).files:
        ch.sock.sendall((step_dir / entry.name).read_bytes())
    ch.sock.sendall(b"x" * 4096)  # beyond the last file: where the trailer should be
    with pytest.raises(PeerCorrupt, match="frame"):
        ch.reply("waiting", "ok")
    ch.sock.close()
    assert not (server.root / rel).exists() and leftovers(server.root) == []


def test_a_trailer_announcing_other_bytes_is_refused(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    ch = hostile_put(server, rel, (step_dir / MANIFEST_NAME).read_bytes())
    for entry in read_manifest(step_dir).files:
        ch.sock.sendall((step_dir / entry.name).read_bytes())
    ch.send({"done": 1})
    with pytest.raises(PeerCorrupt, match="the end of exp/step-000000001"):
        ch.reply("waiting", "ok")
    ch.sock.close()
    assert not (server.root / rel).exists() and leftovers(server.root) == []


def test_a_short_stream_closed_early_leaves_nothing(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    ch = hostile_put(server, rel, (step_dir / MANIFEST_NAME).read_bytes())
    first = read_manifest(step_dir).files[1]
    ch.sock.sendall((step_dir / first.name).read_bytes()[:1000])
    ch.sock.close()
    assert "closed the connection" in str(failure_of(server, PeerUnavailable))
    wait_until(lambda: leftovers(server.root) == [], 10, "the partial step to be removed")
    assert not (server.root / rel).exists()


def test_a_lying_checksum_is_refused(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    victim = step_dir / read_manifest(step_dir).files[2].name
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # the bytes no longer match the manifest's checksum
    victim.write_bytes(bytes(data))
    with pytest.raises(PeerCorrupt, match="checksum"):
        pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT)
    assert not (server.root / rel).exists() and leftovers(server.root) == []


def _edited(step_dir: Path, **changes: Any) -> bytes:
    raw = json.loads((step_dir / MANIFEST_NAME).read_bytes())
    for key, value in changes.items():
        if key == "file0":
            raw["files"][0].update(value)
        else:
            raw[key] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("changes", "error", "reason"),
    [
        ({"file0": {"compression": "zstd", "stored_size": 100}}, PeerRefused, "compressed"),
        ({"file0": {"source_step": 0}}, PeerRefused, "earlier step"),
        ({"step": 2}, PeerCorrupt, "not 'exp' step 1"),
        ({"run": "other"}, PeerCorrupt, "not 'exp' step 1"),
        ({"file0": {"size": 10}}, PeerCorrupt, "outside its file"),
        ({"files": "nope"}, PeerCorrupt, "unreadable"),
        ({"file0": {"name": "../../evil.safetensors"}}, PeerCorrupt, "plain safetensors file name"),
    ],
)
def test_a_bad_manifest_is_refused_before_any_byte(
    server: pw.PeerServer, tmp_path: Path, changes: dict[str, Any], error: type[PeerError], reason: str
) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    ch = pc.client_session(server.address, TOKEN, TIMEOUT)
    ch.send({"op": "put", "rel": rel})
    ch.send_blob(_edited(step_dir, **changes))
    with pytest.raises(error, match=reason):
        ch.reply("offering", "send")
    ch.sock.close()
    assert not (server.root / rel).exists() and leftovers(server.root) == []


def test_a_step_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    with pw.PeerServer(tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=1 << 20, timeout=TIMEOUT) as small:
        with pytest.raises(PeerRefused, match="more than the 1048576 allowed"):
            pw.push_step(small.address, TOKEN, step_dir, rel, timeout=TIMEOUT)
        assert not (small.root / rel).exists()
    with pw.PeerServer(tmp_path / "src", TOKEN, accept_put=any_step, max_step_bytes=1 << 30, timeout=TIMEOUT) as source:
        with pytest.raises(PeerRefused, match="more than the 1000 allowed"):
            pw.pull_step(source.address, TOKEN, rel, tmp_path / "dest", timeout=TIMEOUT, max_bytes=1000)
    assert leftovers(tmp_path / "dest") == [] and not (tmp_path / "dest" / rel).exists()


@pytest.mark.parametrize("authenticated", [False, True])
def test_an_oversized_header_is_refused_unread(server: pw.PeerServer, authenticated: bool) -> None:
    if authenticated:
        ch = pc.client_session(server.address, TOKEN, TIMEOUT)
        sock = ch.sock
    else:
        sock = socket.create_connection(server.address, timeout=TIMEOUT)
        pc.Channel(sock, "server", TIMEOUT, server=False).recv()  # the greeting
    sock.sendall(struct.pack(">I", 1 << 30))  # a 1 GiB header: never allocated, never read
    assert "more than 65536" in str(failure_of(server, PeerCorrupt))
    sock.close()


def test_a_committed_step_is_never_replaced(server: pw.PeerServer, tmp_path: Path) -> None:
    good_dir, rel = make_step(tmp_path / "good", "exp", 1)
    pw.push_step(server.address, TOKEN, good_dir, rel, timeout=TIMEOUT)
    held = contents(server.root / rel)
    other_dir, _ = make_step(tmp_path / "other", "exp", 1)  # same name, other bytes
    assert pw.push_step(server.address, TOKEN, other_dir, rel, timeout=TIMEOUT) == 0
    # a hostile client is told "have" before it may send a byte
    ch = pc.client_session(server.address, TOKEN, TIMEOUT)
    ch.send({"op": "put", "rel": rel})
    ch.send_blob((other_dir / MANIFEST_NAME).read_bytes())
    assert ch.reply("offering", "send", "have")["status"] == "have"
    ch.sock.close()
    assert contents(server.root / rel) == held and verifies(server.root / rel)


def test_a_corrupt_copy_on_the_serving_side_is_refused_by_the_puller(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT)
    victim = server.root / rel / read_manifest(step_dir).files[1].name
    data = bytearray(victim.read_bytes())
    data[5000] ^= 1
    victim.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    with pytest.raises(PeerCorrupt, match="checksum"):
        pw.pull_step(server.address, TOKEN, rel, dest, timeout=TIMEOUT, max_bytes=1 << 30)
    assert not (dest / rel).exists() and leftovers(dest) == []
    victim.write_bytes(victim.read_bytes()[:-10])  # now also shorter than its manifest says
    with pytest.raises(PeerCorrupt, match="regular file of"):
        pw.pull_step(server.address, TOKEN, rel, dest, timeout=TIMEOUT, max_bytes=1 << 30)


def test_a_local_step_that_fails_its_checks_is_not_pushed(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    with pytest.raises(CorruptCheckpoint, match="not 'exp' step 2"):
        pw.push_step(server.address, TOKEN, step_dir, "exp/step-000000002", timeout=TIMEOUT)
    (step_dir / MANIFEST_NAME).unlink()
    with pytest.raises(CorruptCheckpoint, match="not a committed step"):
        pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT)
    assert sorted(server.root.iterdir()) == []


# --- concurrency, limits, stopping ---------------------------------------------------------------------------


def test_concurrent_puts_of_one_step_install_it_once(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1, (4 << 20, 4 << 20))
    results: list[object] = []

    def push() -> None:
        try:
            results.append(pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT))
        except PeerError as exc:
            results.append(exc)

    threads = [threading.Thread(target=push) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4 and all(isinstance(r, int) for r in results), results
    assert contents(server.root / rel) == contents(step_dir) and verifies(server.root / rel)
    assert leftovers(server.root) == []
    # and concurrent pulls into one place
    dest = tmp_path / "dest"
    pulled: list[object] = []
    pullers = [
        threading.Thread(
            target=lambda: pulled.append(
                pw.pull_step(server.address, TOKEN, rel, dest, timeout=TIMEOUT, max_bytes=1 << 30)
            )
        )
        for _ in range(3)
    ]
    for thread in pullers:
        thread.start()
    for thread in pullers:
        thread.join(30)
    assert pulled == [dest / rel] * 3 and contents(dest / rel) == contents(step_dir) and leftovers(dest) == []


def test_connections_beyond_the_limit_are_told_busy(tmp_path: Path) -> None:
    with pw.PeerServer(
        tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=1 << 20, timeout=TIMEOUT, max_connections=1
    ) as srv:
        held = pc.client_session(srv.address, TOKEN, TIMEOUT)  # authenticated, idle: holds the only slot
        # the server takes the slot just after sending its proof, which is where the client's handshake ends: under
        # load the next connection could take it first (a fresh-clone run saw the list succeed)
        wait_until(lambda: srv._slots._value == 0, 10, "the held session's slot")
        with pytest.raises(PeerUnavailable, match="busy"):
            pw.list_steps(srv.address, TOKEN, "exp", timeout=TIMEOUT)
        held.sock.close()
        wait_until(lambda: not srv._conns, 10, "the slot to be free")
        assert pw.list_steps(srv.address, TOKEN, "exp", timeout=TIMEOUT) == []


def test_stop_cuts_a_transfer_and_removes_its_partial_step(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    srv = pw.PeerServer(tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=1 << 30, timeout=30)
    srv.start()
    ch = hostile_put(srv, rel, (step_dir / MANIFEST_NAME).read_bytes())
    ch.sock.sendall(b"\0" * 500)  # then nothing: the server waits for the rest
    wait_until(lambda: leftovers(srv.root) != [], 10, "the transfer to start")
    began = time.monotonic()
    srv.stop()
    assert time.monotonic() - began < 5
    assert leftovers(srv.root) == [] and not (srv.root / rel).exists()
    ch.sock.close()


def test_on_installed_names_each_step_a_put_installed(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    seen: list[str] = []

    def hook(installed: str) -> None:
        seen.append(installed)
        raise RuntimeError("a failing hook changes nothing for the peer")

    with pw.PeerServer(tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=1 << 30, on_installed=hook) as srv:
        assert pw.push_step(srv.address, TOKEN, step_dir, rel, timeout=TIMEOUT) > 0
        assert pw.push_step(srv.address, TOKEN, step_dir, rel, timeout=TIMEOUT) == 0
        wait_until(lambda: seen == [rel], 10, "the hook to be called once")
        assert verifies(srv.root / rel)


def test_a_stale_incoming_directory_is_removed_at_start(tmp_path: Path) -> None:
    stale = tmp_path / "peer" / "exp" / "rank-00001" / (ps.INCOMING_PREFIX + "dead")
    stale.mkdir(parents=True)
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"x")
    with pw.PeerServer(tmp_path / "peer", TOKEN, accept_put=any_step, max_step_bytes=1 << 20):
        assert leftovers(tmp_path / "peer") == []


# --- other processes -----------------------------------------------------------------------------------------

SERVER = """
import sys
from pathlib import Path
from dcs_tasks.checkpoint.store.peers.transfer import PeerServer
srv = PeerServer(Path(sys.argv[1]), sys.argv[2], accept_put=lambda rel, raw: None, max_step_bytes=1 << 30, timeout=5.0)
print(srv.start()[1], flush=True)
sys.stdin.read()
srv.stop()
"""

# A peer that takes part of a step, then dies (SIGKILL: no goodbye, the kernel closes its socket).
DYING_SERVER = """
import os, signal, socket, sys
from pathlib import Path
from dcs_tasks.checkpoint.store.peers import channel as pc
from dcs_tasks.checkpoint.store.peers import stepfiles as ps
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
sock, _ = listener.accept()
ch = pc.Channel(sock, "client", 5.0, server=True)
pc.accept_session(ch, sys.argv[2].encode())  # the server side of the handshake only
ch.recv()
ch.recv_blob(ps.MAX_MANIFEST_BYTES)
ch.send({"status": "send"})
ch.recv_exact(1 << 20, "the first MiB")
os.kill(os.getpid(), signal.SIGKILL)
"""

# A peer that starts sending a step it was asked for (`get`), then dies.
DYING_SENDER = """
import os, signal, socket, sys
from pathlib import Path
from dcs_tasks.checkpoint.store.peers import channel as pc
step_dir = Path(sys.argv[3])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
sock, _ = listener.accept()
ch = pc.Channel(sock, "client", 5.0, server=True)
pc.accept_session(ch, sys.argv[2].encode())  # the server side of the handshake only
ch.recv()
ch.send({"status": "send"})
ch.send_blob((step_dir / "manifest.json").read_bytes())
sock.sendall(sorted(step_dir.glob("*.safetensors"))[0].read_bytes()[: 1 << 20])
os.kill(os.getpid(), signal.SIGKILL)
"""

# A client that sends part of a step, then dies.
DYING_CLIENT = """
import os, signal, sys
from pathlib import Path
from dcs_tasks.checkpoint.store.peers import channel as pc
port, token, step_dir, rel = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
ch = pc.client_session(("127.0.0.1", port), token, 5.0)
ch.send({"op": "put", "rel": rel})
ch.send_blob((step_dir / "manifest.json").read_bytes())
ch.reply("offering", "send")
first = sorted(step_dir.glob("*.safetensors"))[0]
ch.sock.sendall(first.read_bytes())
ch.sock.sendall(b"\\0" * 100000)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def first_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child printed nothing in time"
    return proc.stdout.readline().strip()


def finish(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_a_server_in_another_process_round_trip_and_a_hung_one(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 9, rank=2)
    proc = spawn(SERVER, str(tmp_path / "peer"), TOKEN)
    try:
        address = ("127.0.0.1", int(first_line(proc)))
        assert pw.push_step(address, TOKEN, step_dir, rel, timeout=TIMEOUT) > 0
        assert pw.list_steps(address, TOKEN, "exp", timeout=TIMEOUT) == [rel]
        got = pw.pull_step(address, TOKEN, rel, tmp_path / "dest", timeout=TIMEOUT, max_bytes=1 << 30)
        assert contents(got) == contents(step_dir)
        # stopped (not dead): the kernel still accepts connections, nothing answers
        proc.send_signal(signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(PeerUnavailable, match="within 1s"):
            pw.list_steps(address, TOKEN, "exp", timeout=1.0)
        assert time.monotonic() - began < 3
        proc.send_signal(signal.SIGCONT)
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
        assert proc.returncode == 0
    finally:
        finish(proc)


def test_a_peer_killed_mid_transfer_is_unavailable_within_the_timeout(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1, (16 << 20, 16 << 20))
    proc = spawn(DYING_SERVER, str(tmp_path / "unused"), TOKEN)
    try:
        address = ("127.0.0.1", int(first_line(proc)))
        began = time.monotonic()
        with pytest.raises(PeerUnavailable):
            pw.push_step(address, TOKEN, step_dir, rel, timeout=TIMEOUT)
        assert time.monotonic() - began < TIMEOUT
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        finish(proc)


def test_a_sender_killed_mid_transfer_leaves_the_puller_nothing(tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1, (4 << 20, 4 << 20))
    proc = spawn(DYING_SENDER, str(tmp_path / "unused"), TOKEN, str(step_dir))
    dest = tmp_path / "dest"
    try:
        address = ("127.0.0.1", int(first_line(proc)))
        began = time.monotonic()
        with pytest.raises(PeerUnavailable, match="closed the connection"):
            pw.pull_step(address, TOKEN, rel, dest, timeout=TIMEOUT, max_bytes=1 << 30)
        assert time.monotonic() - began < TIMEOUT
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        finish(proc)
    assert not (dest / rel).exists() and leftovers(dest) == []


def test_a_client_killed_mid_transfer_leaves_no_partial_step(server: pw.PeerServer, tmp_path: Path) -> None:
    step_dir, rel = make_step(tmp_path / "src", "exp", 1)
    proc = spawn(DYING_CLIENT, str(server.address[1]), TOKEN, str(step_dir), rel)
    try:
        assert first_line(proc) == "sent"
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        finish(proc)
    assert "closed the connection" in str(failure_of(server, PeerUnavailable))
    wait_until(lambda: leftovers(server.root) == [], 10, "the partial step to be removed")
    assert not (server.root / rel).exists()
    # and the server still serves
    assert pw.push_step(server.address, TOKEN, step_dir, rel, timeout=TIMEOUT) > 0


def test_idle_connections_hold_their_place_only_briefly_and_never_a_transfer_slot(tmp_path: Path) -> None:
    """Before authenticating: at most `per_source` connections from one address (more are closed at once), each
    for at most `handshake_seconds`, and none of them keeps an authenticated client from a transfer slot. After
    it: a client that says nothing holds its slot only for the handshake's time plus the largest manifest's at
    the minimum rate (1 + 1 s here)."""
    with pw.PeerServer(
        tmp_path / "peer",
        TOKEN,
        accept_put=any_step,
        max_step_bytes=1 << 20,
        timeout=TIMEOUT,
        handshake_seconds=1.0,
        max_connections=1,
        per_source=2,
        max_manifest_bytes=1 << 20,
        min_rate=1 << 20,
    ) as srv:
        idle = [socket.create_connection(srv.address, TIMEOUT, ("127.0.0.2", 0)) for _ in range(3)]
        try:
            idle[2].settimeout(2.0)
            frames = idle[2].recv(65536)  # the third from this address: told why, and closed at once
            assert b"too many connections are authenticating" in frames
            # from another address: the one transfer slot is free
            assert pw.list_steps(srv.address, TOKEN, "exp", timeout=TIMEOUT) == []
            began = time.monotonic()
            for sock in idle[:2]:  # the greeting, then closed at the handshake deadline
                sock.settimeout(5.0)
                while sock.recv(65536):
                    pass
            assert time.monotonic() - began < 2.0
        finally:
            for sock in idle:
                sock.close()
        quiet = pc.client_session(srv.address, TOKEN, TIMEOUT)  # authenticated, holds the slot, says nothing
        began = time.monotonic()
        quiet.sock.settimeout(10.0)
        with pytest.raises(PeerUnavailable, match="closed the connection"):
            quiet.reply("waiting", "never")
        assert time.monotonic() - began < 4.0
        quiet.sock.close()
        assert pw.list_steps(srv.address, TOKEN, "exp", timeout=TIMEOUT) == []
