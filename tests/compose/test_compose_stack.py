"""compose/ brought up for real, under podman (docs/operations.md, Compose under podman).

`make compose-test` runs this module, as its own CI step: compose/podman/setup.sh installs podman and runc and
makes the Debian base image (debootstrap + `podman import`), `make compose-wheels` hands the build the wheels of
.venv (torch's CPU build among them). Here podman-compose builds the DCS image and brings the stack up
(compose/docker-compose.yml with compose/podman/compose.override.yml); then this process, a trainer outside
the containers, saves a checkpoint that the worker container persists, restores it bit-exactly in a fresh
Checkpointer, pushes its weights to a `dcs receiver` started here (the worker container forms the gloo group),
asks Prometheus whether it scrapes the coordinator, the worker and Flower, and brings the stack down: no
container, pod, network or volume of the project may be left. Every wait is bounded; the stack is removed
even when a test fails. Each phase's seconds are printed (run with -s) and written to $DCS_COMPOSE_TIMINGS.

Skipped unless DCS_COMPOSE_TEST=1 (the normal `make test` run has no podman, and the stack's fixed ports must
not race the other tests).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

REPO = Path(__file__).resolve().parents[2]
FILES = ["-f", "compose/docker-compose.yml", "-f", "compose/podman/compose.override.yml"]
CONTAINERS_CONF = REPO / "compose" / "podman" / "containers.conf"
BASE_IMAGE = os.environ.get("DCS_DEBIAN_IMAGE", "localhost/dcs-debian:bookworm")
# Ports compose/prometheus.yml scrapes (the compose file's defaults) and Prometheus's own: the stack needs them
# free on 127.0.0.1. Redis's port is any free one (DCS_REDIS_PORT).
COORDINATOR_PORT, FLOWER_PORT, PROMETHEUS_PORT, WORKER_METRICS_PORT = 8000, 5555, 9090, 9091
LABEL = "io.podman.compose.project"
RUN = "compose-e2e"

BUILD_TIMEOUT = 900
UP_TIMEOUT = 180
READY_TIMEOUT = 120
SAVE_TIMEOUT = 120
PUSH_TIMEOUT = 180
SCRAPE_TIMEOUT = 90  # Prometheus scrapes every 15 s
DOWN_TIMEOUT = 180

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DCS_COMPOSE_TEST") != "1",
        reason="brings compose/ up under podman (root, fixed ports): run by `make compose-test`, CI's own step; "
        "DCS_COMPOSE_TEST=1 runs it here",
    ),
]


def podman_compose() -> str | None:
    given = os.environ.get("DCS_PODMAN_COMPOSE")
    if given:
        return given
    beside = Path(sys.executable).parent / "podman-compose"  # make compose-test installs it into .venv
    return str(beside) if beside.exists() else shutil.which("podman-compose")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """check()'s first truthy answer; AssertionError naming `what` and the last error after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            answer = check()
            if answer:
                return answer
            last = answer
        except Exception as exc:  # the service is not there yet
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})"[:2000])
        time.sleep(interval)


