"""Models crossing process boundaries in weight sync: SGLang's weight-update bodies and Celery payloads.

The HTTP bodies are SGLang's (`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`,
... in sglang/srt/managers/io_struct.py of 0.5.20-0.5.23), field for field, so a real SGLang server accepts
what the trainer sends and `dcs receiver` accepts what SGLang's own clients send. There is no DCS extension:
the fast path is SGLang's own `load_format="flattened_bucket"` (one unpadded uint8 broadcast per request,
see `dcs_tasks.backends.fusion.sglang_layout`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dcs_tasks.config import MAX_GROUP_INIT_TIMEOUT_SECONDS, BackendType

SGLANG_FLAT_FORMAT = "flattened_bucket"
"""SGLang's flattened-bucket load format: the request's tensors arrive as one uint8 broadcast, each tensor's
raw bytes right after the previous one's (no padding; every offset must be a multiple of its itemsize)."""
SGLANG_DEFAULT_GROUP = "weight_update_group"
MAX_GROUP_RANK = 2**20 - 1  # ranks and world sizes in payloads: the coordinator's rank bound (dcs_tasks.models)
MAX_GROUP_ENGINES = 4096  # engines in one group plan / destroy payload


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's body: join group `group_name` at tcp://master_address:master_port with ranks from rank_offset
    (an engine of tp_size T joins as rank_offset .. rank_offset + T - 1)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_GROUP_RANK)
    world_size: int = Field(ge=2, le=MAX_GROUP_RANK + 1)
    group_name: str = Field(default=SGLANG_DEFAULT_GROUP, min_length=1, max_length=256)
    backend: BackendType = BackendType.NCCL


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's body: receive these tensors from rank 0 of `group_name` (one bucket of an update).

    `load_format=None`: one broadcast per tensor, in order; `"flattened_bucket"`: one broadcast of all of
    them (SGLang's layout). The trainer sends only the fields it sets (`wire()`), so older SGLang versions,
    which lack `selector` / `torch_empty_cache`, accept the body too."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default=SGLANG_DEFAULT_GROUP, min_length=1, max_length=256)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _check_lengths(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have equal lengths")
        return self

    def wire(self) -> dict[str, object]:
        """The JSON body as sent: every field that differs from SGLang's default, plus the tensors."""
        return self.model_dump(mode="json", exclude_defaults=True) | {
            "names": self.names,
            "dtypes": self.dtypes,
            "shapes": self.shapes,
        }


class DestroyWeightsUpdateGroupRequest(BaseModel):
    group_name: str = Field(min_length=1, max_length=256)


class GetWeightsByNameRequest(BaseModel):
    """SGLang's body of `/get_weights_by_name`: the first `truncate_size` rows of a weight."""

    name: str
    truncate_size: int = 100


class EngineResponse(BaseModel):
    """SGLang's answer shape for weight-update calls."""

    success: bool
    message: str = ""


class WeightsDigest(BaseModel):
    """`dcs receiver`'s read-only debug route `/weights_digest` (not an SGLang route; the trainer never calls
    it): what a DCS receiver holds: its committed version and a sha256 of every tensor's bytes."""

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


EngineKind = Literal["sglang", "vllm"]
"""The engine family of a rollout engine: SGLang's weight-update API (`engine_protocol`) or vLLM's RL API in dev
mode (`vllm_protocol`). Chosen at registration (`dcs engine attach --kind`, metadata `engine`); default SGLang."""
ENGINE_KINDS: tuple[str, ...] = ("sglang", "vllm")


class EngineInfo(BaseModel):
    """What an engine said about itself (SGLang: `GET /server_info`, `dcs_tasks.sync.engine_protocol.engine_info`;
    vLLM: `GET /version` and `/get_world_size`, `dcs_tasks.sync.vllm_protocol`), and the protocol it speaks."""

    model_config = ConfigDict(frozen=True)

    kind: EngineKind = "sglang"
    version: str
    tp_size: int = Field(default=1, ge=1)
    sessions: bool = Field(description="updates must run between /begin_weight_update and /end_weight_update")
    flattened_bucket: bool = Field(description="update_weights_from_distributed takes load_format=flattened_bucket")
    pause: bool = Field(description="serves /pause_generation and /continue_generation")
    pause_mode: Literal["abort", "retract", "wait", "keep"] = Field(
        default="retract", description="the /pause_generation mode whose queued requests let the cache flush"
    )


