"""Weight-sync tasks (group bootstrap, engine join, group destroy): thin wrappers over `dcs_tasks.sync.group_bootstrap`.

`BOOTSTRAP_GROUP` runs on the trainer host's node queue (the port must bind there); it enqueues one
`JOIN_ENGINE` per engine on the same queue and returns their ids at once. Join tasks block until their
engine has joined the rendezvous, so a host's worker needs concurrency >= engines per group (the thread
pool suits these I/O-bound tasks). Payloads are JSON dicts validated by `dcs_tasks.sync.wire`; a malformed
one fails with `InvalidTaskPayload`, at once and never retried.

All three run on `DCSTask` (workers/taskbase.py): late acks with a redelivery cap, and retries with backoff for
connection errors. Redelivery is safe because each is idempotent (docs/reliability.md, "Weight-sync
bootstrap tasks"): a bootstrap is keyed by its request id, so every delivery returns the same epoch, master
port and join task ids; a join POSTs at most once per task id; a destroy of a DESTROYED group does nothing.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import shared_task

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.sync.group_bootstrap import abandon_bootstrap, bootstrap, bootstrap_ttl, join_once
from dcs_tasks.sync.group_bootstrap import destroy_group as destroy_group_impl
from dcs_tasks.sync.wire import BootstrapRequest, DestroyRequest, JoinRequest
from workers.runtime import runtime
from workers.taskbase import DCSTask, parse_payload

log = logging.getLogger(__name__)


class BootstrapTask(DCSTask):
    def give_up(self, args: Any, kwargs: Any, reason: str) -> None:
        """Release the port of a bootstrap that failed for good and mark its group DESTROYED."""
        payload = args[0] if args else None
        if not isinstance(payload, dict) or not isinstance(payload.get("group_prefix"), str):
            return
        request_id = payload.get("request_id") or self.request.id
        if not isinstance(request_id, str):
            return
        rt = runtime()
        group = abandon_bootstrap(rt.redis, rt.keys, rt.config.host_name, request_id, payload["group_prefix"], reason)
        if group is not None:
            log.error("bootstrap of %s failed for good; port released, group DESTROYED: %s", group, reason)


@shared_task(name=TaskName.BOOTSTRAP_GROUP.value, base=BootstrapTask, bind=True)
def bootstrap_group(self: BootstrapTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Reserve a master port, record the group (new epoch), enqueue the engines' joins; the same at every
    delivery of one request."""
    request = parse_payload(BootstrapRequest, payload, self.name)
    rt = runtime()
    request_id = request.request_id or self.request.id or uuid.uuid4().hex
    queue = node_queue(rt.config.host_name)

    def send(task_id: str, join: JoinRequest) -> None:
        self.app.send_task(
            TaskName.JOIN_ENGINE.value, args=[join.model_dump(mode="json")], queue=queue, task_id=task_id
        )

    return bootstrap(rt.redis, rt.keys, rt.config, request, str(request_id), send).model_dump(mode="json")


@shared_task(name=TaskName.JOIN_ENGINE.value, base=DCSTask, bind=True)
def join_engine(self: DCSTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Have one engine join (once per task id); returns a `JoinResult` (success False with the engine's reason
    on failure)."""
    request = parse_payload(JoinRequest, payload, self.name)
    rt = runtime()
    # a join holds a pool slot while it waits: never longer than this host's own settings allow
    longest = min(rt.config.sync.group_init_timeout_seconds, rt.config.sync.group_init_timeout_max_seconds)
    if request.timeout_seconds > longest:
        request = request.model_copy(update={"timeout_seconds": longest})
    token = rt.config.token()  # this host's DCS_AUTH_TOKEN: sent as the engine's API key, never in payloads
    ttl = bootstrap_ttl(rt.config)
    result = join_once(rt.redis, rt.keys, request, self.request.id, rt.config.host_name, ttl, token)
    return result.model_dump(mode="json")


@shared_task(name=TaskName.DESTROY_GROUP.value, base=DCSTask, bind=True)
def destroy_group(self: DCSTask, payload: dict[str, Any]) -> dict[str, Any]:
    """Tell engines to drop the group, release its master port, mark its record DESTROYED (idempotent)."""
    request = parse_payload(DestroyRequest, payload, self.name)
    rt = runtime()
    answered = destroy_group_impl(rt.redis, rt.keys, request, token=rt.config.token())
    return {"engines_answered": answered}
