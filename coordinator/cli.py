"""`dcs coordinator`: serve `create_app(DCSConfig())` with uvicorn (binds 127.0.0.1 unless told otherwise;
slow clients bounded and secrets scrubbed from logs, see `coordinator.serving`)."""

from __future__ import annotations

import argparse
from typing import Any

from dcs_tasks.config import DCSConfig


def _mapping(text: str) -> tuple[str, str]:
    role, sep, peer = text.partition("=")
    if not sep or not role or not peer:
        raise argparse.ArgumentTypeError(f"expected ROLE=PEER_ROLE, got {text!r}")
    return role, peer


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("coordinator", help="run the control-plane HTTP service (settings from DCS_* env)")
    parser.add_argument("--host", help="bind address (default: DCS_COORDINATOR_HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: DCS_COORDINATOR_PORT, 8000)")
    parser.add_argument(
        "--role-mapping",
        type=_mapping,
        action="append",
        help="ROLE=PEER_ROLE for /peer, repeatable (default: DCS_ROLE_MAPPINGS, actor=rollout)",
    )
    parser.add_argument(
        "--role-order",
        help="comma-separated roles in global-rank order (default: DCS_ROLE_ORDER, else registration order)",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.app import create_app
    from coordinator.serving import configure_logging, uvicorn_options

    overrides: dict[str, Any] = {"coordinator_host": args.host, "coordinator_port": args.port}
    if args.role_mapping:
        overrides["role_mappings"] = dict(args.role_mapping)
    if args.role_order:
        overrides["role_order"] = [r for r in args.role_order.split(",") if r]
    config = DCSConfig(**{k: v for k, v in overrides.items() if v is not None})
    configure_logging(config, args.log_level)
    app = create_app(config)
    uvicorn.run(app, **uvicorn_options(config, args.log_level))
    return 0
