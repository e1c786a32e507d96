"""Retention policy arithmetic (pure): what keep_last / keep_every / protected steps let go."""

from __future__ import annotations

from dcs_tasks.checkpoint.store.ledger.retention import steps_to_delete
from dcs_tasks.checkpoint.store.payloads import RetentionPolicy


def test_keep_last_and_every_and_protected() -> None:
    steps = [10, 20, 30, 40, 50, 60]
    assert steps_to_delete(steps, RetentionPolicy(keep_last=2), set()) == [10, 20, 30, 40]
    assert steps_to_delete(steps, RetentionPolicy(keep_last=2, keep_every=20), set()) == [10, 30]
    assert steps_to_delete(steps, RetentionPolicy(keep_last=1), {30}) == [10, 20, 40, 50]


def test_no_policy_deletes_nothing() -> None:
    assert steps_to_delete([1, 2, 3], RetentionPolicy(), set()) == []
