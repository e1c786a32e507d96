"""Group bootstrap on the trainer's host: master-port reservation, group records, engine joins, teardown.

A master port is taken from `comm_base_port..comm_max_port` only if (1) `SET NX` of its reservation key
succeeds (TTL `PORT_RESERVATION_TTL_SECONDS`, value = group name) and (2) it binds on the master address
right now. So no two groups, of any run, share a host:port while reserved. `release_port` deletes the key
only if it still names the group (Lua compare-and-delete), so a late destroy cannot free a port that was
re-reserved by another group.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import redis

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import PortAllocationError
from dcs_tasks.keys import Keys
from dcs_tasks.sync.engine_protocol import auth_headers
from dcs_tasks.sync.models import BootstrapRequest, DestroyRequest, GroupStatus, JoinOutcome, JoinRequest, JoinResult

log = logging.getLogger(__name__)

PORT_RESERVATION_TTL_SECONDS = 6 * 3600
GROUP_RECORD_TTL_SECONDS = 7 * 24 * 3600

# KEYS[1] = reservation key; ARGV[1] = group name that must own it. Returns 1 if deleted.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def port_binds(address: str, port: int) -> bool:
    """Whether a TCP listener could bind `address:port` now (no SO_REUSEADDR: TIME_WAIT counts as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def reserve_port(client: redis.Redis, keys: Keys, config: DCSConfig, address: str, group_name: str) -> int:
    """Reserve and return a free master port on this host; PortAllocationError if the range is exhausted."""
    host = config.host_name
    for port in range(config.comm_base_port, config.comm_max_port + 1):
        key = keys.port_reservation(host, port)
        if not client.set(key, group_name, nx=True, ex=PORT_RESERVATION_TTL_SECONDS):
            continue
        if port_binds(address, port):
            return port
        client.delete(key)
    raise PortAllocationError(
        f"no free master port in {config.comm_base_port}-{config.comm_max_port} on host {host} ({address}): every "
        "port is reserved in Redis or bound; destroy idle groups or widen DCS_COMM_BASE_PORT/DCS_COMM_MAX_PORT"
    )


def release_port(client: redis.Redis, keys: Keys, host: str, port: int, group_name: str) -> bool:
    return bool(client.eval(_RELEASE_LUA, 1, keys.port_reservation(host, port), group_name))


def record_group(
    client: redis.Redis, keys: Keys, group_name: str, epoch: int, request: BootstrapRequest, port: int, host: str
) -> None:
    """H group record: members, epoch, master address; readable by operators and by `destroy`."""
    key = keys.group(group_name)
    members = [e.model_dump(mode="json") for e in request.plan.engines]
    client.hset(
        key,
        mapping={
            "epoch": epoch,
            "host": host,
            "master_address": request.master_address,
            "master_port": port,
            "world_size": request.plan.world_size,
            "members": json.dumps(members),
            "status": GroupStatus.BOOTSTRAPPING.value,
            "created_at": time.time(),
        },
    )
    client.expire(key, GROUP_RECORD_TTL_SECONDS)


def join_engine(request: JoinRequest, token: str | None = None) -> JoinResult:
    """POST the engine's /init_weights_update_group (with SGLang's API-key header when DCS has a token);
    blocks until the engine has joined (or fails).

    The HTTP timeout exceeds the rendezvous timeout by a margin, so an engine's own failure message wins.
    """
    url = f"{request.engine.url}/init_weights_update_group"
    node = request.engine.node_id
    try:
        response = httpx.post(
            url,
            json=request.body.model_dump(mode="json"),
            headers=auth_headers(token),
            timeout=request.timeout_seconds + 5,
        )
    except httpx.TimeoutException as exc:
        return JoinResult(node_id=node, success=False, outcome=JoinOutcome.TIMED_OUT, message=f"{url}: {exc!r}")
    except httpx.HTTPError as exc:
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
    if response.status_code in (401, 403):
        reason = f"{reason}: the engine refused DCS's API key (start it with --api-key equal to DCS_AUTH_TOKEN)"
    return JoinResult(
        node_id=node, success=False, outcome=JoinOutcome.REFUSED, message=f"{response.status_code}: {reason}"
    )


def destroy_group(
    client: redis.Redis, keys: Keys, request: DestroyRequest, timeout: float = 10.0, token: str | None = None
) -> int:
    """Best-effort engine teardown, then port release and record removal; returns engines that answered."""
    answered = 0
    for engine in request.engines:
        try:
            httpx.post(
                f"{engine.url}/destroy_weights_update_group",
                json={"group_name": request.group_name},
                headers=auth_headers(token),
                timeout=timeout,
            )
            answered += 1
        except httpx.HTTPError as exc:
            log.info("engine %s did not answer destroy of %s: %s", engine.node_id, request.group_name, exc)
    release_port(client, keys, request.host, request.master_port, request.group_name)
    client.delete(keys.group(request.group_name))
    return answered
