"""Asynchronous checkpoints: shared-memory staging, Celery persistence to safetensors, verified restore.

The names below are imported on first use, so a process that needs only part of this package (a worker
persisting staged bytes) does not import torch with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.checkpointer import Checkpointer
    from dcs_tasks.checkpoint.pending import CheckpointInfo, PendingCheckpoint, RestoredCheckpoint

__all__ = ["CheckpointInfo", "Checkpointer", "PendingCheckpoint", "RestoredCheckpoint"]
_HOMES = {
    "Checkpointer": "dcs_tasks.checkpoint.checkpointer",
    "CheckpointInfo": "dcs_tasks.checkpoint.pending",
    "PendingCheckpoint": "dcs_tasks.checkpoint.pending",
    "RestoredCheckpoint": "dcs_tasks.checkpoint.pending",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
