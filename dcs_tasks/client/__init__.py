"""Clients of DCS services. `CoordinatorAPI` talks to the coordinator over HTTP; `CheckpointEngineClient` and
`create_client` (the original design's trainer/engine client) load lazily, with torch."""

from typing import Any

from dcs_tasks.client.coordinator_api import CoordinatorAPI, FleetHeartbeatLoop, HeartbeatLoop

__all__ = ["CheckpointEngineClient", "CoordinatorAPI", "FleetHeartbeatLoop", "HeartbeatLoop", "create_client"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointEngineClient", "create_client"):
        from dcs_tasks.client import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dcs_tasks.client' has no attribute {name!r}")
