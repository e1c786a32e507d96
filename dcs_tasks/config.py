"""Typed settings for every DCS process.

One `DCSConfig` object is built at a process edge (CLI, trainer, test) and passed explicitly to
`create_app`, `make_celery`, `Checkpointer` and `CheckpointEngineClient`. Values come from constructor
arguments first, then `DCS_*` environment variables, then the defaults below. Nothing here reads the
environment at import time.
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from dcs_tasks.redisurl import parse_sentinel_url
from dcs_tasks.storage_url import StorageRoot, parse_root

MiB = 1024 * 1024
COMM_PORT_SPAN = 1000  # ports in the weight-sync master range when only comm_base_port is given
_HOST_DIRS = ("runtime_dir", "staging_dir", "memory_dir")  # derived from runtime_dir unless given
HOST_DIR_LEAVES = {"staging_dir": "staging", "memory_dir": "memory"}  # their defaults under runtime_dir
MASK = "***"
# scheme://user:password@  or  scheme://user@  (a lone user may be a secret too); ?password=... query values
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^@/\s?#]*)@")
_URL_PASSWORD_PARAM = re.compile(r"(?P<key>[?&](?:\w*password|pass|pwd|token)=)[^&#\s]*", re.IGNORECASE)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, sep, _ = match["userinfo"].partition(":")
    return f"{match['scheme']}{user}:{MASK}@" if sep else f"{match['scheme']}{MASK}@"


def mask_url_credentials(text: str) -> str:
    """`text` with the credentials of every URL in it masked: `redis://user:***@host/0`, `redis://***@host`,
    `?password=***`. Safe to apply to whole log lines and error messages."""
    return _URL_PASSWORD_PARAM.sub(lambda m: m["key"] + MASK, _URL_USERINFO.sub(_mask_userinfo, text))


def scrub_secrets(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every given secret value and every URL's credentials replaced by `***`."""
    for secret in secrets:
        if secret and len(secret) >= 3:
            text = text.replace(secret, MASK)
    return mask_url_credentials(text)


MAX_GROUP_INIT_TIMEOUT_SECONDS = 3600.0  # the longest group-formation wait DCS sends or accepts in a payload


class BackendType(str, enum.Enum):
    """Transport used for tensor broadcasts."""

    GLOO = "gloo"
    NCCL = "nccl"
    TCP = "tcp"


class CheckpointCompression(str, enum.Enum):
    """How workers store checkpoint files (docs/checkpoints.md, Compression)."""

    NONE = "none"
    ZSTD = "zstd"


class StagingPolicy(str, enum.Enum):
    """What `Checkpointer.save` does when every staging buffer is still being persisted."""

    BLOCK = "block"
    SKIP = "skip"


class SaveFailurePolicy(str, enum.Enum):
    """What a `Checkpointer` does when it learns that a save failed for a reason retrying will not fix."""

    RAISE = "raise"
    WARN = "warn"


def _nullable(schema: dict[str, Any]) -> WithJsonSchema:
    """JSON schema of a field that takes `null` for its default (the Python type stays non-optional)."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


class RoleInfo(BaseModel):
    """One node of the cluster: a process with a role and a rank inside that role."""

    model_config = ConfigDict(extra="forbid")

    role_name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=0)
    # null is accepted for these (the original design types them optional) and stands for the default
    ip: Annotated[str, _nullable({"type": "string"})] = "127.0.0.1"
    port: Annotated[int, _nullable({"type": "integer", "minimum": 0, "maximum": 65535})] = Field(
        default=0, ge=0, le=65535
    )
    device_id: int | None = Field(default=None, ge=0)
    metadata: Annotated[dict[str, Any], _nullable({"type": "object"})] = Field(default_factory=dict)

    @field_validator("ip", "port", "metadata", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """`null` means "not given" (the original design types these optional): the field's default."""
        if value is None:
            return cls.model_fields[info.field_name or ""].get_default(call_default_factory=True)
        return value

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


_DERIVED: Any = None  # for type checkers: a host directory derived when not given is a Path once validated


def default_runtime_dir(uid: int | None = None) -> Path:
    """`runtime_dir` when unset: `/dev/shm/dcs-<uid>` (default: this process's effective uid)."""
    return Path(f"/dev/shm/dcs-{os.geteuid() if uid is None else uid}")


