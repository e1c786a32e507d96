"""What a save hands the workers once its state is staged: the step opened in the Redis ledger, one persist task
per file, and the layout cache that keeps files of unchanged tensors byte-equal for incremental saves.
`Checkpointer.save` drives these; the trainer never writes checkpoint files itself."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import redis
import torch
from celery import Celery

from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.checkpoint import agreement
from dcs_tasks.checkpoint.committer import committed
from dcs_tasks.checkpoint.format.compression import CompressionSpec
from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, Layout, ManifestDraft, plan_layout, specs_of
from dcs_tasks.checkpoint.save.staging import BufferLease
from dcs_tasks.checkpoint.state.structure import FlatState
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, Verdict
from dcs_tasks.checkpoint.store.payloads import PersistRequest, RetentionPolicy, StepRef
from dcs_tasks.config import CheckpointCompression, DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointFailed, NoWorkerError, RunNameTaken
from dcs_tasks.keys import Keys
from dcs_tasks.storage import Location

if TYPE_CHECKING:
    from dcs_tasks.checkpoint.inline import InlineCommitter


def require_worker(app: Celery | InlineCommitter, client: redis.Redis, keys: Keys, config: DCSConfig) -> None:
    """NoWorkerError unless a live `dcs worker` serves this host's node queue (or `app` persists in this
    process: an InlineCommitter); SettingsMismatch when that worker's published settings disagree with `config`."""
    if getattr(app, "inline", False):
        return
    queue = node_queue(config.host_name)
    try:
        present = bool(client.exists(keys.worker_presence(queue)))
    except redis.RedisError as exc:
        raise NoWorkerError(f"cannot check for a worker on {queue}: Redis unreachable ({exc})") from exc
    if not present:
        raise NoWorkerError(
            f"no live `dcs worker` serves queue {queue!r}; start one on host {config.host_name!r} "
            "(`dcs worker`) before saving"
        )
    agreement.require_agreement(config, client, keys, app)  # a worker started or restarted since construction


def committed_dirs(step_dir: Location, primary_dir: Location) -> list[Location]:
    """Which of the two hold the step committed (its manifest stored): asked of storage, a HEAD each on an object
    store."""
    return [existing for existing in dict.fromkeys((step_dir, primary_dir)) if committed(existing)]


def open_step(
    ledger: StepLedger,
    config: DCSConfig,
    run: str,
    shard_run: str,
    draft: ManifestDraft,
    files: int,
    step_dir: Location,
    primary_dir: Location,
    found: list[Location] | None = None,
) -> StepRef:
    """Begin step `draft.step` of `shard_run` (written to `step_dir`) in the ledger. Raises CheckpointError (naming
    `run`) when the step is committed (in the ledger, or under `step_dir` or `primary_dir` though the ledger
    forgot it) or another attempt is still persisting it. `found`: `committed_dirs(step_dir, primary_dir)`, when
    the caller asked storage already (beside the copy into staging: a HEAD on an object store)."""
    step = draft.step
    found = committed_dirs(step_dir, primary_dir) if found is None else found
    if found:  # committed though the ledger forgot it (expired, lost)
        raise CheckpointError(
            f"step {step} of run {run!r} is already committed ({found[0] / MANIFEST_NAME} exists); DCS "
            "never overwrites a committed step: save under a new step"
        )
    ref = StepRef(run=shard_run, step=step, token=uuid.uuid4().hex, step_dir=str(step_dir))
    abandoned_after = config.abandoned_save_seconds()
    verdict = ledger.begin(shard_run, step, ref.token, files, draft, abandoned_after)
    if verdict is Verdict.COMMITTED:  # the ledger has it, yet neither directory holds it (checked above)
        raise RunNameTaken(
            f"step {step} of run {run!r} is recorded as committed in Redis (namespace {config.redis.namespace!r}), but "
            f"{step_dir} holds no such step: the run name was used before under another checkpoint directory (or "
            "that run's files were removed). To start fresh, give this run a new name, or run with another "
            f"DCS_NAMESPACE; to continue the old run, use its DCS_CHECKPOINT_DIR (`dcs ckpt list --run {run} "
            "--dir OLD_DIR` shows its steps)"
        )
    if verdict is Verdict.BUSY:
        raise CheckpointError(
            f"step {step} of run {run!r} is still being persisted (an attempt that never finishes is "
            f"taken over {abandoned_after:g}s after it began)"
        )
    return ref


