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

from dcs_tasks.errors import StorageError

SUBCOMMANDS: dict[str, str] = {
    "coordinator": "coordinator.cli",
    "worker": "workers.cli",
    "ckpt": "dcs_tasks.cli.ckpt",
    "receiver": "dcs_tasks.sync.receiver.cli",
    "engine": "dcs_tasks.cli.engine",
    "config": "dcs_tasks.cli.config",
    "doctor": "dcs_tasks.cli.doctor",
    "up": "dcs_tasks.cli.up",
    "demo": "dcs_tasks.cli.demo",
    "clean": "dcs_tasks.cli.clean",
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


# Long-running commands keep Python's SIGPIPE handling (ignored: a client that hangs up mid-answer fails that
# one connection with EPIPE); the default action would kill a server on the first abandoned answer.
SERVERS = frozenset({"coordinator", "worker", "receiver", "engine", "up", "demo"})


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    if chosen not in SERVERS:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `dcs ckpt list | head` ends quietly
    parser = _build_parser(args_list)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except (OSError, StorageError) as exc:  # a path that cannot be read or written, a port that cannot be bound,
        # an object store that refuses or cannot be reached: one line (never a credential: errors carry none)
        print(f"dcs {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # pydantic's ValidationError is a ValueError; others are bugs and keep their traceback
        lines = settings_errors(exc)
        if lines is None:
            raise
        print(f"dcs {args.command}: invalid settings:", *lines, sep="\n  ", file=sys.stderr)
        return 2


def settings_errors(exc: ValueError) -> list[str] | None:
    """One line per invalid setting of a pydantic ValidationError, without the rejected values (a URL or a
    token may hold a secret) and with URL credentials masked in messages; None for any other ValueError."""
    from pydantic import ValidationError

    from dcs_tasks.config import mask_url_credentials

    if not isinstance(exc, ValidationError):
        return None
    return [
        f"{'.'.join(str(part) for part in error['loc']) or exc.title}: {mask_url_credentials(error['msg'])}"
        for error in exc.errors(include_input=False, include_url=False)
    ]


if __name__ == "__main__":
    sys.exit(main())
