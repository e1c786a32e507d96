"""Bounded waits for a condition: tests poll what they rely on instead of sleeping for a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> None:
    """Call `predicate` until it is truthy; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def eventually(
    check: Callable[[], Awaitable[T]] | Callable[[], T], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Call (and await, if it is a coroutine function) `check` until it returns something truthy, which is
    returned; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        value: T = await answer if inspect.isawaitable(answer) else answer
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """The lines `proc` prints up to and including the first that holds `marker`; fails naming what it printed
    when `marker` is not among them (the process ended, or `timeout` passed between two lines)."""
    assert proc.stdout is not None
    seen, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if marker in line or time.monotonic() > deadline:
            break
    text = "".join(seen)
    assert marker in text, text
    return text
