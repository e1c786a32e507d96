"""`dcs demo`: the whole DCS loop on one machine, with real processes, and what it measured.

1. A `LocalStack`: a private redis-server (unless DCS_REDIS_URL is set), `dcs coordinator`, `dcs worker`
   and two `dcs receiver` rollout engines.
2. A trainer process trains a tiny character-level transformer on the shipped sonnets, saving an
   asynchronous checkpoint every few steps; the demo kills it with SIGKILL in the middle of the run.
3. A new trainer process resumes from the newest committed checkpoint (its restored state must hash to the
   digest the first trainer recorded for that step: bit-exact) and trains to the end.
4. The final weights are pushed to the two receivers over gloo, twice (group formation, then reuse), and
   each receiver's digest must equal the trainer's.
5. A summary table, `summary.json` and a PNG timeline (steps, stalls, persists, sync phases).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import ConfigError, DCSError
from dcs_tasks.local.charlm import Corpus, make_model, sample
from dcs_tasks.local.stack import LocalStack
from dcs_tasks.local.trainer_proc import Event, TrainerProcess
from dcs_tasks.sync.receiving import tensor_sha256
from dcs_tasks.sync.wire import WeightsDigest

RUN = "demo"
TRAINER_TIMEOUT_SECONDS = 600.0
TRAINER_IDLE_SECONDS = 120.0  # torch import plus a restore on a loaded machine stay well below
COMMIT_WAIT_SECONDS = 120.0
PUSH_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 300
    save_every: int = 0  # 0: steps // 10
    crash_at: int = 0  # 0: the middle of a save interval past 60 % of the run
    receivers: int = 2
    out: Path = Path(".dcs-run/demo")
    keep: bool = False
    png: bool = True
    threads: int = 1  # torch threads of the trainer: more spin-wait badly on a busy machine

    def resolved(self) -> DemoSettings:
        """Defaults filled in; ConfigError naming the setting when the run cannot crash and resume."""
        if not 10 <= self.steps <= 100_000:
            raise ConfigError(f"--steps must be between 10 and 100000, got {self.steps}")
        every = self.save_every or max(1, self.steps // 10)
        crash = self.crash_at or (int(self.steps * 0.6) // every) * every + max(1, every // 2)
        if not 1 <= every < self.steps:
            raise ConfigError(f"--save-every must be between 1 and {self.steps - 1}, got {every}")
        if not every < crash < self.steps:
            raise ConfigError(f"--crash-at must be after the first save ({every}) and before {self.steps}, got {crash}")
        if not 1 <= self.receivers <= 8:
            raise ConfigError(f"--receivers must be between 1 and 8, got {self.receivers}")
        if not 1 <= self.threads <= 256:
            raise ConfigError(f"--threads must be between 1 and 256, got {self.threads}")
        return replace(self, save_every=every, crash_at=crash)


@dataclass
class Record:
    """Everything measured, in wall-clock seconds (time.time()); the timeline and the summary read it."""

    started: float = field(default_factory=time.time)
    steps: list[tuple[int, float, float, float, int]] = field(default_factory=list)  # step, t0, t1, loss, phase
    saves: list[dict[str, Any]] = field(default_factory=list)  # step, t0, stall, digest, phase, durable_at
    killed_at: float | None = None
    kill_step: int | None = None
    restore: dict[str, Any] = field(default_factory=dict)
    syncs: list[dict[str, Any]] = field(default_factory=list)  # t0, t1 and the client's metrics
    stack_ready: float | None = None
    spawned: list[float] = field(default_factory=list)  # when each trainer process was started
    starts: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)


class Demo:
    def __init__(self, settings: DemoSettings, console: Console) -> None:
        self.s = settings.resolved()
        self.console = console
        self.record = Record()
        self.out = self.s.out.resolve()
        self.workdir = self.out / "stack"
        self.corpus = Corpus.load()
        self.sample_text = ""

    # --- the scenario --------------------------------------------------------------------------------
    def run(self) -> bool:
        self.out.mkdir(parents=True, exist_ok=True)
        config = DCSConfig(
            checkpoint_dir=self.workdir / "checkpoints",
            namespace=f"demo-{int(self.record.started)}",
            node_name=f"demo-{os.getpid()}",  # its own node queue: a worker already serving this host takes nothing
            enable_metrics=False,
            heartbeat_interval_seconds=1.0,
            heartbeat_timeout_seconds=5.0,
        )
        stack = LocalStack(config, workdir=self.workdir, receivers=self.s.receivers, flower=False)
        with self.console.status("starting redis-server, coordinator, worker and receivers ..."):
            stack.start()
        self.record.stack_ready = time.time()
        try:
            self.console.print(
                f"stack up: coordinator {stack.coordinator_url}, 1 worker, {self.s.receivers} rollout receivers "
                f"(logs in {escape(str(stack.logs))})"
            )
            ok = self.scenario(stack)
        finally:
            stack.stop()
        self.finish(ok)
        if ok and not self.s.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return ok

    def scenario(self, stack: LocalStack) -> bool:
        s = self.s
        self.console.print(
            f"[bold]1.[/] training {s.steps} steps of a character-level transformer on "
            f"{len(self.corpus.text) // 1024} KiB of sonnets, a checkpoint every {s.save_every} steps; "
            f"SIGKILL at step {s.crash_at}"
        )
        code = self.train(stack, resume=False)
        self.check(f"trainer killed by SIGKILL at step {self.record.kill_step} (exit {code})", code == -signal.SIGKILL)
        staged = max(e["step"] for e in self.record.saves)
        committed = self.wait_committed(stack.config, staged)
        self.check(f"saves staged before the kill still commit (newest: step {committed})", committed == staged)
        self.console.print("[bold]2.[/] a new trainer process resumes from the newest committed checkpoint")
        code = self.train(stack, resume=True)
        if code != 0:
            return self.check(f"resumed trainer exited with {code}", False)
        restored = self.record.restore
        want = next((e["digest"] for e in self.record.saves if e["step"] == restored["step"] and e["phase"] == 0), None)
        self.check(f"restored step {restored['step']} is bit-exact (state digest)", restored["digest"] == want)
        self.console.print(f"[bold]3.[/] pushing the final weights to {s.receivers} rollout receivers over gloo")
        return self.push(stack)

    def train(self, stack: LocalStack, resume: bool) -> int:
        phase = 1 if resume else 0
        args = ["--run", RUN, "--steps", str(self.s.steps), "--save-every", str(self.s.save_every)]
        args += ["--threads", str(self.s.threads)]
        log = stack.logs / f"trainer-{phase}.log"
        self.record.spawned.append(time.time())
        trainer = TrainerProcess([*args, "--resume"] if resume else args, stack.env(), log).start()
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  stall {task.fields[stall]}"),
            TimeElapsedColumn(),
        )
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                label = "resumed trainer" if resume else "trainer"
                task = progress.add_task(label, total=self.s.steps, loss="-", stall="-")

                def on_event(event: Event) -> bool:
                    return self.on_event(event, phase, lambda **kw: progress.update(task, **kw))

                return trainer.follow(on_event, TRAINER_TIMEOUT_SECONDS, TRAINER_IDLE_SECONDS)
        except BaseException:
            self.console.print(f"trainer log ({log}):\n{escape(trainer.log_tail())}")
            raise
        finally:
            trainer.stop()

    def on_event(self, event: Event, phase: int, update: Any) -> bool:
        """Record one trainer event and update the progress bar; True: kill the trainer now."""
        kind, rec = event["ev"], self.record
        if kind == "step":
            rec.steps.append((event["step"], event["t0"], event["t"], event["loss"], phase))
            update(completed=event["step"], loss=f"{event['loss']:.3f}")
        elif kind == "save":
            rec.saves.append({**event, "phase": phase})
            update(stall=f"{event['stall'] * 1e3:.1f} ms")
        elif kind == "restored":
            rec.restore = event
            update(completed=event["step"])
        elif kind == "start":
            rec.starts.append(event)
        if phase == 0 and kind == "step" and event["step"] >= self.s.crash_at:
            rec.killed_at, rec.kill_step = time.time(), event["step"]
            return True
        return False

    def wait_committed(self, config: DCSConfig, step: int) -> int | None:
        """The newest committed step once `step` committed (the worker reads it from shared memory after
        the trainer died), or whatever is newest after COMMIT_WAIT_SECONDS."""
        deadline = time.monotonic() + COMMIT_WAIT_SECONDS
        with Checkpointer(RUN, config) as ckpt:
            while True:
                steps = [info.step for info in ckpt.list()]
                if step in steps or time.monotonic() > deadline:
                    return max(steps, default=None)
                time.sleep(0.2)

    def push(self, stack: LocalStack) -> bool:
        with Checkpointer(RUN, stack.config) as ckpt:
            final = ckpt.restore()
        model = make_model(self.corpus.vocab)
        model.load_state_dict(final.state["model"])
        pushes = asyncio.wait_for(push_weights(stack.config, model, times=2), PUSH_TIMEOUT_SECONDS)
        self.record.syncs = asyncio.run(pushes)
        want = {name: tensor_sha256(t) for name, t in model.state_dict().items()}
        digests = [receiver_digest(url, stack.config.token()) for url in stack.receiver_urls]
        ok = self.check(
            f"all {len(digests)} receivers hold the trainer's weights bit-exactly (weight_version "
            f"{[d.weight_version for d in digests]})",
            len(digests) == self.s.receivers and all(d.tensors == want for d in digests),
        )
        self.sample_text = sample(model, self.corpus, "Shall I ", 160)
        return ok

    def check(self, label: str, ok: bool) -> bool:
        self.record.checks[label] = ok
        self.console.print(f"  [{'green' if ok else 'red'}]{'ok' if ok else 'FAILED'}[/] {escape(label)}")
        return ok

    # --- results ---------------------------------------------------------------------------------------
    def finish(self, ok: bool) -> None:
        self.attach_durable_times()
        summary = summarize(self.record, self.s)
        summary["passed"] = ok and all(self.record.checks.values())
        summary["sample"] = self.sample_text
        self.console.print(summary_table(summary))
        if summary["sample"]:
            self.console.print(f"sample from the pushed weights:\n[italic]{escape(summary['sample'])}[/]")
        png = self.out / "timeline.png"
        summary["png"] = str(png) if self.draw(png) else None
        path = self.out / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        self.console.print(f"summary: {escape(str(path))}")

    def draw(self, png: Path) -> bool:
        if not self.s.png:
            return False
        from dcs_tasks.local.timeline import MatplotlibMissing, draw_timeline

        try:
            draw_timeline(self.record, png)
        except MatplotlibMissing as exc:
            self.console.print(f"[yellow]timeline PNG skipped:[/] {escape(str(exc))}")
            return False
        self.console.print(f"timeline: {escape(str(png))}")
        return True

    def attach_durable_times(self) -> None:
        """When each save became durable: the mtime of its manifest, written when the worker commits."""
        run_dir = self.workdir / "checkpoints" / RUN
        for save in self.record.saves:
            manifest = run_dir / step_dir_name(save["step"]) / "manifest.json"
            try:
                save["durable_at"] = manifest.stat().st_mtime
            except OSError:
                save["durable_at"] = None


async def push_weights(config: DCSConfig, model: torch.nn.Module, times: int) -> list[dict[str, Any]]:
    """Push `model` to every rollout engine `times` times from one actor client: the first update forms the
    gloo group (bootstrap via the worker), the later ones reuse it. Returns each update's metrics."""
    from dcs_tasks.client.engine import CheckpointEngineClient

    client = CheckpointEngineClient(
        coordinator_url=config.base_url, role="actor", rank=0, model=model, model_name="demo", config=config
    )
    await client.start()
    pushes: list[dict[str, Any]] = []
    try:
        for _ in range(times):
            t0 = time.time()
            metrics = (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
            pushes.append({"t0": t0, "t1": time.time(), **metrics})
        return pushes
    finally:
        await client.stop()


def receiver_digest(url: str, token: str | None) -> WeightsDigest:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{url}/weights_digest", headers=headers, timeout=30)
    response.raise_for_status()
    return WeightsDigest.model_validate_json(response.content)


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def summarize(rec: Record, s: DemoSettings) -> dict[str, Any]:
    stalls = [e["stall"] for e in rec.saves]
    durable = [e["durable_at"] - e["t0"] for e in rec.saves if e.get("durable_at")]
    losses = [loss for _, _, _, loss, _ in rec.steps]
    start = rec.starts[0] if rec.starts else {}
    syncs = rec.syncs
    return {
        "steps": s.steps,
        "save_every": s.save_every,
        "killed_at_step": rec.kill_step,
        "params": start.get("params"),
        "checkpoint_mib": start.get("state_bytes", 0) / 2**20,
        "saves": len(stalls),
        "stall_p50_ms": _ms(stalls, 50),
        "stall_p99_ms": _ms(stalls, 99),
        "memcpy_ms": start["memcpy"] * 1e3 if start else None,
        "durable_p50_ms": _ms(durable, 50),
        "durable_max_ms": _ms(durable, 100),
        "restored_step": rec.restore.get("step"),
        "restore_ms": rec.restore.get("seconds", 0.0) * 1e3 if rec.restore else None,
        "resumed_bit_exact": any("bit-exact (state digest)" in k and v for k, v in rec.checks.items()),
        "receivers_match": any("receivers hold" in k and v for k, v in rec.checks.items()),
        "sync_first_ms": syncs[0]["total_seconds"] * 1e3 if syncs else None,
        "sync_reuse_ms": syncs[-1]["total_seconds"] * 1e3 if len(syncs) > 1 else None,
        "sync_bytes": syncs[-1].get("bytes") if syncs else None,
        "sync_reuse_rebuilt_group": syncs[-1].get("group_rebuilt") if len(syncs) > 1 else None,
        "stack_start_s": rec.stack_ready - rec.started if rec.stack_ready else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "checks": rec.checks,
    }


def _fmt(value: float | None, unit: str = "ms", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} {unit}".strip()


def summary_table(m: dict[str, Any]) -> Table:
    table = Table(title="dcs demo: what it measured", show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("note")
    reuse_note = f"{(m['sync_bytes'] or 0) / 2**20:.2f} MiB" + (
        " (group rebuilt)" if m["sync_reuse_rebuilt_group"] else ""
    )
    rows = [
        ("stack start", _fmt(m["stack_start_s"], "s"), "redis, coordinator, worker, receivers"),
        ("checkpoint size", f"{m['checkpoint_mib']:.2f} MiB", f"{m['params']} params + AdamW state + RNG + step"),
        ("save stall p50 / p99", f"{_fmt(m['stall_p50_ms'])} / {_fmt(m['stall_p99_ms'])}", f"{m['saves']} saves"),
        ("plain memcpy of the state", _fmt(m["memcpy_ms"], digits=2), "the floor of a stall"),
        ("save -> durable p50 / max", f"{_fmt(m['durable_p50_ms'])} / {_fmt(m['durable_max_ms'])}", "off the trainer"),
        ("SIGKILL at step", str(m["killed_at_step"]), f"resumed from step {m['restored_step']}"),
        ("restore (verified)", _fmt(m["restore_ms"]), "bit-exact" if m["resumed_bit_exact"] else "NOT bit-exact"),
        ("weight push, new group", _fmt(m["sync_first_ms"]), "gloo group formed via the worker"),
        ("weight push, reused group", _fmt(m["sync_reuse_ms"]), reuse_note),
        ("receivers' digests", "equal" if m["receivers_match"] else "DIFFER", "sha256 of every tensor"),
        ("loss first -> last", f"{_fmt(m['loss_first'], '', 3)} -> {_fmt(m['loss_last'], '', 3)}", "cross-entropy"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def run_demo(settings: DemoSettings, console: Console | None = None) -> bool:
    """Run the demo; True when every check passed. Raises ConfigError for bad settings."""
    torch.set_num_threads(settings.threads)
    demo = Demo(settings, console or Console(soft_wrap=True))  # soft wrap: printed paths stay copyable
    try:
        return demo.run()
    except (DCSError, TimeoutError) as exc:  # a bounded wait ran out, a save or a push failed: say which, once
        demo.console.print(f"[red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
        return False
