"""Checkpoints through S3: DCS's durable save and restore against a plain parallel multipart transfer of the same
bytes (the limit) and torch DCP's S3 writers, all against one S3 server in one run.

  limit  s3transfer (boto3's managed transfer) and obstore (Rust object_store) uploading / downloading the same
         files with the same part size and as many parts in flight as DCS has
  ours   Checkpointer.save -> durable commit (a real `dcs worker` and redis-server), Checkpointer.restore()
         into new memory and restore(into=) existing tensors, both verified
  others torch.distributed.checkpoint with s3torchconnector's DCP writer/reader (AWS CRT client) and with
         fsspec's S3 (s3fs: DCP's FsspecWriter/FsspecReader, as many IO threads as DCS has parts in flight):
         s3fs pins an older botocore than DCS's boto3, so it runs in a child process with its own botocore
         (`.bench-s3fs/`, installed by `make bench-storage`; "not run" without it)

Payload signing (`--payload-signing`, default off): whether SigV4 signatures cover each request body's SHA-256.
DCS's default (`s3_payload_signing = auto`) is off over https and on over plain http; the bench's server is plain
http on loopback standing in for an https endpoint, so by default every contender that has the option runs
unsigned (DCS, s3transfer, obstore's `unsigned_payload`, s3fs), as s3torchconnector's CRT client always does
(aws-c-s3 signs UNSIGNED-PAYLOAD); `--payload-signing on` signs for DCS, s3transfer, obstore and s3fs alike.

The server is whatever AWS_ENDPOINT_URL names (credentials from the standard AWS environment); `--bucket` must
exist. The server's own caches are not dropped, for any contender. Prints a summary and writes
a result file under bench/results/storage/. Example (a Swift s3api server the test suite starts, see
docs/benchmarks.md):
    AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
        python bench/storage.py --bucket bench --size-mb 1024
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, Run, start_redis, start_worker, stop, tree_cpu_seconds
from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig

MiB = 1 << 20


def make_state(size_mb: int, tensors: int) -> dict[str, torch.Tensor]:
    per = size_mb * MiB // 4 // tensors
    return {f"layers.{i}.weight": torch.randn(per) for i in range(tensors)}


def timed(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


SIGN = False  # --payload-signing: the plain contenders sign their bodies as DCS does (set by main)
WORKER_PID: int | None = None  # the `dcs worker` (its pool's CPU counts as DCS's client side; set by main)
CPU: dict[str, list[dict[str, float]]] = {}  # upload phases by contender: CPU seconds (`cpu_spent`)


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def client_seconds() -> float:
    """CPU seconds of the client side so far: this process (every thread: the trainer's copy, botocore's and
    obstore's and the CRT's own threads) and the `dcs worker` with its pool processes."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + (0.0 if WORKER_PID is None else tree_cpu_seconds(WORKER_PID))


@contextlib.contextmanager
def cpu_spent(name: str) -> Iterator[None]:
    """Record under `name` in CPU the CPU seconds the client side and the whole machine (the S3 server included,
    when it runs here) spend in the `with` block."""
    client, busy = client_seconds(), machine_busy_seconds()
    yield
    CPU.setdefault(name, []).append(
        {"client_cpu_s": client_seconds() - client, "machine_cpu_s": machine_busy_seconds() - busy}
    )


def client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        config=Config(
            s3={"addressing_style": "path", "payload_signing_enabled": SIGN},
            max_pool_connections=64,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def plain_transfer(
    bucket: str, files: list[bytes], part: int, concurrency: int, tag: str, at_once: int
) -> tuple[float, float]:
    """(upload seconds, download seconds) of `files` as objects by s3transfer, `at_once` files at a time with
    `concurrency` parts each (what DCS's worker processes and `s3_concurrency` keep in flight)."""
    from boto3.s3.transfer import TransferConfig

    s3 = client()
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency)
    keys = [f"plain/{tag}/file-{i}" for i in range(len(files))]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(at_once) as pool:
        with cpu_spent("plain"):
            up = timed(
                lambda: list(
                    pool.map(
                        lambda kv: s3.upload_fileobj(io.BytesIO(kv[1]), bucket, kv[0], Config=cfg),
                        zip(keys, files, strict=True),
                    )
                )
            )
        sinks = [io.BytesIO() for _ in files]
        down = timed(
            lambda: list(
                pool.map(
                    lambda ks: s3.download_fileobj(bucket, ks[0], ks[1], Config=cfg), zip(keys, sinks, strict=True)
                )
            )
        )
    assert [s.getvalue() for s in sinks] == files
    return up, down


