"""What `dcs engine attach` accepts from an engine's server info, and which address it advertises."""

from __future__ import annotations

from typing import Any

import pytest

from dcs_tasks.cli.engine import advertised_address
from dcs_tasks.engine.errors import EngineDataParallelUnsupported, UnsupportedEngine
from dcs_tasks.engine.server_info import check_engine, engine_metadata, parse_server_info
from dcs_tasks.errors import ConfigError


def info(**fields: Any) -> dict[str, Any]:
    """A `/server_info` answer's fields that matter here, plus the clear-text `api_key` SGLang includes."""
    return {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "pp_size": 1, "api_key": "s3cret", **fields}


def test_tp_size_is_the_rank_span_and_the_api_key_is_dropped() -> None:
    parsed = parse_server_info(info(), "test")
    assert str(check_engine(parsed)) == "0.5.23"
    assert engine_metadata(parsed)["num_gpus"] == 2
    assert "s3cret" not in repr(parsed) and "s3cret" not in str(engine_metadata(parsed))


def test_data_parallel_engine_is_refused_by_name() -> None:
    with pytest.raises(EngineDataParallelUnsupported, match="dp_size=2"):
        check_engine(parse_server_info(info(dp_size=2), "test"))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"version": "0.4.6.post1"}, "older than the oldest supported"),
        ({"version": "not-a-version"}, "not an SGLang version"),
        ({"pp_size": 2}, "pp_size=2"),
    ],
)
def test_unsupported_engines_are_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedEngine, match=match):
        check_engine(parse_server_info(info(**fields), "test"))


def test_a_server_info_without_tp_size_is_not_sglang() -> None:
    payload = info()
    del payload["tp_size"]
    with pytest.raises(UnsupportedEngine, match="tp_size"):
        parse_server_info(payload, "GET /server_info")
    with pytest.raises(UnsupportedEngine, match="not a JSON object"):
        parse_server_info([payload], "GET /server_info")


def test_advertised_address() -> None:
    assert advertised_address("http://10.0.0.5:30000", None) == ("10.0.0.5", 30000)
    assert advertised_address("http://127.0.0.1:30000", "http://10.0.0.5:31000") == ("10.0.0.5", 31000)
    with pytest.raises(ConfigError, match=r"--engine-url host 0\.0\.0\.0"):
        advertised_address("http://0.0.0.0:30000", None)
    with pytest.raises(ConfigError, match="--advertise-url must be http"):
        advertised_address("http://127.0.0.1:30000", "https://10.0.0.5:30000")
