"""Hugging Face `Trainer`: `DCSCallback` saves the training state through DCS where the `Trainer` would write a
`checkpoint-N` folder, and `resume_from_checkpoint` resumes from the newest verified DCS step.

    dcs = DCSCallback("my-run")
    trainer = Trainer(model, TrainingArguments(..., save_strategy="steps", save_steps=100), callbacks=[dcs], ...)
    trainer.train(resume_from_checkpoint=dcs.resume_from_checkpoint())   # None: no step yet, train from the start

Whenever the `Trainer` decides to save (`save_strategy` "steps" every `save_steps` and at the last step, or
"epoch"), the callback saves DCS step `global_step` of run `run` instead: the model's `state_dict()`, the
optimizer's and the LR scheduler's states, the RNG states (Python, NumPy, torch CPU and CUDA) and the `TrainerState`
(as JSON). The save returns once the tensors are copied into staging; a `dcs worker` writes, checksums and commits
them. It then clears the `Trainer`'s `should_save`, so no `checkpoint-N` folder is written
(`keep_hf_checkpoints=True` lets the `Trainer` write its folders too). A state value DCS cannot store raises
`StagingError` naming its key, and nothing is saved. A step the run already held when the callback first saved (a run
resumed from an older step, e.g. after the newest failed to verify) is kept as it is, with a warning. At the end of
training (`on_train_end`) the callback waits for the saves in flight and raises `CheckpointFailed` naming the steps
that did not commit.

`resume_from_checkpoint()` restores the newest committed step whose files verify (falling back to older ones) and
lays it out in a local folder the way the `Trainer` reads a checkpoint on resume (`model.safetensors`,
`optimizer.pt`, `scheduler.pt`, `rng_state.pth`, `trainer_state.json`), so the `Trainer`'s own resume runs
unchanged: weights, optimizer, scheduler, RNG, global step, and the batches already seen in the epoch skipped. The
folder is a temporary one, removed at the end of training, unless `directory` is given; it costs one local write of
the model and optimizer.

Not covered: a `Trainer` under DeepSpeed or FSDP (they write their own sharded checkpoints), `save_strategy="best"`
(decided after the callbacks run), several processes (rank 0 saves its own state only), mixed-precision scaler
states and `save_only_model`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.torch
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dcs_tasks.checkpoint import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, CheckpointFailed, CheckpointNotFound

if TYPE_CHECKING:
    from celery import Celery

    from dcs_tasks.checkpoint.inline import InlineCommitter

log = logging.getLogger(__name__)

# What the Trainer reads from a checkpoint folder on resume (transformers/trainer.py's names).
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"
TRAINER_STATE_FILE = "trainer_state.json"


class DCSCallback(TrainerCallback):
    """Saves the `Trainer`'s state as DCS steps of `run` where it would save a checkpoint folder (see the module's
    docstring). `config`: default `DCSConfig()` (the `DCS_*` environment); `celery_app`: handed to `Checkpointer`
    (an `InlineCommitter` commits in this process, without a worker)."""

    def __init__(
        self,
        run: str,
        config: DCSConfig | None = None,
        *,
        celery_app: Celery | InlineCommitter | None = None,
        keep_hf_checkpoints: bool = False,
    ) -> None:
        self.run = run
        self.config = config or DCSConfig()
        self.keep_hf_checkpoints = keep_hf_checkpoints
        self._celery_app = celery_app
        self._checkpointer: Checkpointer | None = None
        self._saved: set[int] = set()  # steps this callback saved
        self._made: list[Path] = []  # temporary resume folders, removed by close()
        self._held: set[int] | None = None  # steps the run held when this callback first saved

    @property
    def checkpointer(self) -> Checkpointer:
        """The run's `Checkpointer`, made at first use (and again after `on_train_end` closed it)."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.run, self.config, celery_app=self._celery_app)
        return self._checkpointer

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._maybe_save(state, control, kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._maybe_save(state, control, kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the saves in flight (at most `visibility_timeout_seconds`) and close the checkpointer; raises
        CheckpointFailed naming the steps that failed or did not commit."""
        checkpointer, self._checkpointer = self._checkpointer, None
        made, self._made = self._made, []
        self._saved.clear()
        self._held = None
        for folder in made:  # the Trainer has read it by the end of training
            shutil.rmtree(folder, ignore_errors=True)
        if checkpointer is None:
            return
        closed = checkpointer.close()
        if not closed.ok:
            raise CheckpointFailed(
                f"DCS run {self.run!r}: checkpoint steps {list(closed.failed)} failed and {list(closed.unfinished)} "
                "were not committed when training ended"
            )

    def _maybe_save(self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]) -> TrainerControl:
        if not control.should_save or not state.is_world_process_zero:
            return control
        step = state.global_step
        if self._held is None:
            self._held = {info.step for info in self.checkpointer.list()}
        if step in self._held and step not in self._saved:
            log.warning(
                "step %d of DCS run %r is already committed (an earlier process saved it): kept", step, self.run
            )
        elif step not in self._saved:  # the last step's on_step_end and the epoch's end can both ask for one
            self.checkpointer.save(training_state(state, kwargs), step=step, metadata={"framework": "transformers"})
        self._saved.add(step)
        if not self.keep_hf_checkpoints:
            control.should_save = False
        return control

    def resume_from_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> str | None:
        """The newest committed step that verifies, laid out as a `Trainer` checkpoint folder in `directory`
        (default: a new temporary directory, removed by `close()` at the end of training); None when the run has
        no committed step. For `trainer.train(resume_from_checkpoint=...)`. Raises CorruptCheckpoint when no
        committed step verifies."""
        try:
            restored = self.checkpointer.restore()
        except CheckpointNotFound:
            if self.checkpointer.list():
                raise
            return None
        if directory is None:
            folder = Path(tempfile.mkdtemp(prefix=f"dcs-{self.run}-"))
            self._made.append(folder)
        else:
            folder = Path(directory)
        write_folder(restored.state, folder, restored.step)
        log.info("resuming from DCS step %d of run %r (laid out in %s)", restored.step, self.run, folder)
        return str(folder)


def training_state(state: TrainerState, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a `Trainer` checkpoint holds, as a DCS state: tensors, and plain values for the rest."""
    model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
    if model is None or optimizer is None or scheduler is None:
        raise CheckpointError("the Trainer did not hand DCSCallback its model, optimizer and lr_scheduler")
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_states(),
        "trainer_state": json.loads(json.dumps(dataclasses.asdict(state))),  # what save_to_json writes
    }


def rng_states() -> dict[str, Any]:
    """Python's, NumPy's and torch's RNG states; NumPy's key array as a tensor (DCS stores no NumPy arrays)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def write_folder(state: dict[str, Any], folder: Path, step: int) -> None:
    """Lay a restored DCS state out as a `Trainer` checkpoint folder (the files `Trainer._load_*` read)."""
    for key in ("model", "optimizer", "scheduler", "rng", "trainer_state"):
        if key not in state:
            raise CheckpointError(f"DCS step {step} is not a Trainer checkpoint saved by DCSCallback: no {key!r}")
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(untied(state["model"]), str(folder / MODEL_FILE), metadata={"format": "pt"})
    torch.save(copied(state["optimizer"]), folder / OPTIMIZER_FILE)
    torch.save(copied(state["scheduler"]), folder / SCHEDULER_FILE)
    rng = copied(state["rng"])
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    rng["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    rng["python"] = (rng["python"][0], tuple(rng["python"][1]), rng["python"][2])
    torch.save(rng, folder / RNG_FILE)
    text = json.dumps(state["trainer_state"], indent=2, sort_keys=True) + "\n"
    (folder / TRAINER_STATE_FILE).write_text(text)


def untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as separate contiguous copies, a tensor stored under several names (tied embeddings) kept under its
    first name only, as `save_pretrained` does: safetensors refuses tensors that share memory, and loading the first
    name fills the tied ones."""
    seen: set[tuple[Any, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and identity in seen:
            continue
        seen.add(identity)
        out[name] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def copied(value: Any) -> Any:
    """`value` with every tensor copied into memory of its own (a restored state's tensors may share buffers)."""
    if isinstance(value, torch.Tensor):
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(copied(item) for item in value)
    return value
