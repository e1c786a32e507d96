"""The config a test runs DCS with: short heartbeats, a private checkpoint directory, no metrics server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dcs_tasks.config import DCSConfig


def short_config(redis_url: str, root: Path, **settings: Any) -> DCSConfig:
    """What the `dcs_config` fixture makes (on `redis_url`, checkpoints under `root/ckpt`), plus `settings`
    (flat `DCSConfig` keywords)."""
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "checkpoint_dir": root / "ckpt",
        "heartbeat_interval_seconds": 0.5,
        "heartbeat_timeout_seconds": 2.0,
        "node_name": "testhost",
        "enable_metrics": False,
        **comm_ports(),
    }
    values.update(settings)
    return DCSConfig(**values)


def comm_ports() -> dict[str, int]:
    """Master ports of this pytest process's own: 1,000 from 12000 + 1000 x its xdist index (gw0: 12000-12999).

    A master port is reserved in Redis and then checked to bind, but each pytest process has Redis servers of its
    own, so two processes beside each other could both check a port of the shared default range (11000-11999)
    free and both hand it out: a fresh-clone run had one trainer's store fail with EADDRINUSE on 11001. The ranges
    stay below 20000 (what seed-snippet tests configure) and 24000-31999 (tests/distributed's squatted ports)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker.removeprefix("gw")) % 8 if worker.removeprefix("gw").isdigit() else 0
    base = 12000 + 1000 * index
    return {"comm_base_port": base, "comm_max_port": base + 999}
