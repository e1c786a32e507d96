"""Many long-polls of one coordinator process at one index share a single Redis read when an append wakes them
(real redis-server, the app in-process): the fleet benchmark's heartbeat tail came from 300 separate reads and
encodings per append."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import redis
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from coordinator.weight_meta import WeightMetaStore
from dcs_tasks.config import DCSConfig
from dcs_tasks.models import WeightMeta, WeightMetaBatch
from tests.integration.coordinator_support import InProcessCoordinator, in_process_coordinator

pytestmark = pytest.mark.integration

POLLS = 300


@pytest.fixture
async def coord(dcs_config: DCSConfig) -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(dcs_config) as c:
        yield c


def meta(name: str) -> WeightMeta:
    return WeightMeta(names=[name], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g")


def redis_calls(r: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT (commands run by scripts included)."""
    return {name: int(stat["calls"]) for name, stat in r.info("commandstats").items()}


async def _reads_settled(r: redis.Redis, timeout: float = 20.0) -> None:
    """Wait until the server has run no script for 0.6 s: every poll that was going to read has read (a fixed
    sleep was not enough on a loaded machine, and late first reads were counted as the append's)."""
    last, quiet_since = -1, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = redis_calls(r).get("cmdstat_evalsha", 0)
        if count != last:
            last, quiet_since = count, time.monotonic()
        elif time.monotonic() - quiet_since >= 0.6:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the long-polls kept reading for {timeout}s")


async def poll(http: httpx.AsyncClient, index: int, wait_s: float) -> httpx.Response:
    return await http.get("/recv_weight_meta", params={"index": index, "wait_timeout_s": wait_s})


@pytest.mark.own_redis
async def test_one_append_answers_300_long_polls_with_one_shared_read(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    r = redis.Redis.from_url(dcs_config.redis.url, decode_responses=True)
    await coord.api.send_weight_meta(meta("before"))
    polls = [asyncio.create_task(poll(coord.http, 1, 30.0)) for _ in range(POLLS)]
    await _reads_settled(r)  # every poll read index 1 (empty) and waits for the append
    assert not any(p.done() for p in polls)
    r.config_resetstat()
    await coord.api.send_weight_meta(meta("new"))
    done, _ = await asyncio.wait(polls, timeout=20.0)
    assert len(done) == POLLS
    calls = redis_calls(r)
    answers = [p.result() for p in polls]
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1  # all the same entries
    batch = WeightMetaBatch.model_validate_json(answers[0].content)
    assert batch.entries == [meta("new")] and (batch.first_index, batch.next_index, batch.end_index) == (1, 2, 2)
    # exactly the bytes FastAPI sends for the route's response_model
    assert answers[0].content == JSONResponse(jsonable_encoder(batch)).body
    assert answers[0].headers["content-type"] == "application/json"
    # the append (1 script) and a few shared reads (more batches on a loaded machine); before, every poll ran
    # its own read script (301)
    assert calls.get("cmdstat_evalsha", 0) <= 10, calls
    assert sum(calls.values()) <= 40, calls
    r.close()


async def test_a_shared_read_never_answers_from_before_a_clear_or_append(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    """A read that began before a request arrived is never shared with it: reads after a completed clear
    see the empty log, reads after a completed append see the entry, however many run at once."""
    store: WeightMetaStore = coord.app.state.services.weight_meta
    for round_ in range(5):
        await store.append(meta(f"r{round_}"))
        first = [asyncio.create_task(store.read(0)) for _ in range(50)]
        await asyncio.sleep(0)  # the first readers' shared read is now on its way to Redis
        await store.clear()
        after_clear = await asyncio.gather(*(store.read(0) for _ in range(50)))
        assert all(b.entries == [] for b in after_clear), round_
        await store.append(meta(f"s{round_}"))
        after_append = await asyncio.gather(*(store.read(0) for _ in range(50)))
        assert all(b.entries[-1:] == [meta(f"s{round_}")] for b in after_append), round_
        await asyncio.gather(*first)
        await store.clear()


async def test_a_failed_shared_read_fails_every_request_in_it_and_the_next_read_recovers(
    coord: InProcessCoordinator, dcs_config: DCSConfig
) -> None:
    store: WeightMetaStore = coord.app.state.services.weight_meta
    await store.append(meta("a"))
    r = redis.Redis.from_url(dcs_config.redis.url, decode_responses=True)
    r.set(store.keys.weight_meta_base(), "not a number")  # the read script fails on it
    answers = await asyncio.gather(*(poll(coord.http, 0, 0.0) for _ in range(20)))
    assert {a.status_code for a in answers} == {503}
    r.set(store.keys.weight_meta_base(), "0")
    answers = await asyncio.gather(*(poll(coord.http, 0, 0.0) for _ in range(20)))
    assert {a.status_code for a in answers} == {200}
    assert all(WeightMetaBatch.model_validate_json(a.content).entries == [meta("a")] for a in answers)
    r.close()
