"""Ending background asyncio tasks for certain.

`task.cancel()` then awaiting the task can wait forever: the cancellation is only a request, and code that
catches `CancelledError` or, on Python 3.11, `asyncio.wait_for` whose inner future completes in the same turn
of the loop as the cancel (CPython gh-86296, fixed in 3.12) swallows it, and a loop task then goes on to its
next sleep. `cancel_and_wait` repeats the cancel until the task is done."""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_SECONDS = 0.5  # how long one cancellation is given before it is sent again


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` until it is done, then return (its result or error is dropped)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_SECONDS)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at garbage collection
