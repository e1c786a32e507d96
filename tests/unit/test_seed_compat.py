"""The original design's surface: what it imports from the package root, its config and metrics calls, and
the optional fields of its API models (docs/seed_compat.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

ROOT_NAMES = [
    "BackendType",
    "CheckpointEngineClient",
    "DCSConfig",
    "MetricsCollector",
    "RoleInfo",
    "TopologyConfig",
    "create_client",
    "get_metrics",
]


def test_the_package_root_exports_what_the_original_design_imports() -> None:
    import dcs_tasks
    from dcs_tasks import BackendType, CheckpointEngineClient, DCSConfig, RoleInfo, TopologyConfig, get_metrics
    from dcs_tasks.client.engine import CheckpointEngineClient as Engine
    from dcs_tasks.config import BackendType as ConfigBackendType
    from dcs_tasks.metrics import get_metrics as metrics_get

    assert CheckpointEngineClient is Engine and BackendType is ConfigBackendType and get_metrics is metrics_get
    assert BackendType.NCCL.value == "nccl" and DCSConfig().sync.backend_type is BackendType.GLOO
    assert RoleInfo(role_name="actor", rank=0).node_id == "actor_0"
    assert TopologyConfig(role_mappings={"actor": "rollout"}).get_peer_role("actor") == "rollout"
    assert set(ROOT_NAMES) <= set(dcs_tasks.__all__) and set(ROOT_NAMES) <= set(dir(dcs_tasks))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        dcs_tasks.NoSuchThing  # noqa: B018


def test_root_imports_of_config_and_metrics_do_not_load_torch() -> None:
    code = (
        "import sys\nfrom dcs_tasks import BackendType, DCSConfig, RoleInfo, TopologyConfig, get_metrics\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_comm_base_port_alone_gives_a_range_of_1000_ports() -> None:
    from dcs_tasks import DCSConfig

    config = DCSConfig(comm_base_port=20000)
    assert (config.sync.comm_base_port, config.sync.comm_max_port) == (20000, 20999)
    config.sync.comm_base_port = 30000  # the original design's tuning snippet assigns it
    assert config.sync.comm_max_port == 30999
    assert DCSConfig().model_copy(update={"comm_base_port": 40000}).sync.comm_max_port == 40999
    assert DCSConfig(comm_base_port=65000).sync.comm_max_port == 65535  # capped at the last port
    assert DCSConfig(comm_base_port=20000).to_env()["DCS_COMM_MAX_PORT"] == "20999"  # a child gets the same range


def test_an_explicit_comm_max_port_is_kept_and_checked() -> None:
    from dcs_tasks import DCSConfig

    config = DCSConfig(comm_max_port=12005)
    config.sync.comm_base_port = 12000
    assert config.sync.comm_max_port == 12005
    with pytest.raises(ValidationError, match="comm port range is empty: 20000-11999"):
        DCSConfig(comm_base_port=20000, comm_max_port=11999)


def test_export_prometheus_is_text() -> None:
    from dcs_tasks import get_metrics
    from dcs_tasks.metrics import MetricsCollector

    metrics = MetricsCollector()
    metrics.record_send(bytes_sent=1024 * 1024, duration=0.05)
    text = metrics.export_prometheus()
    assert isinstance(text, str) and "dcs_bytes_sent_total 1.048576e+06" in text
    assert isinstance(get_metrics().export_prometheus(), str)


@pytest.mark.parametrize("field", ["ip", "port", "metadata"])
def test_null_optional_fields_take_their_defaults(field: str) -> None:
    from dcs_tasks.config import RoleInfo
    from dcs_tasks.models import RegisterRequest

    for model in (RoleInfo, RegisterRequest):
        node = model.model_validate({"role_name": "actor", "rank": 0, field: None})
        assert (node.ip, node.port, node.metadata) == ("127.0.0.1", 0, {})
    with pytest.raises(ValidationError, match="role_name"):
        RegisterRequest.model_validate({"role_name": None})  # a role is still required
    with pytest.raises(ValidationError, match="port"):
        RegisterRequest.model_validate({"role_name": "actor", "port": "x"})  # only null is taken as "not given"
