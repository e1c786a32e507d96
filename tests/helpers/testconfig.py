"""The config a test runs DCS with: short heartbeats, a private checkpoint directory, no metrics server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcs_tasks.config import DCSConfig


def short_config(redis_url: str, root: Path, **settings: Any) -> DCSConfig:
    """What the `dcs_config` fixture makes (on `redis_url`, checkpoints under `root/ckpt`), plus `settings`
    (flat `DCSConfig` keywords)."""
    return DCSConfig(
        redis_url=redis_url,
        checkpoint_dir=root / "ckpt",
        heartbeat_interval_seconds=0.5,
        heartbeat_timeout_seconds=2.0,
        node_name="testhost",
        enable_metrics=False,
        **settings,
    )
