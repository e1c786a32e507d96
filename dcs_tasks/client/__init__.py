"""The facade trainers import: `CheckpointEngineClient` and `create_client` (the original design's trainer/engine
client), loaded lazily, with torch. The coordinator's HTTP client is `dcs_tasks.coordinator_api`."""

from typing import Any

__all__ = ["CheckpointEngineClient", "create_client"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointEngineClient", "create_client"):
        from dcs_tasks.client import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dcs_tasks.client' has no attribute {name!r}")
