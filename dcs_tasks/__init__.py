"""DCS: asynchronous checkpoints and weight synchronisation for distributed training."""

from typing import Any

# Lazy exports (PEP 562): `import dcs_tasks.config` stays light; torch loads only when these are used.
_EXPORTS = {
    "Checkpointer": "dcs_tasks.checkpoint",
    "CheckpointInfo": "dcs_tasks.checkpoint",
    "PendingCheckpoint": "dcs_tasks.checkpoint",
    "RestoredCheckpoint": "dcs_tasks.checkpoint",
    "CheckpointEngineClient": "dcs_tasks.client.engine",
    "create_client": "dcs_tasks.client.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcs_tasks' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
