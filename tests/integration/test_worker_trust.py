"""Hostile checkpoint tasks pushed through the real broker to a real `dcs worker`: a payload naming a path
outside the worker's configured roots is refused with a named error, once (never retried), fails its
ledger step when it names one, and reads or writes nothing outside the roots; the worker keeps serving. One worker
serves the module (`tests.helpers.module_worker`; none of these tests needs a fresh one), so each test uses runs of
its own names under the shared root; the redelivery test starts its own (throttled) worker."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from dcs_tasks import Checkpointer
from dcs_tasks.celery_app import TaskName, make_celery, node_queue
from dcs_tasks.checkpoint.format.layout import FileEntry, ManifestDraft
from dcs_tasks.checkpoint.store.ledger.stepledger import FileOutcome, StepLedger, StepStatus, file_entry_json
from dcs_tasks.checkpoint.store.writes.durable import file_checksum
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointFailed, SettingsMismatch
from dcs_tasks.keys import Keys
from tests.checkpoint_support import assert_same_state, ckpt_config, start_worker, training_state, wait_until
from tests.helpers.module_worker import ModuleWorker, module_worker
from tests.helpers.procs import WorkerProcess
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration

FILE = "model-00001-of-00001.safetensors"
TOKEN = "f" * 32


class Scene:
    """A worker on private roots, a directory outside them holding a sentinel file, and the ledger."""

    def __init__(self, config: DCSConfig, tmp_path: Path, worker: WorkerProcess) -> None:
        self.config, self.worker = config, worker
        self.root = Path(config.checkpoint.dir).resolve()
        self.staging = Path(config.host.staging_dir)
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        self.sentinel = self.outside / "secret.txt"
        self.sentinel.write_text("do not copy me\n")
        self.sentinel_stat = (self.sentinel.read_bytes(), self.sentinel.stat().st_mtime_ns)
        self.client = redis.Redis.from_url(config.redis.url, decode_responses=True)
        self.keys = Keys(config.redis.namespace)
        self.book = StepLedger(self.client, self.keys)
        self.app: Celery = make_celery(config)
        self.queue = node_queue(config.host_name)

    def begin(self, run: str, step: int, nfiles: int = 1) -> None:
        draft = ManifestDraft(run=run, step=step, tensors={}, structure={"k": "v", "v": None}, created_at=time.time())
        assert self.book.begin(run, step, TOKEN, nfiles, draft, 3600.0).value == "write"

    def send(self, task: TaskName, payload: dict[str, Any]) -> AsyncResult:
        return self.app.send_task(task.value, args=[payload], queue=self.queue)

    def refused(self, result: AsyncResult, error: str, match: str) -> None:
        """The task failed with `error` (class name) whose message contains `match`, and ran exactly once."""
        with pytest.raises(Exception) as info:
            result.get(timeout=30)
        assert type(info.value).__name__ == error, f"{type(info.value).__name__}: {info.value}"
        assert match in str(info.value), str(info.value)
        assert self.client.get(self.keys.task_deliveries(f"{result.id}:0")) == "1"
        assert not self.client.exists(self.keys.task_deliveries(f"{result.id}:1")), "the task was retried"
        assert f"[{result.id}] retry" not in self.worker.log_tail(10**6)

    def assert_outside_untouched(self, expected: set[str]) -> None:
        found = {str(p.relative_to(self.outside)) for p in self.outside.rglob("*")}
        assert found == expected
        assert (self.sentinel.read_bytes(), self.sentinel.stat().st_mtime_ns) == self.sentinel_stat

    def failed_with(self, run: str, step: int, error: str) -> None:
        """The ledger step is FAILED with a reason naming `error` (the worker records it just after the result)."""
        ended = (StepStatus.FAILED, StepStatus.COMMITTED)
        wait_until(lambda: self.book.progress(run, step)[0] in ended, 10, f"step {step} of {run!r} to end")
        status, _, _, reason = self.book.progress(run, step)
        assert status is StepStatus.FAILED and error in reason, (status, reason)


def persist_payload(run: str, step: int, step_dir: str, staging: str, length: int = 16) -> dict[str, Any]:
    ref = {"run": run, "step": step, "token": TOKEN, "step_dir": step_dir}
    return {"ref": ref, "file_name": FILE, "staging_path": staging, "offset": 0, "length": length}


def _private_staging(base: DCSConfig, tmp: Path) -> DCSConfig:
    config = ckpt_config(base, tmp)
    Path(config.host.staging_dir).mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as the worker checks
    return config


@pytest.fixture(scope="module")
def served(
    shared_redis: tuple[RedisServer, Iterator[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModuleWorker]:
    with module_worker(shared_redis, tmp_path_factory, "trust", prepare=_private_staging) as module:
        yield module


@pytest.fixture
def scene(served: ModuleWorker, tmp_path: Path) -> Scene:
    return Scene(served.config, tmp_path, served.worker)


def test_persist_tasks_naming_paths_outside_the_roots_are_refused_once(scene: Scene) -> None:
    root, outside, staging = scene.root, scene.outside, scene.staging
    (root / "evil").parent.mkdir(parents=True, exist_ok=True)
    (root / "evil").symlink_to(outside, target_is_directory=True)  # a run directory that leads out
    buffer_name = f"dcs-{scene.config.redis.namespace}-victim-{os.getpid()}-0123abcd-0.stage"
    (staging / buffer_name).symlink_to(scene.sentinel)  # a "staging buffer" that leads out
    victim = str(root / "victim")

    def buf(run: str) -> str:  # a staging path that looks right (whether or not the file exists)
        return str(staging / f"dcs-{scene.config.redis.namespace}-{run}-1-0123abcd-0.stage")

    untrusted = "UntrustedPath"
    cases = [  # (run, step, step_dir, staging_path, error, what the message says)
        ("victim", 1, str(outside / "step-000000001"), "/etc/passwd", untrusted, "not in the staging directory"),
        ("victim", 2, str(outside / "step-000000002"), buf("victim"), untrusted, "outside the checkpoint root"),
        ("victim", 3, f"{victim}/step-000000003", str(scene.sentinel), untrusted, "not in the staging directory"),
        ("victim", 4, f"{victim}/step-000000004", str(staging / buffer_name), untrusted, "is a symlink"),
        ("victim", 5, f"{victim}/../../outside/step-000000005", buf("victim"), "InvalidTaskPayload", "'..'"),
        ("evil", 6, str(root / "evil" / "step-000000006"), buf("evil"), untrusted, "outside the checkpoint root"),
        ("victim", 7, str(root / "other" / "step-000000007"), buf("victim"), untrusted, "is not where step 7"),
        ("victim", 8, f"{victim}/step-000000008", buf("other"), untrusted, "not a staging buffer of run 'victim'"),
    ]
    for run, step, step_dir, staging_path, error, match in cases:
        scene.begin(run, step)
        result = scene.send(TaskName.PERSIST, persist_payload(run, step, step_dir, staging_path))
        scene.refused(result, error, match)
        scene.failed_with(run, step, error)  # the waiting trainer would get the reason
    scene.begin("victim", 9)  # a file name that would climb out: refused, and the step fails without it
    climb = {**persist_payload("victim", 9, f"{victim}/step-000000009", buf("victim")), "file_name": "../x.safetensors"}
    scene.refused(scene.send(TaskName.PERSIST, climb), "InvalidTaskPayload", "file_name")
    scene.failed_with("victim", 9, "InvalidTaskPayload")
    scene.begin("victim", 10)  # an offset no staging region has (mmap would refuse it: an OSError, retried)
    unaligned = {**persist_payload("victim", 10, f"{victim}/step-000000010", buf("victim")), "offset": 100}
    scene.refused(scene.send(TaskName.PERSIST, unaligned), "InvalidTaskPayload", "offset 100")
    scene.failed_with("victim", 10, "InvalidTaskPayload")
    dotdot = persist_payload("..", 1, f"{root}/../step-000000001", "/etc/passwd")
    scene.refused(scene.send(TaskName.PERSIST, dotdot), "InvalidTaskPayload", "run name")

    scene.assert_outside_untouched({"secret.txt"})
    assert not (root / "victim").exists() and not (root.parent / "step-000000001").exists()
    assert not list(root.parent.glob("latest")) and not list(root.glob("latest"))
    with Checkpointer("legit", scene.config) as ckpt:  # the worker still serves a real save
        state = training_state()
        ckpt.save(state, step=1).wait(60)
        assert_same_state(state, ckpt.restore().state)


def test_commit_and_retention_tasks_outside_the_root_change_nothing(scene: Scene) -> None:
    root, outside = scene.root, scene.outside
    decoy = outside / "step-000000003"  # what a commit would accept: the file it expects, at its size
    decoy.mkdir()
    (decoy / FILE).write_bytes(b"x" * 16)
    scene.begin("intruder", 3)
    assert scene.book.claim_file("intruder", 3, TOKEN, FILE, "tid").value == "write"
    entry = file_entry_json(FileEntry(name=FILE, size=16, checksum="0" * 32))
    assert scene.book.finish_file("intruder", 3, TOKEN, FILE, FileOutcome.OK, entry).status is StepStatus.COMMITTING
    commit = {"ref": {"run": "intruder", "step": 3, "token": TOKEN, "step_dir": str(decoy)}}
    scene.refused(scene.send(TaskName.COMMIT, commit), "UntrustedPath", "outside the checkpoint root")
    scene.failed_with("intruder", 3, "UntrustedPath")

    with Checkpointer("keep", scene.config) as ckpt:  # three committed steps, copied outside the root
        for step in (1, 2, 3):
            ckpt.save(training_state(seed=step), step=step).wait(60)
    shutil.copytree(root / "keep", outside / "keep")
    before = sorted(p.name for p in (outside / "keep").iterdir())
    policy = {"keep_last": 1, "keep_every": None}
    for run, run_dir, match in (
        ("keep", str(outside / "keep"), "outside the checkpoint root"),
        ("other", str(root / "keep"), "is not where run 'other' lives"),
        ("keep", str(root), "outside the checkpoint root"),
    ):
        retention = {"run": run, "run_dir": run_dir, "policy": policy}
        scene.refused(scene.send(TaskName.RETENTION, retention), "UntrustedPath", match)
    assert sorted(p.name for p in (outside / "keep").iterdir()) == before
    assert len(list((root / "keep").glob("step-*"))) == 3

    scene.assert_outside_untouched({"secret.txt", "step-000000003", f"step-000000003/{FILE}", *_tree(outside, "keep")})
    legit = {"run": "keep", "run_dir": str(root / "keep"), "policy": policy}  # the worker still serves
    assert scene.send(TaskName.RETENTION, legit).get(timeout=30) == [1, 2]


def _tree(base: Path, name: str) -> set[str]:
    return {str(p.relative_to(base)) for p in [base / name, *(base / name).rglob("*")]}


def test_a_trainer_whose_checkpoint_dir_the_worker_does_not_serve_gets_the_reason(scene: Scene, tmp_path: Path) -> None:
    """A trainer configured with another checkpoint root than its worker: the Checkpointer refuses at construction,
    naming both roots (`dcs_tasks.checkpoint.agreement`; the worker would refuse every step as UntrustedPath, which
    the payload tests above check), and nothing appears in either place."""
    elsewhere = tmp_path / "elsewhere"
    trainer_config = scene.config.model_copy(update={"checkpoint_dir": elsewhere})
    with pytest.raises(SettingsMismatch, match=r"checkpoint_dir: this trainer uses .*elsewhere, the worker uses"):
        Checkpointer("astray", trainer_config)
    assert not (elsewhere / "astray").exists() and not (scene.root / "astray").exists()


def test_a_persist_into_a_step_committed_on_disk_is_refused_and_writes_nothing(scene: Scene) -> None:
    """The ledger forgot a committed step (its record expired, or Redis lost its data) and a new attempt at the
    same step begins: the worker refuses to write into the committed step's directory."""
    run, step = "kept", 4
    step_dir = scene.root / run / f"step-{step:09d}"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text('{"committed": "before"}')
    (step_dir / FILE).write_bytes(b"committed bytes")
    staging = scene.staging / f"dcs-{scene.config.redis.namespace}-{run}-{os.getpid()}-0123abcd-0.stage"
    staging.write_bytes(b"\x01" * 4096)
    scene.begin(run, step)
    result = scene.send(TaskName.PERSIST, persist_payload(run, step, str(step_dir), str(staging)))
    with pytest.raises(CheckpointFailed, match="already committed"):
        result.get(timeout=30)
    scene.failed_with(run, step, "already committed")
    assert (step_dir / FILE).read_bytes() == b"committed bytes"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted([FILE, "manifest.json"])


