"""Test helpers: a real SGLang server process on CPU (`SGLangEngine`) and the paths of installed versions.

    engine = SGLangEngine("0.5.23", tmp_path / "engine.log", tp=2, api_key="k").start()
    engine.post("/init_weights_update_group", {...})
    engine.weights("model.embed_tokens.weight")  # bit-exact, through SGLang's /get_weights_by_name
    engine.stop()

The versions are installed by `make sglang-engines` (tests.sglang_engine.install) under .sglang/. Engines and
reference trainers are forked from a per-version zygote that imported SGLang once per pytest process
(tests/sglang_engine/zygote.py); `warm(*versions)` starts those imports ahead of the first engine.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.ports import free_port
from tests.sglang_engine.install import VERSIONS
from tests.sglang_engine.tiny_model import SHAPES
from tests.sglang_engine.zygote import ZygoteProcess, spawn, zygote

REPO = Path(__file__).resolve().parents[2]
SGLANG_ROOT = REPO / ".sglang"
READY_LINE = "The server is fired up and ready to roll!"  # SGLang logs it once its HTTP server is up
NEW, OLD = VERSIONS[-1], VERSIONS[0]
"""NEW has weight-update sessions (/begin_weight_update, /end_weight_update); OLD does not."""
HAS_SESSIONS = {"0.5.20": False, "0.5.23": True}


def sglang_dir(version: str) -> Path:
    return SGLANG_ROOT / version


def installed(version: str) -> bool:
    return (sglang_dir(version) / ".installed").exists() and (SGLANG_ROOT / "deps" / ".installed").exists()


def _environment() -> dict[str, str]:
    """A harness process's environment: this one's without DCS and SGLang settings, with the repository
    importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "SGLANG_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def _spawn(
    version: str, module: str, args: list[str], env: dict[str, str], log: Path, timeout: float, err: Path | None = None
) -> ZygoteProcess:
    """`python -m module args`, forked from `version`'s zygote."""
    return spawn(sglang_dir(version), _environment(), module, args, env, log, timeout, err)


def warm(*versions: str) -> None:
    """Start the zygotes of the installed `versions` now (their imports run while the caller goes on)."""
    for version in versions:
        if installed(version):
            zygote(sglang_dir(version), _environment())


