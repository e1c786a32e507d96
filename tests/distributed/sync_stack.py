"""Real processes for weight-sync tests: coordinator, a thread-pool `dcs worker`, `dcs receiver` servers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig
from dcs_tasks.sync.wire import WeightsDigest
from tests.helpers.ports import free_port, wait_for_port
from tests.helpers.procs import CoordinatorProcess, DcsProcess, WorkerProcess


class ReceiverProcess(DcsProcess):
    """`dcs receiver --coordinator-url URL --rank N --port P`; ready once registered and alive."""

    def __init__(
        self,
        config: DCSConfig,
        coordinator_url: str,
        rank: int,
        log_path: Path,
        role: str = "rollout",
    ) -> None:
        super().__init__(config, log_path)
        self.role = role
        self.coordinator_url = coordinator_url
        self.rank = rank
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ReceiverProcess:
        args = ["receiver", "--coordinator-url", self.coordinator_url, "--rank", str(self.rank)]
        args += ["--port", str(self.port), "--role", self.role]
        self.spawn(*args, preloaded=True)
        try:
            wait_for_port(self.port, timeout)
            wait_registered(self.coordinator_url, self.role, self.rank, timeout, token=self.config.token())
        except BaseException:
            self.kill()
            raise
        return self

    def digest(self) -> WeightsDigest:
        response = httpx.get(f"{self.url}/weights_digest", headers=auth_headers(self.config.token()), timeout=30)
        response.raise_for_status()
        return WeightsDigest.model_validate_json(response.content)


def auth_headers(token: str | None) -> dict[str, str]:
    """`Authorization: Bearer <token>` when a token is configured (DCS_AUTH_TOKEN)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def alive_ranks(coordinator_url: str, role: str, token: str | None = None) -> set[int]:
    url, headers = f"{coordinator_url}/topology", auth_headers(token)
    answer = httpx.get(url, params={"role_filter": role}, headers=headers, timeout=10).json()
    return {int(r) for r in answer["nodes"].get(role, {})}


def wait_registered(
    coordinator_url: str, role: str, rank: int, timeout: float, alive: bool = True, token: str | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (rank in alive_ranks(coordinator_url, role, token)) == alive:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{role}_{rank} not {'alive' if alive else 'gone'} after {timeout}s")


@dataclass
class SyncStack:
    config: DCSConfig
    coordinator: CoordinatorProcess
    worker: WorkerProcess
    tmp: Path
    receivers: list[ReceiverProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.coordinator.url

    def add_receiver(self, rank: int, role: str = "rollout") -> ReceiverProcess:
        log = self.tmp / f"receiver-{role}{rank}.log"
        receiver = ReceiverProcess(self.config, self.url, rank, log, role).start()
        self.receivers.append(receiver)
        return receiver


@contextmanager
def sync_stack(config: DCSConfig, tmp: Path, receivers: int = 0) -> Iterator[SyncStack]:
    """Coordinator + thread-pool worker (sync tasks block on rendezvous) + `receivers` receiver servers."""
    coordinator = CoordinatorProcess(config, tmp / "coordinator.log").start()
    config = config.model_copy(update={"coordinator_url": coordinator.url})
    worker = WorkerProcess(config, tmp / "worker.log", concurrency=8, pool="threads").start()
    stack = SyncStack(config, coordinator, worker, tmp)
    try:
        for rank in range(receivers):
            stack.add_receiver(rank)
        yield stack
    finally:
        for receiver in stack.receivers:
            receiver.stop()
        worker.discard()
        coordinator.stop()


@asynccontextmanager
async def actor_client(
    stack: SyncStack, model: torch.nn.Module, model_name: str
) -> AsyncIterator[CheckpointEngineClient]:
    """A started trainer (role actor, rank 0) of `model` on `stack`, stopped on exit."""
    client = CheckpointEngineClient(
        coordinator_url=stack.url, role="actor", rank=0, model=model, model_name=model_name, config=stack.config
    )
    await client.start()
    try:
        yield client
    finally:
        await client.stop()
