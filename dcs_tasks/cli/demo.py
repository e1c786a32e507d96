"""`dcs demo`: the whole DCS loop on this machine (see dcs_tasks/local/demo.py and docs/local.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="train a tiny transformer with async checkpoints, SIGKILL it, resume bit-exactly, push weights",
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300, about a minute)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint interval (default steps/10)")
    parser.add_argument("--crash-at", type=int, default=0, help="step at which the trainer is killed (default ~60%%)")
    parser.add_argument("--receivers", type=int, default=2, help="rollout receivers to push to (default 2)")
    parser.add_argument(
        "--out", type=Path, default=Path(".dcs-run/demo"), help="summary.json and timeline.png go here (.dcs-run/demo)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the trainer (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and logs under OUT/stack")
    parser.add_argument("--no-png", action="store_true", help="do not draw the timeline")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dcs_tasks.errors import ConfigError
    from dcs_tasks.local.demo import DemoSettings, run_demo
    from dcs_tasks.local.procs import LocalStackError, StackInterrupted, interrupts_as_keyboard

    settings = DemoSettings(
        steps=args.steps,
        save_every=args.save_every,
        crash_at=args.crash_at,
        receivers=args.receivers,
        out=args.out,
        keep=args.keep,
        png=not args.no_png,
        threads=args.threads,
    )
    with interrupts_as_keyboard():
        try:
            ok = run_demo(settings)
        except ConfigError as exc:
            print(f"dcs demo: {exc}", file=sys.stderr)
            return 2
        except LocalStackError as exc:
            print(f"dcs demo: {exc}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, StackInterrupted):
            print("dcs demo: interrupted; everything it started is stopped", file=sys.stderr)
            return 130
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
