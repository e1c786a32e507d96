"""Pydantic bodies of the coordinator's HTTP API, shared by the server and its clients.

Both sides validate with these models, so a field renamed here is renamed everywhere. The shapes follow
the original design's API models (RegisterRequest, RegisterResponse, HeartbeatResponse, TopologyResponse,
GroupRanksResponse, weight meta) with typed fields instead of bare dicts.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dcs_tasks.config import RoleInfo

MAX_RANK = 2**20 - 1  # Lua numbers are doubles: far larger ranks would be rounded and stored under another rank
MAX_INDEX = 2**53 - 1  # weight-meta indices: the largest integer a Lua number (a double) holds exactly
WEIGHT_META_END_NAME = "weight_updated_stop"
WEIGHT_META_END_GROUP = "end"


class ResponseStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"


class HealthStatus(str, enum.Enum):
    """`healthy`: every registered node beats; `degraded`: some registered node is dead."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"


class RegisterRequest(RoleInfo):
    """A node announcing itself. `rank=None` asks the coordinator for the smallest free rank of the role.

    Ranks and world sizes are bounded by `MAX_RANK` (422 beyond it).
    """

    rank: int | None = Field(default=None, ge=0, le=MAX_RANK)
    world_size: int | None = Field(default=None, ge=0, le=MAX_RANK + 1)


class RegisterResponse(BaseModel):
    """`identity` fences the node's heartbeats: send it as header `X-DCS-Node` (CoordinatorAPI does)."""

    status: ResponseStatus = ResponseStatus.OK
    message: str = ""
    rank: int = Field(ge=0)
    node_id: str
    identity: str = Field(default="", description="'ip:port', or 'anon:<hex>' issued to a node without a port")


class StatusResponse(BaseModel):
    status: ResponseStatus = ResponseStatus.OK
    message: str = ""


class HeartbeatResponse(BaseModel):
    status: ResponseStatus = ResponseStatus.OK
    timestamp: float = Field(description="coordinator wall-clock time of the beat (unix seconds)")


MAX_BATCH_NODES = 2048  # nodes in one POST /heartbeats or /register_batch (one Redis call holds them all)
IDENTITY_PATTERN = r"^(anon:[0-9a-f]{16}|.{1,255}:[0-9]{1,5})$"


class NodeBeat(BaseModel):
    """One node's beat inside a batch; `identity` fences it like the X-DCS-Node header ("" = unfenced)."""

    role: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    rank: int = Field(ge=0, le=MAX_RANK)
    identity: str = Field(default="", pattern=r"^$|" + IDENTITY_PATTERN, description="identity from /register")


class HeartbeatBatchRequest(BaseModel):
    """Beats of many nodes held by one process (a host agent), refreshed in one Redis call."""

    beats: list[NodeBeat] = Field(min_length=1, max_length=MAX_BATCH_NODES)


class BeatOutcome(str, enum.Enum):
    OK = "ok"  # TTL refreshed (a node that had expired is alive again)
    NOT_FOUND = "not_found"  # never registered (or unregistered, or swept): register it
    CONFLICT = "conflict"  # the identity no longer holds the rank: another node took it over


class HeartbeatBatchResponse(BaseModel):
    status: ResponseStatus = ResponseStatus.OK
    timestamp: float = Field(description="coordinator wall-clock time of the beats (unix seconds)")
    results: list[BeatOutcome] = Field(description="one outcome per beat, in the request's order")


class RegisterBatchRequest(BaseModel):
    """Many registrations in one call, each applied as /register would (in order, each atomic)."""

    nodes: list[RegisterRequest] = Field(min_length=1, max_length=MAX_BATCH_NODES)


class RegisterBatchResponse(BaseModel):
    status: ResponseStatus = ResponseStatus.OK
    nodes: list[RegisterResponse] = Field(description="one answer per node, in the request's order")


class TopologyResponse(BaseModel):
    """Live nodes by role and rank; `world_size` counts live nodes of the returned roles.

    `rank_space` is the sum over the returned roles of (highest live rank + 1): global ranks lie below it.
    It equals `world_size` unless a dead node leaves a gap below a live rank of its role.
    """

    nodes: dict[str, dict[int, RoleInfo]]
    world_size: int = Field(ge=0)
    rank_space: int = Field(default=0, ge=0, description="sum of the roles' highest live rank + 1")


