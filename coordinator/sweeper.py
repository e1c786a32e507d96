"""Background removal of long-dead nodes (and of roles left without nodes), one task per coordinator process.

The sweep is one idempotent Lua script (`scripts.SWEEP_DEAD_NODES`), so any number of coordinators on one
Redis may run it; the process keeps no state. Without it, every role ever registered would stay in the
role order and every read of the topology would grow with it.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from coordinator.topology import TopologyManager

log = logging.getLogger(__name__)


class DeadNodeSweeper:
    """Calls `TopologyManager.sweep_dead_nodes(retention)` every `interval_s` until stopped."""

    def __init__(self, topology: TopologyManager, retention_s: float, interval_s: float) -> None:
        self.topology = topology
        self.retention_s = retention_s
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dcs-dead-node-sweeper")

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Ends the loop within `timeout_s` even if redis-py swallows the cancellation of a pending call."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            log.warning("dead-node sweeper did not stop in time; abandoning it")
        elif not task.cancelled() and task.exception() is not None:
            log.warning("dead-node sweeper ended with %r", task.exception())

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            try:
                removed = await self.topology.sweep_dead_nodes(self.retention_s)
            except (RedisError, OSError) as exc:  # Redis down: the requests answer 503; try again later
                log.warning("dead-node sweep failed (will retry): %s", type(exc).__name__)
                continue
            if removed:
                log.info("removed %d node(s) dead for longer than %gs", removed, self.retention_s)


def sweep_interval(heartbeat_timeout_s: float, retention_s: float) -> float:
    """How often to sweep: often enough that a node goes soon after its retention ends, at most every minute."""
    return max(0.2, min(heartbeat_timeout_s, retention_s, 60.0) / 2)
