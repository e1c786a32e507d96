"""Background tasks end when stopped, also when a cancellation is swallowed (on Python 3.11 `asyncio.wait_for`
does that when its inner future completes in the turn the cancel arrives; CI lost a test to a heartbeat loop
whose stop waited for good)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dcs_tasks.aiotask import cancel_and_wait


async def _swallows_the_first_cancel(ended: list[str]) -> None:
    swallowed = False
    try:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True  # as a swallowed cancel: the loop goes on to its next sleep
    finally:
        ended.append("ended")


async def test_a_task_that_swallows_a_cancel_is_cancelled_again_until_it_ends() -> None:
    ended: list[str] = []
    task = asyncio.create_task(_swallows_the_first_cancel(ended))
    await asyncio.sleep(0.01)
    started = time.monotonic()
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert ended == ["ended"] and task.cancelled()
    assert time.monotonic() - started < 2


async def test_one_cancel_and_await_is_not_enough_for_such_a_task() -> None:
    """What cancel_and_wait is for: the plain pattern waits on."""
    task = asyncio.create_task(_swallows_the_first_cancel([]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), 0.3)
    await cancel_and_wait(task)


async def test_a_task_that_failed_or_finished_is_left_as_it_is() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert isinstance(task.exception(), ValueError)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancel_and_wait(done)
    assert done.result() is None
