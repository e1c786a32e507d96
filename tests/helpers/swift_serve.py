"""The Swift servers of the S3 tests (tests/helpers/s3server.py), forked from a zygote (tests/helpers/zygote.py)
that imported Swift once per pytest process: each server's start was about 0.5 s of CPU of imports, 2 s for the
four of an `S3Server`, which the suite starts about 18 times.

    python -m tests.helpers.swift_serve --zygote       the zygote: imports what the four server scripts import
    python -m tests.helpers.swift_serve KIND CONF -v   a server: what `swift-KIND-server CONF -v` runs

The `swift-KIND-server` console scripts import their server module and call its `main()` with the command line;
a forked child does the same, so Swift's own start-up (its monkey-patching, paste deploy, the rings) runs in the
child as it does in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import sys

SERVERS = {
    "account": "swift.account.server",
    "container": "swift.container.server",
    "object": "swift.obj.server",
    "proxy": "swift.proxy.server",
}
PRELOAD = tuple(SERVERS.values())


def main() -> None:
    args = sys.argv[1:]
    if args == ["--zygote"]:
        from tests.helpers.zygote import serve_forever

        serve_forever(PRELOAD)  # leaves with os._exit once the pytest process closes its stdin
    if not args or args[0] not in SERVERS:
        raise SystemExit(f"usage: python -m tests.helpers.swift_serve {{--zygote | {'|'.join(SERVERS)} CONF -v}}")
    kind = args[0]
    sys.argv = [f"swift-{kind}-server", *args[1:]]  # the console script's own command line
    sys.exit(importlib.import_module(SERVERS[kind]).main())


if __name__ == "__main__":
    main()
