"""Read committed checkpoints: list, verify, load, restore in place.

Only step directories with a `manifest.json` exist for readers (a partial step has none). Loading reads
each file once through its store's verified reader (`store/reads/verified.py`: for files 32 MiB chunks read by
4 threads, O_DIRECT into new memory or buffered straight into `into=` tensors; for objects parallel ranged
GETs; hashed in order on the way), so a verified restore costs one read of the bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME, Manifest, TensorEntry, step_dir_name
from dcs_tasks.checkpoint.format.layout import STEP_DIR as STEP_DIR
from dcs_tasks.checkpoint.restore.lend import Unmappable, copy_sealed, map_many
from dcs_tasks.checkpoint.restore.tensorviews import tensors_over
from dcs_tasks.checkpoint.store.ledger.steps import read_latest as read_latest
from dcs_tasks.checkpoint.store.ledger.steps import step_dirs as step_dirs
from dcs_tasks.checkpoint.store.reads import verified
from dcs_tasks.checkpoint.store.reads.landing import Progress, Target
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files, read_manifest
from dcs_tasks.checkpoint.store.tiers.seal import Stamp, read_seals
from dcs_tasks.errors import CorruptCheckpoint, StateMismatch
from dcs_tasks.storage import Location, store_of
from dcs_tasks.tensors import code_dtype

if TYPE_CHECKING:  # torch is imported by the functions that make tensors: listing and verifying need none
    import torch


def load_manifest(step_dir: Location) -> Manifest:
    """The step's manifest, checked as untrusted input (`stepcheck.read_manifest`: names, sizes, offsets, shapes,
    dtypes, the structure's form) and its structure decoded against torch (`structure.check_structure`: dtype
    and device names torch knows); CorruptCheckpoint names the manifest and the reason. Imports torch on first
    use: a worker that only lists steps or reads `latest` through this module does not."""
    from dcs_tasks.checkpoint.state.structure import check_structure

    manifest = read_manifest(step_dir)
    try:
        check_structure(manifest.structure, manifest.tensors.keys())
    except CorruptCheckpoint as exc:
        path = step_dir / MANIFEST_NAME
        raise CorruptCheckpoint(f"{path}: {exc}", str(path)) from exc
    return manifest


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
    """Read every file of the step once into `targets` (file name -> ranges), through the verified reader its
    store picks (`verified.read_scatter`: reads of descriptors, or ranged GETs)."""
    verified.read_scatter(
        [(f.stored_path(step_dir), f, targets.get(f.name, [])) for f in manifest.files], verify, progress
    )


class Source(enum.Enum):
    """Which copy of a step a restore reads, and so how it reads it."""

    STORAGE = "storage"
    """Storage (or a copy fetched from it): every file read, and hashed unless `verify` is off."""
    MEMORY = "memory"
    """This host's memory tier, every byte hashed again (`memory_restore_verify="hash"`): the files are mapped,
    lent without `into`, and with `into` read like storage's."""
    SEALED = "sealed"
    """This host's memory tier, trusting seals: a file that matches its seal (`seal.read_seals`) was hashed on
    arrival and is not hashed again; with `into` the files are mapped and copied on several cores."""


def load_tensors(
    step_dir: Location,
    manifest: Manifest,
    *,
    verify: bool = True,
    into: dict[str, torch.Tensor] | None = None,
    source: Source = Source.STORAGE,
) -> dict[str, torch.Tensor]:
    """Tensor name -> tensor, bit-exact to what was saved. Each tensor owns its storage (no views over a
    shared file buffer: some torch APIs, e.g. `set_rng_state`, ignore a view's storage offset). Every file
    is read once (`verified.read_many` / `read_scatter`), hashed while the next chunks are in flight.

    `into` (checked first with `check_targets`): the caller's tensors; contiguous CPU ones are read into
    directly (no second copy), others are filled with `copy_` after the read. If a file then fails its
    checksum the caller's tensors hold partial data and CorruptCheckpoint is raised. `manifest` comes from
    `load_manifest` (checked); the files are checked against it (`stepcheck.check_files`) before anything is
    allocated or read.

    `source` MEMORY or SEALED (a step in this host's memory tier): without `into` the tensors are copy-on-write
    views of the tmpfs files' own pages (`lend.map_many`: no copy; the bytes verified after mapping unless
    sealed; a file that cannot be lent is read); with `into` the files are mapped and copied on several cores
    (`lend.copy_sealed`) when none needs a hash."""
    import torch

    check_files(step_dir, manifest)
    mapped = source is not Source.STORAGE
    local = store_of(step_dir).local_path(step_dir)  # a memory-tier step is local files: mapped, sealed
    seals = read_seals(local) if source is Source.SEALED and local is not None else {}
    if into is None:
        return _load_whole_files(step_dir, manifest, verify, mapped, seals)
    tensors = {name: _destination(name, entry, into) for name, entry in manifest.tensors.items()}
    targets: dict[str, list[Target]] = {f.name: [] for f in manifest.files}
    for name, entry in manifest.tensors.items():
        begin, end = entry.offsets
        if end > begin:
            dest = tensors[name].detach().reshape(-1).view(torch.uint8).numpy().data
            targets[entry.file].append((begin, end, dest))
    if not (mapped and local is not None and _copy_mapped(local, manifest, targets, verify, seals)):
        scatter(step_dir, manifest, targets, verify)
    with torch.no_grad():
        for name, target in into.items():
            if tensors[name] is not target:
                target.copy_(tensors[name])
    return dict(into)


def _copy_mapped(
    step_dir: Path, manifest: Manifest, targets: Mapping[str, list[Target]], verify: bool, seals: dict[str, Stamp]
) -> bool:
    """`lend.copy_sealed` of the step's files into `targets`; False (nothing written) when it cannot."""
    try:
        copy_sealed([(f.stored_path(step_dir), f, targets.get(f.name, [])) for f in manifest.files], verify, seals)
    except Unmappable:
        return False
    return True


def _load_whole_files(
    step_dir: Location, manifest: Manifest, verify: bool, mapped: bool = False, seals: dict[str, Stamp] | None = None
) -> dict[str, torch.Tensor]:
    by_file: dict[str, dict[str, TensorEntry]] = {f.name: {} for f in manifest.files}
    for name, entry in manifest.tensors.items():
        by_file[entry.file][name] = entry
    local = store_of(step_dir).local_path(step_dir)  # a memory-tier step's files can be lent (mapped)
    try:
        if not mapped or local is None:
            raise Unmappable("not a memory-tier step")
        mappings = map_many([(f.stored_path(local), f) for f in manifest.files], verify, seals)
    except Unmappable:
        mappings = verified.read_many([(f.stored_path(step_dir), f) for f in manifest.files], verify)
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
