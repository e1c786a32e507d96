"""Checkpoint metrics, registered next to the seed's metrics in `dcs_tasks.metrics.get_metrics()`.

The seed's collector covers save/load latency, bytes and errors; the pipeline stages it lacks (trainer
stall, persist and commit latency) are added to the same registry on first use, so one scrape (or one
multiprocess directory, in workers) shows all of them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import Histogram

from dcs_tasks.metrics import LATENCY_BUCKETS, get_metrics

_lock = threading.Lock()


@dataclass(frozen=True)
class _StageMetrics:
    stall: Histogram
    persist: Histogram
    commit: Histogram


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
            )
        return _stages


def record_stall(seconds: float, nbytes: int) -> None:
    _stage_metrics().stall.observe(seconds)
    get_metrics().record_save(bytes_saved=nbytes, duration=seconds)


def record_persist(seconds: float) -> None:
    _stage_metrics().persist.observe(seconds)


def record_commit(seconds: float) -> None:
    _stage_metrics().commit.observe(seconds)


def record_load(seconds: float, nbytes: int) -> None:
    get_metrics().record_load(bytes_loaded=nbytes, duration=seconds)


def record_error(error_type: str) -> None:
    get_metrics().record_error(error_type)


class StagingGauges:
    """One checkpointer's share of the seed's `dcs_memory_buffer_usage_bytes` and `dcs_pending_operations`
    gauges. Several checkpointers in a process add up, so each moves the gauges by its own deltas."""

    def __init__(self) -> None:
        self._memory = 0
        self._pending = 0

    def memory(self, nbytes: int) -> None:
        get_metrics().memory_buffer_usage.inc(nbytes - self._memory)
        self._memory = nbytes

    def pending(self, count: int) -> None:
        get_metrics().pending_operations.inc(count - self._pending)
        self._pending = count
