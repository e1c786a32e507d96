"""Goodput of a training loop that checkpoints, and recovery time (issue 19, the memory tier).

One CPU training loop in this process: an MLP (`--layers` Linear(`--width`, `--width`) + GELU) trained by fused
AdamW on a fixed batch of `--batch` rows, `--threads` torch threads. Defaults: 5 x 2112 wide, so the saved state
(weights + AdamW's exp_avg and exp_avg_sq + its step counters) is 255 MiB; batch 96 and 1 thread make a step
~0.25 s on this 2-core VM when it is quiet (0.23-0.26 s; batch 32: 0.15 s, 64: 0.2 s), longer under other jobs'
load (the second core is left to the checkpoint machinery, as a GPU trainer leaves its host CPUs).
Each segment runs `--steps` timed steps (after untimed ones up to a multiple of 8, so the storage rule below
picks the same steps in every segment) under one mode:
  none      no saves (the reference)
  memory    DCS with the memory tier on (`memory_tier_bytes`, `memory_dir` on tmpfs, `memory_keep_last` 2): every
            save is committed in this host's memory, storage gets every step divisible by `--storage-every` (8).
            Budget: `--storage-every` + 4 steps (a step leaves memory only once a newer one is in storage or a
            peer's memory; a save that does not fit goes to storage only, counted as `to_storage_only`)
  storage   DCS without it, as before the memory tier: every save persisted to `checkpoint_dir` (fsync)
  dcp       torch.distributed.checkpoint.async_save (one process, gloo group of 1, a FileSystemWriter per
            checkpoint, fsync on), the previous save's future awaited before the next save (DCP's docs)
with a save after every step divisible by N, N in `--every` (1 and 4). Both DCS modes save with `overlap=True`
(the copy into staging beside the next forward/backward, the optimizer step waiting for it; `--no-overlap`: the
copy inside `save`), and their stall is the call plus that wait. Every segment's saves are drained after
it (timed apart: `drain`) and the memory tier's storage copies waited for, so each segment starts from the same
state. A repetition (`--repeats`) runs every mode/frequency once, in an order rotated by one per repetition,
each segment followed by a `none` one, so every segment with saves sits between two without: its goodput = the
mean loop time of those two / its own (same steps), and a mode's goodput the median over the repetitions (the
machine is shared: its load drifts). Load average recorded at each segment and for the run.

Recovery: `restore(into=)` the live model + AdamW state (verified), from the call to the state in the tensors,
by a fresh Checkpointer as a restarted trainer would make it: from this host's memory (memory tier; sealed files,
hashed on arrival, as restore reads them by default, and again with every byte hashed on restore); from
storage with the page cache dropped (`sync; echo 1 > /proc/sys/vm/drop_caches`, root only: otherwise the figure
is warm and says so) and warm; from a peer: host A's worker (`memory_replicas`) copies its step to the memory of
peer workers (own DCS_NODE_NAME, `memory_dir`, peer server), A's worker is stopped, and a fresh trainer on host C
(empty memory) restores, pulling the step from a peer: on loopback, and (`--netns`, default when root) from a
worker in a network namespace behind a veth pair. `dcp.load` of DCP's newest checkpoint, cache dropped, for comparison.

`--memory-tmpfs DIR` puts the memory tiers on another tmpfs (e.g. one mounted huge=within_size; its mount options
are recorded) and records the run as benchmark `goodput_memory_tmpfs`.

A private redis-server and real `dcs worker` processes (bench/harness.py). Prints a table; writes a result file
under bench/results/goodput/. `--quick`: a small model, a few steps, one repetition (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness
from bench.harness import Row, Run, free_port, start_worker, stop, wait_for_port
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, step_dir_name
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

MiB = 1 << 20
MODES = ("none", "memory", "storage", "dcp")
MEMORY_SETTINGS = ("memory_tier_bytes", "memory_dir", "memory_keep_last", "storage_every_steps", "memory_replicas")
GOODPUT_TARGET = 0.85  # memory tier, a save every step
RECOVERY_TARGET = 10.0  # from memory vs from storage with the page cache dropped
TOKEN = "goodput-bench-token"  # peer copies are authenticated with the shared token


# --- the training loop -----------------------------------------------------------------------------
class Trainer:
    """An MLP and fused AdamW on CPU; `step()` is one training step on a fixed batch."""

    def __init__(self, width: int, layers: int, batch: int) -> None:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*mods)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.global_step = 0

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.global_step += 1

    def state(self) -> dict[str, Any]:
        """What a DCS save takes and a restore fills (`into=`): the live weights and AdamW state."""
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def saved_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state()))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


# --- savers: one per mode --------------------------------------------------------------------------
class Saver:
    """One mode's saves: `save()` inside the timed loop, `drain()` after a segment."""

    def save(self, trainer: Trainer) -> float:
        """Saves the state at the trainer's step; returns the stall (seconds)."""
        return 0.0

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class DCSSaver(Saver):
    """`Checkpointer.save` each time; `drain` waits for every pending save and, with the memory tier, for the
    storage copy of the last step its rule sent there (the worker's flush task).

    `overlap` (the default; `--no-overlap` turns it off): `save(overlap=True)`, the copy into staging running
    beside the next forward and backward, and the optimizer's step waiting for it first (what
    `Checkpointer.guard` does; here the wait is timed too). A save's stall is then its call plus that wait."""

    def __init__(self, ckpt: Checkpointer, storage_every: int | None = None, opt: Any = None) -> None:
        self.ckpt = ckpt
        self.storage_every = storage_every
        self.pending: list[Any] = []
        self.last_step: int | None = None
        self.last_durable: int | None = None
        self.overlap = opt is not None
        self.waited = 0.0
        self.hook = opt.register_step_pre_hook(self._wait_staged) if opt is not None else None

    def _wait_staged(self, *_: object) -> None:
        started = time.perf_counter()
        self.ckpt.wait_staged(timeout=600)
        self.waited += time.perf_counter() - started

    def save(self, trainer: Trainer) -> float:
        waited, self.waited = self.waited, 0.0  # the previous save's copy, waited for by this step's optimizer
        pending = self.ckpt.save(trainer.state(), step=trainer.global_step, overlap=self.overlap)
        self.pending.append(pending)
        self.last_step = trainer.global_step
        if self.storage_every is None or trainer.global_step % self.storage_every == 0:
            self.last_durable = trainer.global_step
        return float(pending.stall_seconds) + waited

    def drain(self) -> None:
        self.ckpt.wait_staged(timeout=600)
        self.waited = 0.0
        for pending in self.pending:
            pending.wait(timeout=600)
        self.pending.clear()
        if self.storage_every is not None and self.last_durable is not None:
            manifest = Path(self.ckpt.config.checkpoint_dir) / self.ckpt.run / step_dir_name(self.last_durable)
            wait_until(lambda: (manifest / MANIFEST_NAME).exists(), 600, f"{manifest} in storage")

    def close(self) -> None:
        self.drain()
        if self.hook is not None:
            self.hook.remove()
        self.ckpt.close()


