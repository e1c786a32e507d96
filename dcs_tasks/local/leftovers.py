"""What DCS leaves on a host once its processes are gone, found for `dcs clean`.

DCS keeps host-local files in tmpfs and the temp dir; they outlive the processes that made them when those die
without cleaning up (kill -9, a crash, an older release). Found here, and only this user's own (never another
uid's, never through a link):

- staging buffers of trainers that are gone: `<staging>/dcs-<namespace>-<run>-<pid>-<8 hex>-<i>.stage` whose pid
  no longer exists (a live trainer's, or one a process still maps or holds open, is kept);
- the memory tier's leftovers: the recycle pool (`.recycle`: files of steps that left memory, kept to be
  overwritten) and partial copies (`.incoming-*` and other dot entries); committed steps too with
  `memory_steps` (they are restorable: a restart of the trainer on this host reads them);
- host agent sockets no agent holds (`agent-*.sock` whose lock is free, and the lock);
- Prometheus directories of workers that are gone (`dcs_tasks/metricsdir.py`);
- the older layout, when `legacy_shm` is given (the runtime directory is the default): staging files and agent
  sockets directly in /dev/shm (`dcs-agent-*.sock` nobody answers), and the old memory directory
  `/dev/shm/dcs-memory`, whole, unless it is the configured one.

`survey` only looks; `remove` deletes what it is handed. `services_using` names the running `dcs worker`, `dcs up`
and `dcs demo` processes of this user whose directories (from their environment) are the ones surveyed: while
one runs, nothing is safe to remove (a worker may be about to read a dead trainer's last staging file, or be
receiving a copy), so `dcs clean` refuses.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dcs_tasks import hostagent, hostdirs, metricsdir
from dcs_tasks.checkpoint.store.tiers.memdir import RECYCLE_DIR
from dcs_tasks.config import HOST_DIR_LEAVES, DCSConfig
from dcs_tasks.process import pid_alive

STAGE_NAME = re.compile(r"dcs-.+-(\d+)-[0-9a-f]{8}-\d+\.stage")  # layout.staging_name_pattern, any run
LEGACY_SHM = Path("/dev/shm")
LEGACY_MEMORY = "dcs-memory"
SERVICES = frozenset({"worker", "up", "demo"})
MAX_ENTRIES = 65536  # directory entries looked at per directory, at most
MAX_PROCESSES = 65536


@dataclass(frozen=True)
class Leftover:
    path: Path
    what: str
    nbytes: int  # the memory or disk it holds (allocated blocks)


@dataclass
class Survey:
    found: list[Leftover] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)  # (path, why it stays)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.found)


def survey(config: DCSConfig, *, memory_steps: bool = False, legacy_shm: Path | None = None, temp_dir: Path) -> Survey:
    """Every leftover of this user's DCS under `config`'s directories (module docstring)."""
    held = held_paths()
    result = Survey()
    root = hostdirs.private_root(config)  # UnsafeHostDirectory when someone else's is there
    _staging(hostdirs.staging_dir(config), held, result)
    memory = hostdirs.memory_dir(config)
    _memory(memory, held, result, memory_steps)
    _agent_sockets(root, result)
    for path in metricsdir.gone_workers_dirs(temp_dir, legacy=True):
        result.found.append(Leftover(path, "Prometheus directory of a worker that is gone", _tree_bytes(path)))
    if legacy_shm is not None:
        _staging(legacy_shm, held, result)
        _legacy_sockets(legacy_shm, result)
        old = legacy_shm / LEGACY_MEMORY
        if old != memory and _own_dir(old) and not _holds(held, old):
            result.found.append(Leftover(old, "memory tier directory of the older layout", _tree_bytes(old)))
    return result


def remove(items: Iterable[Leftover]) -> list[Leftover]:
    """Delete each leftover (a directory with its contents, never following a link); those removed."""
    done = []
    for item in items:
        try:
            if stat.S_ISDIR(item.path.lstat().st_mode):
                shutil.rmtree(item.path)
            else:
                item.path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # reported by the caller as not removed
        done.append(item)
    return done


def _staging(directory: Path, held: set[str], result: Survey) -> None:
    for path, info in _own_entries(directory):
        found = STAGE_NAME.fullmatch(path.name)
        if found is None or not stat.S_ISREG(info.st_mode):
            continue
        pid = int(found.group(1))
        if pid_alive(pid):
            result.kept.append((path, f"its trainer, pid {pid}, is running"))
        elif str(path) in held:
            result.kept.append((path, "a running process holds it open"))
        else:
            result.found.append(Leftover(path, f"staging buffer of a trainer that is gone (pid {pid})", _bytes(info)))


def _memory(root: Path, held: set[str], result: Survey, steps: bool) -> None:
    """The recycle pool's files, partial copies and (with `steps`) the committed steps under the memory root."""
    for path, info in _own_entries(root):
        if not stat.S_ISDIR(info.st_mode):
            continue
        if path.name == RECYCLE_DIR:
            for file, file_info in _own_entries(path):
                if str(file) not in held:
                    result.found.append(Leftover(file, "recycled memory tier file", _bytes(file_info)))
            continue
        what = "partial memory tier copy" if path.name.startswith(".") else "memory tier steps of run " + path.name
        if not path.name.startswith(".") and not steps:
            result.kept.append((path, "committed memory tier steps (restorable; `--memory-steps` removes them)"))
        elif _holds(held, path):
            result.kept.append((path, "a running process holds a file in it"))
        else:
            result.found.append(Leftover(path, what, _tree_bytes(path)))


