"""`dcs ckpt list|verify|inspect|gc|export|import --run R [--dir D]`: look after the checkpoints of a run on disk.

`verify` checks every step's manifest, files and safetensors headers and re-reads every file against its
checksum, prints progress on large files, one line per step, and exits 1 if any step is bad (naming the
file and the reason). With a replica root (`--replica-dir` or DCS_REPLICA_DIR) `list` says where each step
is (primary, replica, both), `verify` checks both copies and `gc` prunes both.
`list` and `inspect` report a step whose manifest does not check as BAD, never with a
traceback (manifests are untrusted input: `dcs_tasks.checkpoint.format.validate`).
`gc` applies the retention policy (`--keep-last`, `--keep-every`, or
DCS_KEEP_LAST / DCS_KEEP_EVERY) and spares steps the Redis ledger still has in flight when Redis answers.
`export --format hf` writes a step's tensors under `--prefix` as a Hugging Face directory, `export --format dcp`
a step saved through torch DCP (`dcs_tasks.integrations.dcp`) as a DCP directory; `import --format
dcp|hf` commits a torch DCP or Hugging Face checkpoint as a step, through the Redis ledger, without a worker
(`dcs_tasks.interop`). A run that does not exist is an error naming it (exit 1), for every subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dcs_tasks.config import DCSConfig
from dcs_tasks.storage import Location

PROGRESS_MIN_BYTES = 256 * 1024 * 1024


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("ckpt", help="list, verify, inspect or gc checkpoints")
    actions = parser.add_subparsers(dest="action", required=True)
    for name, func, text in (
        ("list", _list, "committed steps of a run"),
        ("verify", _verify, "check sizes and checksums of a run's checkpoints"),
        ("inspect", _inspect, "show one checkpoint's manifest summary"),
        ("gc", _gc, "delete checkpoints the retention policy lets go"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("--run", required=True, type=_run_name, help="run name (letters, digits, _ . -)")
        p.add_argument(
            "--dir",
            type=_root_arg,
            default=None,
            help="checkpoint root: a path or s3://bucket/prefix (default: DCS_CHECKPOINT_DIR)",
        )
        p.add_argument("--rank", type=int, default=None, help="one rank's part of a multi-rank run")
        p.add_argument(
            "--replica-dir",
            type=_root_arg,
            default=None,
            help="replica root: a path or s3://bucket/prefix (default: DCS_REPLICA_DIR; none if unset)",
        )
        p.set_defaults(func=func)
        if name in ("verify", "inspect"):
            p.add_argument("--step", type=int, default=None, help="one step (default: all / the newest)")
        if name == "gc":
            p.add_argument("--keep-last", type=int, default=None)
            p.add_argument("--keep-every", type=int, default=None)
    _register_interop(actions)


def _register_interop(actions: Any) -> None:
    p = actions.add_parser("export", help="write a step as a Hugging Face model or torch DCP directory")
    p.add_argument("--run", required=True, type=_run_name, help="run name (letters, digits, _ . -)")
    p.add_argument(
        "--dir",
        type=_root_arg,
        default=None,
        help="checkpoint root: a path or s3://bucket/prefix (default: DCS_CHECKPOINT_DIR)",
    )
    p.add_argument("--step", type=int, default=None, help="the step (default: the newest committed one)")
    p.add_argument(
        "--format",
        choices=["hf", "dcp"],
        default="hf",
        help="hf: model.safetensors (+ index when sharded); dcp: .metadata + .distcp of a step saved through DCP",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (new, or without weights in it)")
    p.add_argument("--prefix", default="model/", help="state keys holding the model ('' for a bare state_dict)")
    p.add_argument("--max-shard-size", default="5GB", help="shard above this many bytes (5GB, 500MB, 2GiB)")
    p.add_argument(
        "--tied", choices=["drop", "copy"], default="drop", help="tied keys: left out as transformers does, or copied"
    )
    p.add_argument("--config", type=Path, default=None, help="a config.json to copy next to the weights")
    p.set_defaults(func=_export)
    p = actions.add_parser("import", help="commit a torch DCP or Hugging Face checkpoint as a step of a run")
    p.add_argument("--run", required=True, type=_run_name, help="run name (letters, digits, _ . -)")
    p.add_argument(
        "--dir",
        type=_root_arg,
        default=None,
        help="checkpoint root: a path or s3://bucket/prefix (default: DCS_CHECKPOINT_DIR)",
    )
    p.add_argument("--step", type=int, required=True, help="the step number to commit it as")
    p.add_argument("--from", dest="source", type=Path, required=True, help="the checkpoint directory to read")
    p.add_argument("--format", choices=["dcp", "hf"], required=True)
    p.add_argument("--prefix", default=None, help="state keys to put it under (default: 'model/' for hf, '' for dcp)")
    p.set_defaults(func=_import)


def _run_name(value: str) -> str:
    """argparse type of `--run`: the run-name rule every entry point uses (no `..`, `/etc`, hidden names)."""
    from dcs_tasks.checkpoint.store.payloads import run_name_problem

    problem = run_name_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _root_arg(value: str) -> Any:
    """argparse type of `--dir` / `--replica-dir`: a path, file:// or s3:// URL (never `s3:/...` as a folder)."""
    from dcs_tasks.errors import ConfigError
    from dcs_tasks.storage import parse_root

    try:
        return parse_root(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_root(args: argparse.Namespace) -> Location:
    from dcs_tasks import storage

    config = DCSConfig()
    root = storage.parse_root(args.dir) if args.dir is not None else config.checkpoint.dir
    return storage.root(root, config) / args.run


def _run_dir(args: argparse.Namespace) -> Location:
    from dcs_tasks.checkpoint.restore.sharded import rank_dir_name

    root = _run_root(args)
    return root / rank_dir_name(args.rank) if args.rank is not None else root


def _locations(args: argparse.Namespace) -> list[tuple[str, Location]]:
    """(location, run directory or rank directory) of the primary and, when a replica root is set, the replica."""
    from dcs_tasks import storage
    from dcs_tasks.checkpoint.replicas import PRIMARY, REPLICA
    from dcs_tasks.checkpoint.restore.sharded import rank_dir_name

    found = [(PRIMARY, _run_dir(args))]
    config = DCSConfig()
    if config.memory.budget_bytes > 0:  # this host's memory tier, read first by restore
        from dcs_tasks.checkpoint.store.tiers.memdir import memory_root
        from dcs_tasks.checkpoint.store.tiers.stepplaces import MEMORY

        run = memory_root(config) / args.run
        found.insert(0, (MEMORY, run / rank_dir_name(args.rank) if args.rank is not None else run))
    replica = storage.parse_root(args.replica_dir) if args.replica_dir is not None else config.checkpoint.replica_dir
    if replica is not None:
        run = storage.root(replica, config) / args.run
        found.append((REPLICA, run / rank_dir_name(args.rank) if args.rank is not None else run))
    return found


def _where(locations: list[str]) -> str:
    from dcs_tasks.checkpoint.replicas import where

    if any(loc not in ("primary", "replica") for loc in locations):
        return "+".join(sorted(locations))
    return where(locations)


def _recorded(args: argparse.Namespace) -> dict[int, str]:
    """Memory tier on: step -> the places Redis records for it (`dcs_tasks.checkpoint.store.tiers`), rank by rank."""
    config = DCSConfig()
    if config.memory.budget_bytes <= 0:
        return {}
    import redis

    from dcs_tasks.checkpoint.store.tiers.stepplaces import Places
    from dcs_tasks.keys import Keys
    from dcs_tasks.redisconn import sync_client

    client = sync_client(config)
    try:
        found = Places(client, Keys(config.redis.namespace)).read(args.run)
    except redis.RedisError as exc:
        print(f"dcs ckpt list: where steps live is unknown (Redis: {exc})", file=sys.stderr)
        return {}
    finally:
        client.close()
    by_step: dict[int, list[str]] = {}
    for (step, rank), places in sorted(found.items()):
        if args.rank is None or args.rank == rank:
            by_step.setdefault(step, []).append(f"rank {rank}: " + " ".join(sorted(places)))
    return {step: "; ".join(parts) for step, parts in by_step.items()}


def _list(args: argparse.Namespace) -> int:
    """One line per step: when, size, files, where it is (primary, replica, both; with the memory tier: memory
    too, and the places Redis records: `mem@<host>`, `peer@<host>`, `storage`, `replicated`), `<- latest`; a
    copy whose manifest does not check is listed as BAD next to it."""
    from dcs_tasks.checkpoint.replicas import PRIMARY
    from dcs_tasks.checkpoint.restore.reader import load_manifest, read_latest, step_dirs
    from dcs_tasks.checkpoint.restore.sharded import rank_dirs
    from dcs_tasks.errors import CorruptCheckpoint

    places = [(location, d) for location, d in _locations(args) if d.is_dir()]
    recorded = _recorded(args)
    shown = len(_locations(args)) > 1  # without a replica root: the listing it always had
    if not places:
        what = f"run {args.run!r}" + (f" rank {args.rank}" if args.rank is not None else "")
        print(f"dcs ckpt list: {what} has no checkpoints: {_run_dir(args)} does not exist", file=sys.stderr)
        return 1
    if args.rank is None and any(rank_dirs(d) for _, d in places):
        return _list_ranks(places, shown, recorded)
    latest = max((s for _, d in places if (s := read_latest(d)) is not None), default=None)
    good: dict[int, dict[str, Any]] = {}
    bad: dict[int, dict[str, str]] = {}
    for location, run_dir in places:
        for step, step_dir in step_dirs(run_dir):
            try:
                good.setdefault(step, {})[location] = load_manifest(step_dir)
            except CorruptCheckpoint as exc:
                bad.setdefault(step, {})[location] = str(exc)
    for step in sorted(set(good) | set(bad)):
        damaged = "".join(f"  ({location} BAD: {why})" for location, why in bad.get(step, {}).items())
        if step not in good:
            print(f"{step:>10}  BAD (not restorable): " + (damaged.strip() if shown else bad[step][PRIMARY]))
            continue
        m = next(iter(good[step].values()))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at))
        mark = "  <- latest" if step == latest else ""
        place = f"  {_where(list(good[step])):<7}" if shown else ""
        size = f"{m.total_bytes / 2**20:10.1f} MiB  {len(m.files):3d} files{_shared(m)}"
        tiers = f"  [{recorded[step]}]" if step in recorded else ""
        print(f"{step:>10}  {when}  {size}{place}{mark}{tiers}{damaged}")
    return 0


