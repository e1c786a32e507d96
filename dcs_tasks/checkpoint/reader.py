"""Read committed checkpoints: list, verify, load, restore in place.

Only step directories with a `manifest.json` exist for readers (a partial step has none). Loading reads
each file once with `fastread` (32 MiB chunks read by 4 threads, O_DIRECT into new memory or buffered
straight into `into=` tensors, hashed in order on the way), so a verified restore costs one read of the
bytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dcs_tasks.checkpoint import objread
from dcs_tasks.checkpoint.fastread import Progress, Target, read_many, read_scatter, tensors_over
from dcs_tasks.checkpoint.format import (
    LATEST_NAME,
    MANIFEST_NAME,
    Manifest,
    TensorEntry,
    step_dir_name,
)
from dcs_tasks.checkpoint.validate import check_files, read_manifest, read_small
from dcs_tasks.errors import CorruptCheckpoint, StateMismatch, StorageError
from dcs_tasks.storage import Location, ObjectPath
from dcs_tasks.tensors import code_dtype

if TYPE_CHECKING:  # torch is imported by the functions that make tensors: listing and verifying need none
    import torch

STEP_DIR = re.compile(r"^step-(\d{9,})$", re.ASCII)


@overload
def step_dirs(run_dir: Path) -> list[tuple[int, Path]]: ...
@overload
def step_dirs(run_dir: ObjectPath) -> list[tuple[int, ObjectPath]]: ...
@overload
def step_dirs(run_dir: Location) -> list[tuple[int, Location]]: ...
def step_dirs(run_dir: Location) -> list[tuple[int, Location]] | list[tuple[int, Path]] | list[tuple[int, ObjectPath]]:
    """(step, directory) of every step directory holding a manifest, oldest first. Only real directories
    named exactly as DCS names them count (no symlinks, no `step-+5` alias of `step-000000005`). In an object
    store: every `<run>/step-N/manifest.json` object (one listing)."""
    if isinstance(run_dir, ObjectPath):
        return _object_step_dirs(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    with os.scandir(run_dir) as entries:
        for entry in entries:
            match = STEP_DIR.match(entry.name)
            if match and entry.name == step_dir_name(int(match.group(1))) and entry.is_dir(follow_symlinks=False):
                if os.path.lexists(os.path.join(entry.path, MANIFEST_NAME)):
                    found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def _object_step_dirs(run_dir: ObjectPath) -> list[tuple[int, ObjectPath]]:
    base = run_dir.key + "/" if run_dir.key else ""
    found = []
    for item in run_dir.store.objects(base):
        parts = item.key[len(base) :].split("/")
        if len(parts) != 2 or parts[1] != MANIFEST_NAME:
            continue
        match = STEP_DIR.match(parts[0])
        if match and parts[0] == step_dir_name(int(match.group(1))):
            found.append((int(match.group(1)), run_dir / parts[0]))
    return sorted(found, key=lambda pair: pair[0])


def load_manifest(step_dir: Location) -> Manifest:
    """The step's manifest, checked as untrusted input (`validate`: names, sizes, offsets, shapes, dtypes,
    structure); CorruptCheckpoint names the manifest and the reason."""
    manifest = read_manifest(step_dir)
    match = STEP_DIR.match(step_dir.name)
    if match and int(match.group(1)) != manifest.step:
        path = step_dir / MANIFEST_NAME
        raise CorruptCheckpoint(f"{path}: records step {manifest.step}, not {int(match.group(1))}", str(path))
    return manifest


def read_latest(run_dir: Location) -> int | None:
    """The step named by the `latest` pointer, or None (also when it is a symlink or not a short file)."""
    try:
        text = read_small(run_dir / LATEST_NAME, 64).decode("ascii").strip().removeprefix("step-")
    except (CorruptCheckpoint, OSError, ValueError, StorageError):
        return None
    return int(text) if text.isdigit() else None


def verify_step(step_dir: Location, manifest: Manifest, progress: Progress | None = None) -> None:
    """Check every file of a committed step against its size, safetensors header and checksum (memory: 6
    chunks of scratch)."""
    check_files(step_dir, manifest)
    scatter(step_dir, manifest, {}, True, progress)


def scatter(
    step_dir: Location,
    manifest: Manifest,
    targets: Mapping[str, list[Target]],
    verify: bool,
    progress: Progress | None = None,
) -> None:
    """Read every file of the step once into `targets` (file name -> ranges), from a file system or an
    object store."""
    if isinstance(step_dir, ObjectPath):
        objread.read_scatter(
            [(f.stored_path(step_dir), f, targets.get(f.name, [])) for f in manifest.files], verify, progress
        )
    else:
        read_scatter([(f.stored_path(step_dir), f, targets.get(f.name, [])) for f in manifest.files], verify, progress)


def load_tensors(
    step_dir: Location, manifest: Manifest, *, verify: bool = True, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Tensor name -> tensor, bit-exact to what was saved. Each tensor owns its storage (no views over a
    shared file buffer: some torch APIs, e.g. `set_rng_state`, ignore a view's storage offset). Every file
    is read once (`fastread`), hashed while the next chunks are in flight.

    `into` (checked first with `check_targets`): the caller's tensors; contiguous CPU ones are read into
    directly (no second copy), others are filled with `copy_` after the read. If a file then fails its
    checksum the caller's tensors hold partial data and CorruptCheckpoint is raised. `manifest` comes from
    `load_manifest` (checked); the files are checked against it (`validate.check_files`) before anything is
    allocated or read."""
    import torch

    check_files(step_dir, manifest)
    if into is None:
        return _load_whole_files(step_dir, manifest, verify)
    tensors = {name: _destination(name, entry, into) for name, entry in manifest.tensors.items()}
    targets: dict[str, list[Target]] = {f.name: [] for f in manifest.files}
    for name, entry in manifest.tensors.items():
        begin, end = entry.offsets
        if end > begin:
            dest = tensors[name].detach().reshape(-1).view(torch.uint8).numpy().data
            targets[entry.file].append((begin, end, dest))
    scatter(step_dir, manifest, targets, verify)
    with torch.no_grad():
        for name, target in into.items():
            if tensors[name] is not target:
                target.copy_(tensors[name])
    return dict(into)


