"""An actor_fwd / reference receiver takes only entries of the update it receives (versioned weight-meta entries).

The log is a list behind a stand-in for the coordinator client's one read call; the end-to-end run with real
processes (PP = 2, back-to-back updates) is tests/distributed/test_actor_fwd_versions.py.
"""

from __future__ import annotations

import asyncio

import pytest

from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.errors import WeightMetaVersionError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.models import WeightMeta, WeightMetaBatch
from dcs_tasks.sync.actor_fwd import MAX_VERSIONS_AHEAD, ActorFwdReceiver
from dcs_tasks.sync.receiving import WeightReceiver

GROUPS = ["update_actor_pp_0-r1", "update_actor_pp_1-r1"]


class _Log:
    """The weight-meta log as `CoordinatorAPI.recv_weight_meta` answers it (every entry at once)."""

    def __init__(self, entries: list[WeightMeta]) -> None:
        self.entries = entries

    async def recv_weight_meta(self, index: int = 0, wait_timeout_s: float = 0.0) -> WeightMetaBatch:
        entries = self.entries[index:]
        end = len(self.entries)
        return WeightMetaBatch(entries=entries, next_index=end, first_index=index, end_index=end)


def _bucket(group: str, version: int | None) -> WeightMeta:
    return WeightMeta(names=["w"], dtypes=["float32"], shapes=[[2]], group_name=group, version=version)


def _receiver(entries: list[WeightMeta], next_update: int = 1) -> ActorFwdReceiver:
    fwd = ActorFwdReceiver(_Log(entries), WeightReceiver(DeviceDirectBackend()), timeout_seconds=5)  # type: ignore[arg-type]
    fwd.group_names, fwd.train_pp_size, fwd.next_update = list(GROUPS), 2, next_update
    return fwd


def _dropped() -> float:
    return get_metrics().registry.get_sample_value("dcs_weight_meta_dropped_total", {"reason": "stale"}) or 0.0


def test_an_unversioned_entry_of_its_groups_is_refused_naming_the_upgrade() -> None:
    fwd = _receiver([_bucket(GROUPS[0], None)])
    with pytest.raises(WeightMetaVersionError, match=r"carries no version.*upgrade the actors"):
        asyncio.run(fwd.recv_weight())
    assert fwd.receiver.weight_version == 0


def test_other_groups_entries_are_skipped_and_stale_ones_dropped_with_a_metric() -> None:
    """Receiving update 3: another group's unversioned entry is not ours, update 2's bucket and end are stale
    (counted), update 4's are kept for the next call, and an entry past the window is refused."""
    too_far = 3 + MAX_VERSIONS_AHEAD + 1
    entries = [
        _bucket("update_actor_pp_0-r0", None),
        _bucket(GROUPS[0], 2),
        WeightMeta.end(2, closes=GROUPS[0]),
        _bucket(GROUPS[1], 4),
        WeightMeta.end(4, closes=GROUPS[1]),
        _bucket(GROUPS[0], too_far),
    ]
    fwd = _receiver(entries, next_update=3)
    before = _dropped()
    with pytest.raises(WeightMetaVersionError, match=f"announced update {too_far} while this receiver still"):
        asyncio.run(fwd.recv_weight())
    assert _dropped() - before == 2
    assert [m.version for m in fwd._ahead[4]] == [4, 4]
    assert fwd.receiver.weight_version == 0