class DCPSaver(Saver):
    """`dcp.async_save` as DCP's async checkpointing recipe does it: the state through `get_state_dict` in a
    Stateful, a FileSystemWriter per checkpoint, the previous save's future awaited before the next save (inside
    `save`, so in the stall). Checkpoints older than the newest complete one are deleted by a thread of their own
    (DCS's retention runs in its worker)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.future: Any = None
        self.done: list[Path] = []
        self.current: Path | None = None
        self.cleaner = ThreadPoolExecutor(1, thread_name_prefix="dcp-clean")
        self.cleaning: list[Future[None]] = []

    def save(self, trainer: Trainer) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        start = time.perf_counter()
        self._wait_previous()
        target = self.root / f"step-{trainer.global_step:09d}"
        state = {"app": AppState(trainer.model, trainer.opt)}
        result = dcp.async_save(state, storage_writer=FileSystemWriter(str(target)))
        self.future = getattr(result, "upload_completion", result)
        self.current = target
        return time.perf_counter() - start

    def _wait_previous(self) -> None:
        if self.future is None:
            return
        self.future.result()
        self.future = None
        if self.current is not None:
            self.done.append(self.current)
            self.current = None
        while len(self.done) > 1:  # keep the newest complete checkpoint
            self.cleaning.append(self.cleaner.submit(shutil.rmtree, self.done.pop(0), True))

    def newest(self) -> Path | None:
        return self.done[-1] if self.done else None

    def drain(self) -> None:
        self._wait_previous()
        for cleaning in self.cleaning:
            cleaning.result()
        self.cleaning.clear()

    def close(self) -> None:
        self.drain()
        self.cleaner.shutdown()


class AppState:
    """The Stateful wrapper of DCP's recipe: model and optimizer through `get_state_dict`/`set_state_dict`."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model = model
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])


