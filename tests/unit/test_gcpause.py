"""`paused_gc`: the cyclic collector is off inside (nested, across threads) and back as it was after."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from dcs_tasks.sync.gcpause import paused_gc


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_off_inside_and_back_after_nested_pauses() -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner pause ending must not re-enable while the outer one runs"
    assert gc.isenabled()


def test_overlapping_pauses_from_threads_resume_once_the_last_ends() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled(), "the other thread's pause is still running"
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_resumes_after_an_exception() -> None:
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("update failed")
    assert gc.isenabled()


def test_leaves_a_collector_the_caller_disabled_off() -> None:
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_disabled_pause_changes_nothing() -> None:
    with paused_gc(enabled=False):
        assert gc.isenabled()