def test_a_redelivery_overlapping_the_first_never_replaces_the_file_it_recorded(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    """Two deliveries of one persist task (a retry beside the restored original: same task id) write at once.
    The first records the file and the step commits; the save's staging buffer is then free and reused (here:
    overwritten), while the second delivery is still reading it. The second must drop its copy instead of
    renaming it over the committed file: the committed bytes stay the first delivery's."""
    config = ckpt_config(dcs_config, tmp_path, persist_throttle_bytes_per_second=32 * 1024)
    Path(config.host.staging_dir).mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as the worker checks
    worker = start_worker(config, tmp_path)  # two pool processes: both deliveries run at once
    try:
        scene = Scene(config, tmp_path, worker)
        run, step = "twice", 1
        step_dir = scene.root / run / f"step-{step:09d}"
        staging = scene.staging / f"dcs-{config.redis.namespace}-{run}-{os.getpid()}-0123abcd-0.stage"
        saved = bytes(range(256)) * 1024  # 256 KiB: ~8 s per delivery at 32 KiB/s
        staging.write_bytes(saved)
        scene.begin(run, step)
        payload = persist_payload(run, step, str(step_dir), str(staging), length=len(saved))

        def send() -> None:
            scene.app.send_task(TaskName.PERSIST.value, args=[payload], queue=scene.queue, task_id="persist-twice")

        def temps() -> list[Path]:
            return list(step_dir.glob(".*.tmp")) if step_dir.exists() else []

        def written() -> int:  # the furthest temp file (one may be renamed away between listing and stat)
            sizes = [0]
            for temp in temps():
                with contextlib.suppress(FileNotFoundError):
                    sizes.append(temp.stat().st_size)
            return max(sizes)

        send()
        # two of its 64 KiB chunks: the first is written at once and the second after a 2 s pause, so the second
        # delivery runs ~2 s behind (after the first chunk only, it ran ~0.1 s behind, and under load both
        # published before either's record was seen: no copy was dropped)
        wait_until(lambda: written() >= 128 * 1024, 30, "the first delivery's write")
        send()  # the same task id, ~2 s behind: it starts well before the first ends, even on a loaded machine
        wait_until(lambda: len(temps()) == 2, 30, "both deliveries writing at once")
        wait_until(lambda: scene.book.progress(run, step)[0] is StepStatus.COMMITTED, 30, "the step's commit")
        committed = (step_dir / FILE).stat().st_ino
        staging.write_bytes(bytes(reversed(saved)))  # the buffer reused by the next save
        wait_until(lambda: not temps(), 30, "the second delivery to end")
        assert (step_dir / FILE).read_bytes() == saved
        assert (step_dir / FILE).stat().st_ino == committed  # never replaced
        wait_until(lambda: "this copy dropped" in worker.log_tail(10**6), 10, "the second delivery's log line")
        recorded = scene.book.read(run, step).files[FILE]
        assert recorded.size == len(saved) and recorded.checksum == file_checksum(step_dir / FILE)
    finally:
        worker.discard()