def _load_whole_files(step_dir: Location, manifest: Manifest, verify: bool) -> dict[str, torch.Tensor]:
    by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in manifest.files}
    for name, entry in manifest.tensors.items():
        by_file[entry.file][name] = entry
    if isinstance(step_dir, ObjectPath):
        mappings = objread.read_many([(f.stored_path(step_dir), f) for f in manifest.files], verify)
    else:
        mappings = read_many([(f.stored_path(step_dir), f) for f in manifest.files], verify)
    loaded: dict[str, torch.Tensor] = {}
    for f, mapping in zip(manifest.files, mappings, strict=True):
        loaded.update(tensors_over(mapping, by_file[f.name]))
    return {name: loaded[name] for name in manifest.tensors}


def _destination(name: str, entry: TensorEntry, into: dict[str, torch.Tensor] | None) -> torch.Tensor:
    import torch

    target = into.get(name) if into is not None else None
    if target is not None and target.device.type == "cpu" and target.is_contiguous():
        return target
    return torch.empty(entry.shape, dtype=code_dtype(entry.dtype))


TensorShapes = Mapping[str, tuple["torch.dtype", tuple[int, ...]]]
"""Tensor name -> (dtype, shape): what a checkpoint (or its resharded part) holds."""


def manifest_shapes(manifest: Manifest) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every tensor `manifest` lists."""
    return {name: (code_dtype(e.dtype), tuple(e.shape)) for name, e in manifest.tensors.items()}


def check_targets(have: Manifest | TensorShapes, targets: Mapping[str, torch.Tensor], note: str = "") -> None:
    """`into=` must hold exactly the checkpoint's tensors with the same shapes and dtypes (StateMismatch
    names the first tensor that differs), checked before anything is read or written. `have`: a manifest,
    or the (dtype, shape) of each tensor (a resharded restore's; `note` says so in the message)."""
    shapes = manifest_shapes(have) if isinstance(have, Manifest) else have
    missing = [name for name in targets if name not in shapes]
    if missing:
        raise StateMismatch(f"checkpoint has no tensor {missing[0]!r} that the target state holds")
    extra = [name for name in shapes if name not in targets]
    if extra:
        raise StateMismatch(f"checkpoint tensor {extra[0]!r} has no counterpart in the target state")
    for name, dst in targets.items():
        dtype, shape = shapes[name]
        if tuple(dst.shape) != shape or dst.dtype != dtype:
            raise StateMismatch(
                f"tensor {name!r}: checkpoint has {dtype} {shape}{note}, target has {dst.dtype} {tuple(dst.shape)}"
            )


def describe(manifest: Manifest) -> dict[str, Any]:
    """A JSON-friendly summary for `dcs ckpt inspect`."""
    return {
        "run": manifest.run,
        "step": manifest.step,
        "dir": step_dir_name(manifest.step),
        "created_at": manifest.created_at,
        "bytes": manifest.total_bytes,
        "stored_bytes": manifest.stored_bytes,
        "files": [f.model_dump(exclude_none=True) for f in manifest.files],
        "tensors": len(manifest.tensors),
        "metadata": manifest.metadata,
        "versions": manifest.versions,
    }
