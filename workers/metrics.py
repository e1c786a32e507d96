"""Prometheus in prefork workers (multiprocess mode), per docs/reliability.md.

`prepare_multiprocess_dir` runs in `dcs worker` BEFORE prometheus_client is imported (it picks its value
store at import): it sets `PROMETHEUS_MULTIPROC_DIR` (kept if the operator set it, else a per-host
directory under the system temp dir) and wipes it, so samples of a previous run never leak in. Every
prefork child then writes its samples there; `mark_dead` (on child exit) drops the gauges of a dead
child; `start_exporter` serves the aggregate of all processes on `config.metrics_port`, after creating every
family a worker records (`dcs_errors_total` with each worker error type at 0 included), so a scrape lists
them before the first save or failure (docs/operations.md, "Metrics").
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from dcs_tasks.config import DCSConfig

log = logging.getLogger(__name__)
ENV = "PROMETHEUS_MULTIPROC_DIR"
# error types a worker records: checkpoint_* by the checkpoint tasks' give_up, task_* by workers.base.DCSTask
WORKER_ERROR_TYPES = ("checkpoint_persist", "checkpoint_commit", "checkpoint_replica", "task_retry", "task_failed")


def prepare_multiprocess_dir(config: DCSConfig) -> Path | None:
    """Set and wipe the multiprocess directory (None when metrics are disabled)."""
    if not config.enable_metrics:
        return None
    default = Path(tempfile.gettempdir()) / f"dcs-prometheus-{config.namespace}-{config.host_name}"
    directory = Path(os.environ.get(ENV) or default)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(directory)
    return directory


def mark_dead(pid: int) -> None:
    if os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def start_exporter(config: DCSConfig) -> None:
    """Serve every worker process's metrics on `metrics_host`:`metrics_port` (a busy port only logs a warning)."""
    if not (config.enable_metrics and os.environ.get(ENV) and config.metrics_port):
        return
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    create_worker_families()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    try:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
    except OSError as exc:
        log.warning("worker metrics not exported: port %d unavailable (%s)", config.metrics_port, exc)


def create_worker_families() -> None:
    """Create (at 0) the families a worker records, in this process's multiprocess files."""
    from dcs_tasks.checkpoint.telemetry import ensure_stage_metrics
    from dcs_tasks.metrics import get_metrics

    metrics = get_metrics()
    for error_type in WORKER_ERROR_TYPES:
        metrics.errors.labels(error_type=error_type)
    ensure_stage_metrics()
