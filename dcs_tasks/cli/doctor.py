"""`dcs doctor`: the checks a trainer's saves depend on, run from the trainer's environment, each printed as
`ok` or `FAIL` with what is wrong and how to fix it. Exit status 1 when any check fails, 0 otherwise.

Checks: the settings parse (done by `dcs` itself), Redis answers, a `dcs worker` serves this host's node queue,
the worker's published settings agree with these (`dcs_tasks.checkpoint.agreement`), and the start-up checks a
worker runs (`dcs_tasks.checkpoint.preflight`: memory tier capacity, checkpoint root writable, object store
reachable), here as this user and read-only against an object store. Secrets are never printed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import redis

from dcs_tasks.celery_app import node_queue
from dcs_tasks.checkpoint import agreement, preflight
from dcs_tasks.config import DCSConfig, mask_url_credentials
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

REDIS_TIMEOUT_SECONDS = 3.0


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "doctor", help="check Redis, this host's worker, settings agreement, memory tier, checkpoint root, S3"
    )
    parser.set_defaults(func=run)


def _redis_findings(config: DCSConfig) -> list[preflight.Finding]:
    """Redis answers; a worker serves this host; its settings agree with `config`."""
    shown = mask_url_credentials(config.redis.url)
    queue = node_queue(config.host_name)
    client = sync_client(config, socket_timeout=min(REDIS_TIMEOUT_SECONDS, config.redis.socket_timeout_seconds))
    try:
        client.ping()
        present = bool(client.exists(Keys(config.redis.namespace).worker_presence(queue)))
        theirs = agreement.read_published(client, Keys(config.redis.namespace), queue)
    except redis.RedisError as exc:
        fix = "check DCS_REDIS_URL (after `dcs up`: `set -a; . .dcs-run/dcs.env; set +a`) and that Redis runs"
        reason = config.scrub(str(exc)).rstrip(".")[:200]
        return [preflight.Finding("redis reachable", shown, f"{reason}. Fix: {fix}")]
    finally:
        client.close()
    found = [preflight.Finding("redis reachable", shown)]
    if not present:
        fix = "start `dcs worker` (or `dcs up`) on this host with the same DCS_NAMESPACE and DCS_NODE_NAME"
        found.append(preflight.Finding("worker serves this host", queue, f"no live worker consumes {queue}. {fix}"))
        return found
    found.append(preflight.Finding("worker serves this host", queue))
    if theirs is None:
        found.append(preflight.Finding("settings agree", "the worker publishes no settings (an older worker)"))
        return found
    lines = agreement.disagreements(agreement.effective(config), theirs)
    found.append(preflight.Finding("settings agree", theirs.worker, "\n        ".join(lines)))
    return found


def findings(config: DCSConfig) -> list[preflight.Finding]:
    return _redis_findings(config) + preflight.run_checks(config, write=False)


def run(args: argparse.Namespace) -> int:
    config = DCSConfig()
    results = findings(config)
    for found in results:
        mark = "ok  " if found.ok else "FAIL"
        print(f"{mark}  {found.check}: {config.scrub(found.detail)}")
        if not found.ok:
            print(f"      {config.scrub(found.problem)}")
    problems = sum(not found.ok for found in results)
    print(f"dcs doctor: {problems} problem(s)" if problems else "dcs doctor: everything checked is fine")
    sys.stdout.flush()
    return 1 if problems else 0
