"""The memory tier through a Redis failover (docs/checkpoints.md, "Memory tier", failure semantics): two hosts'
real `dcs worker`s and a trainer on a Sentinel URL; the Redis master is killed with -9 while host a's worker is
copying a step into host b's memory. The copy ends whole or not at all on b, the step stays restorable from a's
memory, saves and peer copies resume on the promoted replica, and once host a is lost a replacement rank restores
the newest step a peer holds."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.store.peers import stepfiles
from dcs_tasks.checkpoint.store.tiers import memdir
from dcs_tasks.checkpoint.store.tiers.seal import SEAL_NAME
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import start_worker, wait_until
from tests.helpers.sentinel import SentinelCluster
from tests.integration.test_checkpoint_memory_tier import host_config, memory_steps, places, registered

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MiB = 1 << 20


@pytest.fixture
def sentinel_cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    cluster = SentinelCluster(tmp_path / "sentinel").start()
    yield cluster
    cluster.stop()


def _incoming(config: DCSConfig) -> list[Path]:
    root = Path(config.host.memory_dir)
    return list(root.rglob(f"{stepfiles.INCOMING_PREFIX}*")) if root.is_dir() else []


def test_a_failover_mid_peer_copy_loses_no_committed_step(sentinel_cluster: SentinelCluster, tmp_path: Path) -> None:
    base = DCSConfig(
        redis_url=sentinel_cluster.url,
        checkpoint_dir=tmp_path / "ckpt",
        enable_metrics=False,
        redis_socket_timeout_seconds=2.0,
    )
    big = {"w": torch.randn(192 * MiB // 4), "step": 1}  # 192 MiB: its copy to the peer takes a while
    small = {"w": torch.randn(1024), "step": 2}
    budget = 4 * 200 * MiB
    limits = {"task_soft_time_limit_seconds": 20.0, "task_time_limit_seconds": 25.0, "visibility_timeout_seconds": 30.0}
    a = host_config(base, tmp_path, "hosta", memory_tier_bytes=budget, file_shard_bytes=256 * MiB, **limits)
    b = host_config(base, tmp_path, "hostb", memory_tier_bytes=budget, file_shard_bytes=256 * MiB, **limits)
    with ThreadPoolExecutor(2) as pool:  # both start at once
        starting = {"a": pool.submit(start_worker, a, tmp_path, name="worker-a")}
        starting["b"] = pool.submit(start_worker, b, tmp_path, name="worker-b")
    if any(future.exception() is not None for future in starting.values()):
        for future in starting.values():
            if future.exception() is None:
                future.result().discard()
    workers = {host: future.result() for host, future in starting.items()}  # raises what a start raised
    try:
        wait_until(lambda: registered(a) == {"hosta", "hostb"}, 60, "both peer servers to register")
        with Checkpointer("ha", a) as ckpt:
            ckpt.save(big, step=1).wait(timeout=120)  # committed in a's memory; the peer copy starts
            wait_until(lambda: bool(_incoming(b)), 60, "the copy of step 1 to arrive on host b")
            old = sentinel_cluster.kill_master()
            assert sentinel_cluster.wait_promoted(old) != old

            # the step never left a's memory: it restores from there whatever Redis went through
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (1, "memory")
            assert torch.equal(restored.state["w"], big["w"])
            del restored
            # on b the copy ended whole (verified) or not at all: no partial step, no temp directory left
            wait_until(lambda: not _incoming(b), 90, "host b's incoming copy to finish or be removed")
            held = memory_steps(b, "ha")
            assert held in ([], [1])
            if held:
                copy = Path(b.host.memory_dir) / "ha" / "step-000000001"
                own = Path(a.host.memory_dir) / "ha" / "step-000000001"
                assert all((copy / p.name).read_bytes() == p.read_bytes() for p in own.iterdir() if p.name != SEAL_NAME)

            # saves and peer copies go on against the promoted replica
            deadline = time.monotonic() + 60
            while True:
                try:
                    ckpt.save(small, step=2).wait(timeout=60)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.25)
            wait_until(lambda: "replicated" in places(a, "ha").get((2, 0), set()), 120, "step 2 to replicate")

        # host a is lost: a replacement rank on host c restores the newest step a peer holds
        workers["a"].kill()
        shutil.rmtree(a.host.memory_dir)
        c = host_config(base, tmp_path, "hostc", memory_tier_bytes=budget)
        with Checkpointer("ha", c) as replacement:
            restored = replacement.restore()
            assert (restored.step, restored.location) == (2, "peer:hostb")
            assert torch.equal(restored.state["w"], small["w"])
        assert memdir.memory_root(c).is_dir()
    finally:
        for worker in workers.values():
            worker.discard()