class _Area(BaseModel):
    """One area of `DCSConfig`. A field whose name drops the area's prefix has its flat setting name as its alias
    (`port`, alias `coordinator_port`: `DCS_COORDINATOR_PORT`); either name is accepted."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_by_name=True,
        validate_by_alias=True,
    )

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        """repr() and str() never show URL credentials (the token is a SecretStr already)."""
        for name, value in super().__repr_args__():
            yield name, mask_url_credentials(value) if isinstance(value, str) else value


class CoordinatorSettings(_Area):
    """The coordinator: where it listens and clients reach it, its request limits, its node records and its
    topology answers (give every coordinator the same `role_mappings` and `role_order`)."""

    host: str = Field(default="127.0.0.1", alias="coordinator_host")
    """Address the coordinator binds (127.0.0.1 unless you mean to expose it)."""
    port: int = Field(alias="coordinator_port", default=8000, ge=1, le=65535)
    """Port the coordinator listens on."""
    url: str | None = Field(default=None, alias="coordinator_url")
    """URL clients use to reach the coordinator (default: built from host and port)."""
    max_body_bytes: int = Field(default=8 * MiB, ge=1024)
    """Largest request body the coordinator accepts (413 beyond)."""
    request_timeout_seconds: float = Field(default=30.0, gt=0)
    """Timeout of one HTTP request from a DCS client to the coordinator or an engine."""
    weight_meta_max_entries: int = Field(default=10_000, ge=0)
    """Entries the weight-meta log keeps (0: all); older ones are dropped at append. Indices stay absolute,
    so only a reader this far behind misses entries, and it is told (`first_index`)."""
    weight_meta_entry_max_bytes: int = Field(default=1 * MiB, ge=1024)
    """Largest JSON of one /send_weight_meta entry (413 beyond); at most weight_meta_read_max_bytes."""
    weight_meta_read_max_entries: int = Field(default=1000, ge=1)
    """Most entries one /recv_weight_meta answer carries; the client continues from `next_index`."""
    weight_meta_read_max_bytes: int = Field(default=4 * MiB, ge=1024)
    """Most bytes of entries one /recv_weight_meta answer carries (one entry always fits)."""
    metadata_max_depth: int = Field(default=16, ge=1, le=64)
    """Deepest nesting of the `metadata` a node registers (422 beyond)."""
    metadata_max_bytes: int = Field(default=64 * 1024, ge=256)
    """Largest JSON of the `metadata` a node registers (422 beyond)."""
    dead_node_retention_seconds: float = Field(default=3600.0, gt=0)
    """A node dead this long is removed (and its role when it was the role's last node; one beaten through
    `/heartbeats` up to a tenth of this and the heartbeat timeout sooner, see docs/operations.md); until then it
    is listed in /health and keeps its rank for a replacement."""
    unbeaten_node_retention_seconds: float = Field(default=60.0, gt=0)
    """A node that registered but never sent a heartbeat is removed this long after its heartbeat timeout
    (not after dead_node_retention_seconds), however many there are."""
    node_identity_required: bool = True
    """Heartbeats and unregisters must carry X-DCS-Node (the identity /register returned; 422 without it),
    and a register of a rank held by a live node of another identity is refused (409). False: the rules
    before (unfenced beats and unregisters accepted, a register takes a live node's rank over)."""
    keep_alive_seconds: float = Field(alias="coordinator_keep_alive_seconds", default=20.0, gt=0)
    """An idle keep-alive connection to the coordinator is closed after this (longer than the 5 s heartbeat
    interval, so a node's beats reuse one connection; CoordinatorAPI lets its idle ones go after 15 s)."""
    request_read_timeout_seconds: float = Field(alias="coordinator_request_read_timeout_seconds", default=15.0, gt=0)
    """A client must send a whole request (headers and body) within this, else its connection is closed
    (slow clients cannot hold connections open)."""
    max_header_bytes: int = Field(alias="coordinator_max_header_bytes", default=16 * 1024, ge=1024)
    """Largest request line plus headers the coordinator reads (the connection is refused beyond)."""
    role_mappings: dict[str, str] = Field(default_factory=lambda: {"actor": "rollout"})
    """Peer role of each role, e.g. {"actor": "rollout"} (JSON in the environment)."""
    role_order: list[str] | None = None
    """Fixed role order for global ranks (default: order of first registration)."""

    @field_validator("url")
    @classmethod
    def _strip_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _check_relations(self) -> CoordinatorSettings:
        if self.weight_meta_entry_max_bytes > self.weight_meta_read_max_bytes:
            raise ValueError(
                "weight_meta_entry_max_bytes must be <= weight_meta_read_max_bytes (one entry must fit an answer)"
            )
        return self

    @property
    def base_url(self) -> str:
        """The coordinator's URL as clients should use it."""
        if self.url:
            return self.url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


class AuthSettings(_Area):
    """The shared secret of a deployment."""

    token: SecretStr | None = Field(default=None, alias="auth_token")
    """Bearer token required on every coordinator endpoint but /healthz and /metrics when set; `dcs receiver`
    requires it too (all but /health*, /metrics*: SGLang's --api-key rules) and DCS sends it to every engine."""


class RedisSettings(_Area):
    """Redis: the coordinator's state, the Celery broker and results."""

    url: str = Field(default="redis://127.0.0.1:6379/0", alias="redis_url")
    """Redis for the coordinator state, the Celery broker and results: `redis://[:password@]host:6379/0`, or
    Redis Sentinel `sentinel://[:password@]host1:26379,host2:26379,.../<master_name>[/<db>]` (docs/operations.md)."""
    namespace: str = Field(default="dcs", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Prefix of every Redis key DCS writes."""
    socket_timeout_seconds: float = Field(alias="redis_socket_timeout_seconds", default=5.0, gt=0)
    """Connect and read timeout of every Redis connection."""
    max_connections: int = Field(alias="redis_max_connections", default=256, ge=4)
    """Redis connections one coordinator process opens at most; a request waits for a free one."""
    pool_timeout_seconds: float = Field(alias="redis_pool_timeout_seconds", default=5.0, gt=0)
    """How long a coordinator request waits for a free Redis connection before answering 503."""

    @field_validator("url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
            raise ValueError(f"redis_url must be a redis://, rediss://, unix:// or sentinel:// URL, got {value!r}")
        if value.startswith("sentinel://"):
            parse_sentinel_url(value)  # ConfigError (a ValueError) when malformed
        return value


class HostSettings(_Area):
    """This host: its node queue's name, its host agent and its private directories (docs/operations.md, Security)."""

    node_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Name of this host's node queue `dcs.node.<name>` (default: the hostname)."""
    agent: bool = Field(default=True, alias="host_agent")
    """`dcs worker` serves its host's agent on a Unix socket (`host_agent_socket`): trainers, `dcs receiver` and
    `dcs engine attach` on the host register and beat through it (one POST /heartbeats per interval for the
    host) while it answers, and beat per node themselves while it does not. False: none served, none used."""
    agent_socket: Path | None = Field(default=None, alias="host_agent_socket")
    """The host agent's Unix socket (default: `<runtime_dir>/agent-<hash>.sock`, hashed over the coordinator
    URL, Redis URL, namespace and host name, so only processes configured alike share an agent). Its directory
    must be private (owned by this uid or `host_trusted_uid`, mode 0700, no link); a process talks only to an
    agent running as one of those uids (checked with SO_PEERCRED before anything is sent)."""
    # the three directories are Path once validated (None: derived, `_derive_host_dirs`): typed so for readers
    if TYPE_CHECKING:
        runtime_dir: Path = _DERIVED
    else:
        runtime_dir: Path | None = None
        """This user's private directory for everything DCS makes on a host (default: `/dev/shm/dcs-<uid>`, the
        effective uid): the host agent's socket and its lock, and by default staging (`<runtime_dir>/staging`)
        and the memory tier (`<runtime_dir>/memory`). Made with mode 0700; one that exists must be a directory
        (no link) owned by this uid (or `host_trusted_uid`) with no group or other permissions, or DCS refuses it
        (UnsafeHostDirectory)."""
    trusted_uid: int | None = Field(alias="host_trusted_uid", default=None, ge=0)
    """One more uid whose directories and host agent this process trusts besides its own (None: only its own);
    e.g. 0 in a trainer whose host's `dcs worker` runs as root, and the trainer's uid in that worker."""
    if TYPE_CHECKING:
        staging_dir: Path = _DERIVED
    else:
        staging_dir: Path | None = None
        """tmpfs directory of the shared-memory staging buffers (default: `<runtime_dir>/staging`). Checked like
        `runtime_dir` (private to this uid, mode 0700, no link) before use, also when set."""
    if TYPE_CHECKING:
        memory_dir: Path = _DERIVED
    else:
        memory_dir: Path | None = None
        """The memory tier's directory (default: `<runtime_dir>/memory`; tmpfs: it outlives the worker and the
        trainer processes, not the host). The same tree as `checkpoint_dir`; also holds the copies of peer hosts'
        steps. Checked like `runtime_dir` (private to this uid, mode 0700, no link) before use, also when set."""

    @model_validator(mode="after")
    def _derive(self) -> HostSettings:
        self._derive_host_dirs()
        return self

    def _derive_host_dirs(self) -> None:
        """Unless given, runtime_dir, staging_dir and memory_dir follow their defaults (set, assigned or copied
        with an update), as comm_max_port does."""
        given = {name for name in _HOST_DIRS if name in self.model_fields_set and self.__dict__[name] is not None}
        if "runtime_dir" not in given:
            self.__dict__["runtime_dir"] = default_runtime_dir()
        for name, leaf in HOST_DIR_LEAVES.items():
            if name not in given:
                self.__dict__[name] = self.__dict__["runtime_dir"] / leaf

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> HostSettings:
        """pydantic's copy (no validation, as there), with the derived directories following runtime_dir."""
        copy = super().model_copy(update=update, deep=deep)
        copy._derive_host_dirs()
        return copy


class SyncSettings(_Area):
    """Weight sync: the transport of tensor broadcasts and the process groups that carry them."""

    backend_type: BackendType = BackendType.GLOO
    """Transport of tensor broadcasts: gloo (CPU), nccl (CUDA)."""
    tensor_fusion_threshold: int = Field(default=1 * MiB, ge=0)
    """Point-to-point `send`/`recv` of a tensor dict (the original design's API): more than one tensor totalling
    at least this many bytes travel as one fused message, others one message per tensor (both ends need the same
    value). Weight updates always travel in fused buckets (`bucket_size_bytes`)."""
    bucket_size_bytes: int = Field(default=256 * MiB, ge=1024)
    """Largest fused bucket of a weight update; bigger tensors travel alone."""
    pause_gc: bool = Field(default=True, alias="sync_pause_gc")
    """Hold off Python's cyclic garbage collector while a weight update is on the wire (sender and
    receivers): a full collection in a large process stalls the whole group for ~0.1 s."""
    comm_base_port: int = Field(default=11000, ge=1024, le=65535)
    """First master port for weight-sync process groups."""
    comm_max_port: int = Field(default=11000 + COMM_PORT_SPAN - 1, ge=1024, le=65535)
    """Last master port for weight-sync process groups (default: comm_base_port + 999, capped at 65535, also
    when comm_base_port is assigned later; set it to choose another range)."""
    comm_timeout_seconds: float = Field(default=300.0, gt=0)
    """Timeout of every collective (broadcast) of a weight update."""
    advertise_address: str | None = Field(default=None, min_length=1, max_length=253)
    """Address this node registers and serves weight-sync groups at, as other hosts reach it (default: the
    local address of the interface that routes to the coordinator)."""
    comm_ifname: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:@,=^\-]+$")
    """Network interface(s) gloo and NCCL use (sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where unset; default:
    the interface holding the advertised address, so a hostname resolving to loopback does not matter)."""
    group_init_timeout_seconds: float = Field(default=60.0, gt=0, le=MAX_GROUP_INIT_TIMEOUT_SECONDS)
    """Timeout for a weight-sync process group to form (at most `group_init_timeout_max_seconds`; a worker holds
    a join no longer than its own value of this)."""
    group_init_timeout_max_seconds: float = Field(default=300.0, gt=0, le=MAX_GROUP_INIT_TIMEOUT_SECONDS)
    """The longest wait for a group to form this host allows: `group_init_timeout_seconds` may not exceed it, and
    a worker cuts a join task that asks for longer to it (a join holds one of the worker's pool slots while it
    waits). At most 1 h."""
    ref_update_interval: int | None = Field(default=None, ge=1)
    """Update the reference model every N rollouts (None: never)."""

    @model_validator(mode="after")
    def _check_relations(self) -> SyncSettings:
        self._derive_comm_max_port()
        if self.comm_max_port < self.comm_base_port:
            raise ValueError(f"comm port range is empty: {self.comm_base_port}-{self.comm_max_port}")
        if self.group_init_timeout_seconds > self.group_init_timeout_max_seconds:
            raise ValueError(
                f"group_init_timeout_seconds ({self.group_init_timeout_seconds:g}) must be <= "
                f"group_init_timeout_max_seconds ({self.group_init_timeout_max_seconds:g}): a join holds a worker "
                "pool slot that long; raise DCS_GROUP_INIT_TIMEOUT_MAX_SECONDS (at most 3600) to allow it"
            )
        return self

    def _derive_comm_max_port(self) -> None:
        """Unless comm_max_port was given, it follows comm_base_port (set, assigned or copied with an update)."""
        if "comm_max_port" not in self.model_fields_set:
            self.__dict__["comm_max_port"] = min(self.comm_base_port + COMM_PORT_SPAN - 1, 65535)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> SyncSettings:
        """pydantic's copy (no validation, as there), with the derived comm_max_port following comm_base_port."""
        copy = super().model_copy(update=update, deep=deep)
        copy._derive_comm_max_port()
        return copy


class ReceiverSettings(_Area):
    """Rollout receivers (`dcs receiver`, `dcs engine attach`)."""

    tcp_buffer_size: int = Field(default=65536, ge=4096)
    """Send buffer (SO_SNDBUF) of a receiver's HTTP socket."""
    tcp_nodelay: bool = True
    """TCP_NODELAY on a receiver's HTTP socket (off costs a 40 ms delayed ACK per request)."""
    max_update_bytes: int = Field(alias="receiver_max_update_bytes", default=256 * 1024**3, ge=1)
    """Most tensor bytes a receiver accepts in one weight update (all its requests together); a request
    announcing more is refused (400) before anything is allocated."""
    max_body_bytes: int = Field(alias="receiver_max_body_bytes", default=64 * MiB, ge=1024)
    """Largest request body `dcs receiver` reads (413 beyond)."""
    request_read_timeout_seconds: float = Field(alias="receiver_request_read_timeout_seconds", default=10.0, gt=0)
    """Slow-client guard of `dcs receiver`: a connection whose request (head and body) has not fully arrived
    this long after it opened, or after the request's first byte, is closed."""
    keep_alive_seconds: float = Field(alias="receiver_keep_alive_seconds", default=5.0, gt=0)
    """An idle keep-alive connection to `dcs receiver` is closed after this long."""


class HeartbeatSettings(_Area):
    """Node heartbeats."""

    interval_seconds: float = Field(alias="heartbeat_interval_seconds", default=5.0, gt=0)
    """How often nodes send heartbeats."""
    timeout_seconds: float = Field(alias="heartbeat_timeout_seconds", default=30.0, gt=0)
    """A node without a heartbeat for this long is dead."""

    @model_validator(mode="after")
    def _check_relations(self) -> HeartbeatSettings:
        if self.timeout_seconds <= self.interval_seconds:
            raise ValueError(
                "heartbeat_timeout_seconds must be larger than heartbeat_interval_seconds "
                f"({self.timeout_seconds} <= {self.interval_seconds})"
            )
        return self


class CheckpointSettings(_Area):
    """Where checkpoints are written and how: the storage roots, retention, shards, incremental saves and
    compression."""

    dir: StorageRoot = Field(default=Path("checkpoints"), alias="checkpoint_dir")
    """Where runs and their steps are written: a directory (a bare path or `file:///...`; shared storage across
    hosts) or an object store, `s3://bucket/prefix` (S3 or S3-compatible: see the `s3_*` settings and
    docs/checkpoints.md, "Object storage (S3)"). Any other scheme is refused."""
    replica_dir: StorageRoot | None = None
    """Second storage location (None: no replicas). After each commit the worker copies the step to the same
    relative path under this root (`<replica_dir>/<run>/step-.../`), verifies it and moves the replica's
    `latest`; restore falls back to it when the primary step is missing or corrupt; retention prunes both
    (docs/checkpoints.md, Replicas). Must not be `checkpoint_dir` or inside it."""
    keep_last: int | None = Field(default=None, ge=1)
    """Retention: keep the newest N committed steps (None: keep all)."""
    keep_every: int | None = Field(default=None, ge=1)
    """Retention: also keep every step divisible by N."""
    save_failure_policy: SaveFailurePolicy = SaveFailurePolicy.RAISE
    """The trainer's: what a Checkpointer does when it learns that a save failed on the worker for a reason
    retrying will not fix (an untrusted path, refused S3 credentials, a missing bucket, no space left): `raise`
    SaveFailed, naming the step and the worker's reason, at the next save() or at close(); `warn`: log it and
    count it in `dcs_ckpt_save_failures_total`. A save lost because storage could not be reached
    (StorageUnavailable) is always only warned and counted: training goes on and the next save tries again.
    `close()` lists every failed step either way."""
    file_shard_bytes: int = Field(default=256 * MiB, ge=MiB)
    """Largest safetensors file of a step; bigger states are split and written in parallel."""
    async_io: bool = True
    """False: save() returns only once the step is committed (synchronous checkpoints)."""
    incremental_saves: bool = True
    """Incremental saves: a file whose bytes equal the previous step's is not written again (referenced)."""
    incremental_full_every: int | None = Field(default=8, ge=1)
    """Failure isolation of incremental saves (the worker's setting): a file is written anew once it already
    serves this many steps (the step that holds it and the later ones that refer to it), so one damaged file
    never takes more than this many steps with it. None: no bound (every unchanged file refers back to the
    first step that wrote it); 1: every save writes every file."""
    compression: CheckpointCompression = Field(default=CheckpointCompression.NONE, alias="checkpoint_compression")
    """Per-file compression of checkpoint files: none, or zstd. The worker compresses while it persists (never in
    save()'s stall); restore, verify and export read either kind transparently."""
    compression_level: int = Field(alias="checkpoint_compression_level", default=1, ge=-7, le=19)
    """zstd level of compressed checkpoint files (-7..19). Default 1: on bf16 weights, AdamW moments and
    token ids level 3 was 1.4-3x slower to write for the same or a smaller ratio (bench/compression.py)."""
    compression_min_saving: float = Field(alias="checkpoint_compression_min_saving", default=0.05, ge=0.0, le=1.0)
    """A file is compressed only when a sample of it (8 pieces of 128 KiB spread over the file) shrinks by at
    least this fraction at the level; otherwise it is written as it is (0: always compress)."""
    compression_threads: int = Field(alias="checkpoint_compression_threads", default=1, ge=0, le=64)
    """zstd threads a worker uses per file it compresses (the worker's own setting; 0: compress on the persist
    task's own thread, 1: one zstd thread, overlapped with the task's hashing and writing)."""
    persist_throttle_bytes_per_second: float | None = Field(default=None, gt=0)
    """Fault-injection knob: workers write no faster than this."""

    @field_validator("dir", "replica_dir", mode="before")
    @classmethod
    def _storage_root(cls, value: object) -> object:
        return None if value is None else parse_root(value)

    @field_serializer("dir", "replica_dir")
    def _dump_storage_root(self, value: StorageRoot | None) -> str | None:
        return None if value is None else str(value)


class StagingSettings(_Area):
    """The trainer's shared-memory staging buffers (their directory: `host.staging_dir`)."""

    buffers: int = Field(alias="staging_buffers", default=2, ge=1)
    """Staging buffers per Checkpointer: saves that may be in flight at once."""
    policy: StagingPolicy = Field(default=StagingPolicy.BLOCK, alias="staging_policy")
    """When every buffer is in flight: block (wait, counted in the stall) or skip the save."""
    pinned_memory: bool = True
    """Register staging buffers as pinned memory for CUDA tensors."""


class MemorySettings(_Area):
    """The memory tier (docs/checkpoints.md, "Memory tier"; its directory: `host.memory_dir`)."""

    budget_bytes: int = Field(alias="memory_tier_bytes", default=0, ge=0)
    """Host memory the memory tier may hold (bytes; 0: off, every step goes to storage). On: a step is committed
    in `memory_dir` first (restorable from there once verified), storage gets only the steps `storage_every_steps`,
    `storage_every_seconds` or `save(durable=True)` pick, and steps leave memory by `memory_keep_last` and this
    budget (never the newest complete one, never one held nowhere else). A save that does not fit goes to storage."""
    restore_verify: Literal["seal", "hash"] = Field(default="seal", alias="memory_restore_verify")
    """Memory tier: how a restore from this host's memory verifies a file. "seal": a file hashed on arrival, then
    made read-only and stamped (`seal.json`: inode, size, mtime, ctime), is trusted while its stamp holds (any
    later write, chmod or replacement moves the stamp); any other file is hashed. "hash": every byte is hashed on
    every restore (about 3x slower). Storage is always hashed. docs/checkpoints.md, "Memory tier"."""
    keep_last: int = Field(alias="memory_keep_last", default=2, ge=1)
    """Memory tier: the newest steps kept in memory per run and rank (older ones leave once held elsewhere)."""
    storage_every_steps: int = Field(default=1, ge=1)
    """Memory tier: storage gets every step divisible by this (1: every step, also made durable)."""
    storage_every_seconds: float = Field(default=0.0, ge=0)
    """Memory tier: storage also gets a step when the last one sent there is this old (0: no time rule)."""
    replicas: int = Field(alias="memory_replicas", default=0, ge=0, le=8)
    """Memory tier: peer hosts each memory step is copied to (their workers' memory), in failure domains other
    than this host's (`failure_domain`). A step counts as replicated once every copy verified."""
    failure_domain: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    """This host's failure domain (a rack, a switch, a power feed); peer copies of a host's steps go to hosts of
    other domains. None: the host is its own domain."""


class PeerSettings(_Area):
    """The worker's peer server and the memory-tier copies between hosts."""

    host: str = Field(default="127.0.0.1", alias="peer_host")
    """Address the worker's peer server (memory-tier copies) binds."""
    port: int = Field(alias="peer_port", default=0, ge=0, le=65535)
    """Port of the worker's peer server (0: any free port; the worker records the one it got in Redis)."""
    advertise_host: str | None = Field(default=None, alias="peer_advertise_host")
    """Address peers connect to (None: `peer_host`)."""
    timeout_seconds: float = Field(alias="peer_timeout_seconds", default=30.0, gt=0)
    """Memory tier: a peer copy or fetch gives up after this long without progress (connect, each send or read)."""
    handshake_seconds: float = Field(alias="peer_handshake_seconds", default=5.0, gt=0, le=300)
    """Memory tier: a connection to the peer server must prove it knows `auth_token` within this long, or it is
    closed; until then it holds none of the slots transfers use."""
    connections_per_source: int = Field(alias="peer_connections_per_source", default=8, ge=1, le=64)
    """Memory tier: connections one source address may have open at the peer server before they authenticate
    (more are closed at once); at most 64 in all, apart from the 16 that transfer steps."""
    min_bytes_per_second: int = Field(alias="peer_min_bytes_per_second", default=1 << 20, ge=0)
    """Memory tier: the rate a peer copy or fetch must keep once its step's bytes move, judged over each
    `peer_rate_window_seconds` (slower: cut off, its partial copy removed; 0: no minimum, only
    `peer_timeout_seconds` without progress)."""
    rate_window_seconds: float = Field(alias="peer_rate_window_seconds", default=10.0, ge=1.0, le=300)
    """Memory tier: the window `peer_min_bytes_per_second` is judged over, and the longest a moving transfer may
    be silent (when shorter than `peer_timeout_seconds`): a peer that trickles is cut off within about two
    windows. Shorter cuts slow peers sooner but also a transfer that stalls briefly (a busy disk or host)."""
    max_manifest_bytes: int = Field(alias="peer_max_manifest_bytes", default=4 << 20, ge=64 << 10, le=512 << 20)
    """Memory tier: the largest manifest a peer copy may carry (~400 bytes per tensor: 4 MiB holds ~10,000
    tensors per rank). A step with a bigger manifest is not copied to peers; it stays in memory and storage."""


class TaskSettings(_Area):
    """Celery tasks: retries, redeliveries and time limits."""

    max_retries: int = Field(default=3, ge=0)
    """Retries of a failed task or group init (exponential backoff with jitter)."""
    retry_delay_seconds: float = Field(default=1.0, ge=0)
    """First retry delay; doubles each retry."""
    retry_backoff_max_seconds: float = Field(default=30.0, ge=0)
    """Largest retry delay."""
    max_redeliveries: int = Field(default=3, ge=1)
    """A task redelivered more often than this (worker crashes) fails instead of looping."""
    soft_time_limit_seconds: float = Field(alias="task_soft_time_limit_seconds", default=300.0, gt=0)
    """Celery soft time limit of a task."""
    time_limit_seconds: float = Field(alias="task_time_limit_seconds", default=360.0, gt=0)
    """Celery hard time limit of a task."""
    visibility_timeout_seconds: float = Field(default=600.0, gt=0)
    """Redis redelivers an unacked task after this; must exceed limits plus backoff."""
    worker_stuck_stop_seconds: float = Field(default=15.0, gt=0)
    """After Celery gives up on an unrecoverable error (e.g. kombu failing while Redis restarts or fails over),
    the longest its warm stop may wait for running tasks before `dcs worker` kills them and re-execs itself
    (their tasks are late-ack: delivered again)."""

    @model_validator(mode="after")
    def _check_relations(self) -> TaskSettings:
        if self.time_limit_seconds < self.soft_time_limit_seconds:
            raise ValueError("task_time_limit_seconds must be >= task_soft_time_limit_seconds")
        return self

    def abandoned_save_seconds(self) -> float:
        """How long after it began a save still PERSISTING can no longer have a live persist task (a kill -9
        of the worker brings a task back after the visibility timeout, and each try runs at most the hard
        limit plus a backoff): a later save of the same step then takes it over."""
        tries = self.max_retries + 1
        return self.visibility_timeout_seconds + tries * (self.time_limit_seconds + self.retry_backoff_max_seconds)


class MetricsSettings(_Area):
    """Prometheus metrics."""

    enable_metrics: bool = True
    """Record Prometheus metrics."""
    port: int = Field(alias="metrics_port", default=9090, ge=0, le=65535)
    """Port of a worker's Prometheus exporter (0: none)."""
    host: str = Field(default="127.0.0.1", alias="metrics_host")
    """Address a worker's (and a trainer's) Prometheus exporter binds (0.0.0.0 inside a container, for a
    scraper next to it)."""
    trainer_metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port a trainer process (its first Checkpointer) serves its own metrics on, at /metrics (0: none):
    save stalls, staged bytes, restores, staging memory and saves in flight (docs/operations.md, Metrics)."""


class S3Settings(_Area):
    """Object storage (`checkpoint.dir` or `checkpoint.replica_dir` = s3://...); credentials: the standard AWS chain."""

    endpoint_url: str | None = Field(default=None, alias="s3_endpoint_url")
    """Endpoint of an S3-compatible server (None: AWS, or boto3's own `AWS_ENDPOINT_URL`)."""
    region: str | None = Field(default=None, alias="s3_region")
    """Region (None: boto3's own: `AWS_REGION`/`AWS_DEFAULT_REGION`, shared config)."""
    addressing_style: str = Field(alias="s3_addressing_style", default="auto", pattern=r"^(auto|path|virtual)$")
    """`path` for most S3-compatible servers (http://host/bucket/key), `virtual` for bucket.host, `auto`."""
    part_bytes: int = Field(alias="s3_part_bytes", default=32 * MiB, ge=5 * MiB, le=5 * 1024 * MiB)
    """Part size of multipart uploads and of the ranged GETs of a restore (S3 takes 5 MiB to 5 GiB)."""
    concurrency: int = Field(alias="s3_concurrency", default=8, ge=1, le=64)
    """Parts in flight per file a worker uploads (a worker uploads as many files at once as it has processes)."""
    read_concurrency: int = Field(alias="s3_read_concurrency", default=16, ge=1, le=128)
    """Ranged GETs in flight per restore (all of a step's files share them)."""
    max_attempts: int = Field(alias="s3_max_attempts", default=5, ge=1, le=20)
    """Attempts per S3 request (botocore's standard retry mode: throttling, 5xx and connection errors, with
    exponential backoff and jitter)."""
    connect_timeout_seconds: float = Field(alias="s3_connect_timeout_seconds", default=10.0, gt=0, le=300)
    """Connect timeout of one S3 request."""
    read_timeout_seconds: float = Field(alias="s3_read_timeout_seconds", default=60.0, gt=0, le=3600)
    """Longest wait for bytes on an S3 connection."""
    payload_signing: str = Field(alias="s3_payload_signing", default="auto", pattern=r"^(auto|on|off)$")
    """Whether SigV4 signatures cover each request body's SHA-256 (`on`) or say UNSIGNED-PAYLOAD (`off`: method,
    key, headers and credentials stay signed). `auto`: `off` over https, where TLS protects the body in transit
    (as AWS's own SDKs do there), `on` over plain http, where the signature is the body's only protection.
    Signing costs a SHA-256 pass over every uploaded byte in the worker, and another on servers that check it.
    Either way a restore checks every byte against the manifest's xxh3 (docs/checkpoints.md, "Object storage")."""


class DCSConfig(BaseSettings):
    """Every tunable of a DCS deployment, in one sub-model per area: `config.s3.endpoint_url`,
    `config.memory.budget_bytes`, `config.coordinator.port` (docs/configuration.md lists each setting's place).

    Each setting keeps its flat name, the one before the areas (`s3_endpoint_url`, `memory_tier_bytes`), and its
    environment variable is `DCS_<FLAT_NAME>` (`DCS_S3_ENDPOINT_URL`). The constructor, `model_copy(update=...)`
    and attribute assignment take flat names too (`DCSConfig(s3_endpoint_url=...)`, `config.comm_base_port = 20000`),
    or an area's fields (`DCSConfig(s3={"endpoint_url": ...})`); settings are read through their area."""

    model_config = SettingsConfigDict(env_prefix="DCS_", extra="forbid", validate_assignment=True)

    coordinator: CoordinatorSettings = Field(default_factory=CoordinatorSettings)
    """The coordinator: where it listens and clients reach it, its limits, node records and topology answers."""
    auth: AuthSettings = Field(default_factory=AuthSettings)
    """The shared secret of a deployment."""
    redis: RedisSettings = Field(default_factory=RedisSettings)
    """Redis: the coordinator's state, the Celery broker and results."""
    host: HostSettings = Field(default_factory=HostSettings)
    """This host: its node queue's name, its host agent and its private directories."""
    sync: SyncSettings = Field(default_factory=SyncSettings)
    """Weight sync: the transport of tensor broadcasts and its process groups."""
    receiver: ReceiverSettings = Field(default_factory=ReceiverSettings)
    """Rollout receivers (`dcs receiver`, `dcs engine attach`)."""
    heartbeat: HeartbeatSettings = Field(default_factory=HeartbeatSettings)
    """Node heartbeats."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Where checkpoints are written and how."""
    staging: StagingSettings = Field(default_factory=StagingSettings)
    """The trainer's shared-memory staging buffers."""
    memory: MemorySettings = Field(default_factory=MemorySettings)
    """The memory tier."""
    peer: PeerSettings = Field(default_factory=PeerSettings)
    """The worker's peer server and memory-tier copies between hosts."""
    task: TaskSettings = Field(default_factory=TaskSettings)
    """Celery tasks: retries, redeliveries and time limits."""
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """Prometheus metrics."""
    s3: S3Settings = Field(default_factory=S3Settings)
    """Object storage (S3 or S3-compatible)."""

    def __init__(self, **values: Any) -> None:
        """Settings from `values` (flat names or areas) first, then `DCS_*` environment variables, then defaults.
        Validation errors name each bad setting by its flat name (`coordinator_port`), as `DCS_<NAME>` spells it."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _with_flat_locations(exc) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Constructor arguments, then the flat `DCS_<NAME>` variables (`_FlatEnvSource`)."""
        return init_settings, _FlatEnvSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        """Flat setting names (`s3_endpoint_url=...`) go to their area's field; they win over the same field given
        in an area's dict (the environment's, as `_FlatEnvSource` gives them). Unknown names stay and are refused."""
        return nest_settings(data) if isinstance(data, dict) else data

    def __setattr__(self, name: str, value: Any) -> None:
        """`config.comm_base_port = 20000` (the original design's tuning snippets) assigns `config.sync.comm_base_port`,
        validated as the area's own assignment is."""
        setting = SETTINGS.get(name)
        if setting is not None and name not in AREAS:
            setattr(getattr(self, setting.area), setting.field, value)
            return
        super().__setattr__(name, value)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> DCSConfig:
        """pydantic's copy (no validation, as there) of this config and of each area (a copy never shares an area
        with its original). `update` takes flat names (`{"keep_last": 3}`), areas' dicts (`{"s3": {"region": "x"}}`)
        or areas; derived settings (comm_max_port, the host directories) follow as on construction."""
        nested = nest_settings(dict(update or {}))
        unknown = sorted(set(nested) - set(AREAS))
        if unknown:
            raise ValueError(f"unknown settings in model_copy(update=...): {', '.join(unknown)}")
        copy = super().model_copy(deep=deep)
        for area in AREAS:
            change = nested.get(area)
            if isinstance(change, BaseModel):
                copy.__dict__[area] = change.model_copy()
            else:
                copy.__dict__[area] = getattr(copy, area).model_copy(update=change)
        return copy

    @staticmethod
    def default_runtime_dir(uid: int | None = None) -> Path:
        """`runtime_dir` when unset: `/dev/shm/dcs-<uid>` (default: this process's effective uid)."""
        return default_runtime_dir(uid)

    @property
    def base_url(self) -> str:
        """The coordinator's URL as clients should use it."""
        return self.coordinator.base_url

    @property
    def host_name(self) -> str:
        """The name of this host's node queue suffix."""
        return self.host.node_name or socket.gethostname()

    def given(self) -> set[str]:
        """Flat names of the settings given (constructor, environment, assignment), not defaulted or derived."""
        return {
            setting.flat
            for setting in SETTINGS.values()
            if setting.field in getattr(self, setting.area).model_fields_set
        }

    def value(self, flat: str) -> Any:
        """The value of the setting named `flat` (`"s3_endpoint_url"`): for code that lists settings by name
        (`dcs config`, `to_env`); code that reads one setting reads it through its area."""
        setting = SETTINGS[flat]
        return getattr(getattr(self, setting.area), setting.field)

    def to_env(self) -> dict[str, str]:
        """`DCS_*` variables that rebuild this config in a child process (secrets included)."""
        env: dict[str, str] = {}
        dumped = self.model_dump(mode="json")
        for setting in SETTINGS.values():
            value = dumped[setting.area][setting.field]
            if value is None:
                continue
            if setting.flat == "auth_token":
                value = self.token()
            env[setting.env] = value if isinstance(value, str) else json.dumps(value)
        return env

    def token(self) -> str | None:
        return self.auth.token.get_secret_value() if self.auth.token else None

    def secret_values(self) -> list[str]:
        """Every secret this config holds (token, URL passwords), for `scrub_secrets`."""
        found = [self.token() or ""]
        for url in (self.redis.url, self.coordinator.url or ""):
            match = _URL_USERINFO.search(url)
            if match:
                found.append(match["userinfo"].partition(":")[2] or match["userinfo"])
        return [value for value in found if value]

    def scrub(self, text: str) -> str:
        """`text` (a log line, an error message) with this config's secrets masked."""
        return scrub_secrets(text, self.secret_values())

    def abandoned_save_seconds(self) -> float:
        """`task.abandoned_save_seconds()`: when a save still PERSISTING can no longer have a live persist task."""
        return self.task.abandoned_save_seconds()

    def topology_config(self) -> TopologyConfig:
        """The role mappings and role order the coordinator answers with (`DCS_ROLE_MAPPINGS`, `DCS_ROLE_ORDER`)."""
        return TopologyConfig(role_mappings=self.coordinator.role_mappings, role_order=self.coordinator.role_order)


class Setting(NamedTuple):
    """One setting: its flat name (`s3_endpoint_url`), its place (`s3`, `endpoint_url`) and its variable."""

    flat: str
    area: str
    field: str

    @property
    def env(self) -> str:
        return f"DCS_{self.flat.upper()}"

    @property
    def info(self) -> FieldInfo:
        return AREAS[self.area].model_fields[self.field]

    @property
    def description(self) -> str:
        """The setting's docstring: the string under its field in the area's class."""
        return self.info.description or attribute_docstrings(AREAS[self.area]).get(self.field, "")


@functools.cache
def attribute_docstrings(model: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under its annotation) in `model`'s own source.

    Read when asked (`dcs config`, docs/configuration.md), not at import: pydantic's `use_attribute_docstrings`
    parses every area's source when the classes are made, about 0.1-0.2 s of CPU in every process that imports
    the settings (each worker, coordinator and `dcs` command)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(model))).body[0]
    assert isinstance(body, ast.ClassDef), model
    docs: dict[str, str] = {}
    blocks = [body.body]
    while blocks:  # the class body and the branches of `if TYPE_CHECKING:` in it
        block = blocks.pop()
        blocks += [branch for stmt in block if isinstance(stmt, ast.If) for branch in (stmt.body, stmt.orelse)]
        for stmt, after in itertools.pairwise(block):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                if isinstance(after.value.value, str):
                    docs.setdefault(stmt.target.id, inspect.cleandoc(after.value.value))
    return docs


