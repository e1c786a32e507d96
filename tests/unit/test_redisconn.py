"""The Redis connection factory: the Sentinel URL form, its mapping to kombu/Celery, named errors, masking."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dcs_tasks.celery_app import celery_settings, make_celery
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import ConfigError
from dcs_tasks.redisconn import SentinelTarget, parse_sentinel_url, redis_location

URL = "sentinel://:pw1@10.0.0.1:26380,10.0.0.2,10.0.0.3:26381/mymaster/2?sentinel_password=pw2"


def test_the_sentinel_url_names_sentinels_master_db_and_passwords() -> None:
    assert parse_sentinel_url(URL) == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("10.0.0.2", 26379), ("10.0.0.3", 26381)),
        master_name="mymaster",
        db=2,
        password="pw1",
        sentinel_password="pw2",
    )
    assert parse_sentinel_url("sentinel://h1/m") == SentinelTarget(sentinels=(("h1", 26379),), master_name="m")


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("sentinel:///mymaster", "names no sentinel host"),
        ("sentinel://h1:26379", "must name the master"),
        ("sentinel://h1:26379/m/0/extra", "must name the master"),
        ("sentinel://h1:26379/m/zero", "db 'zero' is not a number"),
        ("sentinel://h1:port/m", "'h1:port' is not host[:port]"),
        ("sentinel://h1:26379/m?master=x", "unknown parameter(s) ['master']"),
    ],
)
def test_a_malformed_sentinel_url_is_a_config_error_naming_the_problem(url: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_sentinel_url(url)
    with pytest.raises(ValidationError, match="Sentinel URL"):
        DCSConfig(redis_url=url)


def test_a_malformed_sentinel_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_sentinel_url("sentinel://:hunter22@h1:bad/m")
    assert "hunter22" not in str(info.value)


def test_celery_gets_kombus_sentinel_form_and_the_master_name() -> None:
    settings = celery_settings(DCSConfig(redis_url=URL, redis_socket_timeout_seconds=3))
    expected = "sentinel://:pw1@10.0.0.1:26380/2;sentinel://10.0.0.2:26379/2;sentinel://10.0.0.3:26381/2"
    assert settings["broker_url"] == expected
    assert settings["result_backend"] == expected
    sentinel_kwargs = {"socket_timeout": 3, "socket_connect_timeout": 3, "password": "pw2"}
    for options in (settings["broker_transport_options"], settings["result_backend_transport_options"]):
        assert options["master_name"] == "mymaster"
        assert options["sentinel_kwargs"] == sentinel_kwargs
        assert options["visibility_timeout"] > 0  # the plain-Redis options are kept
    app = make_celery(DCSConfig(redis_url=URL))
    assert type(app.backend).__name__ == "SentinelBackend"
    with app.connection_for_write() as conn:
        assert conn.transport_cls == "sentinel"


def test_a_plain_redis_url_is_passed_through_unchanged() -> None:
    settings = celery_settings(DCSConfig(redis_url="redis://:pw@127.0.0.1:6390/3"))
    assert settings["broker_url"] == settings["result_backend"] == "redis://:pw@127.0.0.1:6390/3"
    assert "master_name" not in settings["broker_transport_options"]


def test_sentinel_passwords_are_masked_in_logs_and_errors() -> None:
    config = DCSConfig(redis_url=URL)
    shown = config.scrub(f"cannot reach {config.redis.url}") + repr(config)
    assert "pw1" not in shown and "pw2" not in shown
    assert "sentinel://:***@10.0.0.1:26380" in shown and "sentinel_password=***" in shown
    assert redis_location(URL) == "sentinel 10.0.0.1:26380,10.0.0.2:26379,10.0.0.3:26381 master 'mymaster' db 2"
