"""Test helper: a vLLM engine made of vLLM's own code on CPU (`VLLMEngine`), see README.md beside this file.

engine = VLLMEngine(tmp_path / "engine.log", tp=2).start()
engine.get("/get_world_size").json()      # {"world_size": 2}, vLLM's RL router
engine.weights()                          # {name: torch.Tensor}, the full tensors, bit-exact
engine.stop()                             # kill -9 of the server and its worker processes
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.helpers.ports import free_port
from tests.vllm_engine.install import VERSIONS
from tests.vllm_engine.launcher import PER_SERVER_SETTINGS

REPO = Path(__file__).resolve().parents[2]
VLLM_ROOT = REPO / ".vllm"
NEWEST = VERSIONS[-1]


def installed(version: str = NEWEST) -> bool:
    dirs = (VLLM_ROOT / version, VLLM_ROOT / "deps", VLLM_ROOT / "plugins")
    return all((d / ".installed").exists() for d in dirs)


class Launcher:
    """A `python -m tests.vllm_engine.launcher` process (vLLM imported once) that forks servers on request; one
    per (vLLM directory, environment) in a test process, kept until it exits (`launcher_for`)."""

    def __init__(self, vllm_dir: Path, env: dict[str, str], log_path: Path) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "tests.vllm_engine.launcher", "--vllm-dir", str(vllm_dir)]
        cmd += ["--fd", str(theirs.fileno())]
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), cwd=REPO
            )
        theirs.close()
        self.log_path = log_path
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()

    def call(self, request: tuple[Any, ...], timeout: float) -> Any:
        """The launcher's answer to `request`; the first waits for its imports (up to `timeout`)."""
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError(f"vLLM launcher busy for {timeout}s")
        try:
            self._conn.send(request)
            deadline = time.monotonic() + timeout
            while not self._conn.poll(0.2):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-4000:]
                    state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "no answer"
                    raise RuntimeError(f"vLLM launcher {state} after {request[0]!r}: {tail}")
            answer = self._conn.recv()
        finally:
            self._lock.release()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        """Close its socket: it exits (the servers it forked run on until killed)."""
        self._conn.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


_launchers: dict[tuple[str, tuple[tuple[str, str], ...]], Launcher] = {}
_launchers_lock = threading.Lock()


def launcher_for(version: str, env: dict[str, str], log_path: Path) -> Launcher:
    """The launcher of `version` for servers of environment `env` (started now, logging to `log_path`, if none
    is): started with `env` less the variables a server may set for itself (launcher.PER_SERVER_SETTINGS) and
    pytest's PYTEST_CURRENT_TEST (the running test's name, different in each: read by nothing in vLLM)."""
    env = {k: v for k, v in env.items() if k not in (*PER_SERVER_SETTINGS, "PYTEST_CURRENT_TEST")}
    key = (version, tuple(sorted(env.items())))
    with _launchers_lock:
        launcher = _launchers.get(key)
        if launcher is None or launcher.proc.poll() is not None:
            launcher = _launchers[key] = Launcher(VLLM_ROOT / version, env, log_path)
        return launcher


@atexit.register
def _close_launchers() -> None:
    for launcher in _launchers.values():
        launcher.close()
    _launchers.clear()


class ForkedServer:
    """A server a launcher forked: the parts of `subprocess.Popen` the harness uses."""

    def __init__(self, launcher: Launcher, argv: list[str], env: dict[str, str], log_path: Path, timeout: float):
        self.launcher = launcher
        self.pid: int = launcher.call(("start", argv, env, str(REPO), str(log_path)), timeout)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.call(("status", self.pid), 60.0)
        return self.returncode

    def kill_group(self) -> None:
        """kill -9 of its process group (the server and its workers); nothing once it was reaped."""
        self.launcher.call(("kill", self.pid), 60.0)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["vllm-engine", str(self.pid)], timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class VLLMEngine:
    """`python -m tests.vllm_engine.serve` in its own session on a free port, logging to `log_path`: forked by
    a `Launcher` that imported vLLM once (a fresh interpreter would import it again, ~10-30 s of CPU each).

    `dev_mode=False` starts it without VLLM_SERVER_DEV_MODE (no RL routes); `backend=None` without
    `--weight-transfer-config` (its workers refuse every weight-transfer call)."""

    def __init__(
        self,
        log_path: Path,
        *,
        version: str = NEWEST,
        tp: int = 1,
        api_key: str | None = None,
        dev_mode: bool = True,
        backend: str | None = "dcs",
        port: int | None = None,
    ) -> None:
        self.log_path, self.version, self.tp, self.api_key = log_path, version, tp, api_key
        self.dev_mode, self.backend = dev_mode, backend
        self.port = port or free_port()
        self.proc: ForkedServer | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The harness command (what a launcher's fork runs); everything after `--` is a `vllm serve` command
        line."""
        cmd = [sys.executable, "-m", "tests.vllm_engine.serve", *self.serve_args()]
        return cmd

    def serve_args(self) -> list[str]:
        """`serve.py`'s arguments (`command()` after `-m tests.vllm_engine.serve`)."""
        model_dir = self.log_path.parent / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        cmd = ["--vllm-dir", str(VLLM_ROOT / self.version), "--"]
        cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.backend:
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.backend})]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self, timeout: float | None = None) -> VLLMEngine:
        """Start and wait for /health: `timeout`, else DCS_TEST_VLLM_START_SECONDS, else 300 s (vLLM's imports
        take ~30 s per process on an idle 2-core machine, minutes under load)."""
        if timeout is None:
            timeout = float(os.environ.get("DCS_TEST_VLLM_START_SECONDS", "300"))
        if not installed(self.version):
            raise RuntimeError(f"vLLM {self.version} is not installed under {VLLM_ROOT}: run `make vllm-engines`")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "VLLM_"))}
        env.update(PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu")
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        deadline = time.monotonic() + timeout
        launcher = launcher_for(self.version, env, self.log_path.with_name("launcher.log"))
        self.proc = ForkedServer(launcher, self.serve_args(), env, self.log_path, timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM engine exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.http.get("/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"vLLM engine not healthy after {timeout}s: {self.log_tail()}")

    def stop(self) -> None:
        """kill -9 the whole session (server and worker processes)."""
        self.http.close()
        if self.proc is None:
            return
        self.proc.kill_group()
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def get(self, path: str, timeout: float = 60.0) -> httpx.Response:
        return self.http.get(path, timeout=timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> httpx.Response:
        return self.http.post(path, json=body, timeout=timeout)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight the engine's workers hold, TP shards joined (the harness's /harness/weights)."""
        response = self.get("/harness/weights")
        response.raise_for_status()
        out = {}
        for name, item in response.json().items():
            raw = torch.frombuffer(bytearray(bytes.fromhex(item["hex"])), dtype=torch.uint8)
            out[name] = raw.view(getattr(torch, item["dtype"])).reshape(item["shape"])
        return out

    def weight_version(self) -> str:
        return str(self.get("/weight_info").json()["weight_version"])
