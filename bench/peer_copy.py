"""Peer copy throughput: the memory tier's `transfer.push_step` (and `pull_step`) against a plain TCP copy of the
same bytes over the same link, in one run.

One committed step of `--files` files (`--size-mib` MiB in all; 4 x 256 MiB by default) of random bytes in
/dev/shm, laid out as DCS writes it (safetensors files, xxh3_128 checksums, manifest). A server process holds a
`PeerServer` on a memory root in /dev/shm and a plain receiver; a client process, on the other end of the link,
runs `--reps` rounds of, in turns:
  plain  connect, a small JSON list of (name, size), `sendfile` of every file; the receiver `recv_into`s a
         reusable buffer (MSG_WAITALL, the same size and socket options as the memory tier's transport) and
         writes each file into /dev/shm, then answers one byte: no authentication, no hashing, no checks
  push   `push_step`: handshake (HMAC both ways), manifest checked, `sendfile` of every file, each hashed on
         arrival, headers checked, manifest written, directory renamed into place, answer
  pull   `pull_step` of the same step back from the server (the server sends, the client hashes and installs)
GB/s = step bytes / seconds from connect to the final answer (1 GB = 1e9 bytes); medians and ratios (DCS / plain)
per link. Links: `loopback` (both processes in this network namespace), and `veth` (each process in a network
namespace of its own, joined by a veth pair; made and removed here) when run as root and `ip netns` works.
The destination directories are removed between rounds (not timed). Other work may share the machine: the
load average is recorded before and after every link and in the result file (bench.harness.Run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, Run
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

MiB = 1 << 20
TOKEN = "bench-peer-token"
RUN = "bench"
REL = "bench/step-000000001"
NETNS = ("dcsbench-a", "dcsbench-b")
VETH = ("dcsbench-va", "dcsbench-vb")
VETH_ADDR = ("10.231.7.1", "10.231.7.2")
CHILD_TIMEOUT = 900.0


# --- the step ---------------------------------------------------------------------------------------------


def make_step(root: Path, files: int, total: int) -> Path:
    """A committed step of `files` files holding `total` bytes of tensor data (one U8 tensor each)."""
    step_dir = root / REL
    step_dir.mkdir(parents=True)
    entries, tensors = [], {}
    for i in range(files):
        size = total // files
        name = file_name(i, files)
        header = json.dumps(
            {"__metadata__": {"format": "pt"}, f"t{i}": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}},
            separators=(",", ":"),
        ).encode()
        padded = -(-(8 + len(header)) // 64) * 64 - 8
        head = struct.pack("<Q", padded) + header + b" " * (padded - len(header))
        hasher = new_hasher()
        hasher.update(head)
        with open(step_dir / name, "wb") as out:
            out.write(head)
            left = size
            while left:
                block = os.urandom(min(64 * MiB, left))
                hasher.update(block)
                out.write(block)
                left -= len(block)
        entries.append(FileEntry(name=name, size=len(head) + size, checksum=hasher.hexdigest()))
        tensors[f"t{i}"] = TensorEntry(file=name, dtype="U8", shape=[size], offsets=(len(head), len(head) + size))
    structure = {
        "k": "dict",
        "keys": [{"k": "v", "v": t} for t in tensors],
        "values": [{"k": "tensor", "name": t} for t in tensors],
    }
    manifest = Manifest(run=RUN, step=1, tensors=tensors, structure=structure, created_at=time.time(), files=entries)
    (step_dir / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    return step_dir


# --- the plain contender ----------------------------------------------------------------------------------


def plain_receive(conn: socket.socket, dest: Path) -> None:
    """One plain copy: (name, size) list, then each file's bytes into `dest`, then a one-byte answer."""
    conn.settimeout(60)
    (length,) = struct.unpack(">I", _recv_exact(conn, 4))
    listing = json.loads(_recv_exact(conn, length))
    dest.mkdir(parents=True, exist_ok=True)
    buf = bytearray(ps.RECV_CHUNK_BYTES)
    view = memoryview(buf)
    for name, size in listing:
        fd = os.open(dest / Path(name).name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left:
                want = min(left, len(buf))
                pos = 0
                while pos < want:
                    n = conn.recv_into(view[pos:want], want - pos, socket.MSG_WAITALL)
                    if n == 0:
                        raise ConnectionError("plain sender closed early")
                    pos += n
                with view[:want] as chunk:
                    written = 0
                    while written < want:
                        written += os.write(fd, chunk[written:])
                left -= want
        finally:
            os.close(fd)
    conn.sendall(b"k")


def plain_send(address: tuple[str, int], step_dir: Path) -> None:
    files = sorted(step_dir.glob("*.safetensors"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        pc.tune(sock)
        sock.settimeout(60)
        sock.connect(address)
        listing = json.dumps([[f.name, f.stat().st_size] for f in files]).encode()
        sock.sendall(struct.pack(">I", len(listing)) + listing)
        for f in files:
            with open(f, "rb") as src:
                sock.sendfile(src)
        if _recv_exact(sock, 1) != b"k":
            raise ConnectionError("plain receiver did not confirm")
    finally:
        sock.close()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("connection closed early")
        buf += chunk
    return bytes(buf)


# --- the two ends -----------------------------------------------------------------------------------------


def tune(args: argparse.Namespace) -> None:
    ps.RECV_CHUNK_BYTES = int(args.chunk_kib * 1024)
    pc.SOCKET_BUFFER_BYTES = int(args.sockbuf_mib * MiB)


def serve(args: argparse.Namespace) -> None:
    """The server end: a PeerServer on `--root`/peer and a plain receiver into `--root`/plain; prints its ports,
    runs until stdin closes."""
    tune(args)
    root = Path(args.root)
    server = pw.PeerServer(
        root / "peer", TOKEN, args.bind, 0, max_step_bytes=1 << 40, accept_put=lambda rel, raw: None, timeout=60.0
    )
    _, peer_port = server.start()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    pc.tune(listener)
    listener.bind((args.bind, 0))
    listener.listen(8)
    print(json.dumps({"peer": peer_port, "plain": listener.getsockname()[1], "pid": os.getpid()}), flush=True)
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
            if sys.stdin in ready and not sys.stdin.readline():
                return
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    plain_receive(conn, root / "plain")
                finally:
                    conn.close()
    finally:
        listener.close()
        server.stop()


def client(args: argparse.Namespace) -> None:
    """The client end: `--reps` rounds of plain, push and pull (their order turning each round); prints JSON."""
    tune(args)
    step_dir = Path(args.step)
    server_root = Path(args.server_root)
    dest = Path(args.root) / "pulled"
    total = sum(f.stat().st_size for f in step_dir.glob("*.safetensors"))
    peer = (args.host, args.peer_port)
    plain = (args.host, args.plain_port)
    rounds: list[dict[str, Any]] = []

    def run_plain() -> float:
        began = time.perf_counter()
        plain_send(plain, step_dir)
        return time.perf_counter() - began

    def run_push() -> float:
        began = time.perf_counter()
        sent = pw.push_step(peer, TOKEN, step_dir, REL, timeout=60.0)
        took = time.perf_counter() - began
        assert sent == total, f"push sent {sent} of {total} bytes"
        return took

    def run_pull_setup() -> None:
        if not (server_root / "peer" / REL / MANIFEST_NAME).exists():
            pw.push_step(peer, TOKEN, step_dir, REL, timeout=60.0)

    def run_pull() -> float:
        began = time.perf_counter()
        pw.pull_step(peer, TOKEN, REL, dest, timeout=60.0, max_bytes=1 << 40)
        return time.perf_counter() - began

    contenders = {"plain": run_plain, "push": run_push, "pull": run_pull}
    order = list(contenders)
    for rep in range(args.reps + 1):  # round 0 warms up (page faults of the source, TCP windows), not counted
        seconds: dict[str, float] = {}
        cpu: dict[str, dict[str, float]] = {}
        for name in order[rep % 3 :] + order[: rep % 3]:
            if name == "push":
                shutil.rmtree(server_root / "peer" / RUN, ignore_errors=True)
            if name == "pull":
                run_pull_setup()
            server_before, client_before = cpu_seconds(args.server_pid), own_cpu_seconds()
            seconds[name] = contenders[name]()
            cpu[name] = {
                "server": round(cpu_seconds(args.server_pid) - server_before, 3),
                "client": round(own_cpu_seconds() - client_before, 3),
            }
            shutil.rmtree(server_root / "plain", ignore_errors=True)
            shutil.rmtree(dest, ignore_errors=True)
        if rep:
            rounds.append({"seconds": seconds, "cpu_seconds": cpu, "load": [round(x, 2) for x in os.getloadavg()]})
    print(json.dumps({"bytes": total, "rounds": rounds}), flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


# --- orchestration ----------------------------------------------------------------------------------------


def child_argv(mode: str, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        mode,
        "--chunk-kib",
        str(args.chunk_kib),
        "--sockbuf-mib",
        str(args.sockbuf_mib),
        *extra,
    ]


def in_netns(ns: str | None, argv: list[str]) -> list[str]:
    return argv if ns is None else ["ip", "netns", "exec", ns, *argv]


def measure(
    link: str, args: argparse.Namespace, step_dir: Path, work: Path, ns: tuple[str | None, str | None], host: str
) -> dict[str, Any]:
    server_root = work / f"server-{link}"
    client_root = work / f"client-{link}"
    client_root.mkdir()
    load_before = os.getloadavg()
    server = subprocess.Popen(
        in_netns(ns[1], child_argv("serve", args, "--root", str(server_root), "--bind", host)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        ready, _, _ = select.select([server.stdout], [], [], 60)
        if not ready:
            raise TimeoutError(f"{link}: the server end printed no ports within 60 s")
        ports = json.loads(server.stdout.readline())
        argv = child_argv(
            "client", args, "--root", str(client_root), "--step", str(step_dir), "--server-root", str(server_root),
            "--host", host, "--peer-port", str(ports["peer"]), "--plain-port", str(ports["plain"]),
            "--reps", str(args.reps), "--server-pid", str(ports["pid"]),
        )  # fmt: skip
        done = subprocess.run(in_netns(ns[0], argv), capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        if done.returncode:
            raise RuntimeError(f"{link}: the client end failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        server.stdin.close()
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        shutil.rmtree(server_root, ignore_errors=True)
        shutil.rmtree(client_root, ignore_errors=True)
    return summarize(link, result, load_before, mtu(ns[0], VETH[0] if ns[0] else "lo"))


def summarize(
    link: str, result: dict[str, Any], load_before: tuple[float, ...], link_mtu: int | None
) -> dict[str, Any]:
    total = result["bytes"]
    out: dict[str, Any] = {
        "link": link,
        "mtu": link_mtu,
        "bytes": total,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": result["rounds"],
    }
    for name in ("plain", "push", "pull"):
        rates = sorted(total / r["seconds"][name] / 1e9 for r in result["rounds"])
        receiver, sender = ("client", "server") if name == "pull" else ("server", "client")
        out[name] = {
            "gbps": [round(x, 3) for x in rates],
            "median_gbps": round(statistics.median(rates), 3),
            "best_gbps": round(rates[-1], 3),
            # CPU seconds per GB on each end: what the copy costs whatever else runs on the machine
            "receiver_cpu_s_per_gb": round(
                statistics.median(r["cpu_seconds"][name][receiver] for r in result["rounds"]) / (total / 1e9), 3
            ),
            "sender_cpu_s_per_gb": round(
                statistics.median(r["cpu_seconds"][name][sender] for r in result["rounds"]) / (total / 1e9), 3
            ),
        }
    out["push_vs_plain"] = round(out["push"]["median_gbps"] / out["plain"]["median_gbps"], 3)
    out["pull_vs_plain"] = round(out["pull"]["median_gbps"] / out["plain"]["median_gbps"], 3)
    return out


def mtu(ns: str | None, device: str) -> int | None:
    argv = ["ip", *(["-n", ns] if ns else []), "-j", "link", "show", "dev", device]
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return int(json.loads(done.stdout)[0]["mtu"])
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


def remove_netns() -> None:
    for ns in NETNS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@contextlib.contextmanager
def veth_pair() -> Iterator[str | None]:
    """Two network namespaces joined by a veth pair; yields None (with the reason printed) when unavailable."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("veth: skipped (needs root and iproute2)")
        yield None
        return
    remove_netns()  # leftovers of an interrupted run
    try:
        for ns in NETNS:
            _ip("netns", "add", ns)
        _ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for ns, dev, addr in zip(NETNS, VETH, VETH_ADDR, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        remove_netns()
        print(f"veth: skipped ({getattr(exc, 'stderr', '') or exc})")
        yield None
        return
    try:
        yield "ok"
    finally:
        remove_netns()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "serve", "client"))
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--links", default="loopback,veth")
    parser.add_argument("--chunk-kib", type=int, default=ps.RECV_CHUNK_BYTES // 1024)
    parser.add_argument("--sockbuf-mib", type=float, default=pc.SOCKET_BUFFER_BYTES / MiB)
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default: bench/results/peer_copy/<UTC>.json)"
    )
    # the children's own arguments
    parser.add_argument("--root")
    parser.add_argument("--bind")
    parser.add_argument("--step")
    parser.add_argument("--server-root")
    parser.add_argument("--host")
    parser.add_argument("--peer-port", type=int)
    parser.add_argument("--plain-port", type=int)
    parser.add_argument("--server-pid", type=int)
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args)
        return
    if args.mode == "client":
        client(args)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    record = Run("peer_copy")
    links = [name.strip() for name in args.links.split(",") if name.strip()]
    work = Path(tempfile.mkdtemp(prefix="dcs-bench-peer-", dir="/dev/shm"))
    figures: dict[str, Any] = {
        "size_bytes": args.size_mib * MiB,
        "files": args.files,
        "reps": args.reps,
        "recv_chunk_bytes": args.chunk_kib * 1024,
        "socket_buffer_bytes": int(args.sockbuf_mib * MiB),
        "socket_buffers": "set" if pc.buffer_limit() >= args.sockbuf_mib * MiB > 0 else "autotuned",
        "links": {},
    }
    try:
        print(f"making a {args.size_mib} MiB step of {args.files} files in {work} ...", flush=True)
        step_dir = make_step(work / "source", args.files, args.size_mib * MiB)
        for link in links:
            if link == "loopback":
                figures["links"][link] = measure(link, args, step_dir, work, (None, None), "127.0.0.1")
            elif link == "veth":
                with veth_pair() as ok:
                    if ok is None:
                        figures["links"][link] = {"skipped": "needs root and working `ip netns`"}
                        continue
                    figures["links"][link] = measure(link, args, step_dir, work, NETNS, VETH_ADDR[1])
            else:
                raise SystemExit(f"unknown link {link!r}: loopback or veth")
            report(figures["links"][link])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        Row(
            what=f"{args.size_mib} MiB step of {args.files} files over {fig['link']}: {name}_step vs a plain TCP copy",
            ours=f"{fig[name]['median_gbps']} GB/s",
            compared=f"{fig['plain']['median_gbps']} GB/s",
            ratio=fig[f"{name}_vs_plain"],
            ratio_text="median GB/s, DCS / plain (sendfile -> recv_into + write, no auth, no hashing)",
        )
        for fig in figures["links"].values()
        if "skipped" not in fig
        for name in ("push", "pull")
    ]
    headline = "; ".join(
        f"{fig['link']}: push {fig['push']['median_gbps']} GB/s = {fig['push_vs_plain']}x a plain TCP copy"
        for fig in figures["links"].values()
        if "skipped" not in fig
    )
    notes = "1 GB = 1e9 bytes; medians of --reps rounds after a warm-up round; CPU seconds per GB from /proc"
    record.record(
        figures, rows, notes=notes, out=args.out, headline=f"peer copy of a {args.size_mib} MiB step: {headline}"
    )


def report(fig: dict[str, Any]) -> None:
    print(
        f"{fig['link']:>8} (mtu {fig['mtu']}): plain {fig['plain']['median_gbps']:.2f} GB/s, "
        f"push {fig['push']['median_gbps']:.2f} GB/s ({fig['push_vs_plain']:.2f}x), "
        f"pull {fig['pull']['median_gbps']:.2f} GB/s ({fig['pull_vs_plain']:.2f}x); receiver CPU s/GB: plain "
        f"{fig['plain']['receiver_cpu_s_per_gb']}, push {fig['push']['receiver_cpu_s_per_gb']}, pull "
        f"{fig['pull']['receiver_cpu_s_per_gb']}; "
        f"load {fig['load_before']} -> {fig['load_after']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
