"""Clients of DCS services. `CoordinatorAPI` talks to the coordinator over HTTP."""

from dcs_tasks.client.coordinator_api import CoordinatorAPI, HeartbeatLoop

__all__ = ["CoordinatorAPI", "HeartbeatLoop"]
