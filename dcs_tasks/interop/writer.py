"""Write a state as a committed step of a run without a worker (`dcs ckpt import`).

The same path a save takes, run in the calling process: `flatten_state` and `plan_layout` give the files'
bytes; the step is opened in the Redis ledger (`StepLedger.begin`: refused when the step is committed or
another save of it is in flight), each file is claimed, written by `durable.stream_region` (the persist
writer, `dcs_tasks.checkpoint.committer.write_file`: on files a temp name, O_DIRECT where allowed, xxh3_128
on the same pass, fsync, rename, directory fsync; in an object store a multipart upload) from a memfd holding
just that file, and recorded; then the commit is claimed and the step published exactly as the worker's
commit task does (`committer.publish_step`: the reader's own checks, manifest, `latest` forward only), and
the step is marked COMMITTED. On any failure the ledger step goes FAILED with the reason and the partial
step directory (never a committed one) is removed. Memory: one file of the layout at a time.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from typing import Any

import redis
import torch

from dcs_tasks import storage
from dcs_tasks.checkpoint import committer
from dcs_tasks.checkpoint.committer import ObjectLock, committed, publish_step, remove_partial_step
from dcs_tasks.checkpoint.format.layout import (
    FileEntry,
    FileLayout,
    Manifest,
    draft_of,
    plan_layout,
    specs_of,
    step_dir_name,
)
from dcs_tasks.checkpoint.restore.sharded import rank_dirs
from dcs_tasks.checkpoint.state.structure import flatten_state
from dcs_tasks.checkpoint.store.ledger import objlocks
from dcs_tasks.checkpoint.store.ledger.stepledger import FileOutcome, StepLedger, StepStatus, Verdict, file_entry_json
from dcs_tasks.checkpoint.store.payloads import validate_run_name, validate_step
from dcs_tasks.checkpoint.store.writes.durable import write_all
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointFailed
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from dcs_tasks.storage import Location, ObjectPath, store_of


def write_step(state: Any, *, run: str, step: int, config: DCSConfig, metadata: dict[str, Any]) -> Location:
    """Commit `state` as step `step` of `run` under `config.checkpoint.dir`; returns the step directory.
    CheckpointError when the name or step is invalid, the run is multi-rank, or the step exists or is in
    flight; StagingError (naming the path) for a value a checkpoint cannot hold; CheckpointFailed otherwise."""
    validate_run_name(run)
    validate_step(step)
    run_root = storage.root(config.checkpoint.dir, config) / run
    if rank_dirs(run_root):
        raise CheckpointError(f"run {run!r} is a multi-rank run: an import writes a single-rank step")
    step_dir = run_root / step_dir_name(step)
    if committed(step_dir):
        raise CheckpointError(f"step {step} of run {run!r} is already committed in {step_dir}")
    flat = flatten_state(state)
    layout = plan_layout(specs_of(flat.tensors), config.checkpoint.file_shard_bytes)
    draft = draft_of(run, step, layout, flat.structure, metadata)
    token = uuid.uuid4().hex
    client = sync_client(config, decode_responses=False)
    try:
        ledger = StepLedger(client, Keys(config.redis.namespace))
        verdict = ledger.begin(run, step, token, len(layout.files), draft, config.abandoned_save_seconds())
        if verdict is Verdict.COMMITTED:
            raise CheckpointError(f"step {step} of run {run!r} is already committed")
        if verdict is Verdict.BUSY:
            raise CheckpointError(f"step {step} of run {run!r} is being saved right now")
        keys = Keys(config.redis.namespace)

        def object_lock(where: ObjectPath, purpose: str) -> contextlib.AbstractContextManager[None]:
            return objlocks.run_lock(client, keys, where, purpose)

        _Commit(ledger, run, step, token, step_dir, object_lock).run(layout.files, flat.tensors)
    except redis.RedisError as exc:
        raise CheckpointFailed(
            f"import of step {step} of run {run!r} needs the Redis ledger (DCS_REDIS_URL), which failed: {exc}"
        ) from exc
    finally:
        client.close()
    return step_dir


class _Commit:
    """One fenced import attempt: files, then manifest and `latest`; FAILED in the ledger on any error."""

    def __init__(
        self, ledger: StepLedger, run: str, step: int, token: str, step_dir: Location, object_lock: ObjectLock
    ) -> None:
        self.ledger, self.run_name, self.step, self.token, self.step_dir = ledger, run, step, token, step_dir
        self.object_lock = object_lock
        self.task_id = f"dcs-import-{token}"

    def run(self, files: tuple[FileLayout, ...], tensors: dict[str, torch.Tensor]) -> None:
        try:
            store_of(self.step_dir).make_folder(self.step_dir)
            for f in files:
                self._file(f, tensors)
            self._commit()
        except BaseException as exc:
            self._fail(f"import failed: {type(exc).__name__}: {exc}")
            raise

    def _file(self, f: FileLayout, tensors: dict[str, torch.Tensor]) -> None:
        verdict = self.ledger.claim_file(self.run_name, self.step, self.token, f.name, self.task_id)
        if verdict is not Verdict.WRITE:
            raise CheckpointFailed(f"step {self.step} of run {self.run_name!r}: file {f.name} is {verdict.value}")
        entry = write_file(self.step_dir, f, tensors, self.task_id)
        self.ledger.finish_file(self.run_name, self.step, self.token, f.name, FileOutcome.OK, file_entry_json(entry))

    def _commit(self) -> None:
        verdict = self.ledger.claim_commit(self.run_name, self.step, self.token, self.task_id)
        if verdict is not Verdict.WRITE:
            raise CheckpointFailed(f"step {self.step} of run {self.run_name!r}: commit is {verdict.value}")
        state = self.ledger.read(self.run_name, self.step)
        files = [state.files[name] for name in sorted(state.files)]
        manifest = Manifest(**state.manifest_draft().model_dump(), files=files)
        publish_step(self.step_dir, manifest, self.task_id, object_lock=self.object_lock)
        self.ledger.finish_commit(self.run_name, self.step, self.token, StepStatus.COMMITTED, task_id=self.task_id)

    def _fail(self, reason: str) -> None:
        with contextlib.suppress(Exception):  # the original error is what the caller must see
            status = self.ledger.progress(self.run_name, self.step)[0]
            if status is StepStatus.PERSISTING:
                self.ledger.abandon(self.run_name, self.step, self.token, reason[:1000])
            elif status is StepStatus.COMMITTING:
                self.ledger.finish_commit(
                    self.run_name, self.step, self.token, StepStatus.FAILED, reason[:1000], task_id=self.task_id
                )
        with contextlib.suppress(Exception):
            remove_partial_step(self.step_dir)


def write_file(step_dir: Location, f: FileLayout, tensors: dict[str, torch.Tensor], tag: str) -> FileEntry:
    """Build file `f` (header, then each slot's bytes in order: `plan_layout` leaves no gaps) in an unlinked
    temporary file and stream it to `step_dir/f.name` with the persist writer; returns its entry with the
    checksum. The temporary file lies in the step directory (the system's temp directory for an object
    store), never in memory: a memfd is shared memory, so one big tensor (a sparse 12 GiB file holds one in
    4 KiB of disk) grew the host's shared memory by its size."""
    spool = tempfile.TemporaryFile(dir=store_of(step_dir).local_path(step_dir))
    fd = spool.fileno()
    try:
        write_all(fd, memoryview(f.header))
        pos = 0
        for slot in f.slots:
            if slot.begin != pos:
                raise CheckpointFailed(f"layout of {f.name} has a gap before {slot.spec.name!r}")
            if slot.end > slot.begin:
                src = tensors[slot.spec.name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                write_all(fd, src.numpy().data)
            pos = slot.end
        entry = committer.write_file(fd, 0, f.size, step_dir / f.name, tag)
    finally:
        spool.close()
    return FileEntry(name=f.name, size=f.size, checksum=entry.checksum)