def plain_obstore(
    bucket: str, files: list[bytes], part: int, concurrency: int, tag: str, at_once: int
) -> tuple[float, float] | str:
    """(upload seconds, download seconds) of the same files by obstore (Rust object_store), `at_once` files at a
    time: multipart `put` and parallel ranged `get_ranges` of `part` bytes."""
    try:
        import obstore
        from obstore.store import S3Store as ObStore
    except ImportError as exc:
        return f"not run: {exc}"
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    store = ObStore(
        bucket,
        endpoint=endpoint,
        access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        virtual_hosted_style_request=False,
        unsigned_payload=not SIGN,
        client_options={"allow_http": endpoint.startswith("http://")},
    )
    keys = [f"obstore/{tag}/file-{i}" for i in range(len(files))]
    from concurrent.futures import ThreadPoolExecutor

    def put(kv: tuple[str, bytes]) -> None:
        obstore.put(store, kv[0], kv[1], chunk_size=part, max_concurrency=concurrency)

    def get(kv: tuple[str, bytes]) -> bool:
        size = len(kv[1])
        starts = list(range(0, size, part))
        got = obstore.get_ranges(store, kv[0], starts=starts, ends=[min(b + part, size) for b in starts])
        return b"".join(bytes(g) for g in got) == kv[1]

    with ThreadPoolExecutor(at_once) as pool:
        with cpu_spent("plain_obstore"):
            up = timed(lambda: list(pool.map(put, zip(keys, files, strict=True))))
        results: list[bool] = []
        down = timed(lambda: results.extend(pool.map(get, zip(keys, files, strict=True))))
    assert all(results)
    return up, down


def dcs_round(ckpt: Checkpointer, config: DCSConfig, state: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """One save (stall, then durable commit, both from the call) through `ckpt` (warmed up: its staging buffer
    exists), then restores by a fresh Checkpointer, as a restarted trainer does."""
    with cpu_spent("dcs"):
        began = time.perf_counter()
        pending = ckpt.save(state, step=step)
        stall = time.perf_counter() - began
        pending.wait(timeout=1800)
        durable = time.perf_counter() - began
    with Checkpointer("bench", config) as fresh:
        began = time.perf_counter()
        restored = fresh.restore(step=step)
        restore = time.perf_counter() - began
        assert all(torch.equal(restored.state[k], v) for k, v in state.items())
        del restored
        target = {k: torch.empty_like(v) for k, v in state.items()}
        began = time.perf_counter()
        fresh.restore(step=step, into=target)
        into = time.perf_counter() - began
    return {"stall_s": stall, "durable_s": durable, "restore_s": restore, "restore_into_s": into}


def dcp_s3torchconnector(
    bucket: str, state: dict[str, torch.Tensor], tag: str, region: str, part: int, threads: int
) -> dict[str, float] | str:
    try:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError as exc:
        return f"not run: {exc}"
    uri = f"s3://{bucket}/dcp-s3tc/{tag}"  # the CRT client takes the endpoint from AWS_ENDPOINT_URL
    cfg = S3ClientConfig(force_path_style=True, part_size=part)
    try:
        writer = S3StorageWriter(region=region, path=uri, s3client_config=cfg, thread_count=threads)
        save = timed(lambda: dcp.save(state, storage_writer=writer))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        reader = S3StorageReader(region=region, path=uri, s3client_config=cfg)
        load = timed(lambda: dcp.load(target, storage_reader=reader))
    except Exception as exc:  # the CRT client against this server: say what failed
        return f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    assert all(torch.equal(target[k], v) for k, v in state.items())
    return {"save_s": save, "load_into_s": load}


def dcp_fsspec(bucket: str, state: dict[str, torch.Tensor], tag: str, threads: int) -> dict[str, float] | str:
    """DCP's FsspecWriter/FsspecReader over s3fs, `threads` IO threads. s3fs pins an older botocore than DCS's
    boto3, so it runs in a child process with `S3FS_DIR` (s3fs and its own botocore, installed there with
    `pip install --target` by `make bench-storage`) first on its path; "not run" when that folder is absent."""
    where = Path(os.environ.get("S3FS_DIR", Path(__file__).resolve().parents[1] / ".bench-s3fs"))
    if not (where / "s3fs").is_dir():
        return f"not run: s3fs is not installed in {where} (make bench-storage installs it there)"
    shapes = {k: list(v.shape) for k, v in state.items()}
    child = subprocess.run(
        [sys.executable, __file__, "--dcp-fsspec-child", json.dumps([bucket, tag, threads, shapes, SIGN])],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if child.returncode != 0:
        return f"failed: {child.stderr.strip()[-300:]}"
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


def dcp_fsspec_child(spec: str) -> None:
    """The child of `dcp_fsspec`: a state of the given shapes saved and loaded back (into=) through s3fs."""
    import s3fs  # noqa: F401  (from S3FS_DIR, with its own botocore)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # not re-exported in 2.13

    bucket, tag, threads, shapes, sign = json.loads(spec)
    state = {k: torch.randn(shape) for k, shape in shapes.items()}
    uri = f"s3://{bucket}/dcp-fsspec/{tag}"
    s3 = {"addressing_style": "path", "payload_signing_enabled": sign}
    opts = {"endpoint_url": os.environ.get("AWS_ENDPOINT_URL"), "config_kwargs": {"s3": s3}}
    save = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(uri, thread_count=threads, **opts)))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    load = timed(lambda: dcp.load(target, storage_reader=FsspecReader(uri, **opts)))
    assert all(torch.equal(target[k], v) for k, v in state.items())
    print(json.dumps({"save_s": save, "load_into_s": load}))


