"""Asynchronous checkpoints: shared-memory staging, Celery persistence to safetensors, verified restore."""

from dcs_tasks.checkpoint.checkpointer import Checkpointer
from dcs_tasks.checkpoint.pending import CheckpointInfo, PendingCheckpoint, RestoredCheckpoint

__all__ = ["CheckpointInfo", "Checkpointer", "PendingCheckpoint", "RestoredCheckpoint"]
