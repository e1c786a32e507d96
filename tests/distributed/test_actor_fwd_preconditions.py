"""actor -> actor_fwd preconditions are checked and named, not assumed (real coordinator, worker and processes).

An actor_fwd that asks for its groups before the actor registered waits for it (bounded), then joins and gets
the update; when the wait runs out it raises `ActorWaitTimeout` naming what it waited for. An actor registered
without metadata `is_pp_src_rank=True` gets a `SyncPreconditionError` saying what to set (it used to get a
`DCSTimeoutError` at once, waiting for nothing), and sits the update out once another actor is its stage's source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import ActorWaitTimeout, ConfigError, SyncPreconditionError
from tests.distributed.sync_stack import sync_stack, wait_registered
from tests.helpers.ports import free_port
from tests.helpers.preloaded import PreloadedProcess, python_module
from tests.helpers.procs import child_env

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def fwd_config(dcs_config: DCSConfig) -> DCSConfig:
    """Short timeouts, and master ports of its own: the default range (11000-) is shared by every test run on
    this host, and each run's Redis reserves ports only for itself."""
    base = free_port()
    update = {"comm_base_port": base, "comm_max_port": min(base + 50, 65535)}
    return dcs_config.model_copy(update={**update, "comm_timeout_seconds": 30.0, "group_init_timeout_seconds": 30.0})


def wait_for_line(path: Path, line: str, proc: PreloadedProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and line in path.read_text(errors="replace").splitlines():
            return
        assert proc.poll() is None, f"exited {proc.returncode}: {path.read_text(errors='replace')[-3000:]}"
        time.sleep(0.1)
    raise TimeoutError(f"no line {line!r} in {path} after {timeout}s")


def test_an_actor_fwd_that_asks_before_the_actor_registered_waits_then_gets_the_update(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    with sync_stack(fwd_config(dcs_config), tmp_path) as stack:
        procs: dict[str, PreloadedProcess] = {}

        def spawn(role: str) -> None:
            out, log, env = str(tmp_path / f"{role}.json"), tmp_path / f"{role}.log", child_env(stack.config)
            procs[role] = python_module("tests.distributed.early_fwd_node", role, out, log=log, env=env)

        try:
            spawn("actor_fwd")
            wait_for_line(tmp_path / "actor_fwd.log", "init", procs["actor_fwd"])
            time.sleep(2.0)  # the actor_fwd is inside its init now, and no actor is registered
            assert procs["actor_fwd"].poll() is None, (tmp_path / "actor_fwd.log").read_text()[-3000:]
            spawn("actor")
            codes = {role: p.wait(timeout=150) for role, p in procs.items()}
        finally:
            for p in procs.values():
                p.kill()
        logs = {role: (tmp_path / f"{role}.log").read_text(errors="replace")[-3000:] for role in procs}
        assert codes == {"actor_fwd": 0, "actor": 0}, logs
    fwd = json.loads((tmp_path / "actor_fwd.json").read_text())
    actor = json.loads((tmp_path / "actor.json").read_text())
    assert fwd["init_called"] < actor["registered"] < fwd["init_returned"], (fwd, actor)  # it waited
    assert fwd["joined"] is True and actor["joined"] is True
    assert fwd["version"] == 1 and fwd["digest"] == actor["digest"]


async def test_an_actor_fwd_whose_actor_never_registers_times_out_naming_what_it_waited_for(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    with sync_stack(fwd_config(dcs_config), tmp_path) as stack:
        client = CheckpointEngineClient(role="actor_fwd", rank=0, model_name="alone", config=stack.config)
        await client.start()
        started = time.monotonic()
        try:
            with pytest.raises(ActorWaitTimeout) as info:
                await client.init_process_groups_for_actor_fwd_ref(1, wait_timeout_s=3.0)
        finally:
            await client.stop()
        waited = time.monotonic() - started
    message = str(info.value)
    assert "actor_fwd rank 0 waited 3s for the source actor of update_actor_pp_0 to register" in message
    assert "registered sources: none" in message and "is_pp_src_rank" in message
    assert isinstance(info.value, TimeoutError)
    assert waited >= 3.0  # it did wait, rather than answer at once


async def test_an_actor_without_is_pp_src_rank_is_told_what_to_set_and_sits_out_once_a_source_exists(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    with sync_stack(fwd_config(dcs_config), tmp_path) as stack:

        def client(rank: int, metadata: dict[str, object]) -> CheckpointEngineClient:
            return CheckpointEngineClient(
                role="actor", rank=rank, model={}, model_name="pre", config=stack.config, metadata=metadata
            )

        plain = client(0, {})
        await plain.start()
        source = client(1, {"pp_rank": 0, "is_pp_src_rank": True})
        try:
            with pytest.raises(SyncPreconditionError) as info:
                await plain.init_process_groups_for_actor_fwd_ref(1)
            await source.start()  # now pp stage 0 has a source: the plain actor has nothing to send
            wait_registered(stack.url, "actor", 1, 30.0, token=stack.config.token())
            assert await plain.init_process_groups_for_actor_fwd_ref(2) is False
        finally:
            await source.stop()
            await plain.stop()
    message = str(info.value)
    assert "actor rank 0 has no metadata is_pp_src_rank=True" in message, message
    assert "register the actor with metadata={'is_pp_src_rank': True}" in message, message
    assert isinstance(info.value, ConfigError) and not isinstance(info.value, TimeoutError)
