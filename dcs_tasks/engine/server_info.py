"""What an SGLang server says about itself (`GET /server_info`), and whether DCS can push weights to it.

SGLang answers `/server_info` (and the deprecated `/get_server_info`) with its resolved server arguments
flattened into one JSON object, plus `version` (sglang/srt/entrypoints/http_server.py, `server_info`).
The object also holds `api_key` in clear: `EngineServerInfo` keeps only the fields below, so nothing
that parses an answer ever holds (or logs) the key.

Each engine process joins the trainer's update group as `rank_offset + tp_rank` (SGLang's model runner,
`init_weights_update_group`), so an engine spans `tp_size` ranks of the group. Refused layouts:
- dp_size > 1: SGLang asserts dp_size == 1 in `update_weights_from_distributed`;
- pp_size > 1: every pipeline stage would join with the same `rank_offset + tp_rank`.
"""

from __future__ import annotations

from typing import Any

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcs_tasks.engine.errors import EngineDataParallelUnsupported, UnsupportedEngine

MIN_SGLANG_VERSION = Version("0.5.20")
"""Oldest SGLang whose weight-update HTTP API was read here against what the trainer sends."""
NEWEST_CHECKED_SGLANG_VERSION = Version("0.5.23")
"""Newest SGLang checked here; newer ones are attached with a warning."""
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
"""Newer SGLang first; `/get_server_info` is the deprecated alias older releases answer."""


class EngineServerInfo(BaseModel):
    """The fields of `/server_info` that attaching needs (every other field, `api_key` included, is dropped)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: str = Field(min_length=1)
    tp_size: int = Field(ge=1)
    dp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)
    model_path: str | None = None


def parse_server_info(payload: Any, source: str) -> EngineServerInfo:
    """`payload` (the decoded JSON of `source`) as `EngineServerInfo`; UnsupportedEngine when it is not one."""
    if not isinstance(payload, dict):
        raise UnsupportedEngine(f"{source} answered {type(payload).__name__}, not a JSON object: not an SGLang server")
    try:
        return EngineServerInfo.model_validate(payload)
    except ValidationError as exc:
        fields = ", ".join(".".join(str(p) for p in err["loc"]) or "<root>" for err in exc.errors())
        raise UnsupportedEngine(
            f"{source} is not the server info of a supported SGLang server (missing or invalid: {fields})"
        ) from None


def sglang_version(info: EngineServerInfo) -> Version:
    try:
        return Version(info.version)
    except InvalidVersion:
        raise UnsupportedEngine(f"engine reports version {info.version!r}, which is not an SGLang version") from None


def check_engine(info: EngineServerInfo) -> Version:
    """Refuse what DCS cannot push weights to (typed errors); returns the engine's SGLang version."""
    version = sglang_version(info)
    if version < MIN_SGLANG_VERSION:
        raise UnsupportedEngine(
            f"SGLang {version} is older than the oldest supported version {MIN_SGLANG_VERSION}: upgrade the engine"
        )
    if info.dp_size > 1:
        raise EngineDataParallelUnsupported(
            f"engine runs with dp_size={info.dp_size}: SGLang refuses distributed weight updates with data "
            "parallelism; start one engine per replica (dp_size 1) and attach each at its own rank"
        )
    if info.pp_size > 1:
        raise UnsupportedEngine(
            f"engine runs with pp_size={info.pp_size}: its pipeline stages would join the update group with "
            "the same ranks (rank_offset + tp_rank); DCS supports pp_size 1"
        )
    return version


def engine_metadata(info: EngineServerInfo) -> dict[str, Any]:
    """The topology metadata of an attached engine: `num_gpus` is the rank span the trainer's planner reads."""
    return {
        "num_gpus": info.tp_size,
        "load_formats": [],  # SGLang's per-tensor wire format only (not `dcs_fused_u8_v1`)
        "engine": "sglang",
        "engine_version": info.version,
        "tp_size": info.tp_size,
        "dp_size": info.dp_size,
        "pp_size": info.pp_size,
    }