def init_dist() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


# --- segments --------------------------------------------------------------------------------------
@dataclass
class Segment:
    mode: str
    every: int
    repeat: int
    loop_s: float = 0.0
    drain_s: float = 0.0
    stalls: list[float] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    memory_used_bytes: int | None = None
    to_storage_only: int = 0  # memory tier full: saves the Checkpointer sent to storage instead
    trainer_cpu_s: float = 0.0  # this process (training, staging copies, DCP's writer threads), loop + drain
    worker_cpu_s: float = 0.0  # every `dcs worker` process (main + pool), loop + drain

    @property
    def key(self) -> str:
        return "none" if self.mode == "none" else f"{self.mode}/{self.every}"


def run_segment(
    trainer: Trainer, saver: Saver, segment: Segment, steps: int, align: int, workers: Callable[[], float]
) -> None:
    """Untimed steps up to a multiple of `align` (the memory tier's storage rule, step % storage_every_steps,
    then picks the same steps in every segment), `steps` timed steps with a save after each step divisible by
    `segment.every`, then the saves drained (timed apart)."""
    while trainer.global_step % align:
        trainer.step()
    FULL.count = 0
    load_before = os.getloadavg()[0]
    cpu_before, workers_before = time.process_time(), workers()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
        if segment.mode != "none" and trainer.global_step % segment.every == 0:
            segment.stalls.append(saver.save(trainer))
    segment.loop_s = time.perf_counter() - start
    if isinstance(saver, DCSSaver) and saver.storage_every is not None:
        segment.memory_used_bytes = memory_used(saver.ckpt.config)
    drained = time.perf_counter()
    saver.drain()
    segment.drain_s = time.perf_counter() - drained
    segment.load = (load_before, os.getloadavg()[0])
    segment.to_storage_only = FULL.count
    segment.trainer_cpu_s = time.process_time() - cpu_before
    segment.worker_cpu_s = workers() - workers_before


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its descendants (live ones, and the waited-for dead ones), /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return 0.0
    own = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return own + sum(tree_cpu_seconds(child) for child in children)


