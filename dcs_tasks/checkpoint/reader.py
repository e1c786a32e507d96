"""Read committed checkpoints: list, verify, load, restore in place.

Only step directories with a `manifest.json` exist for readers (a partial step has none). Loading reads
each file once, in order, hashing it while reading each tensor's bytes straight into that tensor's own
storage, so a verified restore costs one sequential read per file. Files are read in parallel threads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dcs_tasks.checkpoint.fastread import read_whole, tensors_over
from dcs_tasks.checkpoint.format import (
    CODE_DTYPES,
    LATEST_NAME,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
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


Region = tuple[int, int, torch.Tensor]  # (begin, end, uint8 destination) inside one file


def _regions_of(size: int, targets: list[Region]) -> list[Region]:
    """Cover [0, size) with `targets` (sorted, disjoint) and scratch buffers for the gaps (header, padding)."""
    regions: list[Region] = []
    pos = 0
    for begin, end, dest in sorted(targets, key=lambda r: r[0]):
        if begin > pos:
            regions.append((pos, begin, torch.empty(begin - pos, dtype=torch.uint8)))
        regions.append((begin, end, dest))
        pos = end
    if pos < size:
        regions.append((pos, size, torch.empty(size - pos, dtype=torch.uint8)))
    return regions


def _read_file(
    path: Path, entry: FileEntry, verify: bool, progress: Progress | None, targets: list[Region] | None = None
) -> torch.Tensor | None:
    """Read `path` once, hashing it in order. Without `targets` the whole file lands in one uint8 tensor
    (returned); with them each region lands in its own destination (None is returned)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"checkpoint file {path} is missing", str(path)) from exc
    if size != entry.size:
        raise CorruptCheckpoint(f"checkpoint file {path} has {size} bytes, manifest says {entry.size}", str(path))
    whole = torch.empty(size, dtype=torch.uint8) if targets is None else None
    regions = [(0, size, whole)] if whole is not None else _regions_of(size, targets or [])
    hasher = new_hasher() if verify else None
    with open(path, "rb", buffering=0) as f:
        for begin, end, dest in regions:
            _read_region(f, path, begin, end, memoryview(dest.numpy()), hasher)  # type: ignore[arg-type]
            if progress is not None:
                progress(entry.name, end, size)
    if hasher is not None and hasher.hexdigest() != entry.checksum:
        raise CorruptCheckpoint(f"checkpoint file {path} fails its {entry.algorithm} checksum", str(path))
    return whole


def _read_region(f: Any, path: Path, begin: int, end: int, view: memoryview, hasher: Any) -> None:
    done = 0
    while done < end - begin:
        n = f.readinto(view[done : min(done + CHUNK_BYTES, end - begin)])
        if not n:
            raise CorruptCheckpoint(f"checkpoint file {path} ended early at byte {begin + done}", str(path))
        if hasher is not None:
            hasher.update(view[done : done + n])
        done += n


def read_files(
    step_dir: Path, manifest: Manifest, *, verify: bool = True, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """File name -> raw bytes (uint8 tensor) of every file; raises CorruptCheckpoint naming the file."""
    threads = max(1, min(READ_THREADS, len(manifest.files), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="dcs-read") as pool:
        futures = {f.name: pool.submit(_read_file, step_dir / f.name, f, verify, progress) for f in manifest.files}
        return {name: _whole(fut.result()) for name, fut in futures.items()}


def _whole(data: torch.Tensor | None) -> torch.Tensor:
    assert data is not None
    return data


def verify_step(step_dir: Path, manifest: Manifest, progress: Progress | None = None) -> None:
    """Check every file of a committed step against its size and checksum."""
    for entry in manifest.files:
        _read_file(step_dir / entry.name, entry, True, progress)


def load_tensors(
    step_dir: Path, manifest: Manifest, *, verify: bool = True, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Tensor name -> tensor, bit-exact to what was saved. Each tensor owns its storage (no views over a
    shared file buffer: some torch APIs, e.g. `set_rng_state`, ignore a view's storage offset) and the
    bytes are read straight into it, so a verified restore is still one sequential read per file.

    `into` (checked first with `check_targets`): the caller's tensors; contiguous CPU ones are read into
    directly (no second copy), others are filled with `copy_` after the read. If a file then fails its
    checksum the caller's tensors hold partial data and CorruptCheckpoint is raised."""
    if into is None:
        return _load_whole_files(step_dir, manifest, verify)
    tensors = {name: _destination(name, entry, into) for name, entry in manifest.tensors.items()}
    regions: dict[str, list[Region]] = {f.name: [] for f in manifest.files}
    for name, entry in manifest.tensors.items():
        begin, end = entry.offsets
        if end > begin:
            regions[entry.file].append((begin, end, tensors[name].reshape(-1).view(torch.uint8)))
    threads = max(1, min(READ_THREADS, len(manifest.files), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="dcs-read") as pool:
        futures = [pool.submit(_read_file, step_dir / f.name, f, verify, None, regions[f.name]) for f in manifest.files]
        for fut in futures:
            fut.result()
    if into is None:
        return tensors
    with torch.no_grad():
        for name, target in into.items():
            if tensors[name] is not target:
                target.copy_(tensors[name])
    return dict(into)


def _load_whole_files(step_dir: Path, manifest: Manifest, verify: bool) -> dict[str, torch.Tensor]:
    by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in manifest.files}
    for name, entry in manifest.tensors.items():
        by_file[entry.file][name] = entry

    def load(f: FileEntry) -> dict[str, torch.Tensor]:
        return tensors_over(read_whole(step_dir / f.name, f, verify), by_file[f.name])

    threads = max(1, min(READ_THREADS, len(manifest.files), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="dcs-read") as pool:
        parts = list(pool.map(load, manifest.files))
    loaded = {name: t for part in parts for name, t in part.items()}
    return {name: loaded[name] for name in manifest.tensors}


def _destination(name: str, entry: TensorEntry, into: dict[str, torch.Tensor] | None) -> torch.Tensor:
    target = into.get(name) if into is not None else None
    if target is not None and target.device.type == "cpu" and target.is_contiguous():
        return target
    return torch.empty(entry.shape, dtype=CODE_DTYPES[entry.dtype])


def check_targets(manifest: Manifest, targets: dict[str, torch.Tensor]) -> None:
    """`into=` must hold exactly the checkpoint's tensors with the same shapes and dtypes (StateMismatch
    names the first tensor that differs), checked before anything is read."""
    missing = [name for name in targets if name not in manifest.tensors]
    if missing:
        raise StateMismatch(f"checkpoint has no tensor {missing[0]!r} that the target state holds")
    extra = [name for name in manifest.tensors if name not in targets]
    if extra:
        raise StateMismatch(f"checkpoint tensor {extra[0]!r} has no counterpart in the target state")
    for name, dst in targets.items():
        entry = manifest.tensors[name]
        dtype = CODE_DTYPES[entry.dtype]
        if tuple(dst.shape) != tuple(entry.shape) or dst.dtype != dtype:
            raise StateMismatch(
                f"tensor {name!r}: checkpoint has {dtype} {tuple(entry.shape)}, "
                f"target has {dst.dtype} {tuple(dst.shape)}"
            )


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
