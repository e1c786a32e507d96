"""Export a committed step as a Hugging Face model directory (`dcs ckpt export --format hf`).

The tensors under a prefix of the saved state (`model/` for `save({"model": model.state_dict(), ...})`)
become `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`
when they exceed `max_shard_bytes`, named with the prefix stripped, metadata `{"format": "pt"}`: what
`transformers`' `from_pretrained` and `safetensors.torch.load_file` read.

Tied weights: a step stores a tied tensor once, under the first key that reached it, and its structure lists
every key. By default each tied group is written once, under its first key inside the prefix, and the other
keys are left out, as `transformers`' `save_pretrained` does (it drops `lm_head.weight` when it is tied to
`model.embed_tokens.weight`, and `from_pretrained` ties it again from the model's config). `tied="copy"`
writes every key (for consumers that `load_state_dict(load_file(...))` strictly).

Reading is verified: every source file that holds an exported tensor is read once (`verified.read_scatter`: its
store's verified reader) straight into the output files' mappings and checked against its xxh3_128 checksum; a file
that fails makes the export fail with `CorruptCheckpoint` naming it, and no output file is left behind (each is
written to a temp name and renamed only after every read verified). Source files holding no exported tensor
(optimizer state) are not read. A multi-rank run is gathered first as a single trainer would restore it (sharded
tensors joined, `dcs_tasks.checkpoint.restore.sharded`): every file of the ranks it needs is read and verified, and
the whole state is held in memory.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcs_tasks.checkpoint.format.layout import DATA_ALIGN, Layout, Manifest, TensorSlot, TensorSpec, plan_layout
from dcs_tasks.checkpoint.restore.reader import load_manifest, load_tensors, step_dirs
from dcs_tasks.checkpoint.restore.sharded import (
    StepShards,
    assemble,
    incomplete_steps,
    plan_reshard,
    rank_dirs,
    scan_steps,
)
from dcs_tasks.checkpoint.store.reads import verified
from dcs_tasks.checkpoint.store.reads.landing import Target
from dcs_tasks.checkpoint.store.reads.stepcheck import check_files, read_small
from dcs_tasks.checkpoint.store.writes.durable import durable_file, write_all, write_bytes_durably
from dcs_tasks.errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint
from dcs_tasks.interop.names import normalise_prefix, tensor_paths
from dcs_tasks.storage import Location
from dcs_tasks.storage.fs import make_dirs_durable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
MAX_CONFIG_BYTES = 16 * 1024 * 1024
TIED_MODES = ("drop", "copy")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """Bytes from "5GB" / "500MB" / "2GiB" / "1048576" (decimal units as in `transformers`, binary with "i")."""
    match = _SIZE.match(text)
    if match is None or int(match.group(1)) <= 0:
        raise CheckpointError(f"size {text[:40]!r} is not a positive size like 5GB, 500MB, 2GiB or 1048576")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


@dataclass(frozen=True)
class ExportResult:
    step: int
    out_dir: Path
    files: list[str]
    tensors: int
    total_bytes: int
    tied: dict[str, str] = field(default_factory=dict)  # left-out key -> the key it is tied to (tied="drop")


@dataclass(frozen=True)
class _Pick:
    """One output tensor: its Hugging Face name and the step tensor it comes from."""

    name: str
    stored: str


def export_hf(
    run_dir: Location,
    out_dir: Path,
    *,
    step: int | None = None,
    prefix: str = "model/",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tied: str = "drop",
    config_path: Path | None = None,
) -> ExportResult:
    """Write step `step` (default: the newest committed step) of the run in `run_dir` to `out_dir` as a
    Hugging Face directory. CheckpointNotFound when the step does not exist (or, in a multi-rank run, not
    every rank committed it), CorruptCheckpoint when it does not verify, CheckpointError for a prefix that
    selects nothing, names that clash, DTensor shards, or an `out_dir` that already holds weights."""
    if tied not in TIED_MODES:
        raise CheckpointError(f"tied must be one of {TIED_MODES}, not {tied!r}")
    shards = _complete_step(run_dir, step) if rank_dirs(run_dir) else None
    step_dir, manifest = _committed_step(run_dir, step) if shards is None else (None, shards.manifests[0])
    picks, dropped = _select(manifest, normalise_prefix(prefix), tied)
    _check_out_dir(out_dir)
    config = _read_config(config_path) if config_path is not None else None
    gathered = _gather(shards, picks) if shards is not None else None
    specs = [_spec(p, manifest) if gathered is None else TensorSpec.of(p.name, gathered[p.stored]) for p in picks]
    layout = plan_layout(specs, max_shard_bytes)
    single = len(layout.files) == 1
    tensor_bytes = sum(slot.end - slot.begin for f in layout.files for slot in f.slots)
    names = [SINGLE_FILE] if single else [f.name for f in layout.files]
    make_dirs_durable(out_dir)
    if gathered is not None:
        _write_gathered(gathered, picks, layout, out_dir, names)
    else:
        assert step_dir is not None
        check_files(step_dir, manifest)  # names, sizes and headers of the source before any data is read
        _write_files(step_dir, manifest, picks, layout, out_dir, names)
    if not single:
        weight_map = {slot.spec.name: name for f, name in zip(layout.files, names, strict=True) for slot in f.slots}
        index = {"metadata": {"total_size": tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_bytes_durably(out_dir / INDEX_FILE, json.dumps(index, indent=2).encode() + b"\n", "dcs-export")
    if config is not None:
        write_bytes_durably(out_dir / CONFIG_FILE, config, "dcs-export")
    return ExportResult(manifest.step, out_dir, names, len(picks), tensor_bytes, dropped)


def _committed_step(run_dir: Location, step: int | None) -> tuple[Location, Manifest]:
    dirs = dict(step_dirs(run_dir))
    if not dirs:
        raise CheckpointNotFound(f"no committed checkpoint in {run_dir}")
    chosen = max(dirs) if step is None else step
    if chosen not in dirs:
        raise CheckpointNotFound(f"no committed step {chosen} in {run_dir} (committed: {sorted(dirs)[-8:]})")
    return dirs[chosen], load_manifest(dirs[chosen])


def _complete_step(run_root: Location, step: int | None) -> StepShards:
    """A step every rank of a multi-rank run committed (default: the newest); CorruptCheckpoint when a rank's
    manifest of it does not check, CheckpointNotFound when it is missing or incomplete."""
    complete, broken = scan_steps(run_root)
    chosen = max(set(complete) | set(broken), default=None) if step is None else step
    if chosen is not None and chosen in broken:
        raise broken[chosen]
    if chosen is None or chosen not in complete:
        partial = incomplete_steps(run_root).get(chosen) if chosen is not None else None
        detail = f": only ranks {partial} committed it" if partial else ""
        raise CheckpointNotFound(f"no step {chosen} that every rank committed in {run_root}{detail}")
    return complete[chosen]


def _gather(shards: StepShards, picks: list[_Pick]) -> dict[str, torch.Tensor]:
    """The exported tensors of a multi-rank step as one trainer would restore them (`plan_reshard` to world
    size 1: sharded tensors joined along their dimension, rank-local ones from rank 0), every file read
    verified. Holds the whole state in memory."""
    plan = plan_reshard(shards, 0, 1)
    loaded = {src: load_tensors(shards.dirs[src], shards.manifests[src], verify=True) for src in plan.sources}
    tensors = assemble(plan, shards, loaded)
    return {p.stored: tensors[p.stored] for p in picks}


def _write_gathered(
    tensors: dict[str, torch.Tensor], picks: list[_Pick], layout: Layout, out_dir: Path, names: list[str]
) -> None:
    """Write in-memory tensors: each file's header, then its slots' bytes in order (`plan_layout` leaves no
    gaps), durably; any failure removes every temp file."""
    stored_of = {p.name: p.stored for p in picks}
    with contextlib.ExitStack() as stack:
        for f, name in zip(layout.files, names, strict=True):
            fd = stack.enter_context(durable_file(out_dir / name, "dcs-export"))
            write_all(fd, memoryview(hf_header(f.slots)))
            for slot in f.slots:
                if slot.end > slot.begin:
                    data = tensors[stored_of[slot.spec.name]].contiguous().reshape(-1).view(torch.uint8)
                    write_all(fd, data.numpy().data)


def _select(manifest: Manifest, prefix: str, tied: str) -> tuple[list[_Pick], dict[str, str]]:
    """The output tensors (state order) and, with tied="drop", the left-out tied keys."""
    paths = tensor_paths(manifest.structure)
    inside = [p for p in paths if p.path.startswith(prefix) and len(p.path) > len(prefix)]
    if not inside:
        tops = sorted({p.path.split("/", 1)[0] for p in paths})[:12]
        raise CheckpointError(
            f"step {manifest.step} has no tensor under prefix {prefix!r} (top-level keys with tensors: {tops}); "
            "pick one with --prefix ('' for a bare state_dict)"
        )
    picks: list[_Pick] = []
    first: dict[str, str] = {}  # stored name -> the output name it was first written under
    dropped: dict[str, str] = {}
    seen: set[str] = set()
    for p in inside:
        name = p.path[len(prefix) :]
        if p.dtensor:
            raise CheckpointError(f"tensor {p.path!r} is one rank's DTensor shard: restore the full state and export")
        if name in seen or name == "__metadata__":
            raise CheckpointError(f"two tensors of step {manifest.step} export under the same name {name!r}")
        seen.add(name)
        if p.stored in first and tied == "drop":
            dropped[name] = first[p.stored]
            continue
        first.setdefault(p.stored, name)
        picks.append(_Pick(name, p.stored))
    return picks, dropped


def _spec(pick: _Pick, manifest: Manifest) -> TensorSpec:
    entry = manifest.tensors[pick.stored]
    return TensorSpec(pick.name, entry.dtype, tuple(entry.shape), entry.offsets[1] - entry.offsets[0])


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to mix with weights already there (a stale shard would be loaded with the new ones)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir} exists and is not a directory")
    if not out_dir.is_dir():
        return
    clash = sorted(
        p.name for p in out_dir.iterdir() if p.name == INDEX_FILE or re.fullmatch(r"model.*\.safetensors", p.name)
    )
    if clash:
        raise CheckpointError(f"{out_dir} already holds {clash[:4]}: export into an empty or new directory")


def _read_config(path: Path) -> bytes:
    """A model config to copy next to the weights: a regular file holding a JSON object (size bounded)."""
    try:
        raw = read_small(path, MAX_CONFIG_BYTES)
        parsed = json.loads(raw)
    except (CorruptCheckpoint, ValueError, RecursionError) as exc:
        raise CheckpointError(f"config {path} is not a readable JSON file: {exc}") from exc
    if not isinstance(parsed, dict):
        raise CheckpointError(f"config {path} is not a JSON object")
    return raw


def hf_header(slots: tuple[TensorSlot, ...]) -> bytes:
    """A safetensors header with metadata {"format": "pt"} (what `transformers` checks), padded with spaces
    so that data starts on a `DATA_ALIGN` boundary."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for slot in slots:
        header[slot.spec.name] = {
            "dtype": slot.spec.dtype,
            "shape": list(slot.spec.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(raw)) // DATA_ALIGN) * DATA_ALIGN - 8
    return struct.pack("<Q", padded) + raw + b" " * (padded - len(raw))


def _unmap(mapping: mmap.mmap) -> None:
    """Flush and unmap; a view still held by a read that failed leaves the unmapping to the collector (the
    failure itself, not a BufferError, is what the caller must see)."""
    mapping.flush()
    with contextlib.suppress(BufferError):
        mapping.close()


def _write_files(
    step_dir: Location, manifest: Manifest, picks: list[_Pick], layout: Layout, out_dir: Path, names: list[str]
) -> None:
    """Map every output file (temp name), read the source files once into them (verified), then fsync and
    rename each. Any failure removes every temp file."""
    stored_of = {p.name: p.stored for p in picks}
    with contextlib.ExitStack() as stack:
        views: dict[str, memoryview] = {}  # output tensor name -> its bytes in the output mapping
        for f, name in zip(layout.files, names, strict=True):
            fd = stack.enter_context(durable_file(out_dir / name, "dcs-export"))
            header = hf_header(f.slots)
            size = len(header) + sum(s.end - s.begin for s in f.slots)
            os.ftruncate(fd, size)
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the temp file again: mmap needs read access
            try:
                mapping = mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(rw)
            stack.callback(_unmap, mapping)  # runs before the file's fsync and rename (LIFO)
            whole = memoryview(mapping)
            stack.callback(whole.release)
            whole[: len(header)] = header
            for slot in f.slots:
                views[slot.spec.name] = whole[len(header) + slot.begin : len(header) + slot.end]
                stack.callback(views[slot.spec.name].release)
        targets: dict[str, list[Target]] = {}
        first_out: dict[str, str] = {}
        for pick in picks:
            entry = manifest.tensors[pick.stored]
            if pick.stored in first_out or entry.offsets[1] == entry.offsets[0]:
                continue  # a tied copy (filled below) or an empty tensor
            first_out[pick.stored] = pick.name
            targets.setdefault(entry.file, []).append((entry.offsets[0], entry.offsets[1], views[pick.name]))
        files = [(f.stored_path(step_dir), f, targets[f.name]) for f in manifest.files if f.name in targets]
        verified.read_scatter(files, verify=True)  # the store's reader: descriptors, or ranged GETs
        for name, stored in stored_of.items():
            if stored in first_out and first_out[stored] != name:
                views[name][:] = views[first_out[stored]]
