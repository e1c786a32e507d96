"""bench/goodput.py's DCS side: a private redis-server, `dcs worker`s as simulated hosts (own node name, staging
and memory directories; one in a network namespace behind a veth pair), the memory tier's settings."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness
from bench.goodput_loop import wait_until
from bench.harness import free_port, start_worker, stop, tree_cpu_seconds, wait_for_port
from dcs_tasks.config import SETTINGS, DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

MiB = 1 << 20
MEMORY_SETTINGS = ("memory_tier_bytes", "memory_dir", "memory_keep_last", "storage_every_steps", "memory_replicas")
TOKEN = "goodput-bench-token"  # peer copies are authenticated with the shared token


# --- the DCS side: Redis, workers as hosts ---------------------------------------------------------
@dataclass
class Veth:
    """A network namespace behind a veth pair: `outer` (root namespace) and `inner` addresses of a /30."""

    name: str
    outer: str
    inner: str

    @classmethod
    def create(cls) -> Veth:
        tag = f"{os.getpid():x}"[-6:]
        base = f"10.217.{os.getpid() % 250}"
        veth = cls(f"dcsgp{tag}", f"{base}.1", f"{base}.2")
        run_ip("netns", "add", veth.name)
        try:
            run_ip("link", "add", f"{veth.name}o", "type", "veth", "peer", "name", "eth0", "netns", veth.name)
            run_ip("addr", "add", f"{veth.outer}/30", "dev", f"{veth.name}o")
            run_ip("link", "set", f"{veth.name}o", "up")
            run_ip("-n", veth.name, "addr", "add", f"{veth.inner}/30", "dev", "eth0")
            run_ip("-n", veth.name, "link", "set", "eth0", "up")
            run_ip("-n", veth.name, "link", "set", "lo", "up")
        except BaseException:
            veth.destroy()
            raise
        return veth

    def destroy(self) -> None:
        for pid in subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.name}o"], capture_output=True)


def run_ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


def start_redis(workdir: Path, binds: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """harness.start_redis's server (AOF everysec, no eviction), also listening on `binds` (the veth)."""
    if binds == ["127.0.0.1"]:
        return harness.start_redis(workdir)
    port = free_port()
    args = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        *binds,
        "--dir",
        str(workdir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--maxmemory-policy",
        "noeviction",
        "--protected-mode",
        "no",
        "--logfile",
        str(workdir / "redis.log"),
    ]
    proc = subprocess.Popen(args)
    wait_for_port(port)
    return proc, f"redis://{binds[-1]}:{port}/0"


@dataclass
class Stack:
    """The private redis-server and the `dcs worker`s, one per simulated host (its own node name, staging and
    memory directories)."""

    root: Path
    shm: Path  # tmpfs: staging buffers (and memory tiers unless `memory`)
    redis_url: str = ""
    memory: Path | None = None  # where the memory tiers live (`--memory-tmpfs`; None: `shm`)

    @property
    def memory_root(self) -> Path:
        return self.memory or self.shm

    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def config(self, host: str, **settings: Any) -> DCSConfig:
        staging = self.shm / "staging" / host
        staging.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: DCS refuses a staging dir open to others
        base = DCSConfig(
            redis_url=self.redis_url,
            node_name=host,
            checkpoint_dir=self.root / "storage",
            staging_dir=staging,
            enable_metrics=False,
            metrics_port=0,
            keep_last=2,
            auth_token=TOKEN,
        )
        return base.model_copy(update=settings)

    def worker(self, host: str, concurrency: int, netns: str | None = None, **settings: Any) -> DCSConfig:
        config = self.config(host, **settings)
        log = self.root / f"worker-{host}.log"
        if netns is None:
            self.procs[host] = start_worker(config, log, concurrency=concurrency)
        else:
            self.procs[host] = start_worker_in(netns, config, log, concurrency)
        return config

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(proc.pid) for proc in self.procs.values())

    def stop_worker(self, host: str) -> None:
        stop(self.procs.pop(host))

    def stop(self) -> None:
        for host in reversed(list(self.procs)):
            stop(self.procs.pop(host))


def start_worker_in(netns: str, config: DCSConfig, log_path: Path, concurrency: int) -> subprocess.Popen[bytes]:
    """harness.start_worker's `dcs worker`, run inside network namespace `netns` (`ip netns exec`)."""
    from dcs_tasks.celery_app import node_queue

    env = {k: v for k, v in os.environ.items() if not k.startswith("DCS_")}
    env.update(config.to_env())
    env["PYTHONPATH"] = str(harness.REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        "ip",
        "netns",
        "exec",
        netns,
        sys.executable,
        "-m",
        "dcs_tasks.cli.main",
        "worker",
        f"--concurrency={concurrency}",
        "--loglevel=INFO",
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=harness.REPO, start_new_session=True)
    client = sync_client(config)
    key = Keys(config.redis.namespace).worker_presence(node_queue(config.host_name))
    try:
        wait_until(lambda: bool(client.exists(key)) or proc.poll() is not None, 60, f"worker {config.host_name}")
    except TimeoutError:
        stop(proc)
        raise
    if proc.poll() is not None:
        raise RuntimeError(f"dcs worker in {netns} exited ({proc.returncode}); see {log_path}")
    return proc


def memory_tier_missing() -> str | None:
    """Why the memory tier cannot be measured in this tree (None: it can)."""
    missing = [name for name in MEMORY_SETTINGS if name not in SETTINGS]
    return f"DCSConfig has no {', '.join(missing)}: the memory tier is not in this tree" if missing else None


def memory_settings(args: argparse.Namespace, state_bytes: int, memory_dir: Path, **extra: Any) -> dict[str, Any]:
    """The memory tier's settings. The budget: a step leaves memory only once a newer one is in storage (or a
    peer), so up to `storage_every` steps + the ones in flight stay; the budget holds them (a save that does
    not fit would go to storage instead)."""
    budget = args.memory_tier_mib * MiB if args.memory_tier_mib else (args.storage_every + 4) * (state_bytes + 8 * MiB)
    return {
        "memory_tier_bytes": budget,
        "memory_dir": memory_dir,
        "memory_keep_last": args.memory_keep_last,
        "storage_every_steps": args.storage_every,
        "incremental_saves": False,
        **extra,
    }


def mount_options(path: Path) -> str:
    """The file system type and options of the mount holding `path` (/proc/mounts, longest matching mount point)."""
    best, found = "", "unknown"
    target = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, found = point, f"{fields[2]} {fields[3]}"
    return found