def _shared(manifest: Any) -> str:
    """`(N MiB written, M files from earlier steps)` for a step that reuses files (incremental saves)."""
    shared = [f for f in manifest.files if f.source_step is not None]
    if not shared:
        return ""
    written = (manifest.total_bytes - sum(f.size for f in shared)) / 2**20
    return f"  ({written:.1f} MiB written, {len(shared)} from earlier steps)"


def _list_ranks(places: list[tuple[str, Location]], shown: bool, recorded: dict[int, str]) -> int:
    """A multi-rank run: steps every rank committed (restorable) and where, then corrupt steps, then steps some
    rank is missing."""
    from dcs_tasks.checkpoint.replicas import PRIMARY
    from dcs_tasks.checkpoint.restore.sharded import StepShards, incomplete_steps, scan_steps

    complete: dict[int, dict[str, StepShards]] = {}
    broken: dict[int, dict[str, Exception]] = {}
    for location, root in places:
        ok, damaged = scan_steps(root)
        for step, shards in ok.items():
            complete.setdefault(step, {})[location] = shards
        for step, exc in damaged.items():
            broken.setdefault(step, {})[location] = exc
    for step in sorted(complete):
        shards = next(iter(complete[step].values()))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(shards.manifests[0].created_at))
        size = sum(m.total_bytes for m in shards.manifests.values()) / 2**20
        place = f"  {_where(list(complete[step]))}" if shown else ""
        tiers = f"  [{recorded[step]}]" if step in recorded else ""
        print(f"{step:>10}  {when}  {size:10.1f} MiB  {shards.world_size:3d} ranks{place}{tiers}")
    for step, errors in sorted(broken.items()):
        if step not in complete:
            why = "; ".join(f"{loc}: {exc}" for loc, exc in errors.items()) if shown else str(errors[PRIMARY])
            print(f"{step:>10}  BAD (not restorable): {why}")
    primary = next((d for loc, d in places if loc == PRIMARY), places[0][1])
    for step, ranks in sorted(incomplete_steps(primary).items()):
        if step not in broken and step not in complete:
            print(f"{step:>10}  incomplete: only ranks {ranks} committed it (not restorable)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Every step (or `--step`) in every location: manifest, files, headers and checksums; one line per step
    and copy, 1 if any is bad."""
    from dcs_tasks.checkpoint.restore.reader import load_manifest, step_dirs, verify_step
    from dcs_tasks.errors import CorruptCheckpoint

    places = _locations(args)
    found = [(loc, s, d) for loc, run_dir in places for s, d in step_dirs(run_dir) if args.step in (None, s)]
    if not found:
        print(f"no committed checkpoint found in {_run_dir(args)}", file=sys.stderr)
        return 1
    bad = 0
    for location, step, step_dir in sorted(found, key=lambda f: (f[1], f[0])):
        name = f"step {step}" + (f" ({location})" if len(places) > 1 else "")
        try:
            verify_step(step_dir, load_manifest(step_dir), progress=_progress)
        except CorruptCheckpoint as exc:
            print(f"{name}: BAD: {exc}", file=sys.stderr)
            bad += 1
            continue
        print(f"{name}: ok")
    return 1 if bad else 0


def _progress(name: str, done: int, size: int) -> None:
    if size >= PROGRESS_MIN_BYTES:
        end = "\n" if done >= size else "\r"
        print(f"  {name}: {100 * done // size:3d}% of {size / 2**20:.0f} MiB", end=end, file=sys.stderr, flush=True)


def _inspect(args: argparse.Namespace) -> int:
    from dcs_tasks.checkpoint.restore.reader import describe, load_manifest, step_dirs
    from dcs_tasks.errors import CorruptCheckpoint

    dirs = dict(step_dirs(_run_dir(args)))
    step = args.step if args.step is not None else max(dirs, default=None)
    if step is None or step not in dirs:
        print(f"no committed step {args.step if args.step is not None else ''} in {_run_dir(args)}", file=sys.stderr)
        return 1
    try:
        manifest = load_manifest(dirs[step])
    except CorruptCheckpoint as exc:
        print(f"step {step}: BAD: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(describe(manifest), indent=2))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from dcs_tasks.checkpoint.store.ledger.retention import apply_retention
    from dcs_tasks.checkpoint.store.payloads import RetentionPolicy
    from dcs_tasks.storage import store_of

    config = DCSConfig()
    policy = RetentionPolicy(
        keep_last=args.keep_last or config.checkpoint.keep_last,
        keep_every=args.keep_every or config.checkpoint.keep_every,
    )
    if not policy.active:
        print("nothing to do: give --keep-last (or set DCS_KEEP_LAST)", file=sys.stderr)
        return 2
    in_flight, refs = _in_flight(config, args.run)
    places = _locations(args)
    lock = _object_lock(config)  # a run in an object store is fenced by its refs lock in Redis, not an flock
    for location, run_dir in places:
        local = store_of(run_dir).local_path(run_dir)  # a directory (object keys have no links to follow)
        if local is not None and location != places[0][0] and not local.is_dir():
            continue
        near = [] if local is None else [local, local.parent][: 1 + (args.rank is not None)]
        linked = next((d for d in near if d.is_symlink()), None)
        # the worker's retention refuses the same (dcs_tasks/checkpoint/trust.py resolves every path)
        if linked is not None:
            print(f"dcs ckpt gc: {location} run directory {str(linked)!r} is a symlink: not followed", file=sys.stderr)
            return 2
        deleted = apply_retention(run_dir, policy, in_flight, refs, object_lock=lock)
        prefix = f"{location}: " if len(places) > 1 else ""  # one root: the output it always had
        print(f"{prefix}deleted steps: {deleted}" if deleted else f"{prefix}nothing to delete")
    return 0


def _object_lock(config: DCSConfig) -> Any:
    """The `refs` lock of a run in an object store, on the configured Redis (the worker's retention takes it)."""
    from dcs_tasks.checkpoint.store.ledger import objlocks
    from dcs_tasks.keys import Keys
    from dcs_tasks.redisconn import sync_client

    client = sync_client(config, socket_timeout=5)
    return lambda where: objlocks.run_lock(client, Keys(config.redis.namespace), where, "refs")


def _in_flight(config: DCSConfig, run: str) -> tuple[set[int], Any]:
    """The steps in flight and a reader of the files they refer to (empty when Redis does not answer)."""
    import redis

    from dcs_tasks.checkpoint.store.ledger.retention import in_flight_refs
    from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger
    from dcs_tasks.keys import Keys
    from dcs_tasks.redisconn import sync_client

    client = sync_client(config, socket_timeout=2, decode_responses=False)
    book = StepLedger(client, Keys(config.redis.namespace))
    try:
        steps = book.in_flight_steps(run)
    except redis.RedisError as exc:
        print(f"warning: Redis unreachable ({exc}); in-flight steps cannot be spared", file=sys.stderr)
        client.close()
        return set(), set

    def refs() -> Any:
        try:
            return in_flight_refs(book, run)
        finally:
            client.close()

    return steps, refs


def _export(args: argparse.Namespace) -> int:
    from dcs_tasks.errors import CheckpointError
    from dcs_tasks.interop.hf_export import export_hf, parse_size

    try:
        run_root = _run_root(args)
        if not run_root.is_dir():
            raise CheckpointError(f"run {args.run!r} has no checkpoints: {run_root} does not exist")
        if args.format == "dcp":
            return _export_dcp(args, run_root)
        result = export_hf(
            run_root,
            args.out,
            step=args.step,
            prefix=args.prefix,
            max_shard_bytes=parse_size(args.max_shard_size),
            tied=args.tied,
            config_path=args.config,
        )
    except CheckpointError as exc:
        print(f"dcs ckpt export: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(
        f"exported step {result.step} of run {args.run!r}: {result.tensors} tensors, "
        f"{result.total_bytes / 2**20:.1f} MiB in {len(result.files)} file(s) to {result.out_dir}"
    )
    for alias, source in result.tied.items():
        print(f"  tied: {alias} -> {source} (left out; from_pretrained ties it again)")
    return 0


def _export_dcp(args: argparse.Namespace, run_root: Location) -> int:
    from dcs_tasks.interop.dcp_steps import export_dcp

    done = export_dcp(args.run, run_root, args.out, step=args.step)
    print(
        f"exported step {done.step} of run {args.run!r} as torch DCP: {done.tensors} tensors, {done.values} other "
        f"values, {done.total_bytes / 2**20:.1f} MiB to {done.out_dir}"
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    from dcs_tasks.errors import CheckpointError
    from dcs_tasks.interop.foreign import read_dcp_dir, read_hf_dir
    from dcs_tasks.interop.names import normalise_prefix, prefix_keys
    from dcs_tasks.interop.writer import write_step

    config = DCSConfig()
    if args.dir is not None:
        config = config.model_copy(update={"checkpoint_dir": args.dir})
    default = "model/" if args.format == "hf" else ""
    try:
        keys = prefix_keys(normalise_prefix(default if args.prefix is None else args.prefix))
        state: Any = read_hf_dir(args.source) if args.format == "hf" else read_dcp_dir(args.source)
        for key in reversed(keys):
            state = {key: state}
        origin = {"imported_from": {"format": args.format, "path": str(args.source.resolve())}}
        step_dir = write_step(state, run=args.run, step=args.step, config=config, metadata=origin)
    except CheckpointError as exc:
        print(f"dcs ckpt import: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"imported {args.source} ({args.format}) as step {args.step} of run {args.run!r}: {step_dir}")
    return 0
