"""Read committed checkpoints: list, verify, load, restore in place.

Only step directories with a `manifest.json` exist for readers (a partial step has none). Loading reads
each file once, in large chunks, straight into one tensor-backed buffer while hashing it, and returns
tensors as views over that buffer (the layout keeps every tensor aligned), so a verified restore costs one
sequential read. Files are read in parallel threads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dcs_tasks.checkpoint.format import (
    CODE_DTYPES,
    LATEST_NAME,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    new_hasher,
    read_manifest,
    step_dir_name,
)
from dcs_tasks.checkpoint.fsio import CHUNK_BYTES
from dcs_tasks.errors import CorruptCheckpoint, StateMismatch

Progress = Callable[[str, int, int], None]  # (file name, bytes done, file size)
READ_THREADS = 4


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step directory holding a manifest, oldest first."""
    if not run_dir.is_dir():
        return []
    found = []
    for entry in run_dir.iterdir():
        if entry.name.startswith("step-") and (entry / MANIFEST_NAME).is_file():
            with contextlib.suppress(ValueError):
                found.append((int(entry.name[5:]), entry))
    return sorted(found)


def load_manifest(step_dir: Path) -> Manifest:
    try:
        return read_manifest(step_dir / MANIFEST_NAME)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{step_dir / MANIFEST_NAME} is unreadable: {exc}", str(step_dir)) from exc


def read_latest(run_dir: Path) -> int | None:
    """The step named by the `latest` pointer, or None."""
    try:
        return int((run_dir / LATEST_NAME).read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return None


def _read_file(path: Path, entry: FileEntry, verify: bool, progress: Progress | None) -> torch.Tensor:
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing", str(path)) from exc
    if size != entry.size:
        raise CorruptCheckpoint(f"checkpoint file {path} has {size} bytes, manifest says {entry.size}", str(path))
    data = torch.empty(size, dtype=torch.uint8)
    view = memoryview(data.numpy())  # type: ignore[arg-type]
    hasher = new_hasher() if verify else None
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + CHUNK_BYTES])
            if not n:
                raise CorruptCheckpoint(f"checkpoint file {path} ended early at byte {pos}", str(path))
            if hasher is not None:
                hasher.update(view[pos : pos + n])
            pos += n
            if progress is not None:
                progress(entry.name, pos, size)
    if hasher is not None and hasher.hexdigest() != entry.checksum:
        raise CorruptCheckpoint(f"checkpoint file {path} fails its {entry.algorithm} checksum", str(path))
    return data


def read_files(
    step_dir: Path, manifest: Manifest, *, verify: bool = True, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """File name -> raw bytes (uint8 tensor) of every file; raises CorruptCheckpoint naming the file."""
    threads = max(1, min(READ_THREADS, len(manifest.files), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="dcs-read") as pool:
        futures = {f.name: pool.submit(_read_file, step_dir / f.name, f, verify, progress) for f in manifest.files}
        return {name: fut.result() for name, fut in futures.items()}


def verify_step(step_dir: Path, manifest: Manifest, progress: Progress | None = None) -> None:
    """Check every file of a committed step against its size and checksum."""
    for entry in manifest.files:
        _read_file(step_dir / entry.name, entry, True, progress)


def load_tensors(step_dir: Path, manifest: Manifest, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Tensor name -> tensor (views over the files' bytes, bit-exact to what was saved)."""
    files = read_files(step_dir, manifest, verify=verify)
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in manifest.tensors.items():
        begin, end = entry.offsets
        raw = files[entry.file][begin:end]
        tensors[name] = raw.view(CODE_DTYPES[entry.dtype]).view(entry.shape)
    return tensors


def copy_into_targets(loaded: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    """Copy loaded tensors into the caller's tensors (`into=`); StateMismatch names the first mismatch."""
    missing = sorted(set(targets) - set(loaded))
    if missing:
        raise StateMismatch(f"checkpoint has no tensor {missing[0]!r} that the target state holds")
    extra = sorted(set(loaded) - set(targets))
    if extra:
        raise StateMismatch(f"checkpoint tensor {extra[0]!r} has no counterpart in the target state")
    for name, dst in targets.items():
        src = loaded[name]
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise StateMismatch(
                f"tensor {name!r}: checkpoint has {src.dtype} {tuple(src.shape)}, "
                f"target has {dst.dtype} {tuple(dst.shape)}"
            )
    with torch.no_grad():
        for name, src in loaded.items():
            targets[name].copy_(src)


def describe(manifest: Manifest) -> dict[str, Any]:
    """A JSON-friendly summary for `dcs ckpt inspect`."""
    return {
        "run": manifest.run,
        "step": manifest.step,
        "dir": step_dir_name(manifest.step),
        "created_at": manifest.created_at,
        "bytes": manifest.total_bytes,
        "files": [f.model_dump() for f in manifest.files],
        "tensors": len(manifest.tensors),
        "metadata": manifest.metadata,
        "versions": manifest.versions,
    }
