"""Which address `dcs engine attach` advertises for an engine, and what it registers about it."""

from __future__ import annotations

import pytest

from dcs_tasks.cli.engine import advertised_address
from dcs_tasks.cli.main import main
from dcs_tasks.errors import ConfigError
from dcs_tasks.sync.attach import engine_metadata
from dcs_tasks.sync.wire import EngineInfo


def test_advertised_address_is_the_engine_url_unless_overridden() -> None:
    assert advertised_address("http://10.0.0.5:30000", None) == ("10.0.0.5", 30000)
    assert advertised_address("http://127.0.0.1:30000", "http://10.0.0.5:31000") == ("10.0.0.5", 31000)
    assert advertised_address("http://engine-3.cluster:30000", None) == ("engine-3.cluster", 30000)


@pytest.mark.parametrize(
    ("engine_url", "advertise_url", "match"),
    [
        ("http://0.0.0.0:30000", None, r"--engine-url host 0\.0\.0\.0 is not an address trainers can reach"),
        ("http://127.0.0.1:30000", "http://[::]:30000", "--advertise-url host :: is not an address"),
        ("http://127.0.0.1:30000", "https://10.0.0.5:30000", "--advertise-url must be http"),
    ],
)
def test_unusable_advertised_addresses_are_refused(engine_url: str, advertise_url: str | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        advertised_address(engine_url, advertise_url)


def test_metadata_names_the_rank_span() -> None:
    info = EngineInfo(version="0.5.23", tp_size=2, sessions=True, flattened_bucket=True, pause=True)
    assert engine_metadata(info) == {"engine": "sglang", "engine_version": "0.5.23", "tp_size": 2, "num_gpus": 2}


def test_bad_arguments_and_settings_exit_2_before_anything_runs() -> None:
    base = ["engine", "attach", "--engine-url", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit) as exited:
        main([*base, "--coordinator-url", "http://127.0.0.1:2", "--rank", "-1"])
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        main([*base, "--coordinator-url", "http://127.0.0.1:2", "--rank", "0", "--down-after", "0"])
    assert exited.value.code == 2
    assert main([*base, "--coordinator-url", "coordinator:8000", "--rank", "0"]) == 2
