"""actor_fwd / reference receivers follow `next_index` across capped /recv_weight_meta answers (real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcs_tasks.config import DCSConfig
from tests.distributed.test_actor_fwd_ref import (
    test_pp2_actors_update_actor_fwd_every_rollout_and_reference_on_its_interval as pp2_update_round,
)

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def test_receivers_get_whole_updates_when_each_answer_holds_two_entries(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """The same PP=2 actor -> actor_fwd + reference run, with every /recv_weight_meta answer capped at 2 entries
    (an update has many more buckets), so every update spans several answers and each receiver continues."""
    pp2_update_round(dcs_config.model_copy(update={"weight_meta_read_max_entries": 2}), tmp_path)
