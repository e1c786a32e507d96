"""The demo's side of a trainer process: spawn it, read its JSON events with bounded waits, kill it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dcs_tasks.errors import DCSTimeoutError
from dcs_tasks.local.procs import PDEATHSIG, LocalStackError, Service

Event = dict[str, Any]


class TrainerProcess:
    """`python -m dcs_tasks.local.trainer ...` in its own session; stdout is its event stream, stderr a log."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.service = Service("trainer", [sys.executable, "-m", "dcs_tasks.local.trainer", *args], env, log_path)
        self.events: list[Event] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> TrainerProcess:
        log = self.service.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.service.argv,
                env=self.service.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                preexec_fn=PDEATHSIG,  # only sets the parent-death signal
            )
        finally:
            log.close()
        self.service.proc = self.proc
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True, name="dcs-trainer-out").start()
        return self

    def _pump(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)

    def follow(self, on_event: Callable[[Event], bool], timeout: float, idle_timeout: float) -> int:
        """Hand each event to `on_event` until the process ends (returns its status) or `on_event` returns
        True (kill it with SIGKILL, return its status). DCSTimeoutError when it runs past `timeout` or says
        nothing for `idle_timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            wait = min(idle_timeout, deadline - time.monotonic())
            if wait <= 0:
                raise DCSTimeoutError(f"trainer still running after {timeout:.0f}s; log {self.service.log_path}")
            try:
                line = self._lines.get(timeout=wait)
            except queue.Empty:
                raise DCSTimeoutError(
                    f"trainer said nothing for {idle_timeout:.0f}s; log {self.service.log_path}"
                ) from None
            if line is None:
                return self._reap(deadline)
            event = _parse(line)
            if event is None:
                continue
            self.events.append(event)
            if on_event(event):
                self.kill()
                return self._reap(deadline)

    def kill(self) -> None:
        """SIGKILL the trainer's process group: no `finally`, no atexit, nothing flushed."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGKILL)

    def _reap(self, deadline: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise LocalStackError(f"trainer did not exit; log {self.service.log_path}") from None

    def stop(self) -> None:
        self.service.stop(timeout=5)

    def log_tail(self) -> str:
        return self.service.tail()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _parse(line: str) -> Event | None:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "ev" in event else None
