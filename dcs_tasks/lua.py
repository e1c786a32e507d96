"""Lua scripts run by SHA: loaded into Redis once, then `EVALSHA` on every call (not the whole source each time).

`LuaScript` does what redis-py's `register_script` does (EVALSHA, and on NOSCRIPT - a restarted or failed-over
Redis, `SCRIPT FLUSH` - load the source again and repeat) without being bound to the one client it was
registered on: module-level scripts are called with whichever client the caller holds (the worker's, a test's).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
from redis.exceptions import NoScriptError


class LuaScript:
    """One Lua source, known to Redis by its SHA1."""

    def __init__(self, source: str) -> None:
        self.source = source
        # the name SCRIPT LOAD gives it (SHA1 as a name, not for security)
        self.sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()

    def __call__(self, client: redis.Redis, keys: list[str], args: list[Any] | tuple[Any, ...] = ()) -> Any:
        """EVALSHA with `keys` and `args`; loads the source first if this server does not have it."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)