def _best_plain(summary: dict[str, Any], way: str) -> tuple[float, str]:
    """The faster plain transfer `way` ("upload" / "download") and how the table names it."""
    s3transfer, obstore = summary[f"plain_{way}_s"], summary.get(f"obstore_{way}_s")
    best = s3transfer if obstore is None else min(s3transfer, obstore)
    others = f"s3transfer {s3transfer:.2f}" + ("" if obstore is None else f", obstore {obstore:.2f}")
    return best, f"best plain {way} {best:.2f} s ({others})"


DCP_CONTENDERS = (("dcp_s3torchconnector", "DCP + s3torchconnector"), ("dcp_fsspec", "DCP + s3fs"))


def _dcp(summary: dict[str, Any], what: str, ours: float) -> tuple[str, str, bool]:
    """(what the contenders took, how many times faster DCS was, whether DCS beat every one that ran) for
    `what` ("save_s" or "load_into_s")."""
    took, faster, beat = [], [], True
    for name, label in DCP_CONTENDERS:
        figures = summary.get(name)
        if not isinstance(figures, dict):  # the reason it did not run
            continue
        ratio = figures[what] / ours
        took.append(f"{label} {'save' if what == 'save_s' else 'load'} {figures[what]:.2f} s")
        faster.append(f"{ratio:.2f}x {label}")
        beat = beat and ratio > 1.0
    return "; ".join(took), ", ".join(faster), beat and bool(took)


def round_wins(rounds: dict[str, list[Any]], ours: str, name: str, theirs: str) -> tuple[int, int] | None:
    """(rounds in which DCS's `ours` figure beat contender `name`'s `theirs`, rounds both ran): each round runs
    every contender once, in turn, so round i of one is measured beside round i of the other."""
    pairs = [(d, c) for d, c in zip(rounds["dcs"], rounds[name], strict=True) if isinstance(c, dict)]
    return (sum(d[ours] < c[theirs] for d, c in pairs), len(pairs)) if pairs else None


def rows(summary: dict[str, Any]) -> list[Row]:
    """docs/benchmarks.md's rows: durable save, restore and restore `into=` through S3 against the best plain
    transfer of the same bytes (s3transfer or obstore, whichever was faster) and DCP's S3 writers/readers
    (s3torchconnector, s3fs: each where it ran). The durable save's target also asks DCS to beat DCP +
    s3torchconnector in at least 4 of every 5 rounds (`round_wins`), not only in the medians."""
    dcs = summary["dcs"]
    up, plain_up = _best_plain(summary, "upload")
    down, plain_down = _best_plain(summary, "download")
    durable, restore, restore_into = up / dcs["durable_s"], down / dcs["restore_s"], down / dcs["restore_into_s"]
    save_took, save_faster, save_beat = _dcp(summary, "save_s", dcs["durable_s"])
    load_took, load_faster, load_beat = _dcp(summary, "load_into_s", dcs["restore_into_s"])
    wins = summary.get("dcs_durable_rounds_won_vs_dcp_s3torchconnector")
    won = "" if wins is None else f"; faster than DCP + s3torchconnector in {wins[0]} of {wins[1]} rounds"
    return [
        Row(
            what=f"S3 durable save, {summary['bytes'] / 2**30:.3g} GiB in {summary['files']} files",
            ours=f"{dcs['durable_s']:.2f} s (stall {dcs['stall_s'] * 1e3:.0f} ms)",
            compared=plain_up + (f"; {save_took}" if save_took else ""),
            ratio=durable,
            ratio_text=f"{durable:.2f}x the best upload" + (f"; {save_faster}" if save_faster else "") + won,
            target=">= 0.95x the plain transfer, faster than DCP (s3torchconnector: in 4 of 5 rounds)",
            met=durable >= 0.95 and save_beat and wins is not None and wins[0] * 5 >= wins[1] * 4,
        ),
        Row(
            what="S3 restore, verified, into new memory",
            ours=f"{dcs['restore_s']:.2f} s",
            compared=plain_down,
            ratio=restore,
            ratio_text=f"{restore:.2f}x the best download",
            target=">= 1.0x the plain transfer",
            met=restore >= 1.0,
        ),
        Row(
            what="S3 restore into= existing tensors, verified",
            ours=f"{dcs['restore_into_s']:.2f} s",
            compared=plain_down + (f"; {load_took}" if load_took else ""),
            ratio=restore_into,
            ratio_text=f"{restore_into:.2f}x the best download" + (f"; {load_faster} faster" if load_faster else ""),
            target=">= 1.0x the plain transfer, faster than DCP",
            met=restore_into >= 1.0 and load_beat,
        ),
    ]