class _FullCounter(logging.Handler):
    """Counts the Checkpointer's "memory tier full ... goes to storage only" warnings (saves that missed memory)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("memory tier full"):
            self.count += 1


FULL = _FullCounter()
logging.getLogger("dcs_tasks.checkpoint.checkpointer").addHandler(FULL)


def memory_used(config: DCSConfig) -> int:
    from dcs_tasks.checkpoint.store import tiers

    return tiers.used_bytes(tiers.memory_root(config))


def run_segments(
    trainer: Trainer, savers: dict[str, Saver], modes: list[str], args: argparse.Namespace, workers: Callable[[], float]
) -> list[Segment]:
    """`none`, then per repetition every mode/frequency segment (order rotated by one each repetition), each
    followed by a `none` segment: every segment with saves sits between two without (its reference)."""
    plan = [(m, e) for m in modes if m != "none" for e in args.every]
    align = math.lcm(args.storage_every, *args.every)
    segments: list[Segment] = []

    def run(mode: str, every: int, repeat: int) -> None:
        segment = Segment(mode, every, repeat)
        run_segment(trainer, savers[mode], segment, args.steps, align, workers)
        segments.append(segment)
        stall = statistics.median(segment.stalls) * 1e3 if segment.stalls else 0.0
        missed = f", {segment.to_storage_only} saves to storage only (memory full)" if segment.to_storage_only else ""
        print(
            f"  repeat {repeat} {segment.key:10s} loop {segment.loop_s:6.2f} s "
            f"({segment.loop_s / args.steps * 1e3:4.0f} ms/step), stall p50 {stall:5.0f} ms, "
            f"drain {segment.drain_s:5.2f} s, load {segment.load[0]:.2f}{missed}",
            flush=True,
        )

    run("none", 0, 0)
    for repeat in range(args.repeats):
        shift = repeat % len(plan) if plan else 0
        for mode, every in plan[shift:] + plan[:shift]:
            run(mode, every, repeat)
            run("none", 0, repeat)
    return segments


def goodput(segments: list[Segment]) -> dict[str, Any]:
    """Per mode/frequency: the mean loop time of the `none` segments right before and after a segment / its loop
    time (same steps); medians over the repetitions."""
    ratios: dict[str, list[float]] = {}
    for i, s in enumerate(segments):
        if s.mode == "none":
            continue
        reference = (segments[i - 1].loop_s + segments[i + 1].loop_s) / 2
        ratios.setdefault(s.key, []).append(reference / s.loop_s)
    nones = [s.loop_s for s in segments if s.mode == "none"]
    none_cpu = [(s.trainer_cpu_s, s.worker_cpu_s) for s in segments if s.mode == "none"]
    out: dict[str, Any] = {
        "none": {
            "goodput": 1.0,
            "goodput_runs": [],
            "loop_s": statistics.median(nones),
            "loop_runs_s": nones,
            "saves_per_segment": 0,
            "stall_p50_s": 0.0,
            "stall_max_s": 0.0,
            "stall_total_s": 0.0,
            "drain_s": 0.0,
            "to_storage_only": [],
            "trainer_cpu_s": statistics.median(c[0] for c in none_cpu),
            "worker_cpu_s": statistics.median(c[1] for c in none_cpu),
        }
    }
    for key, runs in ratios.items():
        mine = [s for s in segments if s.key == key]
        stalls = [x for s in mine for x in s.stalls]
        used = [s.memory_used_bytes for s in mine if s.memory_used_bytes is not None]
        out[key] = {
            "goodput": statistics.median(runs),
            "goodput_runs": runs,
            "loop_s": statistics.median(s.loop_s for s in mine),
            "loop_runs_s": [s.loop_s for s in mine],
            "saves_per_segment": len(mine[0].stalls),
            "stall_p50_s": statistics.median(stalls) if stalls else 0.0,
            "stall_max_s": max(stalls) if stalls else 0.0,
            "stall_total_s": statistics.median(sum(s.stalls) for s in mine),
            "drain_s": statistics.median(s.drain_s for s in mine),
            "to_storage_only": [s.to_storage_only for s in mine],
            "trainer_cpu_s": statistics.median(s.trainer_cpu_s for s in mine),
            "worker_cpu_s": statistics.median(s.worker_cpu_s for s in mine),
            **({"memory_used_max_bytes": max(used)} if used else {}),
        }
    return out


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
        staging.mkdir(parents=True, exist_ok=True)
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
    key = Keys(config.namespace).worker_presence(node_queue(config.host_name))
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
    missing = [name for name in MEMORY_SETTINGS if name not in DCSConfig.model_fields]
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


# --- recovery --------------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """`sync; echo 1 > /proc/sys/vm/drop_caches` (root); False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def timed_restores(
    ckpt: Checkpointer, into: dict[str, Any] | None, step: int, repeats: int, before: Callable[[], object]
) -> dict[str, Any]:
    """`repeats` restores of `step` into `into` (None: into new tensors, the restored state dropped after each),
    `before()` untimed ahead of each; median and where they read."""
    runs, locations = [], set()
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        restored = ckpt.restore(step=step, into=into)
        runs.append(time.perf_counter() - start)
        locations.add(str(restored.location))
        if restored.step != step:
            raise RuntimeError(f"restored step {restored.step}, not {step}")
        del restored  # new tensors: freed (unmapped) before the next restore
    return {"median_s": statistics.median(runs), "runs_s": runs, "locations": sorted(locations), "step": step}


