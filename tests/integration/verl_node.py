"""The verl workers of tests/integration/test_verl_backend.py:

    python -m tests.integration.verl_node SOCKET LOGDIR KIND...

One process imports verl (seconds of CPU: ray, tensordict, transformers, torch._dynamo) and then forks one worker
per KIND, as tests/helpers/preloaded.py forks ranks from a process that imported torch: four fresh interpreters
importing verl at once took a 2-core machine ten seconds. KIND: `trainer0` (verl's trainer rank 0:
`is_master=True`), `trainer1` (another trainer rank: `is_master=False`) or `rollout` (a rollout worker: no
`is_master`, as verl's CheckpointEngineWorker builds it). Each worker builds its engine from verl's own registry
after verl's own `import_external_libs` imported the module named by verl's `custom_backend_module`, as verl's
workers do (the parent imports verl only, not DCS's backend). The test drives the workers as verl's
CheckpointEngineManager does (prepare, build_topology in the test, init_process_group, send/receive, finalize):
worker i takes one JSON command per line on its connection to the test's abstract unix socket `SOCKET-i` and
answers each with one line `@@ {json}` there; its stdout and stderr go to `LOGDIR/KIND-i.log`. The parent exits
once every worker has, with status 1 if one of them failed. DCS settings come from DCS_* in the environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Any, TextIO

import torch

from dcs_tasks.sync.receiving import tensor_sha256
from tests.verl_lib import on_path


def weights(seed: int) -> dict[str, torch.Tensor]:
    """What a trainer's `get_per_tensor_param` yields at step `seed`: mixed dtypes, one tensor over a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(300, 40, generator=g),  # 48 KB > a 16 KiB bucket
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.float16),
        "model.norm.steps": torch.tensor([seed], dtype=torch.int64),
    }


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in sorted(state.items())}


def bad_entries(kind: str, seed: int) -> Iterator[tuple[Any, Any]]:
    yield from list(weights(seed).items())[:2]
    if kind == "not_a_tensor":
        yield "model.lm_head.weight", [[0.5, 0.25]]
    else:
        yield "model.layers." + "x" * 2000 + ".weight", torch.zeros(2)


async def main(kind: str, commands: TextIO, answers: TextIO) -> None:
    on_path()
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("dcs_tasks.integrations.verl")  # verl's checkpoint_engine.custom_backend_module
    engine_kwargs: dict[str, Any] = {"model_name": "verl-test"}
    if kind != "rollout":
        engine_kwargs["is_master"] = kind == "trainer0"
    engine = CheckpointEngineRegistry.new("dcs", bucket_size=16 << 10, **engine_kwargs)
    loop = asyncio.get_running_loop()
    answer: Any = None
    while line := await loop.run_in_executor(None, commands.readline):
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "prepare":
                answer = {**engine.prepare(), "class": type(engine).__name__}
            elif op == "init":
                engine.init_process_group(**command["kwargs"])
                answer = "joined"
            elif op == "send":
                state = weights(command["seed"])
                metrics = await engine.send_weights((item for item in state.items()), global_steps=command["seed"])
                answer = {"metrics": metrics, "digest": digest(state)}
            elif op == "send_bad":
                await engine.send_weights(bad_entries(command["kind"], command["seed"]))
                answer = "sent"
            elif op == "receive":
                got = {name: t.clone() async for name, t in engine.receive_weights(global_steps=command.get("seed"))}
                answer = {"digest": digest(got), "version": engine.client.weight_version}
            elif op == "finalize":
                engine.finalize()
                answer = "finalized"
            elif op == "close":
                engine.close()
                print("@@ " + json.dumps({"ok": "closed"}), file=answers, flush=True)
                return
            print("@@ " + json.dumps({"ok": answer}), file=answers, flush=True)
        except Exception as exc:
            traceback.print_exc()
            print("@@ " + json.dumps({"error": type(exc).__name__, "message": str(exc)}), file=answers, flush=True)


def worker(kind: str, address: str, log: str) -> None:
    """In a forked child: the worker KIND, on the test's socket `address`, logging to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect("\0" + address)
        with channel.makefile("r", encoding="utf-8") as commands, channel.makefile("w", encoding="utf-8") as answers:
            asyncio.run(main(kind, commands, answers))


def fork_workers(name: str, logdir: str, kinds: list[str]) -> int:
    """Import verl, fork a worker per kind, wait for them all; 0 when every one exited 0."""
    on_path()
    import verl.checkpoint_engine  # what every worker imports: once, before the forks
    import verl.utils.import_utils  # noqa: F401

    children = []
    for i, kind in enumerate(kinds):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                worker(kind, f"{name}-{i}", os.path.join(logdir, f"{kind}-{i}.log"))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    failed = [pid for pid in children if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(fork_workers(sys.argv[1], sys.argv[2], sys.argv[3:]))
