"""Lua has one home (`dcs_tasks.lua`): every script runs by EVALSHA, never EVAL, and survives a real
redis-server restart (which forgets loaded scripts: NOSCRIPT, then one SCRIPT LOAD and the call again) on
sync clients, asyncio clients and asyncio pipelines alike."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from coordinator import scripts
from coordinator.topology import TopologyManager
from dcs_tasks.checkpoint.format.layout import ManifestDraft
from dcs_tasks.checkpoint.store.ledger import ledger_scripts as ledger_scripts_module
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, StepStatus, Verdict
from dcs_tasks.config import RoleInfo, TopologyConfig
from dcs_tasks.keys import Keys
from dcs_tasks.lua import LuaScript
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _script_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha", "script|load")}


@pytest.mark.own_redis
def test_the_step_ledger_runs_by_sha_and_reloads_after_a_redis_restart(redis_server: RedisServer) -> None:
    client = redis.Redis(port=redis_server.port, socket_timeout=5)
    ledger = StepLedger(client, Keys("lua"))
    draft = ManifestDraft(run="r", step=1, created_at=time.time(), structure={}, tensors={})
    assert ledger.begin("r", 1, "tok", 1, draft, 60.0) is Verdict.WRITE
    assert ledger.claim_file("r", 1, "tok", "a.safetensors", "task-1") is Verdict.WRITE
    redis_server.restart()  # AOF keeps the step's hash; the server has no scripts loaded any more
    ledger_scripts = [v for v in vars(ledger_scripts_module).values() if isinstance(v, LuaScript)]
    assert len(ledger_scripts) == 7 and client.script_exists(*[s.sha for s in ledger_scripts]) == [False] * 7
    assert ledger.claim_file("r", 1, "tok", "a.safetensors", "task-2") is Verdict.CLAIMED
    assert ledger.abandon("r", 1, "tok", "test") is Verdict.OK
    assert ledger.progress("r", 1)[0] is StepStatus.FAILED
    calls = _script_calls(client)
    assert calls["eval"] == 0 and calls["evalsha"] == 4 and calls["script|load"] == 2, calls  # NOSCRIPT, load, again
    client.close()


@pytest.mark.own_redis
async def test_coordinator_scripts_reload_after_a_restart_on_clients_and_pipelines(redis_server: RedisServer) -> None:
    client = aioredis.Redis(port=redis_server.port, socket_timeout=5)
    keys = Keys("lua")
    topology = TopologyManager(client, keys, TopologyConfig(), 60.0)
    actor = RoleInfo(role_name="actor", port=7000)
    first = await topology.register_many([actor, actor.model_copy(update={"port": 7001})])  # one pipeline
    assert [r.rank for r in first] == [0, 1]
    redis_server.restart()  # the nodes' records and heartbeat keys survive (AOF); the loaded scripts do not
    shas = [s.sha for s in (scripts.REGISTER, scripts.HEARTBEAT, scripts.CLEAR_WEIGHT_META)]
    assert await client.script_exists(*shas) == [False] * 3
    (again,) = await topology.register_many([actor.model_copy(update={"port": 7002})])  # pipeline loads REGISTER
    assert again.rank == 2
    assert await topology.heartbeat("actor", 0, first[0].identity) is not None  # plain client: NOSCRIPT, reload
    assert await scripts.CLEAR_WEIGHT_META.run_async(client, [keys.weight_meta(), keys.weight_meta_base()]) == 0
    calls = _script_calls(redis.Redis(port=redis_server.port, socket_timeout=5))
    assert calls["eval"] == 0 and calls["script|load"] == 3, calls
    await client.aclose()


def test_no_product_code_runs_lua_except_through_dcs_tasks_lua() -> None:
    """No `register_script`, `eval(`/`evalsha(` outside `dcs_tasks.lua`; Lua sources only in LuaScript modules."""
    offenders = []
    for top in ("dcs_tasks", "coordinator", "workers"):
        for path in sorted((REPO / top).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(REPO).as_posix()
            if rel != "dcs_tasks/lua.py" and re.search(r"\bregister_script\(|\.eval(sha)?\((?!\))", text):
                offenders.append(rel)
            if "redis.call(" in text and not re.search(r"^from dcs_tasks\.lua import LuaScript$", text, re.M):
                offenders.append(rel)
    assert offenders == []