def recovery(
    trainer: Trainer,
    savers: dict[str, Saver],
    stack: Stack,
    veth: Veth | None,
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    into = trainer.state()
    repeats = args.recovery_repeats
    memory = savers.get("memory")
    if isinstance(memory, DCSSaver):
        trainer.step()
        memory.save(trainer)
        memory.drain()
        with Checkpointer(memory.ckpt.run, memory.ckpt.config) as fresh:  # sealed files: hashed on arrival only
            out["memory"] = timed_restores(fresh, into, trainer.global_step, repeats, lambda: None)
            out["memory_new"] = timed_restores(fresh, None, trainer.global_step, repeats, lambda: None)
        hashing = memory.ckpt.config.model_copy(update={"memory_restore_verify": "hash"})
        with Checkpointer(memory.ckpt.run, hashing) as fresh:  # every byte hashed again on restore
            out["memory_hashed"] = timed_restores(fresh, into, trainer.global_step, repeats, lambda: None)
            out["memory_new_hashed"] = timed_restores(fresh, None, trainer.global_step, repeats, lambda: None)
    storage = savers.get("storage")
    if isinstance(storage, DCSSaver) and storage.last_step is not None:
        with Checkpointer(storage.ckpt.run, storage.ckpt.config) as fresh:
            dropped = drop_page_cache()
            if not dropped:
                notes.append("page cache not dropped (not root): 'storage_cold' read warm files")
            out["storage_cold"] = timed_restores(fresh, into, storage.last_step, repeats, drop_page_cache)
            out["storage_cold"]["page_cache_dropped"] = dropped
            out["storage_warm"] = timed_restores(fresh, into, storage.last_step, repeats, lambda: None)
            out["storage_cold_new"] = timed_restores(fresh, None, storage.last_step, repeats, drop_page_cache)
    dcp_saver = savers.get("dcp")
    if isinstance(dcp_saver, DCPSaver) and dcp_saver.newest() is not None:
        out["dcp_load_cold"] = dcp_load(trainer, dcp_saver.newest(), repeats)  # type: ignore[arg-type]
    if isinstance(memory, DCSSaver) and not args.no_peer:
        out.update(peer_recovery(trainer, stack, veth, args, notes))
    if "memory" in out and "storage_cold" in out:
        out["storage_cold_vs_memory"] = out["storage_cold"]["median_s"] / out["memory"]["median_s"]
    if "memory_new" in out and "storage_cold_new" in out:
        out["storage_cold_vs_memory_new"] = out["storage_cold_new"]["median_s"] / out["memory_new"]["median_s"]
    for suffix, cold in (("", "storage_cold"), ("_new", "storage_cold_new")):
        if f"memory{suffix}_hashed" in out and cold in out:
            out[f"storage_cold_vs_memory{suffix}_hashed"] = (
                out[cold]["median_s"] / out[f"memory{suffix}_hashed"]["median_s"]
            )
    return out


def dcp_load(trainer: Trainer, checkpoint: Path, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    runs = []
    for _ in range(repeats):
        drop_page_cache()
        start = time.perf_counter()
        state = {"app": AppState(trainer.model, trainer.opt)}
        dcp.load(state, checkpoint_id=str(checkpoint))
        runs.append(time.perf_counter() - start)
    return {"median_s": statistics.median(runs), "runs_s": runs, "locations": ["dcp files"], "step": None}


def peer_recovery(
    trainer: Trainer, stack: Stack, veth: Veth | None, args: argparse.Namespace, notes: list[str]
) -> dict[str, Any]:
    """Host A (memory tier, `memory_replicas` = the number of peers) saves one step; its worker copies it to each
    peer's memory; A's worker stops (A is lost); a fresh trainer on host C restores the step, pulling it from a
    peer into C's memory (verified on arrival) and reading it from there. Loopback first (peer B); then, with a
    veth, B stops too and the pull comes from peer V in the network namespace."""
    from dcs_tasks.checkpoint.store import tiers

    shm = stack.memory_root
    state_bytes = trainer.saved_bytes()
    run = "goodput-peer"
    peers: list[tuple[str, str, str | None]] = [("peer-loopback", "bench-peer-b", None)]
    if veth is not None:
        peers.append(("peer-veth", "bench-peer-v", veth.name))
    for _, host, netns in peers:
        extra = {"peer_host": veth.inner} if netns and veth else {}
        stack.worker(
            host, args.worker_concurrency, netns, **memory_settings(args, state_bytes, shm / f"memory-{host}", **extra)
        )
    config_a = stack.worker(
        "bench-peer-a",
        args.worker_concurrency,
        **memory_settings(args, state_bytes, shm / "memory-a", memory_replicas=len(peers)),
    )
    trainer.step()
    step = trainer.global_step
    with Checkpointer(run, config_a) as ckpt_a:
        ckpt_a.save(trainer.state(), step=step).wait(timeout=600)
    client = sync_client(config_a)
    book = tiers.Places(client, Keys(config_a.namespace))
    wanted = {tiers.peer_place(host) for _, host, _ in peers}
    wait_until(
        lambda: wanted <= book.read(run).get((step, 0), set()), 600, f"peer copies {sorted(wanted)} of step {step}"
    )
    stack.stop_worker("bench-peer-a")
    config_c = stack.config("bench-peer-c", **memory_settings(args, state_bytes, shm / "memory-c"))
    memory_c = Path(config_c.memory_dir)
    into = trainer.state()
    out: dict[str, Any] = {}
    with Checkpointer(run, config_c) as ckpt_c:
        for key, host, _ in peers:
            out[key] = timed_restores(
                ckpt_c, into, step, args.recovery_repeats, lambda: shutil.rmtree(memory_c / run, True)
            )
            expected = f"peer:{host}"
            if out[key]["locations"] != [expected]:
                notes.append(f"{key}: restores read {out[key]['locations']}, not {expected}")
            stack.stop_worker(host)
    client.close()
    return out


# --- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32, help="timed training steps per segment (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every segment (default 3)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed training steps first (default 4)")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4], help="save every N steps (default 1 4)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--width", type=int, default=2112, help="MLP width (default 2112: 255 MiB saved)")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=96, help="rows per step: sets the step time (default 96)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop (default 1)")
    parser.add_argument("--storage-every", type=int, default=8, help="memory tier: storage every N steps (8)")
    parser.add_argument("--memory-keep-last", type=int, default=2, help="memory tier: steps kept in memory (2)")
    parser.add_argument(
        "--memory-tier-mib", type=int, default=0, help="memory tier budget (default: storage-every + 4 steps)"
    )
    parser.add_argument(
        "--memory-tmpfs",
        type=Path,
        default=None,
        help="put the memory tiers on this tmpfs instead of /dev/shm (e.g. one mounted huge=within_size); "
        "the run is recorded as benchmark goodput_memory_tmpfs",
    )
    parser.add_argument("--worker-concurrency", type=int, default=2)
    parser.add_argument("--recovery-repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip the recovery from a peer's memory")
    parser.add_argument(
        "--no-overlap", action="store_true", help="DCS saves copy before returning (no save(overlap=True))"
    )
    parser.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also recover from a peer in a network namespace behind a veth pair (default: when root)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="storage and DCP files (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="the result file (default: bench/results/...)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) for a look")
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, 8 steps, 1 repetition")
    args = parser.parse_args(argv)
    if args.netns is None:
        args.netns = os.geteuid() == 0
    if args.quick:
        args.width, args.layers, args.batch = 512, 2, 8
        args.steps, args.repeats, args.warmup, args.recovery_repeats = 8, 1, 1, 1
    return args


def main() -> None:
    args = parse_args()
    run_ = Run("goodput_memory_tmpfs" if args.memory_tmpfs else "goodput")
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    trainer = Trainer(args.width, args.layers, args.batch)
    for _ in range(max(1, args.warmup)):  # AdamW's state exists from the first step on
        trainer.step()
    state_bytes = trainer.saved_bytes()
    notes: list[str] = []
    figures: dict[str, Any] = {
        "model": {
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "threads": args.threads,
            "saved_bytes": state_bytes,
            "optimizer": "AdamW(fused=True)",
        },
        "steps": args.steps,
        "repeats": args.repeats,
        "every": args.every,
        "storage_every_steps": args.storage_every,
        "memory_keep_last": args.memory_keep_last,
    }
    modes = list(args.modes)
    why = memory_tier_missing()
    if "memory" in modes and why:
        modes.remove("memory")
        notes.append(f"memory mode and every recovery from memory not run: {why}")
    veth = None
    if args.netns and "memory" in modes and not args.no_peer:
        try:
            veth = Veth.create()
        except (OSError, RuntimeError) as exc:
            notes.append(f"no veth peer: {exc}")
    if "dcp" in modes:
        init_dist()
    root = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir="/dev/shm"))
    (root / "redis").mkdir()
    redis, url = start_redis(root / "redis", ["127.0.0.1", veth.outer] if veth else ["127.0.0.1"])
    memory_dir = None
    if args.memory_tmpfs:
        memory_dir = Path(tempfile.mkdtemp(prefix="dcs-bench-goodput-", dir=args.memory_tmpfs))
    stack = Stack(root, shm, url, memory=memory_dir)
    if args.memory_tmpfs:
        figures["memory_tmpfs"] = {"dir": str(args.memory_tmpfs), "mount": mount_options(args.memory_tmpfs)}
    savers: dict[str, Saver] = {"none": Saver()}
    overlap = None if args.no_overlap else trainer.opt
    figures["overlap"] = not args.no_overlap
    try:
        if "storage" in modes:
            config = stack.worker("bench-storage", args.worker_concurrency)
            savers["storage"] = DCSSaver(
                Checkpointer("goodput-storage", config, size_hint_bytes=state_bytes + 16 * MiB), opt=overlap
            )
        if "memory" in modes:
            settings = memory_settings(args, state_bytes, stack.memory_root / "memory-bench-memory")
            config = stack.worker("bench-memory", args.worker_concurrency, **settings)
            ckpt = Checkpointer("goodput-memory", config, size_hint_bytes=state_bytes + 16 * MiB)
            savers["memory"] = DCSSaver(ckpt, storage_every=args.storage_every, opt=overlap)
            figures["memory_tier_bytes"] = settings["memory_tier_bytes"]
        if "dcp" in modes:
            (root / "dcp").mkdir()
            savers["dcp"] = DCPSaver(root / "dcp")
        warm_up(trainer, savers)
        figures["step_s_alone"] = time_steps(trainer, 5)
        print(
            f"state {state_bytes / MiB:.0f} MiB ({args.layers} x {args.width}, AdamW); one step "
            f"{figures['step_s_alone'] * 1e3:.0f} ms (batch {args.batch}, {args.threads} thread(s)); "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        segments = run_segments(trainer, savers, modes, args, stack.cpu_seconds)
        figures["segments"] = [{**vars(s), "key": s.key} for s in segments]
        figures["goodput"] = goodput(segments)
        figures["recovery"] = recovery(trainer, savers, stack, veth, args, notes)
    finally:
        for saver in savers.values():
            with contextlib.suppress(Exception):
                saver.close()
        stack.stop()
        stop(redis)
        if veth is not None:
            veth.destroy()
        if args.keep:
            print(f"kept {root} and {shm}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
            if memory_dir is not None:
                shutil.rmtree(memory_dir, ignore_errors=True)
    if args.netns and veth is None and "memory" in modes and not args.no_peer:
        notes.append("peer over veth not measured")
    figures["load_start"] = [round(x, 2) for x in load_start]
    figures["load_end"] = [round(x, 2) for x in os.getloadavg()]
    report(figures, notes)
    run_.record(figures, summary(figures), notes="; ".join(notes), out=args.out, headline=headline(figures))


def warm_up(trainer: Trainer, savers: dict[str, Saver]) -> None:
    """Untimed saves per mode (staging buffers, memory files and DCP's stager allocated); the memory tier's are
    durable (`save(durable=True)`), so its workers have flushed to storage once before the timed segments."""
    for saver in savers.values():
        for _ in range(2):
            trainer.step()
            if isinstance(saver, DCSSaver) and saver.storage_every is not None:
                saver.pending.append(saver.ckpt.save(trainer.state(), step=trainer.global_step, durable=True))
                saver.last_durable = trainer.global_step
            else:
                saver.save(trainer)
            saver.drain()


def time_steps(trainer: Trainer, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- output ----------------------------------------------------------------------------------------
def summary(figures: dict[str, Any]) -> list[Row]:
    rows = []
    gp = figures["goodput"]
    base = gp["none"]["loop_s"]
    steps = figures["steps"]
    size = figures["model"]["saved_bytes"] / MiB
    for key, g in gp.items():
        if key == "none":
            continue
        mode, every = key.split("/")
        judged = mode == "memory" and every == "1"
        rows.append(
            Row(
                what=f"goodput, {mode}, a save every {every} step(s) ({steps} steps, {size:.0f} MiB)",
                ours=f"{g['goodput']:.3f} (loop {g['loop_s']:.2f} s, stall p50 {g['stall_p50_s'] * 1e3:.0f} ms, "
                f"workers {g['worker_cpu_s'] / max(1, g['saves_per_segment']):.2f} CPU-s per save)",
                compared=f"no saves: loop {base:.2f} s",
                ratio=g["goodput"],
                ratio_text=f"goodput {g['goodput']:.3f}",
                target=f">= {GOODPUT_TARGET}" if judged else "",
                met=(g["goodput"] >= GOODPUT_TARGET) if judged else None,
            )
        )
    rec = figures.get("recovery", {})
    recoveries = (
        ("", "restore(into=) the live model + AdamW state", ""),
        ("_new", "restore() into new tensors (a restarted trainer's state)", ", the tmpfs pages lent, not copied"),
    )
    checks = (
        ("", "sealed files (hashed on arrival, stamp unchanged)", True),
        ("_hashed", 'every byte hashed again (memory_restore_verify="hash")', False),
    )
    for suffix, how, lent in recoveries:
        for check, checked, judged in checks:
            if f"storage_cold_vs_memory{suffix}{check}" not in rec:
                continue
            ratio = rec[f"storage_cold_vs_memory{suffix}{check}"]
            rows.append(
                Row(
                    what=f"recovery: {how}, {checked}",
                    ours=f"from memory {rec[f'memory{suffix}{check}']['median_s']:.3f} s{lent}",
                    compared=f"from storage, page cache dropped, {rec[f'storage_cold{suffix}']['median_s']:.3f} s",
                    ratio=ratio,
                    ratio_text=f"{ratio:.1f}x faster",
                    target=f">= {RECOVERY_TARGET:g}x" if judged else "",
                    met=ratio >= RECOVERY_TARGET if judged else None,
                )
            )
    for key in ("peer-loopback", "peer-veth"):
        if key in rec and "storage_cold" in rec:
            ratio = rec["storage_cold"]["median_s"] / rec[key]["median_s"]
            rows.append(
                Row(
                    what=f"recovery from a peer's memory ({key.removeprefix('peer-')}), fresh host, verified",
                    ours=f"{rec[key]['median_s']:.3f} s",
                    compared=f"from storage, page cache dropped, {rec['storage_cold']['median_s']:.3f} s",
                    ratio=ratio,
                    ratio_text=f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower",
                )
            )
    return rows


def headline(figures: dict[str, Any]) -> str:
    """The README's line: goodput per mode with a save every step (and every 4), recovery ratios."""
    gp = figures.get("goodput", {})
    names = (("memory", "memory tier"), ("storage", "storage only"), ("dcp", "DCP async_save"))

    def row(every: int) -> list[str]:
        return [f"{gp[f'{m}/{every}']['goodput']:.2f} {label}" for m, label in names if f"{m}/{every}" in gp]

    parts = []
    if row(1):
        parts.append("save every step: goodput " + ", ".join(row(1)))
    if row(4):
        parts.append("every 4: " + " / ".join(x.split(" ", 1)[0] for x in row(4)))
    rec = figures.get("recovery", {})
    if "storage_cold_vs_memory_new" in rec:
        hashed = ""
        if "storage_cold_vs_memory_new_hashed" in rec:
            hashed = (
                f" (every byte hashed again: {rec['storage_cold_vs_memory_new_hashed']:.1f}x / "
                f"{rec.get('storage_cold_vs_memory_hashed', 0):.1f}x)"
            )
        parts.append(
            f"recovery from memory {rec['storage_cold_vs_memory_new']:.1f}x (new tensors) / "
            f"{rec.get('storage_cold_vs_memory', 0):.1f}x (into=) faster than cold storage{hashed}"
        )
    return "; ".join(parts)


def report(figures: dict[str, Any], notes: list[str]) -> None:
    gp = figures["goodput"]
    steps = figures["steps"]
    print(
        f"\n{'mode/every':12s} {'goodput':>8s} {'loop s':>7s} {'ms/step':>8s} {'saves':>6s} {'stall p50':>10s} "
        f"{'stall max':>10s} {'drain s':>8s} {'CPU s: trainer':>14s} {'workers':>7s}  "
        "goodput per repetition (none: its loop times)"
    )
    for key, g in gp.items():
        runs = g["loop_runs_s"] if key == "none" else g["goodput_runs"]
        print(
            f"{key:12s} {g['goodput']:8.3f} {g['loop_s']:7.2f} {g['loop_s'] / steps * 1e3:8.0f} "
            f"{g['saves_per_segment']:6d} "
            f"{g['stall_p50_s'] * 1e3:8.0f}ms {g['stall_max_s'] * 1e3:8.0f}ms {g['drain_s']:8.2f} "
            f"{g['trainer_cpu_s']:14.1f} {g['worker_cpu_s']:7.1f}  "
            f"{' '.join(f'{r:.3f}' if key != 'none' else f'{r:.2f}' for r in runs)}"
        )
    rec = figures.get("recovery", {})
    print()
    for key, r in rec.items():
        if isinstance(r, dict):
            print(
                f"recovery {key:14s} {r['median_s']:7.3f} s  runs {' '.join(f'{x:.3f}' for x in r['runs_s'])}; "
                f"read from {'/'.join(r['locations'])}"
            )
    for key, g in gp.items():
        if any(g["to_storage_only"]):
            print(f"{key}: saves sent to storage only, memory tier full, per repetition: {g['to_storage_only']}")
    if "storage_cold_vs_memory" in rec:
        print(f"recovery from memory: {rec['storage_cold_vs_memory']:.1f}x faster than from storage (cache dropped)")
    if "storage_cold_vs_memory_new" in rec:
        print(
            f"recovery into new tensors from memory: {rec['storage_cold_vs_memory_new']:.1f}x faster than from "
            "storage (cache dropped)"
        )
    print(f"load average: start {figures['load_start']}, end {figures['load_end']}")
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
