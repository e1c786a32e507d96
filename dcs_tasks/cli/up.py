"""`dcs up`: the whole DCS stack on this machine in the foreground, until Ctrl-C (or SIGTERM/SIGHUP).

Prints the URLs and the `DCS_*` variables a trainer needs, the token masked; the full values go to a
0600 env file (`set -a; . FILE; set +a`), removed again at stop because the token dies with the stack. The file
carries the stack's own variables and every `DCS_*` setting `dcs up` was started with, since the worker reads
several settings the trainer must share (checkpoint root, memory tier: `dcs_tasks.checkpoint.agreement`). A
`DCS_REDIS_URL` that does not answer is reported within seconds (`LocalStack`), before anything is started.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from dcs_tasks.config import DCSConfig, mask_url_credentials
from dcs_tasks.errors import DCSTimeoutError
from dcs_tasks.local.procs import LocalStackError, StackInterrupted, interrupts_as_keyboard
from dcs_tasks.local.stack import LocalStack, write_private

TRAINER_VARS = (
    "DCS_REDIS_URL",
    "DCS_COORDINATOR_URL",
    "DCS_NAMESPACE",
    "DCS_NODE_NAME",
    "DCS_CHECKPOINT_DIR",
    "DCS_AUTH_TOKEN",
)
WATCH_SECONDS = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("up", help="run redis, coordinator, worker, receivers and Flower here until Ctrl-C")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".dcs-run"),
        help="logs, Redis data, the env file and (unless DCS_CHECKPOINT_DIR is set) checkpoints (default .dcs-run)",
    )
    parser.add_argument("--receivers", type=int, default=0, help="`dcs receiver` rollout engines to start (default 0)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    parser.add_argument("--flower-port", type=int, default=0, help="Flower port (default: a free one)")
    parser.add_argument("--no-flower", action="store_true", help="do not start Flower")
    parser.add_argument("--concurrency", type=int, default=8, help="worker threads (default 8)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds each process may take to be ready")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.receivers < 0 or args.receivers > 64:
        print("dcs up: --receivers must be between 0 and 64", file=sys.stderr)
        return 2
    workdir: Path = args.workdir.resolve()
    config = DCSConfig()
    started_with = config.given()  # the DCS_* settings of this environment (flat names)
    if "checkpoint_dir" not in started_with:
        config = config.model_copy(update={"checkpoint_dir": workdir / "checkpoints"})
    stack = LocalStack(
        config,
        workdir=workdir,
        receivers=args.receivers,
        flower=None if not args.no_flower else False,
        coordinator_port=args.port,
        flower_port=args.flower_port,
        worker_concurrency=args.concurrency,
        timeout=args.timeout,
    )
    env_file = workdir / "dcs.env"
    with interrupts_as_keyboard():
        try:
            print(f"dcs up: starting in {workdir} (logs in {stack.logs}) ...", flush=True)
            with stack:
                write_env_file(env_file, stack, started_with)
                print_summary(stack, env_file, started_with)
                watch(stack)
        except (KeyboardInterrupt, StackInterrupted):
            print("dcs up: stopped", flush=True)
            return 0
        except (LocalStackError, DCSTimeoutError) as exc:  # a process exited or never became ready
            print(f"dcs up: {exc}", file=sys.stderr)
            return 1
        finally:
            env_file.unlink(missing_ok=True)
    return 0


def trainer_env(stack: LocalStack, started_with: Iterable[str] = ()) -> dict[str, str]:
    """The `DCS_*` variables a trainer on this host needs, with their real values: the stack's own
    (TRAINER_VARS) and every setting `dcs up` was started with (`started_with`: field names), so that a trainer
    sourcing the file reads what the worker reads (the memory tier, the storage cadence, S3 settings...)."""
    env = stack.config.to_env()
    env.setdefault("DCS_NODE_NAME", stack.config.host_name)
    names = list(TRAINER_VARS) + [f"DCS_{field.upper()}" for field in sorted(started_with)]
    return {name: env[name] for name in dict.fromkeys(names) if name in env}


def write_env_file(path: Path, stack: LocalStack, started_with: Iterable[str] = ()) -> None:
    lines = [f"{name}={shlex.quote(value)}" for name, value in trainer_env(stack, started_with).items()]
    write_private(path, "\n".join(lines) + "\n")


def print_summary(stack: LocalStack, env_file: Path, started_with: Iterable[str] = ()) -> None:
    print(f"  coordinator  {stack.coordinator_url}   (GET /healthz, /health, /topology with the token)")
    print(f"  redis        {mask_url_credentials(stack.config.redis.url)}")
    print(f"  worker       1 (`dcs worker --pool=threads`), node queue dcs.node.{stack.config.host_name}")
    for rank, url in enumerate(stack.receiver_urls):
        print(f"  receiver     rollout rank {rank} at {url}")
    if stack.flower_url:
        print(f"  flower       {stack.flower_url}   (user dcs, password: DCS_AUTH_TOKEN)")
    if stack.config.metrics.enable_metrics and stack.config.metrics.port:
        print(f"  metrics      http://{stack.config.metrics.host}:{stack.config.metrics.port}/metrics (worker)")
    print("a trainer on this host needs (full values, token included, in the 0600 file below):")
    for name, value in trainer_env(stack, started_with).items():
        shown = "***" if name == "DCS_AUTH_TOKEN" else mask_url_credentials(value)
        print(f"  {name}={shown}")
    print(f"  set -a; . {env_file}; set +a")
    print("Ctrl-C stops everything.", flush=True)


def watch(stack: LocalStack) -> None:
    """Sleep until interrupted; stop (LocalStackError) as soon as any process of the stack exits."""
    while True:
        stack.check_alive()
        time.sleep(WATCH_SECONDS)
