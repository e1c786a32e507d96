"""Checkpoint metrics, registered next to the originally named ones in `dcs_tasks.metrics.get_metrics()`.

Each number is recorded in the process where its work happens (docs/operations.md, "Metrics"):

- trainer (`Checkpointer`): `dcs_ckpt_stall_seconds` and `dcs_ckpt_staged_bytes_total` (what save() cost the
  training loop), `dcs_load_*` / `dcs_bytes_loaded_total` (restores), `dcs_memory_buffer_usage_bytes` and
  `dcs_pending_operations` (saves not yet seen committed or failed, `pending.IN_FLIGHT`). A trainer serves
  them on `metrics_host`:`trainer_metrics_port` when that setting is non-zero (`DCS_TRAINER_METRICS_PORT`).
- worker (`dcs worker`): `dcs_ckpt_persist_seconds` (one file), `dcs_ckpt_commit_seconds` (one commit),
  `dcs_ckpt_replica_seconds` / `dcs_ckpt_replicated_bytes_total` (replicas, when `replica_dir` is set) and
  the durable save itself: `dcs_save_latency_seconds` (from the save's begin in the ledger, right after
  staging, to its commit), `dcs_bytes_saved_total`, `dcs_save_operations_total`; `dcs_errors_total`.

A save is counted once, by the worker that commits it, so trainer and worker scrapes add up without
counting anything twice.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from dcs_tasks.config import DCSConfig
from dcs_tasks.metrics import LATENCY_BUCKETS, MetricsServer, get_metrics, serve_metrics

log = logging.getLogger(__name__)
_lock = threading.Lock()
TRAINER_PORT_ENV = "DCS_TRAINER_METRICS_PORT"


@dataclass(frozen=True)
class _StageMetrics:
    stall: Histogram
    staged: Counter
    persist: Histogram
    commit: Histogram
    replica: Histogram
    replicated: Counter


_stages: _StageMetrics | None = None


def _stage_metrics() -> _StageMetrics:
    global _stages
    with _lock:
        if _stages is None:
            registry = get_metrics().registry
            _stages = _StageMetrics(
                stall=Histogram(
                    "dcs_ckpt_stall_seconds", "Trainer stall per save", buckets=LATENCY_BUCKETS, registry=registry
                ),
                staged=Counter(
                    "dcs_ckpt_staged_bytes", "Tensor bytes staged by the trainer's saves", registry=registry
                ),
                persist=Histogram(
                    "dcs_ckpt_persist_seconds",
                    "Worker time to persist one file",
                    buckets=LATENCY_BUCKETS,
                    registry=registry,
                ),
                commit=Histogram(
                    "dcs_ckpt_commit_seconds",
                    "Worker time to commit one step",
                    buckets=LATENCY_BUCKETS,
                    registry=registry,
                ),
                replica=Histogram(
                    "dcs_ckpt_replica_seconds",
                    "Worker time to copy, verify and publish one step's replica",
                    buckets=LATENCY_BUCKETS,
                    registry=registry,
                ),
                replicated=Counter("dcs_ckpt_replicated_bytes", "Bytes copied to the replica root", registry=registry),
            )
        return _stages


def ensure_stage_metrics() -> None:
    """Create the stage families now (a scrape then lists them at 0 before the first save)."""
    _stage_metrics()


def record_stall(seconds: float, nbytes: int) -> None:
    """Trainer: what one save() cost the training loop, and the bytes it staged (not yet durable)."""
    stages = _stage_metrics()
    stages.stall.observe(seconds)
    stages.staged.inc(nbytes)


def record_durable_save(nbytes: int, seconds: float) -> None:
    """Worker, at commit: a save is durable. `seconds` runs from its begin in the ledger to the commit."""
    get_metrics().record_save(bytes_saved=nbytes, duration=max(0.0, seconds))


def record_persist(seconds: float) -> None:
    _stage_metrics().persist.observe(seconds)


def record_commit(seconds: float) -> None:
    _stage_metrics().commit.observe(seconds)


def record_replica(seconds: float, nbytes: int) -> None:
    """Worker: one step replicated (`nbytes` copied; 0 when a redelivery found it done)."""
    stages = _stage_metrics()
    stages.replica.observe(seconds)
    stages.replicated.inc(nbytes)


def record_load(seconds: float, nbytes: int) -> None:
    get_metrics().record_load(bytes_loaded=nbytes, duration=seconds)


def record_error(error_type: str) -> None:
    get_metrics().record_error(error_type)


class StagingGauges:
    """One checkpointer's share of `dcs_memory_buffer_usage_bytes` (several checkpointers in a process add up,
    so each moves the gauge by its own deltas). Building one starts the trainer's metrics endpoint when
    `trainer_metrics_port` is set (in `config`, or in the environment when no config is given)."""

    def __init__(self, config: DCSConfig | None = None) -> None:
        self._memory = 0
        ensure_stage_metrics()
        serve_trainer_metrics(config)

    def memory(self, nbytes: int) -> None:
        get_metrics().memory_buffer_usage.inc(nbytes - self._memory)
        self._memory = nbytes

    def pending(self, count: int) -> None:
        """Kept for callers: `dcs_pending_operations` is now kept by `pending.IN_FLIGHT`, which drops a save the
        moment anything sees it finish (a checkpointer's own list keeps it until its next reap)."""


_server: MetricsServer | None = None


def serve_trainer_metrics(config: DCSConfig | None = None) -> MetricsServer | None:
    """Serve this process's metrics on `metrics_host`:`trainer_metrics_port` (once per process; None when the
    port is 0). Each scrape first refreshes `dcs_pending_operations` from Redis. A busy port only logs."""
    global _server
    if config is None:
        if not os.environ.get(TRAINER_PORT_ENV):
            return _server
        config = DCSConfig()  # the trainer's settings as its Checkpointer would read them
    if not (config.metrics.enable_metrics and config.metrics.trainer_metrics_port):
        return _server
    with _lock:
        if _server is None:
            from dcs_tasks.checkpoint.pending import IN_FLIGHT

            try:
                _server = serve_metrics(
                    config.metrics.host, config.metrics.trainer_metrics_port, before=IN_FLIGHT.refresh
                )
            except OSError as exc:
                log.warning(
                    "trainer metrics not served: port %d unavailable (%s)", config.metrics.trainer_metrics_port, exc
                )
        return _server


def stop_trainer_metrics() -> None:
    """Stop the trainer's metrics endpoint (tests; a process normally keeps it until it exits)."""
    global _server
    with _lock:
        if _server is not None:
            _server.close()
            _server = None
