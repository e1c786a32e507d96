"""Group bootstrap on the trainer's host: master-port reservation, group records, engine joins, teardown.

A master port is taken from `comm_base_port..comm_max_port` only if (1) `SET NX` of its reservation key
succeeds (value = group name) and (2) it binds on the master address right now. So no two groups, of any run,
share a host:port while reserved. `release_port` deletes the key only if it still names the group (Lua
compare-and-delete), so a late destroy cannot free a port that was re-reserved by another group.

Idempotent under redelivery (docs/reliability.md, "Weight-sync bootstrap tasks"): a bootstrap is keyed by its
request id (the client's, else the task id). `claim_epoch` gives every delivery of one request the same epoch,
so the same group name and record; `group_port` records the reserved port in that record in the same Lua
script that reserves it, so a delivery killed anywhere after it finds the port there instead of reserving a
second one; each join is sent once per engine (`join:<node>` in the record) under a deterministic task id, and
`join_once` claims the join before POSTing, so no engine gets `/init_weights_update_group` twice for one group
(a second one re-initialises SGLang's group and is refused by `dcs receiver`).

Lifecycle of the record (`GroupStatus`): BOOTSTRAPPING -> READY once every engine answered its join ->
DESTROYED at teardown, which also releases the port. The record and the port reservation live `bootstrap_ttl`
while bootstrapping (a bootstrap the trainer gave up on frees them by itself), then `GROUP_RECORD_TTL_SECONDS`
and `PORT_RESERVATION_TTL_SECONDS` once READY (the backstop when no teardown comes).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis

from dcs_tasks.config import DCSConfig
from dcs_tasks.engine_http import EngineHTTPError, EngineTimeout, request_blocking
from dcs_tasks.errors import PortAllocationError, WeightSyncError
from dcs_tasks.keys import Keys
from dcs_tasks.netaddr import port_binds
from dcs_tasks.sync import group_scripts as scripts
from dcs_tasks.sync import vllm_protocol
from dcs_tasks.sync.engine_protocol import auth_headers
from dcs_tasks.sync.wire import (
    BootstrapRequest,
    BootstrapResult,
    DestroyRequest,
    EngineEndpoint,
    GroupStatus,
    InitWeightsUpdateGroupRequest,
    JoinOutcome,
    JoinRequest,
    JoinResult,
)

log = logging.getLogger(__name__)

PORT_RESERVATION_TTL_SECONDS = 6 * 3600
GROUP_RECORD_TTL_SECONDS = 7 * 24 * 3600
DESTROYED_RECORD_TTL_SECONDS = 24 * 3600
JOIN_SENDING = "sending"


class GroupAlreadyDestroyed(WeightSyncError):
    """A bootstrap delivered again after its group was torn down: it is not formed a second time."""


SendJoin = Callable[[str, JoinRequest], None]
"""Enqueues one join under the given task id (the Celery task passes its app's `send_task`)."""


def bootstrap(
    client: redis.Redis, keys: Keys, config: DCSConfig, request: BootstrapRequest, request_id: str, send: SendJoin
) -> BootstrapResult:
    """Epoch, record, master port, one join per engine: the same at every delivery of `request_id`."""
    ttl = bootstrap_ttl(config)
    epoch = claim_epoch(client, keys, request_id, request.group_prefix, ttl)
    group = group_name_of(request.group_prefix, epoch)
    status = open_group(client, keys, group, epoch, request, config.host_name, request_id, ttl)
    if status is GroupStatus.DESTROYED:
        reason = _text(client.hget(keys.group(group), "destroy_reason"))
        raise GroupAlreadyDestroyed(f"group {group} of bootstrap {request_id} was already destroyed ({reason})")
    port = group_port(client, keys, config, request.master_address, group, ttl)
    join_ids = []
    for engine in request.plan.engines:
        task_id = join_id(request_id, engine.node_id)
        if not join_sent(client, keys, group, engine.node_id):  # sent by a delivery before this one
            send(task_id, _join_request(request, engine, group, port, config.sync.group_init_timeout_seconds))
            mark_join_sent(client, keys, group, engine.node_id, task_id)
        join_ids.append(task_id)
    if not request.plan.engines:
        mark_joined(client, keys, group, None, config.host_name, port)
    return BootstrapResult(
        group_name=group,
        epoch=epoch,
        master_address=request.master_address,
        master_port=port,
        world_size=request.plan.world_size,
        join_task_ids=join_ids,
    )


def _join_request(
    request: BootstrapRequest, engine: EngineEndpoint, group: str, port: int, timeout: float
) -> JoinRequest:
    body = InitWeightsUpdateGroupRequest(
        master_address=request.master_address,
        master_port=port,
        rank_offset=engine.rank_offset,
        world_size=request.plan.world_size,
        group_name=group,
        backend=request.backend,
    )
    return JoinRequest(engine=engine, body=body, timeout_seconds=timeout)


def bootstrap_ttl(config: DCSConfig) -> int:
    """Seconds a bootstrap's epoch, join claims and (until READY) its port reservation live: twice the
    visibility timeout, so they outlive every redelivery of the task (a redelivery comes at the latest one
    visibility timeout after the delivery that died)."""
    return int(config.task.visibility_timeout_seconds * 2)


def reserve_port(client: redis.Redis, keys: Keys, config: DCSConfig, address: str, group_name: str) -> int:
    """Reserve and return a free master port on this host; PortAllocationError if the range is exhausted."""
    host = config.host_name
    for port in range(config.sync.comm_base_port, config.sync.comm_max_port + 1):
        key = keys.port_reservation(host, port)
        if not client.set(key, group_name, nx=True, ex=PORT_RESERVATION_TTL_SECONDS):
            continue
        if port_binds(address, port):
            return port
        client.delete(key)
    raise _exhausted(config, address)


def release_port(client: redis.Redis, keys: Keys, host: str, port: int, group_name: str) -> bool:
    return bool(scripts.RELEASE_PORT(client, [keys.port_reservation(host, port)], [group_name]))


def claim_epoch(client: redis.Redis, keys: Keys, request_id: str, group_prefix: str, ttl: int) -> int:
    """The epoch of bootstrap request `request_id`: drawn from the prefix's counter at its first delivery and
    the same at every later one (Lua, so two deliveries at once get one epoch too)."""
    key = keys.bootstrap_request(request_id)
    return int(scripts.CLAIM_EPOCH(client, [key, keys.group_epoch(group_prefix)], [ttl]))


def group_name_of(group_prefix: str, epoch: int) -> str:
    return f"{group_prefix}-e{epoch}"


def open_group(
    client: redis.Redis,
    keys: Keys,
    group_name: str,
    epoch: int,
    request: BootstrapRequest,
    host: str,
    request_id: str,
    ttl: int,
) -> GroupStatus:
    """Create the group's H record (members, epoch, master address; status BOOTSTRAPPING; TTL `ttl` until
    READY) unless a delivery before this one did; returns its status (a redelivery may find it READY or
    DESTROYED)."""
    key = keys.group(group_name)
    fields: dict[str, str | int | float] = {
        "epoch": epoch,
        "request_id": request_id,
        "host": host,
        "master_address": request.master_address,
        "world_size": request.plan.world_size,
        "engines": len(request.plan.engines),
        "members": json.dumps([e.model_dump(mode="json") for e in request.plan.engines]),
        "status": GroupStatus.BOOTSTRAPPING.value,
        "created_at": time.time(),
    }
    args = [str(item) for pair in fields.items() for item in pair]
    status = scripts.OPEN_RECORD(client, [key], [ttl, *args])
    return GroupStatus(_text(status))


def group_port(client: redis.Redis, keys: Keys, config: DCSConfig, address: str, group_name: str, ttl: int) -> int:
    """The group's master port: the one its record holds (a redelivery), else a newly reserved one.

    A recorded port is re-checked for binding only while `port_checked` is "0" (the delivery that reserved it
    died before checking). Once checked it is returned as is: the trainer may already be listening on it."""
    record = keys.group(group_name)
    for _ in range(config.sync.comm_max_port - config.sync.comm_base_port + 2):
        recorded, checked = client.hmget(record, ["master_port", "port_checked"])
        if recorded is None:
            return _reserve_into(client, keys, config, address, group_name, ttl)
        port = int(recorded)
        if _text(checked) == "1":
            return port
        if port_binds(address, port):
            client.hset(record, "port_checked", "1")
            return port
        scripts.UNRESERVE_PORT(client, [keys.port_reservation(config.host_name, port), record], [group_name, port])
    raise PortAllocationError(f"group {group_name}: no recorded master port binds on {address}")


def _reserve_into(client: redis.Redis, keys: Keys, config: DCSConfig, address: str, group_name: str, ttl: int) -> int:
    """`reserve_port`, recording the port in the group's record in the same Lua script that reserves it."""
    host, record = config.host_name, keys.group(group_name)
    for port in range(config.sync.comm_base_port, config.sync.comm_max_port + 1):
        key = keys.port_reservation(host, port)
        got = int(scripts.RESERVE_PORT(client, [key, record], [group_name, port, ttl]))
        if got > 0:  # another delivery of this request recorded one meanwhile
            return group_port(client, keys, config, address, group_name, ttl)
        if got == 0:
            continue
        if port_binds(address, port):
            client.hset(record, "port_checked", "1")
            return port
        scripts.UNRESERVE_PORT(client, [key, record], [group_name, port])
    raise _exhausted(config, address)


def _exhausted(config: DCSConfig, address: str) -> PortAllocationError:
    return PortAllocationError(
        f"no free master port in {config.sync.comm_base_port}-{config.sync.comm_max_port} on host {config.host_name} "
        f"({address}): every port is reserved in Redis or bound; destroy idle groups or widen "
        "DCS_COMM_BASE_PORT/DCS_COMM_MAX_PORT"
    )


def join_id(request_id: str, node_id: str) -> str:
    """The task id of one engine's join: the same at every delivery of the bootstrap that sends it."""
    return f"{request_id}-join-{node_id}"


def join_sent(client: redis.Redis, keys: Keys, group_name: str, node_id: str) -> bool:
    return client.hget(keys.group(group_name), f"join:{node_id}") is not None


def mark_join_sent(client: redis.Redis, keys: Keys, group_name: str, node_id: str, task_id: str) -> None:
    client.hset(keys.group(group_name), f"join:{node_id}", task_id)


def mark_joined(
    client: redis.Redis, keys: Keys, group_name: str, node_id: str | None, host: str, port: int | None = None
) -> bool:
    """Count `node_id` as joined (once); when every engine has, BOOTSTRAPPING -> READY and the port reservation
    gets its long TTL. `node_id` None only checks (a group without engines is READY at once)."""
    record = keys.group(group_name)
    args = (node_id or "", time.time(), GROUP_RECORD_TTL_SECONDS)
    ready = bool(scripts.MARK_JOINED(client, [record], args))
    if ready:
        if port is None:
            port = int(_text(client.hget(record, "master_port")) or 0)
        if port:
            key = keys.port_reservation(host, port)
            scripts.EXTEND_RESERVATION(client, [key, record], [group_name, PORT_RESERVATION_TTL_SECONDS])
        log.info("group %s is ready", group_name)
    return ready


def group_status(client: redis.Redis, keys: Keys, group_name: str) -> GroupStatus | None:
    value = _text(client.hget(keys.group(group_name), "status"))
    return GroupStatus(value) if value else None


def _text(value: object) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def join_engine(request: JoinRequest, token: str | None = None) -> JoinResult:
    """POST the engine's /init_weights_update_group (with SGLang's API-key header when DCS has a token);
    blocks until the engine has joined (or fails).

    The HTTP timeout exceeds the rendezvous timeout by a margin, so an engine's own failure message wins.
    """
    node = request.engine.node_id
    if request.engine.kind == "vllm":  # vLLM's RL API: the same rendezvous, vLLM's init-info body
        url = f"{request.engine.url}/init_weight_transfer_engine"
        b = request.body
        body = vllm_protocol.init_info(
            b.master_address,
            b.master_port,
            b.rank_offset,
            b.world_size,
            b.group_name,
            request.timeout_seconds,
            b.backend,
        )
    else:
        url = f"{request.engine.url}/init_weights_update_group"
        body = request.body.model_dump(mode="json")
    try:
        response = request_blocking(  # total time and answer size bounded (a hostile engine's answer)
            "POST", url, request.timeout_seconds + 5, json_body=body, headers=auth_headers(token)
        )
    except EngineTimeout as exc:
        return JoinResult(node_id=node, success=False, outcome=JoinOutcome.TIMED_OUT, message=f"{url}: {exc!r}")
    except EngineHTTPError as exc:
        return JoinResult(
            node_id=node, success=False, outcome=JoinOutcome.UNREACHABLE, message=f"{url} unreachable: {exc!r}"
        )
    try:
        body = response.json()
    except ValueError:
        body = {"success": False, "message": response.text[:500]}
    if not isinstance(body, dict):
        body = {"message": response.text[:500]}
    if response.is_success and bool(body.get("success", True)):
        return JoinResult(node_id=node, success=True, message=str(body.get("message", "")))
    # SGLang answers {"success": false, "message"}, FastAPI's {"detail"} for a body it cannot parse, or
    # {"error": "Unauthorized"} (401/403) for a wrong API key
    reason = body.get("message") or body.get("detail") or body.get("error") or response.text[:500]
    if response.status in (401, 403):
        reason = f"{reason}: the engine refused DCS's API key (start it with --api-key equal to DCS_AUTH_TOKEN)"
    if response.status == 404 and request.engine.kind == "vllm":
        reason = f"{reason}: vLLM serves no RL API; {vllm_protocol.DEV_MODE_HINT}"
    return JoinResult(node_id=node, success=False, outcome=JoinOutcome.REFUSED, message=f"{response.status}: {reason}")


def join_once(
    client: redis.Redis, keys: Keys, request: JoinRequest, task_id: str | None, host: str, ttl: int, token: str | None
) -> JoinResult:
    """`join_engine`, at most once per join task id: the claim is taken before the POST and holds the result
    after it, so a redelivered join answers what the first one got (or, when the first died mid-POST, success
    unconfirmed: a second `/init_weights_update_group` would re-initialise SGLang's group, and the trainer's
    own rendezvous proves whether the engine is in). A successful join is counted in the group record."""
    group = request.body.group_name
    node = request.engine.node_id
    claim = keys.join_claim(task_id) if task_id else None
    if claim is not None and not client.set(claim, JOIN_SENDING, nx=True, ex=ttl):
        result = _claimed_result(client.get(claim), node, group)
    else:
        result = join_engine(request, token)
        if claim is not None:
            client.set(claim, result.model_dump_json(), ex=ttl)
    if result.success:
        mark_joined(client, keys, group, node, host, request.body.master_port)
    return result


def _claimed_result(value: object, node: str, group: str) -> JoinResult:
    text = _text(value)
    if text and text != JOIN_SENDING:
        return JoinResult.model_validate_json(text)
    log.warning("join of %s to %s was sent by a delivery that died; not sent again", node, group)
    return JoinResult(
        node_id=node,
        success=True,
        message=f"join of {node} to {group} was sent by an earlier delivery that died; not sent again (the "
        "trainer's rendezvous confirms it)",
    )


def destroy_group(
    client: redis.Redis, keys: Keys, request: DestroyRequest, timeout: float = 10.0, token: str | None = None
) -> int:
    """Best-effort engine teardown, then port release; the record turns DESTROYED (kept
    `DESTROYED_RECORD_TTL_SECONDS` for operators). Returns the engines that answered; a group already
    DESTROYED (a redelivered destroy) is not torn down again."""
    if group_status(client, keys, request.group_name) is GroupStatus.DESTROYED:
        release_port(client, keys, request.host, request.master_port, request.group_name)
        return 0
    answered = 0
    for engine in request.engines:
        try:
            if engine.kind == "vllm":
                # vLLM's /shutdown_weight_transfer_engine names no group: sent by this task, which runs after the
                # trainer moved on, it could drop the group a newer join just formed. The next
                # /init_weight_transfer_engine replaces the engine's group; the trainer's side is gone already
                continue
            request_blocking(
                "POST",
                f"{engine.url}/destroy_weights_update_group",
                timeout,
                json_body={"group_name": request.group_name},
                headers=auth_headers(token),
            )
            answered += 1
        except EngineHTTPError as exc:
            log.info("engine %s did not answer destroy of %s: %s", engine.node_id, request.group_name, exc)
    release_port(client, keys, request.host, request.master_port, request.group_name)
    mark_destroyed(client, keys, request.group_name, "destroyed by its trainer")
    return answered


def mark_destroyed(client: redis.Redis, keys: Keys, group_name: str, reason: str) -> bool:
    """DESTROYED with `reason` (an absent record stays absent); True if the record existed."""
    record = keys.group(group_name)
    args = (time.time(), reason[:500], DESTROYED_RECORD_TTL_SECONDS)
    return bool(scripts.MARK_DESTROYED(client, [record], args))


def abandon_bootstrap(
    client: redis.Redis, keys: Keys, host: str, request_id: str, group_prefix: str, reason: str
) -> str | None:
    """A bootstrap that failed for good: release its port and mark its record DESTROYED (its trainer never
    learned the group, so no teardown will come). Returns the group name, None if it drew no epoch."""
    epoch = _text(client.get(keys.bootstrap_request(request_id)))
    if not epoch:
        return None
    group = group_name_of(group_prefix, int(epoch))
    port = _text(client.hget(keys.group(group), "master_port"))
    if port:
        release_port(client, keys, host, int(port), group)
    mark_destroyed(client, keys, group, f"bootstrap failed: {reason}")
    return group
