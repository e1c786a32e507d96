"""Metrics recorded where the work happens (docs/operations.md, "Metrics"), read the way Prometheus reads
them: over HTTP from a real `dcs worker` (prefork, multiprocess mode) and from a trainer's own endpoint.
Also: a save that committed and was since removed by retention still waits successfully (saved through an
in-process committer, `inline`: the trainer's handle is under test, not the worker)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.config import DCSConfig
from dcs_tasks.metrics import get_metrics
from tests.checkpoint_support import Inline, ckpt_config, start_worker, training_state, wait_until
from tests.helpers.ports import free_port
from tests.helpers.procs import CoordinatorProcess, WorkerProcess

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})? (?P<value>\S+)")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def value(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples named `name` whose labels include `labels` (None: no such sample)."""
    found = None
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        if all(f'{k}="{v}"' in (match["labels"] or "") for k, v in labels.items()):
            found = (found or 0.0) + float(match["value"])
    return found


def sample_names(text: str) -> set[str]:
    return {m["name"] for m in map(SAMPLE.match, text.splitlines()) if m}


@pytest.fixture
def metrics_worker(dcs_config: DCSConfig, tmp_path: Path) -> Iterator[tuple[DCSConfig, int]]:
    """A prefork worker exporting its metrics on a free port; yields (trainer config, worker metrics port)."""
    port = free_port()
    config = ckpt_config(dcs_config, tmp_path, enable_metrics=True, metrics_port=port)
    prom = tmp_path / "prom"
    worker = WorkerProcess(config, tmp_path / "worker.log", env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}).start()
    try:
        wait_until(lambda: _answers(port), 30, "the worker's metrics endpoint")
        yield config, port
    finally:
        worker.discard()


def _answers(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


def test_the_worker_exports_durable_saves_and_its_errors(metrics_worker: tuple[DCSConfig, int]) -> None:
    config, port = metrics_worker
    before = scrape(port)
    for error_type in ("checkpoint_persist", "checkpoint_commit", "task_retry", "task_failed"):
        assert value(before, "dcs_errors_total", error_type=error_type) == 0.0, error_type  # listed before any
    assert value(before, "dcs_bytes_saved_total") == 0.0 and value(before, "dcs_save_latency_seconds_count") == 0.0

    with Checkpointer("honest", config) as ckpt:
        began = time.monotonic()
        info = ckpt.save(training_state(width=256), step=1).wait(60)
        waited = time.monotonic() - began
    wait_until(lambda: value(scrape(port), "dcs_save_operations_total") == 1.0, 30, "the durable save")
    text = scrape(port)
    assert value(text, "dcs_bytes_saved_total") == info.nbytes  # the committed bytes, counted once
    assert value(text, "dcs_save_latency_seconds_count") == 1.0
    latency = value(text, "dcs_save_latency_seconds_sum")
    assert latency is not None and 0.0 < latency <= waited + 1.0  # begin -> commit, within what the trainer saw
    assert value(text, "dcs_ckpt_commit_seconds_count") == 1.0

    # a malformed persist payload fails for good in the worker: counted by type where it happened
    app = make_celery(config)
    app.send_task(TaskName.PERSIST.value, args=[{"ref": "not a ref"}], queue=node_queue(config.host_name))
    wait_until(lambda: value(scrape(port), "dcs_errors_total", error_type="checkpoint_persist") == 1.0, 30, "the error")
    assert value(scrape(port), "dcs_errors_total", error_type="task_failed") == 0.0  # not counted twice
    app.close()


def test_pending_operations_is_zero_once_wait_returns(dcs_config: DCSConfig, tmp_path: Path) -> None:
    registry = get_metrics().registry

    def pending() -> float:
        return registry.get_sample_value("dcs_pending_operations") or 0.0

    # a worker paced at 64 KiB/s (each ~60 KB save takes about a second): both saves are still in flight when the
    # gauge is first read. Unpaced, a worker on a loaded machine once committed the first before that read.
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=64 * 1024)
    worker = start_worker(config, tmp_path)
    try:
        base = pending()
        ckpt = Checkpointer("gauge-now", config)
        first, second = ckpt.save(training_state(width=64), step=1), ckpt.save(training_state(width=64), step=2)
        assert pending() == base + 2
        first.wait(60)
        assert pending() == base + 1  # no later save() or close() needed for the gauge to move
        second.wait(60)
        assert pending() == base
        ckpt.close()
        assert pending() == base
    finally:
        worker.discard()


