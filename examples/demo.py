"""`make demo`: the whole DCS loop on one machine, with real processes, and what it measured.

1. Starts a local stack: a private redis-server (unless DCS_REDIS_URL is set), `dcs coordinator`,
   `dcs worker` and two `dcs receiver` rollout engines.
2. Trains a small MLP in a child process with asynchronous checkpoints every few steps, and kills it
   with SIGKILL in the middle of the run.
3. Resumes in a new process from the newest committed checkpoint, checks that the restored state is
   bit-exact against the digest the first trainer recorded, trains to the end, and checks the final
   weights equal those of an uninterrupted run.
4. Pushes the weights to the two rollout receivers over gloo and compares their digests.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dcs_tasks import Checkpointer  # noqa: E402
from dcs_tasks.client.engine import CheckpointEngineClient  # noqa: E402
from dcs_tasks.config import DCSConfig  # noqa: E402
from dcs_tasks.receiver.weights import tensor_sha256  # noqa: E402
from tests.distributed.sync_stack import sync_stack  # noqa: E402
from tests.helpers.procs import child_env  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402

RUN = "demo"
TOTAL_STEPS, SAVE_EVERY, CRASH_AT = 60, 10, 45


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn(64, 256), y)  # draws from the global RNG
    loss.backward()
    opt.step()


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), torch.get_rng_state()]:
        h.update(tensor_sha256(t).encode())
    for group in opt.state_dict()["state"].values():
        for value in group.values():
            h.update(tensor_sha256(value).encode() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def fresh_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    torch.manual_seed(1234)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


def resume(ckpt: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, report: dict[str, Any]) -> int:
    """Restore the newest good checkpoint (verified); returns the next step to train."""
    t0 = time.perf_counter()
    restored = ckpt.restore()
    model.load_state_dict(restored.state["model"])
    opt.load_state_dict(restored.state["optim"])
    torch.set_rng_state(restored.state["rng"])
    report.update(restored_step=restored.step, restore_seconds=time.perf_counter() - t0)
    report["restored_digest"] = state_digest(model, opt)
    return int(restored.state["step"]) + 1


def trainer(config: DCSConfig, out: Path, resuming: bool, crash_at: int | None) -> None:
    """One training process: maybe restore, train, save every SAVE_EVERY steps, maybe die by SIGKILL."""
    model, opt = fresh_state()
    report: dict[str, Any] = {"stalls": [], "digests": {}}
    with Checkpointer(RUN, config) as ckpt:
        first = resume(ckpt, model, opt, report) if resuming else 1
        last = None
        for step in range(first, TOTAL_STEPS + 1):
            train_step(model, opt, step)
            if step % SAVE_EVERY == 0:
                saved_at = time.perf_counter()
                last = ckpt.save(snapshot(model, opt, step), step=step, metadata={"lr": 1e-3})
                report["stalls"].append(last.stall_seconds)
                report["digests"][str(step)] = state_digest(model, opt)
                out.write_text(json.dumps(report))
            if step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
        if last is not None:
            last.wait(timeout=120)
            report["last_commit_seconds"] = time.perf_counter() - saved_at
        report["final_digest"] = state_digest(model, opt)
    out.write_text(json.dumps(report))


def uninterrupted_digest() -> str:
    model, opt = fresh_state()
    for step in range(1, TOTAL_STEPS + 1):
        train_step(model, opt, step)
    return state_digest(model, opt)


def run_trainer(config: DCSConfig, out: Path, resuming: bool, crash_at: int | None) -> int:
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--trainer", "--out", str(out)]
    cmd += ["--resume"] if resuming else []
    cmd += ["--crash-at", str(crash_at)] if crash_at else []
    return subprocess.run(cmd, env=child_env(config), timeout=600, check=False).returncode


def wait_committed(config: DCSConfig, step: int, timeout: float = 60.0) -> list[int]:
    """Steps staged before the crash still commit: the worker reads them from shared memory."""
    deadline = time.monotonic() + timeout
    with Checkpointer(RUN, config) as ckpt:
        while True:
            steps = [info.step for info in ckpt.list()]
            if step in steps or time.monotonic() > deadline:
                return steps
            time.sleep(0.2)


async def push_weights(config: DCSConfig, url: str, model: torch.nn.Module) -> dict[str, Any]:
    client = CheckpointEngineClient(
        coordinator_url=url, role="actor", rank=0, model=model, model_name="demo", config=config
    )
    await client.start()
    try:
        return (await client.update_weights_for_rollout(rollout_only=True))["rollout"]
    finally:
        await client.stop()


def check(label: str, ok: bool) -> bool:
    print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    return ok


def demo(tmp: Path) -> bool:
    base = DCSConfig(
        checkpoint_dir=tmp / "ckpt",
        node_name="demo-host",
        namespace=f"demo{os.getpid()}",
        enable_metrics=False,
        heartbeat_interval_seconds=1.0,
        heartbeat_timeout_seconds=5.0,
    )
    redis = None
    if "DCS_REDIS_URL" not in os.environ:
        redis = RedisServer(tmp / "redis")
        redis.start()
        base = base.model_copy(update={"redis_url": redis.url})
    try:
        with sync_stack(base, tmp, receivers=2) as stack:
            print(f"stack: redis {base.redis_url}, coordinator {stack.url}, 1 worker, 2 rollout receivers")
            return scenario(stack.config, stack.url, [r.digest for r in stack.receivers], tmp)
    finally:
        if redis is not None:
            redis.stop()


def scenario(config: DCSConfig, url: str, digests: list[Any], tmp: Path) -> bool:
    first_out, second_out = tmp / "first.json", tmp / "second.json"
    print(f"1. training {CRASH_AT} of {TOTAL_STEPS} steps, a checkpoint every {SAVE_EVERY}, then SIGKILL")
    rc = run_trainer(config, first_out, resuming=False, crash_at=CRASH_AT)
    first = json.loads(first_out.read_text())
    steps = wait_committed(config, max(int(s) for s in first["digests"]))
    ok = check(f"trainer killed (exit {rc}); committed steps {steps}", rc == -signal.SIGKILL and bool(steps))
    print("2. a new trainer process resumes from the newest good checkpoint")
    rc = run_trainer(config, second_out, resuming=True, crash_at=None)
    if rc != 0 or not second_out.exists():
        return check(f"resumed trainer exited with {rc}", False)
    second = json.loads(second_out.read_text())
    restored = str(second.get("restored_step"))
    ok &= check(f"restored step {restored} is bit-exact", second.get("restored_digest") == first["digests"][restored])
    ok &= check("final state equals an uninterrupted run", second.get("final_digest") == uninterrupted_digest())
    print("3. pushing the newest checkpoint's weights to the rollout receivers over gloo")
    with Checkpointer(RUN, config) as ckpt:
        newest = ckpt.restore()
        size_mib = ckpt.list()[-1].nbytes / 2**20
    model = make_model()
    model.load_state_dict(newest.state["model"])
    sync = asyncio.run(push_weights(config, url, model))
    want = {name: tensor_sha256(t) for name, t in model.state_dict().items()}
    ok &= check("both receivers hold bit-exact weights", all(d().tensors == want for d in digests))
    stalls = first["stalls"] + second["stalls"]
    print("measured:")
    print(f"  checkpoint size       {size_mib:.1f} MiB (model, Adam state, step, RNG)")
    print(f"  save stall            median {statistics.median(stalls) * 1e3:.2f} ms over {len(stalls)} saves")
    print(f"  last save -> durable  {second.get('last_commit_seconds', float('nan')) * 1e3:.1f} ms")
    print(f"  restore               {second['restore_seconds'] * 1e3:.1f} ms (step {restored}, verified)")
    print(
        f"  weight push           {sync.get('bytes', 0) / 2**20:.1f} MiB, {sync.get('tensors')} tensors in "
        f"{sync.get('buckets')} bucket(s) to {sync.get('engines')} engines: group bootstrap "
        f"{sync.get('bootstrap_seconds', 0) * 1e3:.0f} ms, broadcast {sync.get('broadcast_seconds', 0) * 1e3:.1f} ms,"
        f" weight_version {sync.get('weight_version')}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--crash-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(DCSConfig(), args.out, args.resume, args.crash_at)
        return 0
    with tempfile.TemporaryDirectory(prefix="dcs-demo-") as tmp:
        ok = demo(Path(tmp))
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
