"""DCSConfig, RoleInfo and TopologyConfig: what a user sets is what every process gets, bad values say why."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dcs_tasks.config import AREAS, SETTINGS, BackendType, DCSConfig, RoleInfo, StagingPolicy, TopologyConfig

MiB = 1024 * 1024


def test_defaults_follow_the_seed() -> None:
    config = DCSConfig()
    assert config.coordinator.host == "127.0.0.1" and config.coordinator.port == 8000
    assert config.sync.backend_type is BackendType.GLOO
    assert config.sync.tensor_fusion_threshold == 1024 * 1024
    assert (config.heartbeat.interval_seconds, config.heartbeat.timeout_seconds) == (5.0, 30.0)
    assert (config.task.max_retries, config.task.retry_delay_seconds) == (3, 1.0)
    assert (config.sync.comm_base_port, config.sync.comm_max_port) == (11000, 11999)
    assert config.auth.token is None and config.base_url == "http://127.0.0.1:8000"


def test_environment_variables_configure_and_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCS_COORDINATOR_PORT", "9100")
    monkeypatch.setenv("DCS_BACKEND_TYPE", "nccl")
    monkeypatch.setenv("DCS_AUTH_TOKEN", "s3cr3t-value")
    monkeypatch.setenv("DCS_STAGING_POLICY", "skip")
    config = DCSConfig(heartbeat_timeout_seconds=12)
    assert config.coordinator.port == 9100 and config.sync.backend_type is BackendType.NCCL
    assert config.token() == "s3cr3t-value" and "s3cr3t" not in repr(config)
    assert config.staging.policy is StagingPolicy.SKIP and config.heartbeat.timeout_seconds == 12
    assert DCSConfig(coordinator_port=9200).coordinator.port == 9200


def test_to_env_rebuilds_the_same_config(monkeypatch: pytest.MonkeyPatch) -> None:
    original = DCSConfig(auth_token="t0k", coordinator_port=8123, namespace="run7", heartbeat_timeout_seconds=9)
    for name, value in original.to_env().items():
        monkeypatch.setenv(name, value)
    assert DCSConfig() == original


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coordinator_port": 0}, "coordinator_port"),
        (
            {"heartbeat_interval_seconds": 10, "heartbeat_timeout_seconds": 5},
            "heartbeat_timeout_seconds must be larger",
        ),
        ({"comm_base_port": 12000, "comm_max_port": 11000}, "comm port range is empty"),
        ({"redis_url": "http://localhost"}, "redis_url must be"),
        ({"coordinator_url": "localhost:8000"}, "coordinator_url must start"),
        ({"backend_type": "carrier-pigeon"}, "backend_type"),
        ({"namespace": "a b"}, "namespace"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_bad_values_are_rejected_with_a_message(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DCSConfig(**kwargs)


def test_wildcard_host_gives_a_loopback_client_url() -> None:
    assert DCSConfig(coordinator_host="0.0.0.0", coordinator_port=8001).base_url == "http://127.0.0.1:8001"
    assert DCSConfig(coordinator_url="http://coord:9/").base_url == "http://coord:9"


def test_role_info_ids_and_validation() -> None:
    info = RoleInfo(role_name="rollout", rank=3, ip="10.0.0.5", port=15000)
    assert info.node_id == "rollout_3" and info.address == "10.0.0.5:15000"
    with pytest.raises(ValidationError):
        RoleInfo(role_name="actor", rank=-1)
    with pytest.raises(ValidationError):
        RoleInfo(role_name="")


def test_topology_config_peer_role() -> None:
    config = TopologyConfig()
    assert config.get_peer_role("actor") == "rollout" and config.get_peer_role("rollout") is None
    assert TopologyConfig(role_mappings={"a": "b"}).get_peer_role("a") == "b"


def test_topology_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCS_ROLE_MAPPINGS", '{"trainer": "engine"}')
    monkeypatch.setenv("DCS_ROLE_ORDER", '["engine", "trainer"]')
    topology = DCSConfig().topology_config()
    assert topology.get_peer_role("trainer") == "engine" and topology.role_order == ["engine", "trainer"]


# --- the areas: `config.<area>.<field>`, with every DCS_* name and flat keyword as before ---------------------

NON_DEFAULT = {  # a valid value other than the default, for settings whose default is None (or shown as such)
    "coordinator_url": "http://coord.example:8100",
    "auth_token": "t0ken-value",
    "role_order": '["engine", "trainer"]',
    "node_name": "host-7",
    "advertise_address": "10.1.2.3",
    "comm_ifname": "eth1",
    "ref_update_interval": "4",
    "host_agent_socket": "/tmp/dcs-agent-test.sock",
    "host_trusted_uid": "0",
    "replica_dir": "/tmp/dcs-replicas-test",
    "keep_last": "3",
    "keep_every": "10",
    "failure_domain": "rack-2",
    "peer_advertise_host": "10.1.2.4",
    "persist_throttle_bytes_per_second": "1000000.0",
    "s3_endpoint_url": "http://127.0.0.1:9000",
    "s3_region": "eu-west-1",
    "memory_tier_bytes": "1073741824",
    "checkpoint_dir": "s3://bucket/prefix",
}


def _clear_dcs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.upper().startswith("DCS_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("flat", list(SETTINGS))
def test_each_environment_variable_lands_in_its_area_field(flat: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_dcs_env(monkeypatch)
    setting = SETTINGS[flat]
    value = NON_DEFAULT.get(flat) or DCSConfig().to_env()[setting.env]
    monkeypatch.setenv(setting.env, value)
    config = DCSConfig()
    assert config.given() == {flat}
    assert setting.field in getattr(config, setting.area).model_fields_set
    got = config.to_env()[setting.env]
    assert got == value or json.loads(got) == json.loads(value), (flat, got, value)


def test_flat_keywords_construct_copy_and_assign_as_before() -> None:
    config = DCSConfig(
        s3_endpoint_url="http://127.0.0.1:9000", memory_tier_bytes=MiB, keep_last=2, comm_base_port=20000
    )
    assert config.s3.endpoint_url == "http://127.0.0.1:9000" and config.memory.budget_bytes == MiB
    assert config.checkpoint.keep_last == 2 and config.sync.comm_max_port == 20999
    assert config == DCSConfig(
        s3={"endpoint_url": "http://127.0.0.1:9000"},
        memory={"budget_bytes": MiB},
        checkpoint={"keep_last": 2},
        sync={"comm_base_port": 20000},
    )
    copy = config.model_copy(update={"keep_last": 5, "s3_region": "eu-west-1", "runtime_dir": Path("/tmp/dcs-x")})
    assert (copy.checkpoint.keep_last, copy.s3.region, copy.host.staging_dir) == (
        5,
        "eu-west-1",
        Path("/tmp/dcs-x/staging"),
    )
    assert (config.checkpoint.keep_last, config.s3.region) == (2, None)  # the original is untouched
    copy.s3.part_bytes = 64 * MiB  # a copy shares no area with its original
    assert config.s3.part_bytes == 32 * MiB
    config.heartbeat_timeout_seconds = 40  # the original design's tuning snippets assign flat names
    assert config.heartbeat.timeout_seconds == 40
    with pytest.raises(ValidationError, match="heartbeat_timeout_seconds must be larger"):
        config.heartbeat_timeout_seconds = 1  # validated as before
    with pytest.raises(AttributeError):
        config.keep_last  # noqa: B018  # settings are read through their area


def test_constructor_arguments_win_over_the_environment_field_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCS_S3_REGION", "from-env")
    monkeypatch.setenv("DCS_S3_PART_BYTES", str(16 * MiB))
    assert DCSConfig(s3_region="given").s3.region == "given"
    nested = DCSConfig(s3={"region": "nested"})
    assert (nested.s3.region, nested.s3.part_bytes) == ("nested", 16 * MiB)  # the environment fills the rest


def test_unknown_names_are_refused_naming_the_key() -> None:
    with pytest.raises(ValidationError, match="no_such_setting") as caught:
        DCSConfig(no_such_setting=1)
    assert caught.value.errors()[0]["type"] == "extra_forbidden"
    with pytest.raises(ValidationError, match="bogus"):
        DCSConfig(s3={"bogus": 1})
    with pytest.raises(ValueError, match="nope"):
        DCSConfig().model_copy(update={"nope": 1})
    with pytest.raises(ValueError, match="nope"):
        DCSConfig().nope = 1


def test_errors_name_the_flat_setting() -> None:
    with pytest.raises(ValidationError) as caught:
        DCSConfig(coordinator_port=0, s3={"part_bytes": 1})
    assert [error["loc"] for error in caught.value.errors()] == [("coordinator_port",), ("s3_part_bytes",)]


def test_every_area_field_has_one_environment_name() -> None:
    names = [info.alias or name for model in AREAS.values() for name, info in model.model_fields.items()]
    assert len(names) == len(set(names)) == len(SETTINGS) == 107
    assert set(names) == set(SETTINGS) and not set(names) & set(AREAS)
    envs = [setting.env for setting in SETTINGS.values()]
    assert len(set(envs)) == len(envs) and all(env == env.upper() and env.startswith("DCS_") for env in envs)
    for setting in SETTINGS.values():  # a field's name is its flat name, or that name less its area's prefix
        assert setting.field in (setting.flat, setting.flat.removeprefix(f"{setting.area}_"), "budget_bytes", "dir")
        assert setting.description, f"{setting.flat} has no docstring"


def test_the_peer_rate_window_is_a_setting_with_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCS_PEER_RATE_WINDOW_SECONDS sets the window the memory tier's minimum peer rate is judged over (default
    10 s, as the constant it replaced); values outside 1-300 s or not numbers are refused, naming the setting."""
    assert DCSConfig().peer.rate_window_seconds == 10.0
    monkeypatch.setenv("DCS_PEER_RATE_WINDOW_SECONDS", "2.5")
    config = DCSConfig()
    assert config.peer.rate_window_seconds == 2.5
    assert config.to_env()["DCS_PEER_RATE_WINDOW_SECONDS"] == "2.5"
    for bad, why in (
        ("0", "greater than or equal to 1"),
        ("-3", "greater than or equal to 1"),
        ("301", "less than or equal to 300"),
        ("ten", "valid number"),
    ):
        monkeypatch.setenv("DCS_PEER_RATE_WINDOW_SECONDS", bad)
        with pytest.raises(ValidationError, match=why) as caught:
            DCSConfig()
        assert [error["loc"] for error in caught.value.errors()] == [("peer_rate_window_seconds",)]
