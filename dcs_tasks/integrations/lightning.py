"""PyTorch Lightning: `DCSCheckpointIO`, a `CheckpointIO` plugin that saves Lightning's checkpoints through DCS.

    trainer = Trainer(plugins=[DCSCheckpointIO("my-run")], callbacks=[ModelCheckpoint(every_n_train_steps=100,
                      save_last=True)])
    trainer.fit(model, ckpt_path="last")      # resumes from the newest verified DCS step, if there is one

What Lightning hands `save_checkpoint` (its checkpoint dict: weights, optimizer and scheduler states, loop
progress, callback states, hyper-parameters) becomes DCS step `global_step` of run `run`: its tensors are copied
into staging and `save_checkpoint` returns (a `dcs worker` writes, checksums and commits them); everything else is
stored as JSON in the step's manifest. A value that is neither a tensor nor plain data (an arbitrary object in
`hyper_parameters` or a callback's state) raises `StagingError` naming its key, and nothing is saved: DCS never
pickles.

At the path Lightning asked for (`<dirpath>/epoch=0-step=100.ckpt`, `last.ckpt`) goes a small JSON marker naming
the run and the step, so `ModelCheckpoint`'s bookkeeping, its top-k removals and `ckpt_path="last"` (which looks
for `last*.ckpt` files) work unchanged. Loading a `last*.ckpt` marker restores the newest committed step whose
files verify (falling back to older ones), not necessarily the step the marker was written for: a process killed
after a save and before its commit resumes from the step before. Any other marker restores its own step.

Lightning saves `last.ckpt` and a top-k checkpoint at the same global step one after the other: the first is stored,
the second only gets its marker. A step the run already held when this plugin first saved (a run resumed from an
older step, e.g. after the newest failed to verify) is kept as it is, with a warning, and not saved again.
`remove_checkpoint` removes the marker; the DCS steps themselves are kept or deleted by DCS retention (`keep_last`,
`keep_every`: the argument `keep_last` here or `DCS_KEEP_LAST`), which never deletes the newest intact step.
`teardown` (the end of `fit`) waits for the saves in flight and raises `CheckpointFailed` naming the steps that did
not commit.

Only the `lightning` package's classes are supported (`lightning.pytorch.Trainer`; the `pytorch_lightning`
namespace has its own `CheckpointIO` class). Strategies that write their own sharded checkpoints (FSDP, DeepSpeed)
do not go through a `CheckpointIO`; with DDP, rank 0 saves the whole state, as Lightning does.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO

from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointFailed, CheckpointNotFound

if TYPE_CHECKING:
    from celery import Celery

    from dcs_tasks.checkpoint.inline import InlineCommitter

log = logging.getLogger(__name__)

MARKER_KIND = "dcs-lightning-checkpoint"
MARKER_LIMIT = 64 << 10  # a marker is a few hundred bytes: a bigger file is not one
LAST = re.compile(r"^last(-v?\d+)?$")  # ModelCheckpoint's CHECKPOINT_NAME_LAST, with its version suffixes


class NotADCSCheckpoint(CheckpointNotFound):
    """A path handed to `DCSCheckpointIO.load_checkpoint` is not a marker `DCSCheckpointIO` wrote (a `torch.save`
    file, a marker of another kind, a damaged one); the message names the path."""


def is_last(path: str | os.PathLike[str]) -> bool:
    """True for the names `ModelCheckpoint(save_last=True)` writes (`last.ckpt`, `last-v1.ckpt`)."""
    return LAST.match(Path(path).stem) is not None


class DCSCheckpointIO(CheckpointIO):
    """Lightning checkpoints as DCS steps of `run` (see the module's docstring). `config`: default `DCSConfig()`
    (the `DCS_*` environment); `keep_last`: DCS retention for this run's steps (overrides the config's);
    `celery_app`: handed to `Checkpointer` (an `InlineCommitter` commits in this process, without a worker)."""

    def __init__(
        self,
        run: str,
        config: DCSConfig | None = None,
        *,
        keep_last: int | None = None,
        celery_app: Celery | InlineCommitter | None = None,
    ) -> None:
        super().__init__()
        config = config or DCSConfig()
        if keep_last is not None:
            config = config.model_copy(update={"keep_last": keep_last})
        self.run = run
        self.config = config
        self._celery_app = celery_app
        self._checkpointer: Checkpointer | None = None
        self._saved: set[int] = set()  # steps stored (or found committed) since the last teardown
        self._held: set[int] | None = None  # steps the run held when this plugin first saved

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's `Checkpointer`, made at first use (and again after `teardown`)."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.run, self.config, celery_app=self._celery_app)
        return self._checkpointer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage `checkpoint` as DCS step `checkpoint["global_step"]` and write the marker at `path`; returns once
        the tensors are copied. StagingError names a value DCS cannot store (nothing is saved then)."""
        if storage_options is not None:
            raise TypeError(f"DCSCheckpointIO takes no storage_options (got {type(storage_options).__name__})")
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"a Lightning checkpoint's 'global_step' must be an integer >= 0, got {step!r}")
        if self._held is None:
            self._held = {info.step for info in self.checkpointer.list()}
        if step in self._held and step not in self._saved:
            log.warning(
                "step %d of DCS run %r is already committed (an earlier process saved it): kept", step, self.run
            )
        elif step not in self._saved:
            metadata = {"framework": "lightning", "path": os.fspath(path)}
            self.checkpointer.save(checkpoint, step=step, metadata=metadata)
        self._saved.add(step)
        write_marker(Path(path), self.run, step)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint a marker at `path` names: for `last*.ckpt` the newest committed step that verifies, else
        the marker's own step. Tensors come back on the CPU, or on `map_location` when it is a device or a device
        name. Raises NotADCSCheckpoint, CheckpointNotFound (no such step committed) or CorruptCheckpoint."""
        run, step = read_marker(Path(path))
        if run != self.run:
            raise NotADCSCheckpoint(f"{os.fspath(path)!r} is a checkpoint of DCS run {run!r}, not of {self.run!r}")
        want = None if is_last(path) else step
        try:
            restored = self.checkpointer.restore(step=want)
        except CheckpointNotFound as exc:
            raise CheckpointNotFound(f"{os.fspath(path)!r} names step {step} of run {run!r}: {exc}") from exc
        if want is None and restored.step != step:
            log.warning(
                "%s: step %d is not committed or does not verify; resuming from step %d", path, step, restored.step
            )
        state: dict[str, Any] = restored.state
        move = _mover(map_location)
        return state if move is None else _apply(state, move)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the marker at `path` (the step stays until DCS retention lets it go). A file there that is not a
        DCS marker is left alone, with a warning."""
        where = Path(path)
        if not where.exists():
            return
        try:
            read_marker(where)
        except NotADCSCheckpoint as exc:
            log.warning("not removing %s: %s", where, exc)
            return
        where.unlink(missing_ok=True)

    def teardown(self) -> None:
        """Wait for the saves in flight (at most `visibility_timeout_seconds`) and close the checkpointer; raises
        CheckpointFailed naming the steps that failed or did not commit."""
        checkpointer, self._checkpointer = self._checkpointer, None
        self._saved.clear()
        self._held = None
        if checkpointer is None:
            return
        closed = checkpointer.close()
        if not closed.ok:
            raise CheckpointFailed(
                f"DCS run {self.run!r}: checkpoint steps {list(closed.failed)} failed and {list(closed.unfinished)} "
                "were not committed when training ended"
            )


