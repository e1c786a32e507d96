"""verl's checkpoint_engine registry with DCS as its backend ("dcs"), against verl 0.9.1's own code (`make verl-lib`).

verl's `CheckpointEngineRegistry` and `CheckpointEngine` base class are verl's, imported from `.verl/`
(tests/verl_lib). The weights move through the real coordinator, a thread-pool `dcs worker` (master-port
reservation) and gloo between processes: a trainer rank 0 (verl's `is_master=True`), a second trainer rank that
only walks verl's generator, and two rollout workers. The test plays verl's `CheckpointEngineManager`: prepare on
every worker, the backend's `build_topology`, init_process_group on all at once, send and receive at once, finalize.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks.config import DCSConfig
from tests.distributed.sync_stack import sync_stack
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env
from tests.integration.verl_node import digest, weights
from tests.verl_lib import VERL_VERSION, installed, on_path, pythonpath

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
STEP_TIMEOUT = 120.0


@pytest.fixture(scope="module", autouse=True)
def verl_on_path() -> None:
    assert installed(), "verl is not under .verl/: run `make verl-lib` (python -m tests.verl_lib.install)"
    on_path()


class Node:
    """One verl worker (tests/integration/verl_node.py), driven one JSON command at a time over the abstract unix
    socket `address`, on which it connects."""

    def __init__(self, kind: str, address: str, log: Path) -> None:
        self.kind, self.log = kind, log
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + address)
        self.listener.listen(1)
        self.listener.settimeout(STEP_TIMEOUT)
        self.answers: queue.Queue[str] = queue.Queue()
        self.connected = threading.Event()
        self.channel: socket.socket | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.channel, _ = self.listener.accept()
        except OSError:  # no connection within STEP_TIMEOUT: ask() says so
            return
        finally:
            self.listener.close()
        self.channel.settimeout(None)
        self.connected.set()
        with self.channel.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                if line.startswith("@@ "):
                    self.answers.put(line[3:])

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        if not self.connected.wait(STEP_TIMEOUT) or self.channel is None:
            raise AssertionError(f"{self.kind}: did not connect in {STEP_TIMEOUT}s: {self.tail()}")
        self.channel.sendall((json.dumps({"op": op, **fields}) + "\n").encode())
        try:
            answer: dict[str, Any] = json.loads(self.answers.get(timeout=STEP_TIMEOUT))
        except queue.Empty:
            raise AssertionError(f"{self.kind}: no answer to {op} in {STEP_TIMEOUT}s: {self.tail()}") from None
        return answer

    def ok(self, op: str, **fields: Any) -> Any:
        answer = self.ask(op, **fields)
        assert "ok" in answer, f"{self.kind} {op}: {answer}\n{self.tail()}"
        return answer["ok"]

    def tail(self) -> str:
        """The worker's log; before it forked, its parent's (nodes.log: verl's import failing, say)."""
        for log in (self.log, self.log.parent / "nodes.log"):
            if log.exists():
                return f"{log.name}:\n" + log.read_text(errors="replace")[-3000:]
        return ""

    def close(self) -> None:
        """Ask the worker to close its engine and exit; a worker that does not answer is killed with the rest."""
        try:
            if self.connected.is_set():
                self.ok("close")
        except Exception:
            pass
        if self.channel is not None:
            self.channel.close()


def on_all(nodes: list[Node], op: str, **fields: Any) -> list[Any]:
    """`op` on every node at once (verl's manager calls each phase on all workers concurrently)."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(lambda n: n.ok(op, **fields), nodes))


@pytest.fixture
def verl_config(dcs_config: DCSConfig) -> DCSConfig:
    base = free_port()
    update = {"comm_base_port": base, "comm_max_port": min(base + 50, 65535), "comm_timeout_seconds": 60.0}
    return dcs_config.model_copy(update={**update, "group_init_timeout_seconds": 60.0})


@pytest.fixture
def workers(verl_config: DCSConfig, tmp_path: Path) -> Iterator[list[Node]]:
    """trainer0, trainer1, rollout, rollout: each its own process, on a running coordinator and worker. The four are
    forked from one process that imported verl (tests/integration/verl_node.py), itself forked from the forkserver
    that imported torch and DCS (tests/helpers/preloaded.py): fresh interpreters spent seconds each on imports."""
    with sync_stack(verl_config, tmp_path) as stack:
        env = pythonpath(child_env(stack.config))
        kinds = ["trainer0", "trainer1", "rollout", "rollout"]
        name = f"dcs-verl-node-{uuid.uuid4().hex}"
        nodes = [Node(kind, f"{name}-{i}", tmp_path / f"{kind}-{i}.log") for i, kind in enumerate(kinds)]
        parent = python_module(
            "tests.integration.verl_node", name, str(tmp_path), *kinds, log=tmp_path / "nodes.log", env=env
        )
        try:
            yield nodes
        finally:
            for node in nodes:
                node.close()
            try:
                parent.wait(30)
            except subprocess.TimeoutExpired:
                parent.kill()  # its process group: the workers too


def update(nodes: list[Node], seed: int) -> tuple[list[Any], list[Any]]:
    """One weight update the way verl's CheckpointEngineManager runs it; (trainers' answers, rollouts' answers)."""
    from dcs_tasks.integrations.verl import DCSCheckpointEngine

    trainers, rollouts = nodes[:2], nodes[2:]
    metadata = on_all(nodes, "prepare")
    assert {m["class"] for m in metadata} == {"DCSCheckpointEngine"}
    actor_kwargs, rollout_kwargs = DCSCheckpointEngine.build_topology(len(trainers), len(rollouts), metadata)
    with ThreadPoolExecutor(len(nodes)) as pool:
        joins = [
            pool.submit(n.ok, "init", kwargs={k: v[i] for k, v in actor_kwargs.items()}) for i, n in enumerate(trainers)
        ]
        joins += [
            pool.submit(n.ok, "init", kwargs={k: v[i] for k, v in rollout_kwargs.items()})
            for i, n in enumerate(rollouts)
        ]
        assert [j.result() for j in joins] == ["joined"] * 4
        sends = [pool.submit(n.ok, "send", seed=seed) for n in trainers]
        receives = [pool.submit(n.ok, "receive", seed=seed) for n in rollouts]
        sent, received = [s.result() for s in sends], [r.result() for r in receives]
    on_all(nodes, "finalize")
    return sent, received


def test_verl_registry_returns_the_dcs_backend_built_on_verls_base_class() -> None:
    import verl
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    assert verl.__version__ == VERL_VERSION
    import_external_libs("dcs_tasks.integrations.verl")  # what verl does with checkpoint_engine.custom_backend_module
    backend = CheckpointEngineRegistry.get("dcs")
    from dcs_tasks.integrations.verl import DCSCheckpointEngine

    assert backend is DCSCheckpointEngine and issubclass(backend, CheckpointEngine)
    assert not getattr(backend, "__abstractmethods__", None)  # verl's abstract methods are all implemented
    rollout = CheckpointEngineRegistry.new("dcs", bucket_size=1 << 20)  # as CheckpointEngineWorker builds it
    trainer0 = CheckpointEngineRegistry.new("dcs", is_master=True, bucket_size=1 << 20)  # as the trainer's rank 0
    trainer1 = CheckpointEngineRegistry.new("dcs", is_master=False, bucket_size=1 << 20)
    assert (rollout.role, trainer0.role, trainer1.role) == ("actor_fwd", "actor", None)
    assert rollout.config.value("bucket_size_bytes") == 1 << 20


def test_a_weight_dcs_cannot_send_is_named() -> None:
    from dcs_tasks.errors import InvalidTensorSpec
    from dcs_tasks.integrations.verl import InvalidWeight, check_weights

    with pytest.raises(InvalidWeight) as info:
        check_weights([("model.a", torch.zeros(2)), ("model.lm_head.weight", [[0.5]])])
    assert "'model.lm_head.weight' is a list, not a torch.Tensor" in str(info.value)
    long_name = "model.layers." + "x" * 2000
    with pytest.raises(InvalidWeight) as info:
        check_weights([(long_name, torch.zeros(2))])
    assert "'model.layers.xxx" in str(info.value) and "2013 characters; DCS receivers take at most 1024" in str(
        info.value
    )
    with pytest.raises(InvalidWeight, match=r"'model\.a' was yielded twice"):
        check_weights([("model.a", torch.zeros(2)), ("model.a", torch.ones(2))])
    with pytest.raises(InvalidWeight, match=r"'model\.q'"):
        check_weights([("model.q", torch.zeros(2, dtype=torch.complex32))])
    assert issubclass(InvalidWeight, InvalidTensorSpec) and issubclass(InvalidWeight, ValueError)


def test_verl_trainer_pushes_through_dcs_to_two_rollout_workers_bit_exact(workers: list[Node]) -> None:
    sent, received = update(workers, seed=1)
    assert sent[0]["digest"] == digest(weights(1)) and sent[1]["metrics"] == {}  # rank 1 only walked the generator
    assert sent[0]["metrics"]["dcs/tensors"] == 5 and sent[0]["metrics"]["dcs/buckets"] >= 2
    assert received == [{"digest": digest(weights(1)), "version": 1}] * 2

    # bad input: a non-tensor, then a name too long; each is named and nothing of it reaches a rollout worker
    trainer0, trainer1 = workers[:2]
    metadata = on_all(workers, "prepare")
    from dcs_tasks.integrations.verl import DCSCheckpointEngine

    actor_kwargs, rollout_kwargs = DCSCheckpointEngine.build_topology(2, 2, metadata)
    assert actor_kwargs["rollout_id"] == [2, 2] and rollout_kwargs["rollout_id"] == [2, 2]
    for bad, named in (("not_a_tensor", "'model.lm_head.weight' is a list"), ("long_name", "2020 characters")):
        answer = trainer0.ask("send_bad", kind=bad, seed=2)
        assert answer["error"] == "InvalidWeight" and named in answer["message"], answer
    assert trainer1.ask("send_bad", kind="not_a_tensor", seed=2)["error"] == "InvalidWeight"

    # the next update (a new group, as verl rebuilds it) is the rollout workers' version 2, exactly the new weights
    sent, received = update(workers, seed=3)
    assert sent[0]["digest"] == digest(weights(3))
    assert received == [{"digest": digest(weights(3)), "version": 2}] * 2


def test_a_topology_without_its_source_or_receivers_is_refused_by_name() -> None:
    from dcs_tasks.errors import ConfigError, WeightSyncError
    from dcs_tasks.integrations.verl import DCSCheckpointEngine

    source = {"dcs_role": "actor", "updates": 0}
    other, receiver = {"dcs_role": None, "updates": 0}, {"dcs_role": "actor_fwd", "updates": 3}
    assert DCSCheckpointEngine.build_topology(2, 1, [source, other, receiver]) == (
        {"rollout_id": [4, 4]},
        {"rollout_id": [4]},
    )
    with pytest.raises(ConfigError, match=r"trainer workers marked as the source: \[\]"):
        DCSCheckpointEngine.build_topology(2, 1, [other, other, receiver])
    with pytest.raises(ConfigError, match=r"rollout workers \[1\] were not built as DCS receivers"):
        DCSCheckpointEngine.build_topology(1, 2, [source, receiver, other])
    trainer = DCSCheckpointEngine(bucket_size=1 << 20, is_master=True)
    with pytest.raises(WeightSyncError, match="not a rollout worker's"):
        asyncio.run(anext(trainer.receive_weights()))
