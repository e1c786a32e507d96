"""Prometheus in prefork workers (multiprocess mode), per docs/reliability.md.

`prepare_multiprocess_dir` runs in `dcs worker` before the task modules import prometheus_client (it picks its
value store at import; `follow_multiprocess_env` switches it where it was imported first): it sets
`PROMETHEUS_MULTIPROC_DIR`. One the operator set is kept and wiped, so samples of a
previous run never leak in. Otherwise each worker process tree gets a directory of its own, created 0700 under
the system temp dir and named after the worker's pid plus a random part (`dcs-prometheus-<namespace>-<host>-
<pid>-<random>`), so two workers of one host (two stacks, two namespaces alike) never read each other's
samples; it is removed when the worker exits (`remove_own_dir`), and those of workers that died without
exiting (kill -9) are removed by the next worker's start (`remove_stale_dirs`) or `dcs clean`. A re-exec'd
worker (workers/restart.py) replaces its own directory by a fresh one. Every prefork child then writes its
samples there; `mark_dead` (on child exit) drops the gauges of a dead child; `start_exporter` serves the
aggregate of all processes on `config.metrics.port`, after creating every family a worker records
(`dcs_errors_total` with each worker error type at 0 included), so a scrape lists them before the first save
or failure (docs/operations.md, "Metrics").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dcs_tasks import metricsdir
from dcs_tasks.config import DCSConfig

log = logging.getLogger(__name__)
ENV = "PROMETHEUS_MULTIPROC_DIR"
OWNED_ENV = "_DCS_OWN_PROMETHEUS_DIR"  # set beside ENV when the directory is the worker's own (made here)
# error types a worker records: checkpoint_* by the checkpoint tasks' give_up, task_* by workers.taskbase.DCSTask
WORKER_ERROR_TYPES = ("checkpoint_persist", "checkpoint_commit", "checkpoint_replica", "task_retry", "task_failed")


def prepare_multiprocess_dir(config: DCSConfig) -> Path | None:
    """Set the multiprocess directory (None when metrics are disabled): the operator's, wiped, or a fresh private
    one of this worker process tree's, removed at its exit (module docstring)."""
    if not config.metrics.enable_metrics:
        return None
    given = os.environ.get(ENV)
    if given and given != os.environ.get(OWNED_ENV):  # the operator's: used as it is, emptied
        directory = Path(given)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        follow_multiprocess_env()
        return directory
    if given:  # this process's own, from before a re-exec (same pid): a fresh one replaces it
        shutil.rmtree(given, ignore_errors=True)
    base = Path(tempfile.gettempdir())
    remove_stale_dirs(base)
    prefix = f"{metricsdir.PREFIX}{config.redis.namespace}-{config.host_name}-{os.getpid()}-"
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=base))  # 0700, a name nobody else holds
    os.environ[ENV] = os.environ[OWNED_ENV] = str(directory)
    atexit.register(remove_own_dir, directory, os.getpid())
    follow_multiprocess_env()
    return directory


def follow_multiprocess_env() -> None:
    """Make prometheus_client's value store follow `PROMETHEUS_MULTIPROC_DIR` as it is now, in a process that
    imported prometheus_client before the variable was set (one that embeds the worker, or a test's process forked
    from a preloaded parent): it picks the store at import, and the metrics made afterwards use the new one."""
    import sys

    if "prometheus_client.values" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def remove_own_dir(directory: Path, owner_pid: int) -> None:
    """Remove this worker's own directory: only from the process that made it (a forked pool child inherits the
    atexit hook and must not remove its parent's samples) and only while the environment still names it."""
    if os.getpid() == owner_pid and os.environ.get(OWNED_ENV) == str(directory):
        shutil.rmtree(directory, ignore_errors=True)


def remove_stale_dirs(base: Path) -> list[Path]:
    """Remove the per-worker directories under `base` whose worker is gone (`metricsdir.gone_workers_dirs`: this
    user's own, never a symlink, of a pid that no longer exists). Returns those removed."""
    removed = []
    for path in metricsdir.gone_workers_dirs(base):
        with contextlib.suppress(OSError):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def mark_dead(pid: int) -> None:
    if os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def start_exporter(config: DCSConfig) -> None:
    """Serve every worker process's metrics on `metrics_host`:`metrics_port` (a busy port only logs a warning)."""
    if not (config.metrics.enable_metrics and os.environ.get(ENV) and config.metrics.port):
        return
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    create_worker_families()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    try:
        start_http_server(config.metrics.port, addr=config.metrics.host, registry=registry)
    except OSError as exc:
        log.warning("worker metrics not exported: port %d unavailable (%s)", config.metrics.port, exc)


def create_worker_families() -> None:
    """Create (at 0) the families a worker records, in this process's multiprocess files."""
    from dcs_tasks.checkpoint.telemetry import ensure_stage_metrics
    from dcs_tasks.metrics import get_metrics

    metrics = get_metrics()
    for error_type in WORKER_ERROR_TYPES:
        metrics.errors.labels(error_type=error_type)
    ensure_stage_metrics()
