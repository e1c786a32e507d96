"""The suite's scheduler (tests/helpers/schedule.py) overrides private parts of pytest-xdist's file scheduling: a
release without them must stop the run with an error that names what is missing, not schedule wrongly."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

from tests.helpers.schedule import XDIST_METHODS, SchedulerMismatch, check_internals


def test_this_xdist_has_every_internal_the_scheduler_overrides_or_calls() -> None:
    check_internals(LoadFileScheduling, XDIST_METHODS)


def test_a_release_without_them_is_refused_naming_each_missing_part_and_the_release() -> None:
    class Older:
        def schedule(self) -> None: ...

    with pytest.raises(SchedulerMismatch) as caught:
        check_internals(Older, XDIST_METHODS, version="9.9")
    message = str(caught.value)
    assert "pytest-xdist 9.9" in message
    assert (
        "has no _split_scope, _reschedule, _pending_of, _assign_work_unit, which" in message
    )  # what it has is not named
