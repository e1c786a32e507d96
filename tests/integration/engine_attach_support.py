"""Real `dcs engine attach` sidecar processes and topology reads for the attach tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Response

from dcs_tasks.config import DCSConfig, RoleInfo
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.procs import DcsProcess

TOKEN = "attach-test-token-5f1c"  # what the attach tests' coordinators require (engine_attach/conftest.py)


class AttachProcess(DcsProcess):
    """`dcs engine attach --coordinator-url C --engine-url E --rank N [extra...]`. `preloaded`: forked from the
    forkserver that already imported DCS (tests/helpers/preloaded.py) instead of a fresh interpreter (about a
    second of imports less per start on a loaded machine); the sidecar never re-execs itself."""

    def __init__(
        self,
        config: DCSConfig,
        log_path: Path,
        coordinator_url: str,
        engine_url: str,
        rank: int,
        *,
        preloaded: bool = False,
    ) -> None:
        super().__init__(config, log_path)
        self.args = ["engine", "attach", "--coordinator-url", coordinator_url, "--engine-url", engine_url]
        self.args += ["--rank", str(rank)]
        self.preloaded = preloaded

    def start(self, *extra: str, env: dict[str, str] | None = None) -> AttachProcess:
        self.spawn(*self.args, *extra, extra_env=env, preloaded=self.preloaded)
        return self

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def rollout_nodes(coordinator_url: str, token: str | None, role: str = "rollout") -> dict[int, RoleInfo]:
    """Live nodes of `role` as `/topology` reports them."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{coordinator_url}/topology", params={"role_filter": role}, headers=headers, timeout=10)
    answer.raise_for_status()
    nodes = answer.json()["nodes"].get(role, {})
    return {int(rank): RoleInfo.model_validate(info) for rank, info in nodes.items()}


def wait_for(predicate_desc: str, predicate: Callable[[], object], timeout: float, poll: float = 0.1) -> float:
    """Poll `predicate()` until truthy; returns the seconds it took, TimeoutError naming `predicate_desc` after."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if predicate():
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"{predicate_desc} not reached after {timeout}s")


class ReceiverEngine(DcsProcess):
    """`dcs receiver` as the engine: it answers SGLang 0.5.23's `/health` and `/server_info` (tp_size 1) and
    takes the token as SGLang's `--api-key`. It registers itself under `self_role`, not `rollout`, so that
    only the sidecar puts it into the rollout role."""

    def __init__(self, config: DCSConfig, log_path: Path, coordinator_url: str, self_role: str = "engine-self") -> None:
        super().__init__(config, log_path)
        self.coordinator_url = coordinator_url
        self.self_role = self_role
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ReceiverEngine:
        args = ["receiver", "--coordinator-url", self.coordinator_url, "--rank", "0", "--role", self.self_role]
        self.spawn(*args, "--port", str(self.port), preloaded=True)
        wait_for_port(self.port, timeout)
        return self


class HealthSwitchEngine:
    """A stand-in engine in a thread of the test (uvicorn), for what SGLang's code cannot be made to do on
    demand: `/health` answers `health_status` (SGLang answers 503 while its scheduler is busy for > 20 s);
    `/server_info` answers `server_info`. Only used next to tests against real engines."""

    def __init__(self, server_info: dict[str, object]) -> None:
        self.health_status = 200
        self.server_info = server_info
        self.port = free_port()
        app = FastAPI()
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/server_info", self._server_info, methods=["GET"])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="health-switch-engine", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _health(self) -> Response:
        return Response(status_code=self.health_status)

    async def _server_info(self) -> dict[str, object]:
        return self.server_info

    def __enter__(self) -> HealthSwitchEngine:
        self._thread.start()
        wait_for_port(self.port, 10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def live_nodes(url: str) -> dict[str, dict[str, object]]:
    """Every live node `/topology` reports, by role (the coordinator requiring TOKEN)."""
    answer = httpx.get(f"{url}/topology", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    answer.raise_for_status()
    return {role: nodes for role, nodes in answer.json()["nodes"].items() if nodes}


def sidecar(config: DCSConfig, log_path: Path, coordinator_url: str, engine_url: str, rank: int) -> AttachProcess:
    """`dcs engine attach`, forked from the preloaded forkserver (no interpreter start and imports per sidecar)."""
    return AttachProcess(config, log_path, coordinator_url, engine_url, rank, preloaded=True)