def cpu_row(summary: dict[str, Any]) -> Row | None:
    """Where the durable save's time goes on a machine whose S3 server shares the client's cores: CPU seconds per
    GiB of the client side and of the whole machine, DCS's save (copy into staging, upload, hashing, commit)
    beside each plain upload (reported; no target)."""
    cpu = summary.get("cpu_per_gib", {})
    if "dcs" not in cpu:
        return None
    theirs = [
        (label, cpu[name]) for name, label in (("plain_obstore", "obstore"), ("plain", "s3transfer")) if name in cpu
    ]
    client = cpu["dcs"]["client_cpu_s"]
    return Row(
        what="S3 save CPU per GiB: client side (trainer + worker; whole machine, the S3 server included)",
        ours=f"{client:.2f} CPU-s ({cpu['dcs']['machine_cpu_s']:.2f})",
        compared=", ".join(f"{label} upload {c['client_cpu_s']:.2f} ({c['machine_cpu_s']:.2f})" for label, c in theirs),
        ratio=theirs[0][1]["client_cpu_s"] / client if theirs else None,
        ratio_text=f"{client / theirs[0][1]['client_cpu_s']:.1f}x {theirs[0][0]}'s client CPU" if theirs else "",
    )


def headline(table: list[Row]) -> str:
    """The README's one line: each row's ratio."""
    save, restore, into = table[:3]
    return f"S3: durable {save.ratio_text}; restore {restore.ratio_text}, into= {into.ratio_text}"