INSTANCE_MAX_LENGTH = 64
INSTANCE_PATTERN = r"^[A-Za-z0-9_.\-]*$"


def signature_of(engines: Iterable[EngineEndpoint]) -> tuple[tuple[int, str, int, str], ...]:
    """(rank, ip, port, instance) per engine: what must be unchanged for a formed group to be reused."""
    return tuple((e.rank, e.ip, e.port, e.instance) for e in engines)


class EngineEndpoint(BaseModel):
    """A rollout engine as a group member: its node rank, HTTP address, first group rank and (once probed) what
    it said about itself; it spans `info.tp_size` group ranks from `rank_offset`."""

    model_config = ConfigDict(frozen=True)

    rank: int = Field(ge=0, le=MAX_GROUP_RANK)
    ip: str = Field(max_length=253)
    port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1, le=MAX_GROUP_RANK)
    info: EngineInfo | None = None
    instance: str = Field(default="", max_length=INSTANCE_MAX_LENGTH, pattern=INSTANCE_PATTERN)
    """The registration's `metadata["instance"]` ("" when it has none): a new one per engine process, so an
    engine restarted at the same address is not taken for the group member it replaced."""
    kind: EngineKind = "sglang"
    """The registration's `metadata["engine"]`: which protocol the trainer speaks to it (SGLang's by default)."""

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def node_id(self) -> str:
        return f"rollout_{self.rank}"

    @property
    def tp_size(self) -> int:
        return self.info.tp_size if self.info is not None else 1


class GroupPlan(BaseModel):
    """The members of one rollout update group; trainer is rank 0, engines from their rank_offset."""

    model_config = ConfigDict(frozen=True)

    world_size: int = Field(ge=1, le=MAX_GROUP_RANK + 1)
    engines: tuple[EngineEndpoint, ...] = Field(max_length=MAX_GROUP_ENGINES)

    @property
    def signature(self) -> tuple[tuple[int, str, int, str], ...]:
        """Equal signatures (the same engine processes at the same addresses) mean the group can be reused."""
        return signature_of(self.engines)

    @property
    def flattened(self) -> bool:
        """SGLang's flattened buckets only if every engine takes them; otherwise one broadcast per tensor."""
        return bool(self.engines) and all(e.info is not None and e.info.flattened_bucket for e in self.engines)


class BootstrapRequest(BaseModel):
    """Payload of TaskName.BOOTSTRAP_GROUP, run on the trainer host's node queue."""

    group_prefix: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    master_address: str = Field(max_length=253)
    plan: GroupPlan
    backend: BackendType = BackendType.GLOO
    request_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Idempotency key (default: the task id): every delivery of one request gets the same epoch, master port
    and join tasks, so a redelivered or re-sent bootstrap forms no second group."""


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
    timeout_seconds: float = Field(gt=0, le=MAX_GROUP_INIT_TIMEOUT_SECONDS, allow_inf_nan=False)
    """What DCS sends: the bootstrapping worker's `group_init_timeout_seconds`; the joining worker waits no
    longer than its own value of that setting either (at most its `group_init_timeout_max_seconds`)."""


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

    group_name: str = Field(min_length=1, max_length=256)
    host: str = Field(max_length=253)
    master_port: int = Field(ge=1, le=65535)
    engines: list[EngineEndpoint] = Field(default_factory=list, max_length=MAX_GROUP_ENGINES)


class GroupStatus(str, enum.Enum):
    """Lifecycle of a group record: BOOTSTRAPPING (epoch and master port reserved, joins sent) -> READY (every
    engine answered its join) -> DESTROYED (torn down, port released; the record stays a while for operators).
    A group that never forms goes from BOOTSTRAPPING to DESTROYED (the trainer's teardown, or a bootstrap task
    that failed for good)."""

    BOOTSTRAPPING = "bootstrapping"
    READY = "ready"
    DESTROYED = "destroyed"
