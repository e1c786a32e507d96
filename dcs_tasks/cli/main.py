"""`dcs` entry point: each subcommand lives in its own module and is imported only when chosen.

Subcommand modules expose `register(subparsers) -> None`; the parser they add sets `func(args) -> int`.
Modules are named by string so that `dcs_tasks` does not import `coordinator` or `workers`.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, str] = {
    "coordinator": "coordinator.cli",
    "worker": "workers.cli",
    "ckpt": "dcs_tasks.cli.ckpt",
    "receiver": "dcs_tasks.receiver.cli",
    "engine": "dcs_tasks.cli.engine",
    "config": "dcs_tasks.cli.config",
}


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcs", description="Distributed Checkpoint Service")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=f"see `dcs {name} --help`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `dcs ... | head` ends quietly
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(args_list)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except OSError as exc:  # a path that cannot be read or written, a port that cannot be bound: one line
        print(f"dcs {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
