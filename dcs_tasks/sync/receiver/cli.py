"""`dcs receiver`: run the reference rollout receiver and register it with the coordinator as `rollout`.

A receiver is a long-running server: a peer that goes away must never end it. So it ignores SIGPIPE (the `dcs`
entry point restores its default action, so that `dcs ... | head` ends quietly): with the default action, a
client that gives up on a request (the trainer cancelling the pause/begin calls in flight when it finds an
engine replaced, a probe's timeout) while the answer is being written killed the receiver, silently, by
SIGPIPE; ignored, the write fails with EPIPE, which only closes that connection. On SIGTERM/SIGINT it stops
serving, unregisters and leaves its groups (closing its gloo connections in order) before exiting with 0;
uvicorn alone would re-raise the signal once its HTTP shutdown ended and skip all of that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn

from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.config import DCSConfig, RoleInfo
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import ConfigError
from dcs_tasks.hostagent import NodeLiveness
from dcs_tasks.httpguard import guarded_server_options
from dcs_tasks.netaddr import configure_comm_interface, interface_of, is_loopback, route_address
from dcs_tasks.sync.planning import new_instance
from dcs_tasks.sync.receiver.guard import secure_receiver_app
from dcs_tasks.sync.receiver.server import create_receiver_app
from dcs_tasks.sync.receiving import WeightReceiver

log = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
INIT_WAIT_SECONDS = 2.0  # an init arriving while another forms waits this long, then is refused
EXECUTOR_THREADS = 32


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("receiver", help="run a reference rollout weight receiver")
    parser.add_argument("--coordinator-url", required=True)
    parser.add_argument("--rank", type=int, required=True, help="rollout rank to register as")
    parser.add_argument("--role", default="rollout", help="role to register as (default rollout)")
    parser.add_argument(
        "--host", default=None, help="address to bind (default: the advertised address; 0.0.0.0: every interface)"
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="address trainers reach this receiver at, registered with the coordinator (default: "
        "DCS_ADVERTISE_ADDRESS, else --host unless a wildcard, else the local address that routes to the "
        "coordinator)",
    )
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument(
        "--colocated-with",
        type=int,
        default=None,
        metavar="TRAINER_RANK",
        help="this receiver shares its host and device with that trainer rank: updates arrive by handle "
        "(shared memory / CUDA IPC), not over a process group (dcs_tasks/sync/colocated.py)",
    )
    parser.add_argument("--colocated-device", default="cpu", help="the shared device: cpu or cuda:N (default cpu)")
    parser.set_defaults(func=run)


def advertised_host(host: str | None, advertise_host: str | None, coordinator_url: str = "") -> str:
    """The address registered for trainers to call: `advertise_host`, else the bind address unless a wildcard,
    else the local address of the interface that routes to the coordinator. A wildcard bind that would
    advertise loopback is refused (ConfigError): it means to be reached from other hosts."""
    if advertise_host:
        return advertise_host
    if host is not None and host not in WILDCARDS:
        return host
    detected = route_address(coordinator_url)
    if host in WILDCARDS and is_loopback(detected):
        raise ConfigError(
            f"--host {host} binds every interface but the address that routes to the coordinator is {detected} "
            "(loopback); name the address trainers use with --advertise-host"
        )
    return detected


def bind_host(host: str | None, advertised: str) -> str:
    """The address to bind: `host`, else the advertised one where this host holds it, else every interface."""
    if host is not None:
        return host
    return advertised if is_loopback(advertised) or interface_of(advertised) else "0.0.0.0"


class ReceiverServer(uvicorn.Server):
    """uvicorn's server, minus the re-raise of a captured SIGTERM/SIGINT after its graceful shutdown: the
    signal's default action would end the process before `serve` unregisters and leaves its groups."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            captured: list[int] = getattr(self, "_captured_signals", [])
            if captured:
                log.info("stopping on signal %d", captured[-1])
            captured.clear()


def colocated_metadata(args: argparse.Namespace) -> dict[str, Any]:
    """`--colocated-with`'s registration entry (none without it); ColocationInvalid when out of bounds."""
    if getattr(args, "colocated_with", None) is None:
        return {}
    from dcs_tasks.sync.colocated import colocation_metadata

    return colocation_metadata(args.colocated_with, args.colocated_device)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a client gone mid-answer is EPIPE on its connection, not death
    config = DCSConfig(coordinator_url=args.coordinator_url)
    try:
        colocated_metadata(args)
        advertise = advertised_host(args.host, args.advertise_host or config.sync.advertise_address, config.base_url)
    except ConfigError as exc:
        print(f"dcs receiver: {exc}", file=sys.stderr)
        return 2
    configure_comm_interface(
        advertise, config.sync.comm_ifname
    )  # gloo/NCCL: not the hostname's (maybe loopback) address
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on such sockets; without it every response pays a
    # 40 ms delayed-ACK stall (uvicorn writes headers and body separately), i.e. 40 ms per bucket.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if config.receiver.tcp_nodelay else 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.receiver.tcp_buffer_size)
    sock.bind((bind_host(args.host, advertise), args.port))
    info = RoleInfo(
        role_name=args.role,
        rank=args.rank,
        ip=advertise,
        port=sock.getsockname()[1],
        # the trainer reads tp_size and version from GET /server_info, as for a real SGLang engine; the instance
        # token tells it a receiver restarted at the same address is not the group member it replaced
        metadata={"instance": new_instance()} | colocated_metadata(args),
    )
    asyncio.run(serve(config, info, sock))
    return 0


async def serve(config: DCSConfig, info: RoleInfo, sock: socket.socket) -> None:
    """Serve until SIGINT/SIGTERM, registered and heartbeating as `info` meanwhile."""
    backend = DeviceDirectBackend(
        config.sync.backend_type,
        info,
        timeout_seconds=config.sync.comm_timeout_seconds,
        group_init_timeout_seconds=config.sync.group_init_timeout_seconds,
        fusion_threshold_bytes=config.sync.tensor_fusion_threshold,
    )
    receiver = WeightReceiver(
        backend, max_update_bytes=config.receiver.max_update_bytes, init_wait_seconds=INIT_WAIT_SECONDS
    )
    app = create_receiver_app(receiver, pause_gc=config.sync.pause_gc)
    secure_receiver_app(app, config.token(), config.receiver.max_body_bytes)
    options = guarded_server_options(config.receiver.request_read_timeout_seconds, config.receiver.keep_alive_seconds)
    server = ReceiverServer(uvicorn.Config(app, log_level="warning", lifespan="off", **options))
    # every blocking call runs in the default executor: size it so waiting inits never starve digests
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(EXECUTOR_THREADS, "dcs-receiver"))
    api = CoordinatorAPI(config.base_url, config.token(), timeout=config.coordinator.request_timeout_seconds)
    beats = NodeLiveness(api, config, info)  # through the host's agent when one answers (dcs_tasks/hostagent.py)
    answer = await beats.register()
    info = info.model_copy(update={"rank": answer.rank})
    beats.start()
    log.info("receiver %s serving on %s", answer.node_id, info.address)
    gc.freeze()  # start-up objects (torch, FastAPI) leave the collector's view: later collections stay short
    try:
        await server.serve(sockets=[sock])
    finally:
        await beats.stop()
        try:
            await api.unregister(info.role_name, answer.rank)
        except Exception as exc:  # the coordinator may be gone at shutdown
            log.warning("unregister failed: %s", exc)
        await api.aclose()
        backend.close()
        log.info("receiver %s stopped: unregistered, groups left", answer.node_id)
