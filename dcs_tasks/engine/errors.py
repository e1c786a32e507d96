"""Errors of `dcs engine attach`: each names the engine and what to do about it."""

from __future__ import annotations

from dcs_tasks.errors import ConfigError, DCSError, DCSTimeoutError


class EngineError(DCSError):
    """The rollout engine (an SGLang server) cannot be attached."""


class EngineUnavailable(EngineError, DCSTimeoutError):
    """The engine's `/health` did not answer 200 within the bounded wait."""


class EngineAuthError(EngineError):
    """The engine refused the API key (401/403): start it with `--api-key` equal to the key DCS sends."""


class UnsupportedEngine(EngineError, ConfigError):
    """The server is not an SGLang version DCS supports, or its layout cannot take distributed weight updates."""


class EngineDataParallelUnsupported(UnsupportedEngine):
    """The engine runs with dp_size > 1: SGLang refuses `update_weights_from_distributed` with data parallelism."""
