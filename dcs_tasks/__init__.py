"""DCS: asynchronous checkpoints and weight synchronisation for distributed training."""

from typing import Any

# Lazy exports (PEP 562): `import dcs_tasks` and `import dcs_tasks.config` stay light; torch loads only when a
# name that needs it is used. The root offers what the original design imports from its package root.
_EXPORTS = {
    "BackendType": "dcs_tasks.config",
    "DCSConfig": "dcs_tasks.config",
    "RoleInfo": "dcs_tasks.config",
    "TopologyConfig": "dcs_tasks.config",
    "MetricsCollector": "dcs_tasks.metrics",
    "get_metrics": "dcs_tasks.metrics",
    "Checkpointer": "dcs_tasks.checkpoint",
    "CheckpointInfo": "dcs_tasks.checkpoint",
    "PendingCheckpoint": "dcs_tasks.checkpoint",
    "RestoredCheckpoint": "dcs_tasks.checkpoint",
    "CheckpointEngineClient": "dcs_tasks.client.engine",
    "create_client": "dcs_tasks.client.engine",
}

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcs_tasks' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