def main() -> None:
    if sys.argv[1:2] == ["--dcp-fsspec-child"]:
        dcp_fsspec_child(sys.argv[2])
        return
    bench_run = Run("storage")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--part-mb", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--file-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (the save target counts them)")
    parser.add_argument("--processes", type=int, default=2, help="`dcs worker` processes (files persisted at once)")
    parser.add_argument(
        "--payload-signing",
        choices=("off", "on"),
        default="off",
        help="SigV4 over each body's SHA-256, for DCS and every contender that has the option (see the docstring)",
    )
    args = parser.parse_args()
    global SIGN, WORKER_PID
    SIGN = args.payload_signing == "on"
    if not os.environ.get("AWS_ENDPOINT_URL"):
        parser.error("set AWS_ENDPOINT_URL (and the AWS credentials) to the S3 server to measure")
    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    state = make_state(args.size_mb, args.tensors)
    total = sum(t.numel() * 4 for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="dcs-bench-storage-"))
    redis_proc, redis_url = start_redis(work)
    config = DCSConfig(
        redis_url=redis_url,
        checkpoint_dir=f"s3://{args.bucket}/dcs-{uuid.uuid4().hex[:8]}",
        s3_endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        s3_addressing_style="path",
        s3_part_bytes=args.part_mb * MiB,
        s3_concurrency=args.concurrency,
        file_shard_bytes=args.file_mb * MiB,
        incremental_saves=False,
        s3_payload_signing=args.payload_signing,
    )
    worker = start_worker(config, work / "worker.log", concurrency=args.processes)
    WORKER_PID = worker.pid
    files = []  # the same byte count split as DCS splits it (files of --file-mb)
    flat = b"".join(t.numpy().tobytes() for t in state.values())
    for begin in range(0, len(flat), args.file_mb * MiB):
        files.append(flat[begin : begin + args.file_mb * MiB])
    del flat
    rounds: dict[str, list[Any]] = {
        "plain": [],
        "plain_obstore": [],
        "dcs": [],
        "dcp_s3torchconnector": [],
        "dcp_fsspec": [],
    }
    ckpt = Checkpointer("bench", config)
    try:
        ckpt.save(state, step=0).wait(timeout=1800)  # warm-up: the staging buffer is made once per trainer
        CPU.clear()
        for i in range(args.repeats):  # each round starts with the next contender: same server, same bytes
            tag = f"{i}-{uuid.uuid4().hex[:6]}"
            part, conc = args.part_mb * MiB, args.concurrency
            contenders: list[tuple[str, Callable[[], Any]]] = [
                ("plain", partial(plain_transfer, args.bucket, files, part, conc, tag, args.processes)),
                ("plain_obstore", partial(plain_obstore, args.bucket, files, part, conc, tag, args.processes)),
                ("dcs", partial(dcs_round, ckpt, config, state, step=i + 1)),
                ("dcp_s3torchconnector", partial(dcp_s3torchconnector, args.bucket, state, tag, region, part, conc)),
                ("dcp_fsspec", partial(dcp_fsspec, args.bucket, state, tag, conc)),
            ]
            shift = i % len(contenders)
            for name, run in contenders[shift:] + contenders[:shift]:
                os.sync()  # the server's dirty pages from the contender before are flushed outside the next's time
                rounds[name].append(run())
    finally:
        ckpt.close(timeout=60)
        stop(worker)
        stop(redis_proc)
    shutil.rmtree(work, ignore_errors=True)  # the worker's log and Redis's files, kept when the run failed

    def med(values: list[float]) -> float:
        return statistics.median(values)

    up = med([u for u, _ in rounds["plain"]])
    down = med([d for _, d in rounds["plain"]])
    dcs = {k: med([r[k] for r in rounds["dcs"]]) for k in rounds["dcs"][0]}
    summary: dict[str, Any] = {
        "bytes": total,
        "files": len(files),
        "part_mb": args.part_mb,
        "concurrency": args.concurrency,
        "processes": args.processes,
        "payload_signing": args.payload_signing,
        "plain_upload_s": up,
        "plain_download_s": down,
        "dcs": dcs,
        "dcs_durable_vs_plain_upload": up / dcs["durable_s"],
        "dcs_restore_vs_plain_download": down / dcs["restore_s"],
        "dcs_restore_into_vs_plain_download": down / dcs["restore_into_s"],
    }
    obs = rounds["plain_obstore"]
    if all(isinstance(r, tuple) for r in obs):
        summary["obstore_upload_s"] = med([u for u, _ in obs])
        summary["obstore_download_s"] = med([d for _, d in obs])
        best_up, best_down = min(up, summary["obstore_upload_s"]), min(down, summary["obstore_download_s"])
        summary["dcs_durable_vs_best_plain_upload"] = best_up / dcs["durable_s"]
        summary["dcs_restore_vs_best_plain_download"] = best_down / dcs["restore_s"]
    else:
        summary["plain_obstore"] = next(r for r in obs if isinstance(r, str))
    for name in ("dcp_s3torchconnector", "dcp_fsspec"):
        got = rounds[name]
        if all(isinstance(r, dict) for r in got):
            figures = {k: med([r[k] for r in got]) for k in got[0]}
            summary[name] = figures
            summary[f"dcs_durable_vs_{name}_save"] = figures["save_s"] / dcs["durable_s"]
            summary[f"dcs_restore_into_vs_{name}_load"] = figures["load_into_s"] / dcs["restore_into_s"]
        else:
            summary[name] = next(r for r in got if isinstance(r, str))
    gib = total / 2**30
    summary["cpu_per_gib"] = {
        name: {k: med([r[k] for r in got]) / gib for k in ("client_cpu_s", "machine_cpu_s")}
        for name, got in CPU.items()
    }
    wins = round_wins(rounds, "durable_s", "dcp_s3torchconnector", "save_s")
    if wins is not None:
        summary["dcs_durable_rounds_won_vs_dcp_s3torchconnector"] = list(wins)
    record = {
        "command": " ".join(["python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load": os.getloadavg(),
        "rounds": rounds,
        "rounds_cpu": CPU,
        "summary": summary,
    }
    notes = (
        f"Payload signing {args.payload_signing} for DCS, s3transfer, obstore and s3fs (s3torchconnector's CRT client"
        " always sends UNSIGNED-PAYLOAD); the server is plain http on loopback, standing in for an https endpoint,"
        " where DCS's default (s3_payload_signing=auto) is unsigned."
    )
    if not isinstance(summary.get("dcp_fsspec"), dict):
        notes += f" DCP + s3fs (FsspecWriter): {summary['dcp_fsspec']}"
    table = rows(summary)
    extra = cpu_row(summary)
    bench_run.record(record, table + ([extra] if extra else []), notes=notes, headline=headline(table))
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
