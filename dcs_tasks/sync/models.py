"""Models crossing process boundaries in weight sync: SGLang's weight-update bodies and Celery payloads.

The HTTP bodies follow SGLang's API (`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`), so a real SGLang server accepts what the trainer sends. Two optional
fields matter to DCS receivers: `load_format="dcs_fused_u8_v1"` (the bucket arrives as one flat uint8
broadcast laid out by `FusionLayout.from_wire`; absent = one broadcast per tensor, SGLang's default) and
`flush_cache=True` only on the last bucket of an update (a DCS receiver commits the staged update then).
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dcs_tasks.config import BackendType

# Not SGLang's own "flattened_bucket" (one unpadded, element-indexed buffer per request): a different layout,
# so a different name; an engine that advertises this one speaks DCS's format.
DCS_FUSED_FORMAT = "dcs_fused_u8_v1"


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's body: join group `group_name` at tcp://master_address:master_port with ranks from rank_offset."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(min_length=1, max_length=256)
    backend: BackendType = BackendType.GLOO


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's body: receive these tensors from rank 0 of `group_name` (one bucket of an update)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(min_length=1, max_length=256)
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None
    bucket_sizes: list[int] | None = Field(
        default=None,
        description="DCS extension, dcs_fused_u8_v1 only: the tensors form consecutive broadcasts of these "
        "many tensors each, so one request announces a whole update",
    )

    @model_validator(mode="after")
    def _check_buckets(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have equal lengths")
        if self.bucket_sizes is not None:
            if self.load_format != DCS_FUSED_FORMAT:
                raise ValueError("bucket_sizes needs load_format=dcs_fused_u8_v1")
            if any(n < 1 for n in self.bucket_sizes) or sum(self.bucket_sizes) != len(self.names):
                raise ValueError(f"bucket_sizes must be positive and sum to {len(self.names)}")
        return self

    def buckets(self) -> list[tuple[list[str], list[str], list[list[int]]]]:
        """(names, dtypes, shapes) of each broadcast this request announces, in order."""
        sizes = self.bucket_sizes or [len(self.names)]
        out, start = [], 0
        for n in sizes:
            end = start + n
            out.append((self.names[start:end], self.dtypes[start:end], self.shapes[start:end]))
            start = end
        return out


class DestroyWeightsUpdateGroupRequest(BaseModel):
    group_name: str = Field(min_length=1, max_length=256)


class EngineResponse(BaseModel):
    """SGLang's answer shape for weight-update calls."""

    success: bool
    message: str = ""


class WeightsDigest(BaseModel):
    """What a DCS receiver holds: its committed version and a sha256 of every tensor's bytes."""

    weight_version: int
    tensors: dict[str, str]


class QuantizationConfig(BaseModel):
    """Cast floating tensors of `source_dtypes` to `dtype` for transfer (e.g. fp32 masters sent as bf16).

    Error bound (round to nearest): relative error <= 2**-8 for bfloat16, <= 2**-11 for float16 in its
    normal range. Receivers hold the transferred dtype.
    """

    model_config = ConfigDict(frozen=True)

    dtype: str = "bfloat16"
    source_dtypes: tuple[str, ...] = ("float32",)


class EngineEndpoint(BaseModel):
    """A rollout engine as a group member: its node rank, HTTP address and number of GPUs (= group ranks)."""

    model_config = ConfigDict(frozen=True)

    rank: int = Field(ge=0)
    ip: str
    port: int = Field(ge=1, le=65535)
    num_gpus: int = Field(default=1, ge=1)
    rank_offset: int = Field(default=1, ge=1)
    flattened: bool = Field(default=False, description="accepts load_format=dcs_fused_u8_v1 (DCS receivers)")

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def node_id(self) -> str:
        return f"rollout_{self.rank}"


class GroupPlan(BaseModel):
    """The members of one rollout update group; trainer is rank 0, engines from their rank_offset."""

    model_config = ConfigDict(frozen=True)

    world_size: int = Field(ge=1)
    engines: tuple[EngineEndpoint, ...]

    @property
    def signature(self) -> tuple[tuple[int, str, int, int], ...]:
        """Equal signatures mean the group can be reused."""
        return tuple((e.rank, e.ip, e.port, e.num_gpus) for e in self.engines)

    @property
    def flattened(self) -> bool:
        """Flat buckets only if every engine accepts them; otherwise SGLang's one broadcast per tensor."""
        return bool(self.engines) and all(e.flattened for e in self.engines)


class BootstrapRequest(BaseModel):
    """Payload of TaskName.BOOTSTRAP_GROUP, run on the trainer host's node queue."""

    group_prefix: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    master_address: str
    plan: GroupPlan
    backend: BackendType = BackendType.GLOO


class BootstrapResult(BaseModel):
    group_name: str
    epoch: int = Field(ge=1)
    master_address: str
    master_port: int
    world_size: int
    join_task_ids: list[str]


class JoinRequest(BaseModel):
    """Payload of TaskName.JOIN_ENGINE: call one engine's /init_weights_update_group."""

    engine: EngineEndpoint
    body: InitWeightsUpdateGroupRequest
    timeout_seconds: float = Field(gt=0)


class JoinOutcome(str, enum.Enum):
    """How an engine's join ended; `UNREACHABLE` and `REFUSED` blame that engine, `TIMED_OUT` may be a victim."""

    JOINED = "joined"
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    TIMED_OUT = "timed_out"


class JoinResult(BaseModel):
    node_id: str
    success: bool
    outcome: JoinOutcome = JoinOutcome.JOINED
    message: str = ""


class DestroyRequest(BaseModel):
    """Payload of TaskName.DESTROY_GROUP: tell engines to drop the group, release its port and record."""

    group_name: str
    host: str
    master_port: int
    engines: list[EngineEndpoint] = Field(default_factory=list)


class GroupStatus(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    DESTROYED = "destroyed"
