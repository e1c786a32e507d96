"""Another local user of the test host (`nobody`): the shared-host attacker of docs/operations.md, Security.

Tests run as root; `as_nobody` runs a command with uid/gid 65534 (no supplementary groups). `Squatter` is that
user listening on a Unix socket path DCS uses (when it can bind there at all), recording every byte a DCS
process sends it: a client that sends its hello there hands over the token."""

from __future__ import annotations

import hashlib
import pwd
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

NOBODY = pwd.getpwnam("nobody").pw_uid
NOBODY_GID = pwd.getpwnam("nobody").pw_gid
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable  # reachable by nobody


def as_nobody(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run `args` as nobody; the completed process (check the return code yourself)."""
    return subprocess.run(
        list(args), user=NOBODY, group=NOBODY_GID, extra_groups=[], capture_output=True, text=True, timeout=timeout
    )


def shared_shm_dir(tmp_path: Path, what: str) -> Path:
    """A per-test name directly in the shared /dev/shm (where any local user may create it first)."""
    digest = hashlib.sha1(str(tmp_path.resolve()).encode()).hexdigest()[:8]
    return Path("/dev/shm") / f"dcs-test-{what}-{digest}"


_SQUATTER = textwrap.dedent(
    """
    import os, socket, sys
    path = sys.argv[1]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
    except OSError as exc:
        print("refused", exc.errno, flush=True)
        sys.exit(0)
    os.chmod(path, 0o777)
    server.listen(64)
    print("bound", flush=True)
    while True:
        conn, _ = server.accept()
        conn.settimeout(2.0)
        data = b""
        try:
            while b"\\n" not in data and len(data) < 1 << 20:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        print("got", data.hex(), flush=True)
        conn.close()  # answers nothing: the client falls back, after handing over what it sent
    """
)


class Squatter:
    """nobody, listening at `path` if it can bind there; `received` holds what each connection sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bound: bool | None = None
        self.received: list[bytes] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> Squatter:
        self._proc = subprocess.Popen(
            [PYTHON, "-u", "-c", _SQUATTER, str(self.path)],
            user=NOBODY,
            group=NOBODY_GID,
            extra_groups=[],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while self.bound is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the squatter said nothing within {timeout}s")
            time.sleep(0.02)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "bound":
                self.bound = True
            elif word == "refused":
                self.bound = False
            elif word == "got":
                self.received.append(bytes.fromhex(rest))

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        if self.bound:
            self.path.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Remove what a test (or nobody) left at `path`."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
