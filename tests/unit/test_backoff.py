"""The one backoff helper (dcs_tasks/backoff.py) every retry loop uses: schedule, cap, jitter bounds, bad input."""

from __future__ import annotations

from typing import Any

import pytest

from dcs_tasks.backoff import backoff_delay
from workers.taskbase import backoff_seconds


def test_no_jitter_doubles_from_base_up_to_the_cap() -> None:
    assert [backoff_delay(n, 0.5, 3.0, "none") for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize("failures", [0, 1, 3, 10])
def test_equal_jitter_stays_in_upper_half(failures: int) -> None:
    d = min(2.0, 0.1 * 2**failures)
    draws = [backoff_delay(failures, 0.1, 2.0, "equal") for _ in range(500)]
    assert all(d / 2 <= x <= d for x in draws)
    assert len(set(draws)) > 1  # jittered: a fleet that failed together does not retry together


def test_full_jitter_spans_zero_to_delay() -> None:
    draws = [backoff_delay(2, 0.25, 10.0, "full") for _ in range(500)]
    assert all(0 <= x <= 1.0 for x in draws)
    assert min(draws) < 0.5  # reaches below the equal-jitter floor


def test_huge_failure_count_is_the_cap_not_an_overflow() -> None:
    assert backoff_delay(5000, 0.05, 30.0, "none") == 30.0


def test_task_base_backoff_is_the_shared_equal_jitter() -> None:
    draws = [backoff_seconds(4, 0.1, 100.0) for _ in range(200)]
    assert all(0.8 <= x <= 1.6 for x in draws)


@pytest.mark.parametrize(
    ("args", "word"),
    [((-1, 0.1, 1.0, "equal"), "failures"), ((0, -0.1, 1.0, "equal"), "base"), ((0, 0.1, 1.0, "half"), "jitter")],
)
def test_bad_arguments_are_named(args: tuple[Any, ...], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        backoff_delay(*args)