def _agent_sockets(root: Path, result: Survey) -> None:
    """Agent sockets in the runtime directory whose lock no agent holds (a lock only tested, never made)."""
    for path, info in _own_entries(root):
        if not (path.name.startswith("agent-") and path.name.endswith(".sock") and stat.S_ISSOCK(info.st_mode)):
            continue
        lock = hostagent.lock_path(path)
        fd = hostdirs.try_lock(lock) if lock.exists() else None
        if lock.exists() and fd is None:
            result.kept.append((path, "a running worker's host agent serves it"))
            continue
        if fd is not None:
            os.close(fd)
            result.found.append(Leftover(lock, "lock of a host agent that is gone", 0))
        result.found.append(Leftover(path, "socket of a host agent that is gone", 0))


def _legacy_sockets(directory: Path, result: Survey) -> None:
    for path, info in _own_entries(directory):
        if path.name.startswith("dcs-agent-") and path.name.endswith(".sock") and stat.S_ISSOCK(info.st_mode):
            if _answers(path):
                result.kept.append((path, "a running worker's host agent answers on it"))
            else:
                result.found.append(Leftover(path, "socket of a host agent that is gone (older layout)", 0))


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _own_entries(directory: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """(path, lstat) of the entries of `directory` owned by this user (none when it is missing or a link)."""
    if not _own_dir(directory):
        return
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for index, entry in enumerate(entries):
            if index >= MAX_ENTRIES:
                break
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == os.geteuid() and not stat.S_ISLNK(info.st_mode):
                    yield Path(entry.path), info


def _own_dir(path: Path) -> bool:
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def _bytes(info: os.stat_result) -> int:
    return int(info.st_blocks) * 512


def _tree_bytes(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += _bytes(os.lstat(os.path.join(directory, name)))
    return total


def _holds(held: set[str], directory: Path) -> bool:
    prefix = str(directory) + os.sep
    return any(path.startswith(prefix) for path in held)


# --- running processes ---------------------------------------------------------------------------------------


def held_paths() -> set[str]:
    """Every file a process of this host (that this user may look at) has open or mapped."""
    held: set[str] = set()
    for pid_dir in _processes():
        with contextlib.suppress(OSError):
            for fd in os.scandir(pid_dir / "fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd.path))
        with contextlib.suppress(OSError), open(pid_dir / "maps", errors="replace") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    held.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
    return held


def services_using(config: DCSConfig, legacy: bool) -> list[tuple[int, str]]:
    """(pid, command line) of this user's running `dcs worker|up|demo` processes whose runtime, staging or memory
    directory (read from their environment, defaults as DCSConfig derives them) is one of `config`'s."""
    dirs = (hostdirs.runtime_path(config), hostdirs.staging_dir(config), hostdirs.memory_dir(config))
    ours = {os.path.normpath(path) for path in dirs}
    if legacy:
        ours.add(str(LEGACY_SHM))
    found: dict[int, tuple[int, str]] = {}  # pid -> (parent pid, command line)
    for pid_dir in _processes():
        command = _dcs_service(pid_dir)
        with contextlib.suppress(OSError):
            if command is not None and pid_dir.stat().st_uid == os.geteuid() and _dirs_of(pid_dir) & ours:
                found[int(pid_dir.name)] = (_parent(pid_dir), command)
    return [(pid, command) for pid, (parent, command) in found.items() if parent not in found]  # not pool children


def _parent(pid_dir: Path) -> int:
    return int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _processes() -> Iterator[Path]:
    me = os.getpid()
    with os.scandir("/proc") as entries:
        for index, entry in enumerate(entries):
            if index >= MAX_PROCESSES:
                break
            if entry.name.isdigit() and int(entry.name) != me:
                yield Path(entry.path)


def _dcs_service(pid_dir: Path) -> str | None:
    """The command line when the process runs `dcs worker|up|demo` (the `dcs` script or `-m dcs_tasks.cli.main`)."""
    try:
        argv = (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for index, arg in enumerate(argv[:4]):
        if os.path.basename(arg) == "dcs" or arg == "dcs_tasks.cli.main":
            rest = [a for a in argv[index + 1 :] if a and not a.startswith("-")]
            if rest and rest[0] in SERVICES:
                return " ".join(a for a in argv if a)[:200]
    return None


def _dirs_of(pid_dir: Path) -> set[str]:
    """The runtime, staging and memory directories a DCS process uses, from its environment."""
    try:
        raw = (pid_dir / "environ").read_bytes().decode(errors="replace")
        uid = pid_dir.stat().st_uid
    except OSError:
        return set()
    env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    runtime = env.get("DCS_RUNTIME_DIR") or str(DCSConfig.default_runtime_dir(uid))
    dirs = {runtime}
    for name, leaf in HOST_DIR_LEAVES.items():  # a set DCS_STAGING_DIR / DCS_MEMORY_DIR, else its default
        dirs.add(env.get(f"DCS_{name.upper()}") or os.path.join(runtime, leaf))
    return {os.path.normpath(d) for d in dirs}