def _settings_table() -> dict[str, Setting]:
    """Every setting by flat name, derived from the areas: a field's alias is its flat name, else its own name."""
    table: dict[str, Setting] = {}
    for area, field in DCSConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, _Area), area
        for name, info in model.model_fields.items():
            flat = info.alias or name
            if flat in table or flat in DCSConfig.model_fields:
                raise RuntimeError(f"setting name {flat!r} is given twice (areas {table[flat].area!r}, {area!r})")
            table[flat] = Setting(flat, area, name)
    return table


AREAS: dict[str, type[_Area]] = {
    area: field.annotation for area, field in DCSConfig.model_fields.items() if isinstance(field.annotation, type)
}
SETTINGS = _settings_table()  # flat name -> Setting, in the areas' order
_BY_PLACE = {(setting.area, setting.field): setting for setting in SETTINGS.values()}


def nest_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with every flat setting name moved into its area's dict: `{"s3_region": "x"}` ->
    `{"s3": {"region": "x"}}`. An area given as a dict is merged into (flat names win); one given as a model is
    kept unless a flat name also names one of its fields. Other keys are kept as they are."""
    out: dict[str, Any] = {
        key: dict(value) if key in AREAS and isinstance(value, Mapping) else value
        for key, value in values.items()
        if key not in SETTINGS
    }
    for key, value in values.items():
        setting = SETTINGS.get(key)
        if setting is None:
            continue
        target = out.get(setting.area)
        if isinstance(target, BaseModel):
            target = out[setting.area] = target.model_dump(exclude_unset=True)
        elif not isinstance(target, dict):
            target = out[setting.area] = {}
        target[setting.field] = value
    return out


class _FlatEnvSource(EnvSettingsSource):
    """`DCS_<FLAT_NAME>` variables (`DCS_S3_ENDPOINT_URL`), each into its area's field, JSON decoded where the
    field is complex (`DCS_ROLE_MAPPINGS`) as pydantic-settings decodes a flat field."""

    def __call__(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for setting in SETTINGS.values():
            name = setting.env if self.case_sensitive else setting.env.lower()
            raw = self.env_vars.get(name)
            if raw is None:
                continue
            try:
                value = self.prepare_field_value(setting.flat, setting.info, raw, False)
            except ValueError as exc:
                raise SettingsError(f'error parsing value for field "{setting.flat}" from source "{self}"') from exc
            data.setdefault(setting.area, {})[setting.field] = value
        return data


def _with_flat_locations(exc: ValidationError) -> ValidationError:
    """`exc` with each error located at the setting's flat name (`("s3", "s3_region")` -> `("s3_region",)`) and an
    area's own check (two settings that disagree) at the model, as before the areas; `exc` itself when pydantic
    cannot rebuild one of its errors."""
    details: list[InitErrorDetails] = []
    for error in exc.errors(include_url=False):
        loc = error["loc"]
        if loc and loc[0] in AREAS:
            place = _BY_PLACE.get((str(loc[0]), str(loc[1]))) if len(loc) > 1 else None
            setting = SETTINGS.get(str(loc[1])) if len(loc) > 1 else None
            setting = place or (setting if setting is not None and setting.area == loc[0] else None)
            if setting is not None:
                loc = (setting.flat, *loc[2:])
            elif len(loc) == 1:  # the area's own check of settings that disagree: the model's, as before the areas
                loc = ()
        detail = InitErrorDetails(type=error["type"], loc=loc, input=error["input"])
        if "ctx" in error:
            detail["ctx"] = error["ctx"]
        details.append(detail)
    try:
        return ValidationError.from_exception_data(exc.title, details)
    except (KeyError, TypeError, ValueError):
        return exc
