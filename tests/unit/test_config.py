"""DCSConfig, RoleInfo and TopologyConfig: what a user sets is what every process gets, bad values say why."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dcs_tasks.config import BackendType, DCSConfig, RoleInfo, StagingPolicy, TopologyConfig


def test_defaults_follow_the_seed() -> None:
    config = DCSConfig()
    assert config.coordinator_host == "127.0.0.1" and config.coordinator_port == 8000
    assert config.backend_type is BackendType.GLOO
    assert config.tensor_fusion_threshold == 1024 * 1024
    assert (config.heartbeat_interval_seconds, config.heartbeat_timeout_seconds) == (5.0, 30.0)
    assert (config.max_retries, config.retry_delay_seconds) == (3, 1.0)
    assert (config.comm_base_port, config.comm_max_port) == (11000, 11999)
    assert config.auth_token is None and config.base_url == "http://127.0.0.1:8000"


def test_environment_variables_configure_and_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCS_COORDINATOR_PORT", "9100")
    monkeypatch.setenv("DCS_BACKEND_TYPE", "nccl")
    monkeypatch.setenv("DCS_AUTH_TOKEN", "s3cr3t-value")
    monkeypatch.setenv("DCS_STAGING_POLICY", "skip")
    config = DCSConfig(heartbeat_timeout_seconds=12)
    assert config.coordinator_port == 9100 and config.backend_type is BackendType.NCCL
    assert config.token() == "s3cr3t-value" and "s3cr3t" not in repr(config)
    assert config.staging_policy is StagingPolicy.SKIP and config.heartbeat_timeout_seconds == 12
    assert DCSConfig(coordinator_port=9200).coordinator_port == 9200


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