class SGLangEngine:
    """`python -m tests.sglang_engine.serve` in its own session on a free port, logging to `log_path` (forked
    from the version's zygote: the same process, without paying SGLang's imports again)."""

    def __init__(
        self,
        version: str,
        log_path: Path,
        *,
        tp: int = 1,
        api_key: str | None = None,
        port: int | None = None,
        sglang_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`sglang_args` go to SGLang's CLI unchanged (e.g. "--dp-size", "2", "--admin-api-key", "A"); `env`
        is added to the server's environment (e.g. SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="true" for
        SGLang's default /health, which runs a generation)."""
        self.version, self.log_path, self.tp, self.api_key = version, log_path, tp, api_key
        self.sglang_args, self.env = sglang_args, env or {}
        self.port = port or free_port()
        self.proc: ZygoteProcess | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float | None = None) -> SGLangEngine:
        """Start the engine and wait until it is healthy: `timeout`, else DCS_TEST_SGLANG_START_SECONDS, else
        240 s (an SGLang import takes about a minute on an idle 2-core machine, several under heavy load)."""
        if timeout is None:
            timeout = float(os.environ.get("DCS_TEST_SGLANG_START_SECONDS", "240"))
        if not installed(self.version):
            raise RuntimeError(f"SGLang {self.version} is not installed under {SGLANG_ROOT}: run `make sglang-engines`")
        args = ["--sglang-dir", str(sglang_dir(self.version))]
        args += ["--port", str(self.port), "--tp", str(self.tp), "--work-dir", str(self.log_path.parent)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.sglang_args:
            args += ["--", *self.sglang_args]
        env = _environment() | self.env
        started = time.monotonic()
        self.proc = _spawn(self.version, "tests.sglang_engine.serve", args, env, self.log_path, timeout)
        self.wait_healthy(timeout - (time.monotonic() - started))
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Until /health answers 200 (/model_info where /health runs a generation, which the harness cannot)."""
        generating = self.env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false").lower() in ("true", "1")
        path = "/model_info" if generating else "/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SGLang {self.version} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.http.get(path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"SGLang {self.version} not healthy after {timeout}s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """kill -9 the whole session (server, scheduler and detokenizer processes)."""
        self.http.close()
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # not yet its own session (just forked) or gone
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def log_since_ready(self) -> str:
        """The server's log after SGLang's "ready to roll" line: what the requests a test sent wrote. Before it
        SGLang may log a traceback of its own start-up (its post-warmup `/freeze_gc` call can reach the port
        before uvicorn listens: "post-warmup freeze_gc failed", seen once under load)."""
        log = self.log_tail(1 << 20)
        return log.split(READY_LINE, 1)[1] if READY_LINE in log else log

    def wait_for_log(self, text: str, timeout: float = 10.0) -> bool:
        """Whether `text` shows up in the server's log within `timeout` (tracebacks are written after the
        answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log_tail(200_000):
                return True
            time.sleep(0.05)
        return False

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
        return self.http.post(path, json=body, timeout=timeout)

    def get(self, path: str, timeout: float = 60.0) -> httpx.Response:
        return self.http.get(path, timeout=timeout)

    def weights(self, name: str) -> torch.Tensor:
        """The engine's whole tensor `name` through SGLang's own POST /get_weights_by_name, in its dtype.

        SGLang answers `tensor.float().tolist()`; float32 round-trips exactly through JSON, and every
        bfloat16/float16 value is a float32, so casting back gives the stored bits."""
        shape, dtype = SHAPES[name]
        response = self.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
        response.raise_for_status()
        return torch.tensor(response.json(), dtype=torch.float32).reshape(shape).to(dtype)


def run_trainer(
    engines: list[SGLangEngine], workdir: Path, updates: list[dict[str, Any]], **spec: Any
) -> dict[str, Any]:
    """Run tests.sglang_engine.trainer (SGLang's client protocol, rank 0) against `engines`; its HTTP answers.

    Each update: {"tensors": {name: tensor} (sent in this order), "flattened": bool, "broadcast": bool,
    "body": {overrides}, "weight_version": str}; `spec` adds "sessions", "group_name", "destroy". Answers per step:
    {"init": [[status, body] per engine], "begin": ..., "updates": [[[status, body] per engine] per update],
    "end": ..., "destroy": ...}."""
    wire = []
    for i, update in enumerate(updates):
        path = workdir / f"update-{i}.safetensors"
        save_file(update["tensors"], str(path))
        wire.append({**update, "tensors": str(path), "order": list(update["tensors"])})
    full = {
        "sglang_dir": str(sglang_dir(engines[0].version)),
        "engines": [{"url": e.url, "tp": e.tp} for e in engines],
        "api_key": engines[0].api_key,
        "group_name": "harness_group",
        "updates": wire,
        **spec,
    }
    (workdir / "spec.json").write_text(json.dumps(full))
    handle, name = tempfile.mkstemp(prefix="trainer-", suffix=".out", dir=workdir)
    os.close(handle)
    out, err = Path(name), Path(name).with_suffix(".err")
    spec_path = str(workdir / "spec.json")
    proc = _spawn(engines[0].version, "tests.sglang_engine.trainer", [spec_path], _environment(), out, 240, err)
    try:
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    if code == 3 and any("die_after" in u for u in updates):
        return {"died": True}
    stderr = err.read_text(errors="replace") if err.exists() else ""
    if code != 0:
        raise RuntimeError(f"trainer failed ({code}): {stderr[-3000:]}\nengine: {engines[0].log_tail()}")
    return json.loads(out.read_text().strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def sglang_engine(tmp_path: Path) -> Iterator[Callable[..., SGLangEngine]]:
    """Factory fixture: `sglang_engine(version, tp=..., api_key=..., ...)` starts an engine (skips the test when
    that version is not installed) and every engine it started is killed at teardown. Re-export it in a
    conftest.py to use it: `from tests.sglang_engine.harness import sglang_engine as sglang_engine`."""
    started: list[SGLangEngine] = []

    def start(version: str = NEW, **kwargs: Any) -> SGLangEngine:
        if not installed(version):
            pytest.skip(f"SGLang {version} not installed: run `make sglang-engines`")
        log_dir = tmp_path / f"sglang-{version}-{len(started)}"
        log_dir.mkdir()
        engine = SGLangEngine(version, log_dir / "engine.log", **kwargs)
        started.append(engine)
        return engine.start()

    yield start
    for engine in started:
        engine.stop()
