"""Weight-sync tasks (group bootstrap, engine join, group destroy): thin wrappers over `workers.bootstrap`.

`BOOTSTRAP_GROUP` runs on the trainer host's node queue (the port must bind there); it enqueues one
`JOIN_ENGINE` per engine on the same queue and returns their ids at once. Join tasks block until their
engine has joined the rendezvous, so a host's worker needs concurrency >= engines per group (the thread
pool suits these I/O-bound tasks). Payloads are JSON dicts validated by `dcs_tasks.sync.models`.
"""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.sync.models import BootstrapRequest, BootstrapResult, DestroyRequest, JoinRequest
from workers.bootstrap import destroy_group as destroy_group_impl
from workers.bootstrap import join_engine as join_engine_impl
from workers.bootstrap import record_group, reserve_port
from workers.runtime import runtime


@shared_task(name=TaskName.BOOTSTRAP_GROUP.value, bind=True)
def bootstrap_group(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
    """Reserve a master port, record the group (new epoch), enqueue the engines' joins."""
    request = BootstrapRequest.model_validate(payload)
    rt = runtime()
    epoch = int(rt.redis.incr(rt.keys.group_epoch(request.group_prefix)))
    group_name = f"{request.group_prefix}-e{epoch}"
    port = reserve_port(rt.redis, rt.keys, rt.config, request.master_address, group_name)
    record_group(rt.redis, rt.keys, group_name, epoch, request, port, rt.config.host_name)
    timeout = rt.config.group_init_timeout_seconds
    join_ids = []
    for engine in request.plan.engines:
        body = {
            "master_address": request.master_address,
            "master_port": port,
            "rank_offset": engine.rank_offset,
            "world_size": request.plan.world_size,
            "group_name": group_name,
            "backend": request.backend.value,
        }
        join = JoinRequest.model_validate({"engine": engine, "body": body, "timeout_seconds": timeout})
        sent = self.app.send_task(
            TaskName.JOIN_ENGINE.value, args=[join.model_dump(mode="json")], queue=node_queue(rt.config.host_name)
        )
        join_ids.append(sent.id)
    result = BootstrapResult(
        group_name=group_name,
        epoch=epoch,
        master_address=request.master_address,
        master_port=port,
        world_size=request.plan.world_size,
        join_task_ids=join_ids,
    )
    return result.model_dump(mode="json")


@shared_task(name=TaskName.JOIN_ENGINE.value)
def join_engine(payload: dict[str, Any]) -> dict[str, Any]:
    """Have one engine join; returns a `JoinResult` (success False with the engine's reason on failure)."""
    token = runtime().config.token()  # this host's DCS_AUTH_TOKEN: sent as the engine's API key, never in payloads
    return join_engine_impl(JoinRequest.model_validate(payload), token).model_dump(mode="json")


@shared_task(name=TaskName.DESTROY_GROUP.value)
def destroy_group(payload: dict[str, Any]) -> dict[str, Any]:
    """Tell engines to drop the group, release its master port and delete its record (idempotent)."""
    rt = runtime()
    answered = destroy_group_impl(rt.redis, rt.keys, DestroyRequest.model_validate(payload), token=rt.config.token())
    return {"engines_answered": answered}