def send_persist_tasks(
    app: Celery | InlineCommitter,
    ledger: StepLedger,
    config: DCSConfig,
    ref: StepRef,
    lease: BufferLease,
    layout: Layout,
    durable: bool = True,
    in_memory: bool = False,
) -> None:
    """Enqueue one persist task per file on this host's node queue (the dispatcher thread). On failure the step
    is abandoned in the ledger and CheckpointFailed says why; the lease ends here only when no task went out (a
    sent task may still read the buffer; the pending save ends it once the step is FAILED)."""
    queue = node_queue(config.host_name)
    retention = RetentionPolicy(keep_last=config.checkpoint.keep_last, keep_every=config.checkpoint.keep_every)
    sent = 0
    try:
        compression = None if in_memory else compression_spec(config)
        for f in layout.files:
            request = PersistRequest(
                ref=ref,
                file_name=f.name,
                staging_path=str(lease.buffer.path),
                offset=f.offset,
                length=f.size,
                retention=retention,
                incremental=config.checkpoint.incremental_saves and not in_memory,  # memory steps stand alone
                compression=compression,
                durable=durable,
            )
            app.send_task(TaskName.PERSIST.value, args=[request.model_dump(mode="json")], queue=queue)
            sent += 1
    except Exception as exc:
        reason = f"could not enqueue persist tasks of step {ref.step} ({sent}/{len(layout.files)} sent): {exc}"
        with contextlib.suppress(redis.RedisError):  # else a later save of this step waits for the takeover
            ledger.abandon(ref.run, ref.step, ref.token, reason)
        if sent == 0:
            lease.release()
        raise CheckpointFailed(reason) from exc


def compression_spec(config: DCSConfig) -> CompressionSpec | None:
    """What the workers are asked to do with each file of a save (they compress; the trainer never does)."""
    codec = CheckpointCompression(config.checkpoint.compression)  # model_copy(update=...) does not validate
    if codec is CheckpointCompression.NONE:
        return None
    return CompressionSpec(
        codec=codec.value,
        level=config.checkpoint.compression_level,
        min_saving=config.checkpoint.compression_min_saving,
    )


class Layouts:
    """The file layout of each save, reused while the state's tensors keep their names, dtypes and shapes."""

    def __init__(self, config: DCSConfig) -> None:
        self._config = config
        self._layouts: dict[tuple[object, ...], Layout] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # tensor -> (version, data_ptr) at the last save
        self._moving: set[str] = set()

    def of(self, flat: FlatState) -> Layout:
        moving = self._moving_tensors(flat.tensors) if self._config.checkpoint.incremental_saves else frozenset()
        key = (tuple((n, t.dtype, tuple(t.shape)) for n, t in flat.tensors.items()), moving)
        layout = self._layouts.get(key)
        if layout is None:
            layout = plan_layout(specs_of(flat.tensors), self._config.checkpoint.file_shard_bytes, moving)
            self._layouts = {key: layout}
        return layout

    def _moving_tensors(self, tensors: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """Tensors seen changing between two saves (autograd's in-place version counter or the storage moved),
        sticky: the layout puts them in files of their own, so files of frozen tensors stay byte-equal and
        incremental saves reuse them. A hint only: the worker compares checksums, never trusts this."""
        seen = {name: (_version(t), t.data_ptr()) for name, t in tensors.items()}
        self._moving |= {name for name, mark in seen.items() if self._seen.get(name, mark) != mark}
        self._seen = seen
        return frozenset(self._moving & seen.keys())


def _version(t: torch.Tensor) -> int:
    """Autograd's in-place version counter; -1 for inference tensors, which have none."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1
