"""Errors of `dcs engine attach` beyond the trainer's own engine errors.

The engine's answers are judged by the trainer's rules (`dcs_tasks.sync.engine_protocol.engine_info`), so a
refused engine raises the same `EngineIncompatible` (unsupported SGLang version, dp_size > 1, pp_size > 1)
or `EngineAuthRefused` (wrong API key) the trainer would.
"""

from __future__ import annotations

from dcs_tasks.errors import DCSTimeoutError


class EngineUnavailable(DCSTimeoutError):
    """The engine's `GET /health` did not answer 200 within the bounded wait."""