@dataclass
class Stack:
    tool: str
    project: str
    env: dict[str, str]
    token: str
    secrets: list[str]
    redis_port: int
    checkpoint_dir: Path
    timings: dict[str, float] = field(default_factory=dict)
    down_done: bool = False

    @property
    def coordinator_url(self) -> str:
        return f"http://127.0.0.1:{COORDINATOR_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def mask(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def run(self, argv: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run(
                argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            raise AssertionError(f"{' '.join(argv[:6])} ...: over {timeout} s\n{self.mask(out)[-4000:]}") from None
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv[:8])} ... exited {done.returncode}\n"
                f"{self.mask(done.stdout)[-3000:]}\n{self.mask(done.stderr)[-5000:]}"
            )
        return done

    def compose(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run([self.tool, "-p", self.project, *FILES, *args], timeout, check)

    def podman(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["podman", *args], timeout, check)

    def timed(self, phase: str, started: float) -> None:
        self.timings[phase] = round(time.monotonic() - started, 1)
        print(f"\ncompose-test: phase {phase} took {self.timings[phase]} s", flush=True)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def logs(self) -> str:
        """The last lines of every container of the project (for a failure's message), secrets masked."""
        names = self.podman(
            "ps", "-a", "--filter", f"label={LABEL}={self.project}", "--format", "{{.Names}}", check=False
        ).stdout.split()
        parts = []
        for name in names:
            out = self.podman("logs", "--tail", "25", name, check=False)
            parts.append(f"--- {name}\n{out.stdout}{out.stderr}")
        return self.mask("\n".join(parts))[-12000:]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, pods, networks and volumes that still carry the project's label."""
        found = {}
        for kind, argv in {
            "containers": ["ps", "-a", "--format", "{{.Names}}"],
            "pods": ["pod", "ls", "--format", "{{.Name}}"],
            "networks": ["network", "ls", "--format", "{{.Name}}"],
            "volumes": ["volume", "ls", "--format", "{{.Name}}"],
        }.items():
            out = self.podman(*argv, "--filter", f"label={LABEL}={self.project}", check=False)
            found[kind] = out.stdout.split()
        return found

    def force_remove(self) -> None:
        """Remove whatever of the project is left (a failed `up` or `down`), by label, then its images."""
        left = self.leftovers()
        if left["containers"]:
            self.podman("rm", "--force", "--time", "10", *left["containers"], timeout=120, check=False)
        if left["pods"]:
            self.podman("pod", "rm", "--force", *left["pods"], timeout=60, check=False)
        if left["networks"]:
            self.podman("network", "rm", "--force", *left["networks"], timeout=60, check=False)
        if left["volumes"]:
            self.podman("volume", "rm", "--force", *left["volumes"], timeout=60, check=False)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tool = podman_compose()
    missing = [name for name, path in (("podman", shutil.which("podman")), ("podman-compose", tool)) if not path]
    if missing:
        pytest.fail(f"DCS_COMPOSE_TEST=1 but {' and '.join(missing)} missing: `make compose-test` installs them")
    assert tool is not None
    # something answering, not just bindable: a run just before leaves TIME_WAIT sockets, which the services'
    # servers bind over (SO_REUSEADDR)
    busy = [p for p in (COORDINATOR_PORT, FLOWER_PORT, PROMETHEUS_PORT, WORKER_METRICS_PORT) if listening(p)]
    if busy:
        pytest.fail(f"127.0.0.1 ports {busy} are in use: the stack publishes or binds them (compose/prometheus.yml)")
    token = secrets.token_hex(16)
    flower_auth = f"dcs:{secrets.token_hex(12)}"
    checkpoint_dir = Path(tempfile.mkdtemp(prefix="dcs-compose-ckpt-", dir="/var/tmp"))
    project = f"dcsct{os.getpid()}"
    env = {
        **os.environ,
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF)),
        "DCS_BASE_IMAGE": BASE_IMAGE,
        "DCS_UID": str(os.getuid()),  # the trainer's (this process's) uid: its staging files are 0600
        "DCS_GID": str(os.getgid()),
        "DCS_CHECKPOINT_DIR": str(checkpoint_dir),
        "DCS_NODE_NAME": f"compose-{project}",
        "DCS_REDIS_PORT": str(free_port()),  # 6379 is often some other Redis's
        "DCS_COORDINATOR_PORT": str(COORDINATOR_PORT),
        "DCS_FLOWER_PORT": str(FLOWER_PORT),
        "DCS_AUTH_TOKEN": token,
        "DCS_FLOWER_BASIC_AUTH": flower_auth,
    }
    s = Stack(
        tool, project, env, token, [token, flower_auth.split(":", 1)[1]], int(env["DCS_REDIS_PORT"]), checkpoint_dir
    )
    if s.podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {BASE_IMAGE}: compose/podman/setup.sh makes it (make compose-test runs it)")
    images: list[str] = []
    try:
        started = time.monotonic()
        # one image first, then the other two from its cached layers: podman-compose builds services in
        # parallel, and three cold builds at once took 170 s instead of ~60 on two cores
        s.compose("build", "coordinator", timeout=BUILD_TIMEOUT)
        s.compose("build", "worker", "flower", timeout=BUILD_TIMEOUT)
        s.timed("build", started)
        images = [f"localhost/{project}_{name}" for name in ("coordinator", "worker", "flower")]
        for image in images:  # podman-compose's exit status does not always say that a build failed
            assert s.podman("image", "exists", image, check=False).returncode == 0, f"build made no {image}"
        started = time.monotonic()
        s.compose("up", "-d", timeout=UP_TIMEOUT)
        s.timed("up", started)
        started = time.monotonic()
        try:
            wait_ready(s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{s.logs()}") from None
        s.timed("ready", started)
        yield s
    finally:
        if not s.down_done:
            s.compose("down", "--volumes", timeout=DOWN_TIMEOUT, check=False)
        started = time.monotonic()
        s.force_remove()
        for image in images:
            s.podman("rmi", "--force", image, timeout=120, check=False)
        s.timed("cleanup (images)", started)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        timings = os.environ.get("DCS_COMPOSE_TIMINGS")
        if timings:
            Path(timings).write_text(json.dumps(s.timings, indent=1) + "\n")
        print(f"\ncompose-test: phases {json.dumps(s.timings)}", flush=True)


def wait_ready(s: Stack) -> None:
    """The coordinator answers with Redis behind it, a worker consumes the node queue, Flower and Prometheus
    answer."""
    from dcs_tasks.celery_app import node_queue
    from dcs_tasks.keys import Keys

    def coordinator() -> bool:
        answer = httpx.get(f"{s.coordinator_url}/topology", headers=s.headers(), timeout=5)
        return answer.status_code == 200

    wait_for("the coordinator (GET /topology with the token)", coordinator, READY_TIMEOUT)
    # the token reached the container from this environment (compose passes DCS_AUTH_TOKEN by name only)
    assert httpx.get(f"{s.coordinator_url}/topology", timeout=5).status_code == 401
    flower_api = f"http://127.0.0.1:{FLOWER_PORT}/api/workers"
    wait_for("Flower's API", lambda: httpx.get(flower_api, timeout=5).status_code == 401, READY_TIMEOUT)
    user, password = s.env["DCS_FLOWER_BASIC_AUTH"].split(":", 1)
    assert httpx.get(flower_api, auth=(user, password), timeout=30).status_code == 200
    presence = Keys().worker_presence(node_queue(s.env["DCS_NODE_NAME"]))
    client = redis.Redis.from_url(s.redis_url, socket_timeout=5)
    try:
        wait_for(f"the worker container consuming {presence}", lambda: client.exists(presence), READY_TIMEOUT)
    finally:
        client.close()
    flower = f"http://127.0.0.1:{FLOWER_PORT}/metrics"
    wait_for("Flower's /metrics", lambda: httpx.get(flower, timeout=5).status_code == 200, READY_TIMEOUT)
    prometheus = f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready"
    wait_for("Prometheus", lambda: httpx.get(prometheus, timeout=5).status_code == 200, READY_TIMEOUT)


def trainer_config(s: Stack) -> Any:
    from dcs_tasks.config import DCSConfig

    return DCSConfig(
        redis_url=s.redis_url,
        coordinator_url=s.coordinator_url,
        checkpoint_dir=s.checkpoint_dir,
        node_name=s.env["DCS_NODE_NAME"],
        auth_token=s.token,
        enable_metrics=False,
    )


@pytest.mark.timeout(BUILD_TIMEOUT + UP_TIMEOUT + 4 * READY_TIMEOUT + SAVE_TIMEOUT + 60)
def test_a_trainer_outside_saves_through_the_worker_container_and_restores_bit_exactly(stack: Stack) -> None:
    from dcs_tasks import Checkpointer

    started = time.monotonic()
    generator = torch.Generator().manual_seed(22)
    state = {
        "model": {"w": torch.randn(512, 256, generator=generator), "b": torch.arange(100, dtype=torch.int64)},
        "optim": {"m": torch.randn(4096, generator=generator).to(torch.bfloat16)},
        "step": 7,
    }
    config = trainer_config(stack)
    with Checkpointer(RUN, config) as ckpt:
        info = ckpt.save(state, step=7, metadata={"where": "compose"}).wait(SAVE_TIMEOUT)
        assert info.step == 7
    step_dirs = [p for p in (stack.checkpoint_dir / RUN).iterdir() if p.is_dir()]
    written = [f for d in step_dirs for f in d.iterdir()]
    assert any(f.name == "manifest.json" for f in written), f"no manifest among {written}"
    assert all(f.stat().st_uid == os.getuid() for f in written)  # written by the container's dcs user (DCS_UID)
    with Checkpointer(RUN, trainer_config(stack)) as fresh:
        assert [i.step for i in fresh.list()] == [7]
        restored = fresh.restore()
    assert restored.step == 7 and restored.metadata.get("where") == "compose"
    for group, tensors in (("model", state["model"]), ("optim", state["optim"])):
        for name, tensor in tensors.items():
            got = restored.state[group][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"{group}/{name} differs"
    assert restored.state["step"] == 7
    stack.timed("save+restore", started)


@pytest.mark.timeout(PUSH_TIMEOUT + READY_TIMEOUT + 60)
def test_a_weight_push_from_outside_reaches_a_receiver_through_the_worker_container(stack: Stack) -> None:
    from dcs_tasks.client.engine import CheckpointEngineClient
    from dcs_tasks.sync.receiving import tensor_sha256
    from dcs_tasks.sync.wire import WeightsDigest

    started = time.monotonic()
    port = free_port()
    receiver_env = {k: v for k, v in stack.env.items() if k != "DCS_FLOWER_BASIC_AUTH"}
    dcs = str(Path(sys.executable).parent / "dcs")
    argv = [
        dcs,
        "receiver",
        "--coordinator-url",
        stack.coordinator_url,
        "--rank",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = tempfile.TemporaryFile()
    receiver = subprocess.Popen(argv, cwd=REPO, env=receiver_env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def registered() -> bool:
            assert receiver.poll() is None, f"dcs receiver exited {receiver.returncode}"
            answer = httpx.get(
                f"{stack.coordinator_url}/topology",
                params={"role_filter": "rollout"},
                headers=stack.headers(),
                timeout=5,
            )
            return answer.status_code == 200 and "0" in answer.json()["nodes"].get("rollout", {})

        wait_for("the receiver's registration as rollout 0", registered, READY_TIMEOUT)
        generator = torch.Generator().manual_seed(6)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))

        async def push() -> dict[str, Any]:
            client = CheckpointEngineClient(
                coordinator_url=stack.coordinator_url,
                role="actor",
                rank=0,
                model=model,
                model_name="compose",
                config=trainer_config(stack),
            )
            await client.start()
            try:
                return dict((await client.update_weights_for_rollout(rollout_only=True))["rollout"])
            finally:
                await client.stop()

        metrics = asyncio.run(asyncio.wait_for(push(), PUSH_TIMEOUT))
        assert metrics["engines"] == 1, metrics
        answer = httpx.get(f"http://127.0.0.1:{port}/weights_digest", headers=stack.headers(), timeout=30)
        answer.raise_for_status()
        digest = WeightsDigest.model_validate_json(answer.content)
        assert digest.weight_version >= 1
        assert digest.tensors == {name: tensor_sha256(t) for name, t in model.state_dict().items()}
    except BaseException:
        log.seek(0)
        print(stack.mask(log.read().decode(errors="replace"))[-6000:], file=sys.stderr)
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        receiver.terminate()
        try:
            receiver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            receiver.kill()
            receiver.wait(timeout=10)
        log.close()
    stack.timed("weight push", started)


@pytest.mark.timeout(SCRAPE_TIMEOUT + 60)
def test_prometheus_scrapes_the_coordinator_the_worker_and_flower(stack: Stack) -> None:
    started = time.monotonic()
    api = f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1"

    def all_up() -> dict[str, str] | None:
        targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        return (
            health
            if set(health) == {"dcs-coordinator", "dcs-worker", "dcs-flower"}
            and all(h == "up" for h in health.values())
            else None
        )

    wait_for("every DCS target up in Prometheus", all_up, SCRAPE_TIMEOUT, interval=2)

    def scraped(query: str) -> float | None:
        result = httpx.get(f"{api}/query", params={"query": query}, timeout=5).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    # the save of the first test, as the worker container recorded it and Prometheus scraped it from there
    persisted = wait_for(
        "the worker's persist count in Prometheus",
        lambda: scraped('sum(dcs_ckpt_persist_seconds_count{job="dcs-worker"})'),
        SCRAPE_TIMEOUT,
        interval=2,
    )
    assert persisted >= 1
    requests = wait_for(
        "the coordinator's request count in Prometheus",
        lambda: scraped('sum(dcs_coordinator_requests_total{job="dcs-coordinator"})'),
        SCRAPE_TIMEOUT,
        interval=2,
    )
    assert requests >= 1
    stack.timed("prometheus", started)


@pytest.mark.timeout(DOWN_TIMEOUT + 120)
def test_down_leaves_no_container_pod_network_or_volume(stack: Stack) -> None:
    before = stack.leftovers()
    assert len(before["containers"]) == 5 and before["volumes"], before
    started = time.monotonic()
    stack.compose("down", "--volumes", timeout=DOWN_TIMEOUT)
    stack.down_done = True
    stack.timed("down", started)
    assert stack.leftovers() == {"containers": [], "pods": [], "networks": [], "volumes": []}
    for port in (COORDINATOR_PORT, FLOWER_PORT, PROMETHEUS_PORT, WORKER_METRICS_PORT, stack.redis_port):
        assert not listening(port), f"127.0.0.1:{port} still answers after down"