class GlobalRankResponse(BaseModel):
    global_rank: int = Field(ge=0)


class GroupRanksResponse(BaseModel):
    """Where a node sits in the actor -> actor_fwd/reference weight-update group.

    `pp_groups` maps `update_actor_pp_{pp_rank}` to the `tcp://host:port` init method of that stage's group.
    """

    global_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    train_pp_size: int = Field(ge=1)
    pp_groups: dict[str, str] = Field(default_factory=dict)


class WeightMeta(BaseModel):
    """Names, dtypes and shapes of one bucket of tensors broadcast in group `group_name`, of update `version`.

    The end of a pp stage's part of an update is the sentinel `WeightMeta.end(version, closes)`; test with
    `meta.is_end`. `version` is the sender's count of updates in its group (1 for the first update after the
    group formed); `closes` names the group whose part of `version` a sentinel ends. Both are absent (None)
    only in entries of DCS releases before versioned entries, which receivers refuse
    (`WeightMetaVersionError`; docs/weight_sync.md, "Versioned weight-meta entries").
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(min_length=1, max_length=256)
    version: int | None = Field(default=None, ge=1, le=MAX_INDEX)
    closes: str | None = Field(default=None, min_length=1, max_length=256)

    @classmethod
    def end(cls, version: int | None = None, closes: str | None = None) -> WeightMeta:
        """The sentinel closing group `closes`'s part of update `version`: `{names:["weight_updated_stop"],
        dtypes:[], shapes:[], group_name:"end", version, closes}`."""
        return cls(
            names=[WEIGHT_META_END_NAME],
            dtypes=[],
            shapes=[],
            group_name=WEIGHT_META_END_GROUP,
            version=version,
            closes=closes,
        )

    @property
    def is_end(self) -> bool:
        return self.names == [WEIGHT_META_END_NAME] and self.group_name == WEIGHT_META_END_GROUP

    @model_validator(mode="after")
    def _check_lengths(self) -> WeightMeta:
        if self.is_end:
            return self
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got {len(self.names)}, "
                f"{len(self.dtypes)}, {len(self.shapes)}"
            )
        if any(dim < 0 for shape in self.shapes for dim in shape):
            raise ValueError("shapes must not contain negative dimensions")
        return self


class WeightMetaBatch(BaseModel):
    """Entries `[first_index, next_index)` of the weight-meta log; empty when the long-poll timed out.

    Indices are absolute: they keep counting across trimming and /clear_weight_meta. `first_index` is the
    index asked for, or later when the entries in between were already dropped from the log. One answer is
    capped in entries and bytes: while `next_index < end_index` more entries are waiting, so read again from
    `next_index` (`more` says so)."""

    entries: list[WeightMeta]
    next_index: int = Field(ge=0)
    first_index: int = Field(ge=0)
    end_index: int = Field(ge=0, description="absolute index one past the log's last entry when read")

    @property
    def more(self) -> bool:
        """True when the log held entries past this answer (read again from `next_index`)."""
        return self.next_index < self.end_index


class ClearWeightMetaResponse(StatusResponse):
    cleared: int = Field(ge=0, description="number of entries removed")


class HealthResponse(BaseModel):
    status: HealthStatus
    timestamp: float
    world_size: int = Field(ge=0, description="live nodes of every role")
    dead_nodes: list[str] = Field(description="node ids registered but without a heartbeat key")
    unreadable_records: int = Field(default=0, ge=0, description="stored node records that could not be read")
    unreadable_keys: list[str] = Field(
        default_factory=list, description="where they are: 'redis key[rank]' (at most 100 listed)"
    )


class NodeView(BaseModel):
    """A registered node as /debug/topology shows it, dead or alive."""

    info: RoleInfo
    alive: bool
    heartbeat_ttl_ms: int | None = Field(description="remaining heartbeat TTL, None when dead")


class DebugTopologyResponse(BaseModel):
    roles: list[str] = Field(description="roles in global-rank order")
    role_mappings: dict[str, str]
    nodes: dict[str, dict[int, NodeView]]
    heartbeat_timeout_seconds: float
    weight_meta_entries: int = Field(ge=0)


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the coordinator returns on purpose."""

    detail: str
