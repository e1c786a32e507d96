"""`dcs engine attach`: register a running SGLang or vLLM server as a rollout engine and keep it registered.

    dcs engine attach --coordinator-url http://coord:8000 --engine-url http://10.0.0.5:30000 --rank 0

The coordinator token comes from DCS_AUTH_TOKEN; the engine's API key from --engine-api-key, else
DCS_ENGINE_API_KEY, else the same token. Exit status: 0 after SIGTERM/SIGINT (engine unregistered), 1 on a
named error (logged as `ErrorName: message`), 2 on bad arguments or settings.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
from typing import Any

import httpx
from pydantic import ValidationError

from dcs_tasks.config import DCSConfig
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import ConfigError, DCSError
from dcs_tasks.sync.attach import AttachSettings, EngineAttachment
from dcs_tasks.sync.engine_probe import EngineProbe
from dcs_tasks.sync.wire import ENGINE_KINDS, EngineKind

log = logging.getLogger("dcs_tasks.sync.attach")
ENGINE_API_KEY_ENV = "DCS_ENGINE_API_KEY"


def _rank(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a rank is >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a duration is > 0 seconds, got {text}")
    return value


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("engine", help="attach real rollout engines (SGLang)")
    engine_sub = parser.add_subparsers(dest="engine_command", metavar="{attach}", required=True)
    attach = engine_sub.add_parser("attach", help="register a running SGLang server as a rollout engine")
    attach.add_argument("--coordinator-url", required=True)
    attach.add_argument("--engine-url", required=True, help="the SGLang server as this host reaches it")
    attach.add_argument("--rank", type=_rank, required=True, help="rollout rank to register the engine as")
    attach.add_argument("--role", default="rollout", help="role to register as (default rollout)")
    attach.add_argument(
        "--kind",
        choices=ENGINE_KINDS,
        default="sglang",
        help="engine family: sglang (default) or vllm (`vllm serve` with VLLM_SERVER_DEV_MODE=1)",
    )
    attach.add_argument(
        "--advertise-url", help="http://ip:port trainers use to reach the engine (default: --engine-url)"
    )
    attach.add_argument(
        "--engine-api-key",
        help=f"the engine's --api-key (default: ${ENGINE_API_KEY_ENV}, else DCS_AUTH_TOKEN); prefer the variable",
    )
    attach.add_argument("--wait-timeout", type=_seconds, default=1800.0, help="longest wait for /health (s)")
    attach.add_argument("--health-timeout", type=_seconds, default=25.0, help="timeout of one /health probe (s)")
    attach.add_argument(
        "--down-after",
        type=_seconds,
        help="unregister after /health has not answered for this long (default: heartbeat timeout)",
    )
    attach.add_argument(
        "--unhealthy-after",
        type=_seconds,
        default=600.0,
        help="unregister after /health has answered non-200 this long (SGLang answers 503 while busy >20 s)",
    )
    attach.add_argument(
        "--colocated-with",
        type=int,
        default=None,
        metavar="TRAINER_RANK",
        help="the engine shares this host and --colocated-device with that trainer rank: updates by handle "
        "(CUDA IPC; CPU: shared memory), not a process group (SGLang; vLLM with --weight-transfer-config "
        '\'{"backend": "dcs-ipc"}\')',
    )
    attach.add_argument("--colocated-device", default="cuda:0", help="the shared device: cuda:N or cpu")
    attach.set_defaults(func=run)


def advertised_address(engine_url: str, advertise_url: str | None) -> tuple[str, int]:
    """(ip, port) trainers reach the engine at; ConfigError for an address they cannot use."""
    url = httpx.URL(advertise_url or engine_url)
    flag = "--advertise-url" if advertise_url else "--engine-url"
    if url.scheme != "http" or not url.host:
        raise ConfigError(f"{flag} must be http://host:port (trainers post plain HTTP), got {url.scheme}://{url.host}")
    port = url.port or 80
    try:
        address = ipaddress.ip_address(url.host)
    except ValueError:
        address = None
    if address is not None and address.is_unspecified:
        raise ConfigError(f"{flag} host {url.host} is not an address trainers can reach; pass --advertise-url")
    if advertise_url is None and (url.host == "localhost" or (address is not None and address.is_loopback)):
        log.warning(
            "advertising loopback %s:%d: only trainers on this host can reach it (--advertise-url)", url.host, port
        )
    return url.host, port


def _colocated(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--colocated-with`'s registration entry (SGLang, or vLLM with the plugin's "dcs-ipc" backend, which the
    probe checks: docs/weight_sync.md, Colocated engines); ConfigError for an entry out of bounds."""
    if args.colocated_with is None:
        return None
    from dcs_tasks.sync.colocated import colocation_metadata

    return colocation_metadata(args.colocated_with, args.colocated_device)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    try:
        config = DCSConfig(coordinator_url=args.coordinator_url)
        if httpx.URL(args.engine_url).scheme != "http":
            raise ConfigError(f"--engine-url must be http://host:port, got {args.engine_url!r}")
        ip, port = advertised_address(args.engine_url, args.advertise_url)
        settings = AttachSettings(
            rank=args.rank,
            role=args.role,
            advertise_ip=ip,
            advertise_port=port,
            interval=config.heartbeat.interval_seconds,
            down_after=args.down_after if args.down_after is not None else config.heartbeat.timeout_seconds,
            wait_timeout=args.wait_timeout,
            health_timeout=args.health_timeout,
            unhealthy_after=args.unhealthy_after,
            colocated=_colocated(args),
        )
        api_key = args.engine_api_key or os.environ.get(ENGINE_API_KEY_ENV) or config.token()
        if api_key != config.token():
            log.warning("the engine API key differs from DCS_AUTH_TOKEN: trainers send DCS_AUTH_TOKEN to engines")
        asyncio.run(_attach(config, args.engine_url, api_key, settings, args.kind))
    except ValidationError as exc:  # a DCS_* setting or the coordinator URL
        log.error("dcs engine attach: invalid setting: %s", exc)
        return 2
    except DCSError as exc:
        log.error("dcs engine attach failed: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


async def _attach(
    config: DCSConfig, engine_url: str, api_key: str | None, settings: AttachSettings, kind: EngineKind = "sglang"
) -> None:
    """Run the attachment until SIGTERM/SIGINT (then unregister and return) or a named error."""
    loop = asyncio.get_running_loop()
    async with (
        CoordinatorAPI(config.base_url, config.token(), timeout=config.coordinator.request_timeout_seconds) as api,
        EngineProbe(
            engine_url,
            settings.rank,
            api_key,
            config.coordinator.request_timeout_seconds,
            kind,
            colocated=settings.colocated is not None,
        ) as engine,
    ):
        task = asyncio.create_task(EngineAttachment(api, engine, settings, config).run())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped by signal; engine unregistered")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
