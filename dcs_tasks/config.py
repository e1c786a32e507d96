"""Typed settings for every DCS process.

One `DCSConfig` object is built at a process edge (CLI, trainer, test) and passed explicitly to
`create_app`, `make_celery`, `Checkpointer` and `CheckpointEngineClient`. Values come from constructor
arguments first, then `DCS_*` environment variables, then the defaults below. Nothing here reads the
environment at import time.
"""

from __future__ import annotations

import enum
import json
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class BackendType(str, enum.Enum):
    """Transport used for tensor broadcasts."""

    GLOO = "gloo"
    NCCL = "nccl"
    TCP = "tcp"


class StagingPolicy(str, enum.Enum):
    """What `Checkpointer.save` does when every staging buffer is still being persisted."""

    BLOCK = "block"
    SKIP = "skip"


class RoleInfo(BaseModel):
    """One node of the cluster: a process with a role and a rank inside that role."""

    model_config = ConfigDict(extra="forbid")

    role_name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=0)
    ip: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    device_id: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return f"{self.role_name}_{self.rank}"

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


class TopologyConfig(BaseModel):
    """Which role a node talks to: `{"actor": "rollout"}` pairs actor rank N with rollout rank N."""

    role_mappings: dict[str, str] = Field(default_factory=lambda: {"actor": "rollout"})
    role_order: list[str] | None = None

    def get_peer_role(self, role: str) -> str | None:
        return self.role_mappings.get(role)


class DCSConfig(BaseSettings):
    """Every tunable of a DCS deployment. Environment variables: `DCS_<FIELD_NAME>`."""

    model_config = SettingsConfigDict(env_prefix="DCS_", extra="forbid", validate_assignment=True)

    # coordinator
    coordinator_host: str = "127.0.0.1"
    coordinator_port: int = Field(default=8000, ge=1, le=65535)
    coordinator_url: str | None = None
    auth_token: SecretStr | None = None
    max_body_bytes: int = Field(default=8 * MiB, ge=1024)
    request_timeout_seconds: float = Field(default=30.0, gt=0)
    # topology answers (/peer mapping, /global_rank role order); give every coordinator the same values
    role_mappings: dict[str, str] = Field(default_factory=lambda: {"actor": "rollout"})
    role_order: list[str] | None = None

    # identity of this host: names its Celery node queue `dcs.node.<node_name>` (default: hostname)
    node_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]+$")

    # redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = Field(default="dcs", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    redis_socket_timeout_seconds: float = Field(default=5.0, gt=0)

    # communication
    backend_type: BackendType = BackendType.GLOO
    tcp_buffer_size: int = Field(default=65536, ge=4096)
    tcp_nodelay: bool = True
    tensor_fusion_threshold: int = Field(default=1 * MiB, ge=0)
    bucket_size_bytes: int = Field(default=256 * MiB, ge=1024)
    comm_base_port: int = Field(default=11000, ge=1024, le=65535)
    comm_max_port: int = Field(default=11999, ge=1024, le=65535)
    comm_timeout_seconds: float = Field(default=300.0, gt=0)
    group_init_timeout_seconds: float = Field(default=60.0, gt=0)
    ref_update_interval: int | None = Field(default=None, ge=1)

    # heartbeats
    heartbeat_interval_seconds: float = Field(default=5.0, gt=0)
    heartbeat_timeout_seconds: float = Field(default=30.0, gt=0)

    # storage
    checkpoint_dir: Path = Path("checkpoints")
    staging_dir: Path = Path("/dev/shm")
    staging_buffers: int = Field(default=2, ge=1)
    staging_policy: StagingPolicy = StagingPolicy.BLOCK
    file_shard_bytes: int = Field(default=256 * MiB, ge=MiB)
    async_io: bool = True
    pinned_memory: bool = True
    keep_last: int | None = Field(default=None, ge=1)
    keep_every: int | None = Field(default=None, ge=1)
    # fault-injection knob: workers write checkpoint files no faster than this (None: full speed)
    persist_throttle_bytes_per_second: float | None = Field(default=None, gt=0)

    # fault tolerance
    max_retries: int = Field(default=3, ge=0)
    retry_delay_seconds: float = Field(default=1.0, ge=0)
    retry_backoff_max_seconds: float = Field(default=30.0, ge=0)
    max_redeliveries: int = Field(default=3, ge=1)
    task_soft_time_limit_seconds: float = Field(default=300.0, gt=0)
    task_time_limit_seconds: float = Field(default=360.0, gt=0)
    visibility_timeout_seconds: float = Field(default=600.0, gt=0)
    worker_presence_timeout_seconds: float = Field(default=2.0, gt=0)

    # observability
    enable_metrics: bool = True
    metrics_port: int = Field(default=9090, ge=0, le=65535)

    @field_validator("coordinator_url")
    @classmethod
    def _strip_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
            raise ValueError(f"redis_url must be a redis://, rediss://, unix:// or sentinel:// URL, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_relations(self) -> DCSConfig:
        if self.heartbeat_timeout_seconds <= self.heartbeat_interval_seconds:
            raise ValueError(
                "heartbeat_timeout_seconds must be larger than heartbeat_interval_seconds "
                f"({self.heartbeat_timeout_seconds} <= {self.heartbeat_interval_seconds})"
            )
        if self.comm_max_port < self.comm_base_port:
            raise ValueError(f"comm port range is empty: {self.comm_base_port}-{self.comm_max_port}")
        if self.task_time_limit_seconds < self.task_soft_time_limit_seconds:
            raise ValueError("task_time_limit_seconds must be >= task_soft_time_limit_seconds")
        return self

    @property
    def base_url(self) -> str:
        """The coordinator's URL as clients should use it."""
        if self.coordinator_url:
            return self.coordinator_url
        host = "127.0.0.1" if self.coordinator_host in ("0.0.0.0", "::") else self.coordinator_host
        return f"http://{host}:{self.coordinator_port}"

    @property
    def host_name(self) -> str:
        """The name of this host's node queue suffix."""
        return self.node_name or socket.gethostname()

    def to_env(self) -> dict[str, str]:
        """`DCS_*` variables that rebuild this config in a child process (secrets included)."""
        env: dict[str, str] = {}
        for name, value in self.model_dump(mode="json").items():
            if value is None:
                continue
            if name == "auth_token":
                value = self.token()
            env[f"DCS_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def token(self) -> str | None:
        return self.auth_token.get_secret_value() if self.auth_token else None

    def topology_config(self) -> TopologyConfig:
        """The role mappings and role order the coordinator answers with (`DCS_ROLE_MAPPINGS`, `DCS_ROLE_ORDER`)."""
        return TopologyConfig(role_mappings=self.role_mappings, role_order=self.role_order)