def write_marker(path: Path, run: str, step: int) -> None:
    """Write the marker atomically (a temporary file renamed over `path`), creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"kind": MARKER_KIND, "run": run, "step": step}) + "\n"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(body)
    os.replace(temporary, path)


def read_marker(path: Path) -> tuple[str, int]:
    """(run, step) of the marker at `path`; NotADCSCheckpoint when it is not one."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MARKER_LIMIT + 1)
    except OSError as exc:
        raise NotADCSCheckpoint(f"cannot read {os.fspath(path)!r}: {exc}") from exc
    try:
        body = json.loads(raw) if len(raw) <= MARKER_LIMIT else None
    except (UnicodeDecodeError, ValueError):
        body = None
    if (
        not isinstance(body, dict)
        or body.get("kind") != MARKER_KIND
        or not isinstance(body.get("run"), str)
        or not isinstance(body.get("step"), int)
        or isinstance(body.get("step"), bool)
        or body["step"] < 0
    ):
        raise NotADCSCheckpoint(f"{os.fspath(path)!r} is not a checkpoint DCSCheckpointIO wrote")
    return body["run"], body["step"]


def _mover(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if map_location is None or (
        isinstance(map_location, str | torch.device) and torch.device(map_location).type == "cpu"
    ):
        return None
    if isinstance(map_location, str | torch.device):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    raise TypeError(f"DCSCheckpointIO loads onto a device or device name, not map_location={map_location!r}")


def _apply(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        out = type(value)()
        for key, item in value.items():
            out[key] = _apply(item, move)
        if hasattr(value, "_metadata"):  # a module state_dict's per-module versions
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list | tuple):
        return type(value)(_apply(v, move) for v in value)
    return value
