"""Every setting says which processes read it (docs/configuration.md's "read by" column, from
`dcs_tasks/cli/readers.py`): a new setting without an entry fails here, naming it."""

from __future__ import annotations

from dcs_tasks.cli.readers import READ_BY, read_by
from dcs_tasks.config import SETTINGS

PROCESSES = {"trainer", "worker", "coordinator", "receiver", "all"}


def test_every_setting_names_the_processes_that_read_it() -> None:
    missing = [name for name in SETTINGS if read_by(name) == "?"]
    assert missing == [], f"add these settings' readers to dcs_tasks/cli/readers.py: {missing}"


def test_the_readers_table_names_only_settings_and_known_processes() -> None:
    assert set(READ_BY) <= set(SETTINGS), set(READ_BY) - set(SETTINGS)
    for name, readers in READ_BY.items():
        named = {part.strip() for part in readers.replace("(must match)", "").split(",")}
        assert named <= PROCESSES, (name, readers)


def test_the_settings_a_checkpointer_checks_against_its_worker_are_marked_must_match() -> None:
    for name in ("checkpoint_dir", "staging_dir", "memory_tier_bytes", "memory_dir", "s3_endpoint_url"):
        assert read_by(name) == "trainer, worker (must match)", name
