"""Payloads of the checkpoint Celery tasks. JSON only: paths, sizes, ids; never tensor bytes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StepRef(BaseModel):
    """One save attempt of one step. `token` fences tasks of older attempts of the same step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    step: int = Field(ge=0)
    token: str = Field(min_length=8, max_length=64)
    step_dir: str = Field(description="absolute path of the step directory")


class RetentionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_last: int | None = Field(default=None, ge=1)
    keep_every: int | None = Field(default=None, ge=1)

    @property
    def active(self) -> bool:
        return self.keep_last is not None


class PersistRequest(BaseModel):
    """Stream `length` staged bytes at `offset` of `staging_path` into `step_dir/file_name`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: StepRef
    file_name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+\.safetensors$")
    staging_path: str
    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    retention: RetentionPolicy = Field(default_factory=lambda: RetentionPolicy())


class CommitRequest(BaseModel):
    """Write `manifest.json` and move `latest` once every file of the step is durable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: StepRef
    retention: RetentionPolicy = Field(default_factory=RetentionPolicy)


class RetentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    run_dir: str
    policy: RetentionPolicy
