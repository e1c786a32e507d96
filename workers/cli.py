"""`dcs worker`: a Celery worker consuming this host's node queue and the control queue."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from celery import signals

from dcs_tasks.config import DCSConfig
from workers import restart
from workers.prometheus import prepare_multiprocess_dir

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("worker", help="run a Celery worker for this host")
    parser.add_argument("--concurrency", "-c", type=int, default=None, help="worker processes (default: cores)")
    parser.add_argument("--node-name", default=None, help="host name for the node queue (default: hostname)")
    parser.add_argument("--loglevel", "-l", default="INFO")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="re-exec the worker after an unrecoverable crash (e.g. kombu failing while Redis restarts), "
        "at most this many times (default 5)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = {"node_name": args.node_name} if args.node_name else {}
    config = DCSConfig(**overrides)
    if not _private_dirs(config):
        return 1
    if not _preflight(config):
        return 1
    prepare_multiprocess_dir(config)  # before prometheus_client is imported (by the task modules)
    from workers.worker_app import make_worker_app

    app = make_worker_app(config)
    _restore_orphans(app, config)
    restart.lifecycle["max_restarts"] = args.max_restarts
    restart.lifecycle["stuck_stop_seconds"] = config.task.worker_stuck_stop_seconds
    signals.worker_ready.connect(restart.on_ready, weak=False)
    signals.worker_shutting_down.connect(restart.on_shutdown_requested, weak=False)
    worker_cls = app.subclass_with_self(restart.SelfRestartingWorker)  # its stop after a crash is bounded
    # What `celery worker -l LEVEL -P POOL -E --hostname=dcs@HOST --without-mingle --without-gossip [-c N]` makes,
    # made here without Celery's click command line: loading it imports every `celery.commands` plug-in (Flower
    # with Tornado among them), about 0.3 s of CPU at each start for options DCS never passes.
    worker = worker_cls(
        hostname=f"dcs@{config.host_name}",
        pool_cls=args.pool,
        loglevel=args.loglevel,
        concurrency=args.concurrency or None,
        task_events=True,
        without_mingle=True,
        without_gossip=True,
    )
    try:
        worker.start()
    finally:
        if restart.should_restart():
            restart.reexec(args.max_restarts - 1)
    return int(worker.exitcode or 0)


def _preflight(config: DCSConfig) -> bool:
    """The start-up checks (`dcs_tasks.checkpoint.preflight`): False, after one line on stderr, when the host
    cannot honour the settings; a problem that may pass (an object store down) is logged as a warning."""
    from dcs_tasks.checkpoint import preflight
    from dcs_tasks.errors import PreflightFailed

    try:
        findings = preflight.require(config)
    except PreflightFailed as exc:
        print(f"dcs worker: {config.scrub(str(exc))}", file=sys.stderr, flush=True)
        return False
    for found in findings:
        if not found.ok:
            log.warning("pre-flight: %s", config.scrub(found.problem))
    return True


def _private_dirs(config: DCSConfig) -> bool:
    """This user's host-local directories (the runtime directory, staging, the memory tier's when on), made
    private or checked (`dcs_tasks.hostdirs`): False, after one line on stderr naming the path, what is wrong
    and the fix, when one is another user's, a link or open to others (UnsafeHostDirectory)."""
    from dcs_tasks import hostdirs
    from dcs_tasks.errors import UnsafeHostDirectory

    try:
        hostdirs.private_root(config, create=True)
        hostdirs.staging_dir(config, create=True)
        if config.memory.budget_bytes > 0:
            hostdirs.memory_dir(config, create=True)
    except UnsafeHostDirectory as exc:
        print(f"dcs worker: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def _restore_orphans(app: Any, config: DCSConfig) -> None:
    """Take back this host's tasks that a killed worker left unacknowledged (see workers/recovery.py)."""
    from dcs_tasks.celery_app import node_queue
    from workers.recovery import restore_orphaned
    from workers.runtime import runtime

    rt = runtime()
    try:
        restore_orphaned(app, rt.redis, rt.keys, node_queue(config.host_name))
    except Exception as exc:  # recovery is an optimisation: the visibility timeout still brings them back
        log.warning("could not restore orphaned tasks at start-up: %s", exc)
