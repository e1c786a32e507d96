"""`dcs worker`: a Celery worker consuming this host's node queue and the control queue."""

from __future__ import annotations

import argparse
from typing import Any

from dcs_tasks.config import DCSConfig


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("worker", help="run a Celery worker for this host")
    parser.add_argument("--concurrency", "-c", type=int, default=None, help="worker processes (default: cores)")
    parser.add_argument("--node-name", default=None, help="host name for the node queue (default: hostname)")
    parser.add_argument("--loglevel", "-l", default="INFO")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from workers.app import make_worker_app

    overrides = {"node_name": args.node_name} if args.node_name else {}
    config = DCSConfig(**overrides)
    app = make_worker_app(config)
    argv = [
        "worker",
        f"--loglevel={args.loglevel}",
        f"--pool={args.pool}",
        "-E",
        f"--hostname=dcs@{config.host_name}",
        "--without-mingle",
        "--without-gossip",
    ]
    if args.concurrency:
        argv.append(f"--concurrency={args.concurrency}")
    app.worker_main(argv)
    return 0
