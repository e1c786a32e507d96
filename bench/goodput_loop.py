"""bench/goodput.py's training loop and its savers (no saves, DCS memory tier or storage, DCP `async_save`), and
the timed segments whose loop times give goodput."""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.harness import free_port
from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, step_dir_name
from dcs_tasks.config import DCSConfig

MiB = 1 << 20


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
        return sum(t.numel() * t.element_size() for t in tensors_of(self.state()))


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_of(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from tensors_of(value)


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
            manifest = Path(self.ckpt.config.checkpoint.dir) / self.ckpt.run / step_dir_name(self.last_durable)
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
    from dcs_tasks.checkpoint.store.tiers import memdir

    return memdir.used_bytes(memdir.memory_root(config))


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
