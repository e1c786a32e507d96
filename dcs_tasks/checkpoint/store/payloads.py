"""Payloads of the checkpoint Celery tasks. JSON only: paths, sizes, ids; never tensor bytes.

A payload comes off the broker, so it is untrusted input. What can be checked without the worker's
configuration is checked here: run names (`validate_run_name`, the one rule every entry point uses),
steps (integers >= 0, never bool), file names, and paths (absolute, normalised, no `.`/`..` component,
a step directory named after its step). Whether a path lies under the worker's configured checkpoint
root or staging directory is checked by the worker (`workers.trust`).
"""

from __future__ import annotations

import os
import re
from numbers import Integral
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from dcs_tasks.checkpoint.format.compression import CompressionSpec
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.errors import CheckpointError
from dcs_tasks.storage_url import ObjectURL

RUN_NAME_MAX = 128
# first character a letter, digit or underscore: no ".", "..", hidden names or option-like "-x"
RUN_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
RUN_NAME_RULE = (
    f"1-{RUN_NAME_MAX} characters of letters, digits, '_', '.' and '-', starting with a letter, digit or '_'"
)
FILE_NAME_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def run_name_problem(run: object) -> str | None:
    """Why `run` is not a valid run name, or None when it is (fullmatch: no trailing newline slips by)."""
    if not isinstance(run, str):
        return f"run name must be a string, not {type(run).__name__}"
    if len(run) > RUN_NAME_MAX or not RUN_NAME_RE.fullmatch(run):
        return f"run name {run[: RUN_NAME_MAX + 8]!r} is not valid: {RUN_NAME_RULE}"
    return None


def validate_run_name(run: object) -> str:
    """`run` when it is a valid run name (see RUN_NAME_RULE); else CheckpointError naming it."""
    problem = run_name_problem(run)
    if problem is not None:
        raise CheckpointError(problem)
    assert isinstance(run, str)
    return run


def validate_step(step: object, what: str = "step") -> int:
    """`step` as an int when it is an integer >= 0 (bool refused); else CheckpointError naming it."""
    if isinstance(step, bool) or not isinstance(step, Integral):
        raise CheckpointError(f"{what} must be an integer >= 0, not {type(step).__name__} {step!r}")
    if step < 0:
        raise CheckpointError(f"{what} must be an integer >= 0, not {step}")
    return int(step)


def _run_name(value: str) -> str:
    problem = run_name_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def clean_absolute_path(value: str) -> str:
    """`value` when it is an absolute, normalised path without `.`/`..` components or NUL; else ValueError."""
    if "\0" in value or not value.startswith("/") or value.startswith("//"):
        raise ValueError(f"{value[:256]!r} is not an absolute path")
    if os.path.normpath(value) != value or ".." in value.split("/"):
        raise ValueError(f"{value[:256]!r} is not a normalised path (no '.', '..', '//' or trailing '/')")
    return value


RunName = Annotated[str, AfterValidator(_run_name)]
Step = Annotated[StrictInt, Field(ge=0)]
AbsolutePath = Annotated[str, Field(max_length=4096), AfterValidator(clean_absolute_path)]


def clean_location(value: str) -> str:
    """`value` when it is a clean absolute path or a clean `s3://bucket/key` URL; else ValueError."""
    if value.startswith("s3://"):
        url = ObjectURL.parse(value)  # ConfigError (a ValueError) for a bad bucket or key
        if str(url) != value:
            raise ValueError(f"{value[:256]!r} is not a normalised s3:// URL")
        return value
    return clean_absolute_path(value)


StepLocation = Annotated[str, Field(max_length=4096), AfterValidator(clean_location)]
Token = Annotated[str, Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
FileName = Annotated[str, Field(max_length=64, pattern=FILE_NAME_RE.pattern)]


class StepRef(BaseModel):
    """One save attempt of one step. `token` fences tasks of older attempts of the same step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: RunName
    step: Step
    token: Token
    step_dir: StepLocation = Field(description="absolute path of the step directory, or its s3:// URL")

    @model_validator(mode="after")
    def _dir_names_step(self) -> StepRef:
        name = step_dir_name(self.step)
        if os.path.basename(self.step_dir) != name:
            raise ValueError(f"step_dir {self.step_dir[:256]!r} of step {self.step} must end in {name!r}")
        return self


class RetentionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_last: int | None = Field(default=None, ge=1)
    keep_every: int | None = Field(default=None, ge=1)

    @property
    def active(self) -> bool:
        return self.keep_last is not None


class PersistRequest(BaseModel):
    """Stream `length` staged bytes at `offset` of `staging_path` into `step_dir/file_name` (compressed as
    `compression` asks, `dcs_tasks.checkpoint.format.compression`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: StepRef
    file_name: FileName
    staging_path: AbsolutePath
    offset: Annotated[StrictInt, Field(ge=0)]
    length: Annotated[StrictInt, Field(ge=0)]
    retention: RetentionPolicy = Field(default_factory=lambda: RetentionPolicy())
    incremental: bool = Field(default=False, description="reuse the newest earlier step's file if the bytes equal")
    compression: CompressionSpec | None = None  # None: the file is written as it is
    durable: bool = Field(default=True, description="a memory-tier step: also copied to storage after its commit")


class CommitRequest(BaseModel):
    """Write `manifest.json` and move `latest` once every file of the step is durable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: StepRef
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)
    durable: bool = True  # a memory-tier step (`ref.step_dir` under memory_dir): also copied to storage


class MemoryStepRequest(BaseModel):
    """A memory-tier step just committed under `memory_dir` (`ref.step_dir`): copy it to storage (the flush
    task) or to peer hosts' memory (the peer-copy task)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: StepRef
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)


class RetentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: RunName
    run_dir: StepLocation
    policy: RetentionPolicy


class ReplicateRequest(BaseModel):
    """Copy committed step `step` of `run` from `step_dir` (under the checkpoint root) to `replica_step_dir`
    (the same relative path under the replica root), verify it, move the replica's `latest`, then apply
    `retention` to the replica's run directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: RunName
    step: Step
    step_dir: StepLocation
    replica_step_dir: StepLocation
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)

    @model_validator(mode="after")
    def _dirs_name_step(self) -> ReplicateRequest:
        name = step_dir_name(self.step)
        for path in (self.step_dir, self.replica_step_dir):
            if os.path.basename(path) != name:
                raise ValueError(f"step directory {path[:256]!r} of step {self.step} must end in {name!r}")
        return self


class StepIdentity(BaseModel):
    """The ledger identity (run, step, token) read from a payload that failed validation, so that the
    worker can still fail that step in the ledger; its paths are ignored, never used."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    run: RunName
    step: Step
    token: Token


class FailedTask(BaseModel):
    """What a failed persist or commit payload names, read leniently (`file_name` absent for a commit)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ref: StepIdentity
    file_name: FileName | None = None

    @classmethod
    def read(cls, payload: Any) -> FailedTask | None:
        """The step (and file) `payload` names; `file_name` None when it is missing or malformed; None when
        not even the step can be read."""
        try:
            return cls.model_validate(payload)
        except ValueError:
            pass
        try:
            return cls(ref=StepIdentity.model_validate(payload["ref"]))
        except (ValueError, TypeError, KeyError):
            return None