def test_a_trainer_serves_its_metrics_when_asked(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCS_TRAINER_METRICS_PORT: the trainer's stall, staged bytes and saves in flight over HTTP on 127.0.0.1;
    the in-flight gauge is refreshed at each scrape, so it reaches 0 while the trainer polls nothing."""
    from dcs_tasks.checkpoint.telemetry import stop_trainer_metrics

    port = free_port()
    # a slow worker (2 MiB/s): the save is still in flight at the first scrape
    throttle = 2 * 1024 * 1024
    config = ckpt_config(
        dcs_config, tmp_path, persist_throttle_bytes_per_second=throttle, enable_metrics=True, trainer_metrics_port=port
    )
    for name, env_value in config.to_env().items():  # DCS_TRAINER_METRICS_PORT among them: the trainer's setting
        monkeypatch.setenv(name, env_value)
    worker = start_worker(config, tmp_path)
    try:
        ckpt = Checkpointer("trainer-endpoint", config)
        text = scrape(port)  # this test process's values so far (earlier tests saved in it too)
        stalls, staged, pending, saves = (
            value(text, name) or 0.0
            for name in (
                "dcs_ckpt_stall_seconds_count",
                "dcs_ckpt_staged_bytes_total",
                "dcs_pending_operations",
                "dcs_save_operations_total",  # in-process committers of earlier tests counted theirs here
            )
        )
        state = training_state(width=700)  # ~4 MiB of tensors: ~2 s at the throttle
        ckpt.save(state, step=1)
        text = scrape(port)
        assert value(text, "dcs_pending_operations") == pending + 1
        assert value(text, "dcs_ckpt_stall_seconds_count") == stalls + 1
        assert (value(text, "dcs_ckpt_staged_bytes_total") or 0.0) - staged >= 4 * 1024 * 1024
        # a save is counted by the worker that commits it, never by the trainer that staged it
        assert (value(text, "dcs_save_operations_total") or 0.0) == saves
        wait_until(lambda: value(scrape(port), "dcs_pending_operations") == pending, 60, "the commit seen by a scrape")
        ckpt.close()
        with pytest.raises(OSError):  # bound to loopback only
            urllib.request.urlopen(f"http://{_non_loopback_address()}:{port}/metrics", timeout=2)
    finally:
        stop_trainer_metrics()
        worker.discard()


def _non_loopback_address() -> str:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: picks the address of the default route
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("this host has no non-loopback address to probe the binding with")
    return address


def test_wait_on_a_save_retention_removed_returns_what_it_committed(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path, keep_last=2)
    with Checkpointer("retained", config, celery_app=inline(config)) as ckpt:
        pendings = [ckpt.save(training_state(seed=s, width=32), step=s, metadata={"s": s}) for s in range(6)]
        pendings[-1].wait(60)
        wait_until(lambda: [i.step for i in ckpt.list()] == [4, 5], 60, "retention to keep the newest 2")
        infos = [p.wait(60) for p in pendings]  # every save committed: none may raise
    assert [i.step for i in infos] == list(range(6))
    assert [i.removed for i in infos] == [True] * 4 + [False] * 2
    assert all(i.metadata == {"s": i.step} and i.files >= 1 for i in infos)
    # the same tensors every step: the ledger's bytes are the step's; they differ only by header bytes when
    # the layout moves tensors seen changing into files of their own (incremental saves)
    sizes = [i.nbytes for i in infos]
    assert min(sizes) > 0 and max(sizes) - min(sizes) <= 4096, sizes


def test_the_grafana_dashboard_uses_only_exported_metrics(
    metrics_worker: tuple[DCSConfig, int], tmp_path: Path
) -> None:
    """compose/grafana/dcs.json is valid JSON and every metric its panels query is in a real scrape of a
    worker, a trainer (DCS_TRAINER_METRICS_PORT) or a coordinator after a save."""
    from dcs_tasks.checkpoint.telemetry import serve_trainer_metrics, stop_trainer_metrics

    config, worker_port = metrics_worker
    dashboard = json.loads((REPO / "compose" / "grafana" / "dcs.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\bdcs_[a-z0-9_]+", target["expr"])
    }
    assert len(queried) >= 10
    coordinator = CoordinatorProcess(config, tmp_path / "coordinator.log").start()
    trainer_port = free_port()
    try:
        serve_trainer_metrics(config.model_copy(update={"trainer_metrics_port": trainer_port}))
        with Checkpointer("dashboard", config) as ckpt:
            ckpt.save(training_state(width=32), step=1).wait(60)
            ckpt.restore(1)
        wait_until(lambda: value(scrape(worker_port), "dcs_save_operations_total") == 1.0, 30, "the save")
        with urllib.request.urlopen(f"{coordinator.url}/healthz", timeout=10):
            pass
        exported = sample_names(scrape(worker_port)) | sample_names(scrape(trainer_port))
        exported |= sample_names(scrape(coordinator.port))
        assert queried <= exported, sorted(queried - exported)
    finally:
        stop_trainer_metrics()
        coordinator.stop()
